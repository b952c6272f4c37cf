"""The real vLLM as the benchmark's peer: same checkpoint, same trace, its own environment.

Needs vLLM's environment (`make vllm-env`; `make test` builds it and sets SAMCACHE_REQUIRE_PEERS=1,
so there a missing environment fails instead of skipping)."""

import os

import numpy as np
import pytest

pytest.importorskip("transformers")

from samcache.bench.benchmark import run_benchmark  # noqa: E402
from samcache.engine import SAMcacheEngine  # noqa: E402
from samcache.bench.peers.vllm_launcher import PeerUnavailable, find_vllm_python  # noqa: E402
from samcache.bench.workloads import make_trace  # noqa: E402


@pytest.fixture(scope="module")
def vllm_python():
    try:
        return str(find_vllm_python())
    except PeerUnavailable as e:
        if os.environ.get("SAMCACHE_REQUIRE_PEERS") == "1":
            pytest.fail(str(e))
        pytest.skip(str(e))


def test_vllm_serves_the_same_prompts_and_its_prefix_cache_behaves_as_vllms(tiny_checkpoints, vllm_python, tmp_path):
    model = tiny_checkpoints["qwen2_5_vl"]
    trace = make_trace("gui", turns=3, window=2, size=(112, 168), max_new_tokens=2)
    res = run_benchmark(trace, model, modes=["prefix", "vllm"], fidelity=False, calibrate=False, progress=False,
                        threads=1, vllm_python=vllm_python, peer_log_dir=tmp_path)
    by = {r["name"]: r for r in res["runs"]}
    peer = by["vllm"]
    assert peer["peer"]["engine"].startswith("vllm 0.") and (tmp_path / "vllm-play0.log").is_file()
    # the same checkpoint and chat template: the same prompt, token for token in length
    assert [t["prompt_tokens"] for t in peer["turns"]] == [t["prompt_tokens"] for t in by["prefix"]["turns"]]
    assert all(t["same_prompt_as_samcache"] for t in peer["turns"])
    # vLLM's prefix cache (32-token blocks) supplies exactly the whole blocks shared with an earlier
    # prompt: computed here from samcache's own token ids of the same messages
    engine = SAMcacheEngine(model, kv_cache_bytes=1 << 20)
    ids = [_identity(engine.build_prompt(t.resolved())) for t in trace.turns]
    for t in range(3):
        shared = max([_common(ids[t], ids[u]) for u in range(t)] or [0])
        expected = min(shared, len(ids[t]) - 1) // 32 * 32
        assert peer["turns"][t]["prefix_reused_tokens"] == expected, t
    assert peer["turns"][1]["prefix_reused_tokens"] > 0  # turn 1 extends turn 0's screenshot: a real hit
    assert peer["summary"]["ttft_p50_ms"] > 0 and peer["summary"]["vit_calls"] is None


def _identity(prompt) -> np.ndarray:
    """Token ids with every image token replaced by its image's content (all image tokens share one
    id; an engine's prefix cache tells images apart by content)."""
    ids = prompt.token_ids.astype(object)
    for span in prompt.images:
        ids[span.start: span.end] = span.image.content.hex()
    return ids


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def test_bench_engine_vllm_runs_vanilla_vllm_against_vllm_with_samcaches_plugin(tiny_checkpoints, vllm_python, tmp_path):
    """`samcache bench --engine vllm`: the same trace through vanilla vLLM and through vLLM with the
    plugin; the plugin's turns carry its counters and their fidelity against vanilla vLLM."""
    model = tiny_checkpoints["qwen2_5_vl"]
    trace = make_trace("gui", turns=4, window=2, size=(112, 168), max_new_tokens=2)
    res = run_benchmark(trace, model, modes=["vllm", "vllm-samcache"], fidelity=True, calibrate=False, progress=False,
                        threads=1, vllm_python=vllm_python, peer_log_dir=tmp_path)
    by = {r["name"]: r for r in res["runs"]}
    vanilla, plugin = by["vllm"], by["vllm-samcache"]
    assert plugin["peer"]["engine"].endswith("+ samcache plugin") and "samcache" not in vanilla["peer"]["engine"]
    assert [t["prompt_tokens"] for t in plugin["turns"]] == [t["prompt_tokens"] for t in vanilla["turns"]]
    # the window slides: from turn 2 on, the screenshot kept from the last turn moves and is reused
    reused = [t["image_reused_tokens"] for t in plugin["turns"]]
    assert reused[0] == 0 and all(r > 0 for r in reused[2:]), reused
    assert plugin["summary"]["computed_tokens"] < vanilla["summary"]["computed_tokens"]
    fid = [t["fidelity"] for t in plugin["turns"]]
    assert fid[0]["kl"] < 1e-9 and fid[0]["top1_agree"]  # turn 0 reuses nothing: vLLM's own numbers
    assert all(0 <= f["kl"] < 0.1 for f in fid) and plugin["summary"]["fidelity"] is not None
    assert all("first_logprobs" not in t for t in vanilla["turns"] + plugin["turns"])  # not in results.json


def test_the_plugin_mode_needs_samcache_installed_in_vllms_environment(tmp_path):
    from samcache.bench.peers.vllm_launcher import check_plugin_installed

    fake = tmp_path / "python"  # a Python that has neither vLLM nor samcache's plugin
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(PeerUnavailable, match="make vllm-plugin"):
        check_plugin_installed(fake)


def test_the_plugin_is_installed_in_vllms_environment(vllm_python):
    from samcache.bench.peers.vllm_launcher import check_plugin_installed

    check_plugin_installed(vllm_python)  # make test installs it (make vllm-plugin)


def test_task_accuracy_through_the_real_vllm_with_and_without_the_plugin(tiny_checkpoints, vllm_python):
    """`samcache eval --modes vllm,vllm-samcache`: the traces answered by vLLM itself, scored as the
    engine's turns are; at recompute 1.0 the plugin recomputes every reused token, so its replies
    are vanilla vLLM's, while its counters show the reuse it planned."""
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
