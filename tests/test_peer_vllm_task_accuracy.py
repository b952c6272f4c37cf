"""`samcache eval --modes vllm,vllm-samcache`: task accuracy with the real vLLM as the engine.

Needs vLLM's environment, as tests/test_peer_vllm.py."""

import pytest

pytest.importorskip("transformers")

pytestmark = [pytest.mark.long, pytest.mark.peers]


def test_task_accuracy_through_the_real_vllm_with_and_without_the_plugin(tiny_checkpoints, vllm_python, monkeypatch):
    """The traces answered by vLLM itself, scored as the engine's turns are; at recompute 1.0 the
    plugin recomputes every reused token, so its replies are vanilla vLLM's, while its counters
    show the reuse it planned."""
    # vLLM's engine in its caller's process (a third of the start-up on the CPU); the benchmark's
    # peer test (test_peer_vllm.py) runs vLLM's default processes.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from samcache.bench.task_accuracy import evaluate_traces
    from samcache.tasks import visual_qa

    model = tiny_checkpoints["qwen2_5_vl"]
    traces = [visual_qa.trace(seed, scenario="gui", turns=3, window=2) for seed in (1, 2)]
    out = evaluate_traces(model, traces, modes=["vllm", "vllm-samcache"], recompute=[1.0], calibrate=False,
                          max_new_tokens=3, fidelity=False, keep_image_order=False, vllm_python=vllm_python,
                          progress=False)
    vanilla, plugin = out["runs"]
    assert (vanilla["mode"], plugin["mode"], plugin["recompute"]) == ("vllm", "vllm-samcache", 1.0)
    for run in (vanilla, plugin):
        assert run["turns_scored"] == 6 and all(isinstance(t["reply"], str) for t in run["turns"])
        assert all(t["correct"] == visual_qa.is_correct(t["reply"], t["answer"]) for t in run["turns"])
    assert [t["reply"] for t in plugin["turns"]] == [t["reply"] for t in vanilla["turns"]]
    assert sum(t["image_reused_tokens"] for t in vanilla["turns"]) == 0
    reused = [t["image_reused_tokens"] for t in plugin["turns"]]
    assert reused[0] == reused[3] == 0 and all(reused[t] > 0 for t in (1, 2, 4, 5)), reused  # each trace's later turns
    assert all(t["recomputed_token_layers"] == t["image_reused_tokens"] * plugin["num_layers"] for t in plugin["turns"])
    with pytest.raises(ValueError, match="recompute_method 'deviation' needs samcache's own forward"):
        evaluate_traces(model, traces, modes=["vllm-samcache"], methods="deviation", calibrate=False,
                        keep_image_order=False, vllm_python=vllm_python, progress=False)
