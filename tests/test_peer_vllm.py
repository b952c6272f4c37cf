"""The real vLLM as the benchmark's peer: same checkpoint, same trace, its own environment.

Needs vLLM's environment (`make vllm-env`; `make test` builds it and sets SAMCACHE_REQUIRE_PEERS=1,
so there a missing environment fails instead of skipping). Task accuracy through vLLM is in
test_peer_vllm_task_accuracy.py (a file of its own so that the two vLLM-heavy files run side by
side under pytest-xdist)."""

import numpy as np
import pytest

pytest.importorskip("transformers")

pytestmark = [pytest.mark.long, pytest.mark.peers]

from samcache.bench.benchmark import run_benchmark  # noqa: E402
from samcache.engine import SAMcacheEngine  # noqa: E402
from samcache.bench.peers.vllm_launcher import PeerUnavailable  # noqa: E402
from samcache.bench.workloads import make_trace  # noqa: E402


def test_bench_engine_vllm_runs_vanilla_vllm_against_vllm_with_samcaches_plugin(tiny_checkpoints, vllm_python, tmp_path):
    """`samcache bench --modes prefix,vllm,vllm-samcache`: the same trace through samcache's prefix
    mode, vanilla vLLM and vLLM with the plugin. vLLM sees the same prompts and its prefix cache
    behaves as vLLM's; the plugin's turns carry its counters and their fidelity against vanilla
    vLLM."""
    model = tiny_checkpoints["qwen2_5_vl"]
    trace = make_trace("gui", turns=4, window=2, size=(112, 168), max_new_tokens=2)
    res = run_benchmark(trace, model, modes=["prefix", "vllm", "vllm-samcache"], fidelity=True, calibrate=False,
                        progress=False, threads=1, vllm_python=vllm_python, peer_log_dir=tmp_path,
                        engine_kwargs={"keep_image_order": False})  # random weights: reuse at any index
    by = {r["name"]: r for r in res["runs"]}
    vanilla, plugin = by["vllm"], by["vllm-samcache"]
    assert vanilla["peer"]["engine"].startswith("vllm 0.") and (tmp_path / "vllm-play0.log").is_file()
    assert plugin["peer"]["engine"].endswith("+ samcache plugin") and "samcache" not in vanilla["peer"]["engine"]

    # the same checkpoint and chat template: the same prompt, token for token in length
    lengths = [t["prompt_tokens"] for t in by["prefix"]["turns"]]
    assert [t["prompt_tokens"] for t in vanilla["turns"]] == lengths == [t["prompt_tokens"] for t in plugin["turns"]]
    assert all(t["same_prompt_as_samcache"] for t in vanilla["turns"])
    # vLLM's prefix cache (32-token blocks) supplies exactly the whole blocks shared with an earlier
    # prompt: computed here from samcache's own token ids of the same messages
    engine = SAMcacheEngine(model, kv_cache_bytes=1 << 20)
    ids = [_identity(engine.build_prompt(t.resolved())) for t in trace.turns]
    for t in range(len(ids)):
        shared = max([_common(ids[t], ids[u]) for u in range(t)] or [0])
        expected = min(shared, len(ids[t]) - 1) // 32 * 32
        assert vanilla["turns"][t]["prefix_reused_tokens"] == expected, t
    assert vanilla["turns"][1]["prefix_reused_tokens"] > 0  # turn 1 extends turn 0's screenshot: a real hit
    assert vanilla["summary"]["ttft_p50_ms"] > 0 and vanilla["summary"]["vit_calls"] is None

    # the window slides: from turn 2 on, the screenshot kept from the last turn moves and is reused
    reused = [t["image_reused_tokens"] for t in plugin["turns"]]
    assert reused[0] == 0 and all(r > 0 for r in reused[2:]), reused
    assert plugin["summary"]["computed_tokens"] < vanilla["summary"]["computed_tokens"]
    fid = [t["fidelity"] for t in plugin["turns"]]
    assert fid[0]["kl"] < 1e-9 and fid[0]["top1_agree"]  # turn 0 reuses nothing: vLLM's own numbers
    assert all(0 <= f["kl"] < 0.1 for f in fid) and plugin["summary"]["fidelity"] is not None
    assert all("first_logprobs" not in t for t in vanilla["turns"] + plugin["turns"])  # not in results.json


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
