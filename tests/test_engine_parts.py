"""Engine parts on their own: the tensor stores, prompt positions, sampling, and that the demo
and the engine benchmark still run end to end (small sizes)."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from samcache import Namespace, hash_bytes  # noqa: E402
from samcache.engine.images import PreparedImage  # noqa: E402
from samcache.engine.prompt import build_prompt, image_positions  # noqa: E402
from samcache.engine.sampling import Sampler  # noqa: E402
from samcache.cache.block_pool import BlockPool  # noqa: E402
from samcache.cache.stores import ImageKVStore, TensorStore  # noqa: E402

NS = Namespace("test-model")


def key(i):
    return NS.key(hash_bytes(str(i).encode()))


def test_store_is_byte_bounded_evicts_lru_and_drops_payloads():
    store = TensorStore("t", capacity_bytes=3 * 400)
    for i in range(3):
        assert store.put(key(i), torch.zeros(100), check="g")  # 400 bytes each
    assert store.get(key(0), check="g") is not None  # 0 is now the most recent
    store.put(key(3), torch.zeros(100), check="g")
    assert store.get(key(1), check="g") is None and store.get(key(0), check="g") is not None
    assert len(store) == 3 and store.used_bytes == 1200 and store.stats.evictions == 1
    store.check_invariants()
    assert not store.put(key(9), torch.zeros(1000))  # larger than the whole store: not kept
    assert store.stats.rejected == 1 and key(9) not in store


def test_store_sizes_by_request_and_reports_what_it_lets_go():
    released = []
    store = TensorStore("t", capacity_bytes=1000, on_evict=released.append)
    assert store.put(key(0), "a", size_bytes=600) and store.put(key(1), "b", size_bytes=300)
    assert store.used_bytes == 900
    assert store.put(key(2), "c", size_bytes=500)  # evicts the least recently used: "a"
    assert released == ["a"] and store.stats.evictions == 1
    assert store.evict_until(0) == 2 and sorted(released) == ["a", "b", "c"] and len(store) == 0
    store.check_invariants()
    with pytest.raises(ValueError, match="size_bytes must be an int >= 1"):
        store.put(key(3), "d", size_bytes=0)
    with pytest.raises(ValueError, match="capacity_bytes must be an int >= 1"):
        TensorStore("t", capacity_bytes=0)


def test_image_kv_store_checks_its_arguments():
    pool = BlockPool(16, 4)
    store = ImageKVStore(pool, capacity_bytes=1 << 20, block_bytes=64)
    seq = pool.new_sequence()
    pool.append_slots(seq, 20)
    for kw, match in ((dict(start=-3), "start must be"), (dict(length=0), "length must be"),
                      (dict(position=1.5), "position must be")):
        args = dict(start=4, length=8, position=4) | kw
        with pytest.raises(ValueError, match=match):
            store.put(key(0), seq, args["start"], args["length"], args["position"])
    assert store.put(key(0), seq, 4, 8, 4) and not store.put(key(0), seq, 4, 8, 4)
    held = store.get(key(0))
    np.testing.assert_array_equal(store.slots(held, 1, 3), pool.block_table(seq)[[1, 1, 1]] * 4 + [1, 2, 3])
    with pytest.raises(ValueError, match="first must be an int"):
        store.slots(held, 0.5, 2)
    with pytest.raises(ValueError, match="outside the image's 8"):
        store.slots(held, 6, 3)
    with pytest.raises(TypeError, match="held must be a HeldImage"):
        store.slots((0, 0), 0, 1)
    pool.free_sequence(seq)
    store.clear()
    assert pool.stats()["live_sequences"] == 0
    store.check_invariants()


def test_store_lookup_with_another_check_misses():
    store = TensorStore("t", capacity_bytes=1 << 20)
    store.put(key(1), torch.ones(4), check=(1, 4, 6))
    assert store.get(key(1), check=(1, 4, 8)) is None
    assert torch.equal(store.get(key(1), check=(1, 4, 6)), torch.ones(4))


def test_prompt_positions_follow_qwen_mrope_layout():
    img = PreparedImage(np.zeros((1, 1, 3), np.uint8), hash_bytes(b"x"), grid=(1, 4, 6), num_tokens=6)
    p = build_prompt([5, 6, 99, 7, 99, 8], [img, img], image_token_id=99, merge_size=2)
    assert p.token_ids.tolist() == [5, 6] + [99] * 6 + [7] + [99] * 6 + [8]
    assert [(s.start, s.length) for s in p.images] == [(2, 6), (9, 6)]
    assert p.positions[:, :2].tolist() == [[0, 1]] * 3
    assert torch.equal(p.positions[:, 2:8], image_positions(2, (1, 4, 6), 2))
    assert p.positions[:, 8].tolist() == [5, 5, 5]  # 2 + max(2 rows, 3 cols)
    assert p.positions[:, 15].tolist() == [9, 9, 9] and p.next_position == 10
    # moving an image moves all three components by the same delta
    assert torch.equal(p.positions[:, 9:15] - p.positions[:, 2:8], torch.full((3, 6), 4))
    with pytest.raises(ValueError, match="placeholder"):
        build_prompt([99], [img, img], image_token_id=99, merge_size=2)


def test_sampler_greedy_top_p_and_bad_arguments():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert Sampler(0.0)(logits) == 1
    picks = {Sampler(1.0, top_p=0.9, seed=s)(logits) for s in range(50)}
    assert picks <= {1, 2} and picks == {1, 2}  # the nucleus: the two top tokens only
    with pytest.raises(ValueError, match="top_p"):
        Sampler(1.0, top_p=0.0)


def test_demo_runs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "samcache.demo", "--turns", "2", "--window", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    # First the two trained models' answers, turn by turn, samcache beside the full prefill: the
    # isolated one reuses the moved screenshot and replies as the full prefill does ...
    assert "the causal visual-QA model" in out.stdout and "the isolated visual-QA model" in out.stdout
    assert out.stdout.count("    expected ") == 4 and "\n  turn 1: " in out.stdout
    isolated = out.stdout[out.stdout.index("the isolated visual-QA model"):out.stdout.index("GUI agent, window")]
    assert "isolated: " in isolated and "the full prefill's reply in 2 of 2 turns" in isolated
    summary = next(line for line in isolated.splitlines() if line.startswith("  isolated: "))
    assert summary.endswith("image tokens reused") and " 0 image tokens reused" not in summary
    # ... then the speed section.
    assert "median TTFT speedup" in out.stdout and "1 known+1 new" in out.stdout
    assert "vs prefix + ViT caching (today's engines)" in out.stdout and " sub 2 known+0 new" in out.stdout
    assert "Loading weights" not in out.stderr  # no progress-bar noise in the walkthrough


def test_engine_benchmark_runs(tmp_path):
    bench = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_engine.py"
    out = subprocess.run([sys.executable, str(bench), "--image-size", "112", "168", "--reps", "1",
                          "--warmup", "0", "--no-calibrate", "--sweep", "0", "1", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    r = json.loads((tmp_path / "r.json").read_text())
    assert r["modes"]["samcache"]["image_reused_tokens"] > 0 and r["modes"]["prefix"]["vit_calls"] == 0
    assert r["kl_by_recompute"]["1.0"] < 1e-9 <= r["kl_by_recompute"]["0.0"]


def test_onednn_linear_matches_f_linear_and_the_patch_is_undone():
    from samcache.engine.linear import ONEDNN_MIN_ROWS, linear, onednn_linears

    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    for rows in (1, ONEDNN_MIN_ROWS, 300):  # GEMV rows stay with F.linear, the rest go through oneDNN
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 50, 64, generator=gen)
    torch.testing.assert_close(linear(x3, w), torch.nn.functional.linear(x3, w), rtol=1e-5, atol=1e-5)
    module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    with onednn_linears(module):
        assert "forward" in vars(module[0]) and "forward" in vars(module[2])
        inside = module(x3)
    assert "forward" not in vars(module[0])
    torch.testing.assert_close(inside, module(x3), rtol=1e-5, atol=1e-5)


def test_long_vision_attention_goes_through_the_kernel_and_matches_sdpa(monkeypatch):
    import samcache.ops
    from samcache.engine import vision

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 700, 16, generator=gen) for _ in range(3))
    calls = []
    real = samcache.ops.full_attention
    monkeypatch.setattr(samcache.ops, "full_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out, _ = vision._attention(torch.nn.Module(), q, k, v, None, scaling=0.25, is_causal=False)
    assert calls == [1]  # 700 patches: samcache's kernel
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    short = [t[:, :, :64] for t in (q, k, v)]  # a 64-patch window: SDPA
    out, _ = vision._attention(torch.nn.Module(), *short, None, scaling=0.25, is_causal=False)
    assert calls == [1]
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(*short, scale=0.25).transpose(1, 2))
    config = type("Config", (), {"_attn_implementation": "sdpa"})()
    visual = torch.nn.Linear(2, 2)
    visual.config = config
    with vision.fast_vision(visual):
        assert config._attn_implementation == vision.ATTENTION_NAME
    assert config._attn_implementation == "sdpa"


def test_runtime_code_never_imports_the_test_fixture_builders():
    code = ("import sys, samcache.engine, samcache.reuse, samcache.cache.stores, samcache.bench.task_accuracy, samcache.bench.benchmark, "
            "samcache.bench.peers.vllm_launcher, samcache.integrations.vllm.step; print(sorted(m for m in sys.modules if m.startswith('samcache.random_checkpoints')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_one_family_registry_serves_the_runner_the_loader_and_the_builders():
    from samcache.families import FAMILIES, get_family
    from samcache.random_checkpoints import FAMILIES as BUILDABLE
    from samcache.random_checkpoints import model_class

    assert tuple(FAMILIES) == BUILDABLE
    for name, family in FAMILIES.items():
        assert model_class(name).__name__ == family.architecture == get_family(name).architecture
    with pytest.raises(ValueError, match="unknown model family 'llama'"):
        get_family("llama")


def test_batch_benchmark_runs(tiny_checkpoints, tmp_path):
    bench = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_batch.py"
    out = subprocess.run([sys.executable, str(bench), "--model", str(tiny_checkpoints["qwen2_5_vl"]), "--sessions", "3",
                          "--new-tokens", "4", "--image-size", "112", "168", "--kv-cache-mib", "64", "--repeat", "2",
                          "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    r = json.loads((tmp_path / "r.json").read_text())
    assert r["identical_outputs"] is True and r["sessions"] == 3 and len(r["computed_tokens"]) == 3
    assert all(c < p for c, p in zip(r["computed_tokens"], r["prompt_tokens"]))  # 3 of 4 screenshots reused


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projection_rotates_q_and_k_exactly_as_rotate_half(tiny_checkpoints, family, dtype):
    """The runner rotates q and k together with rotate_half's sign folded into sin: bit for bit
    the model's own ``x * cos + rotate_half(x) * sin`` (qk-norm families included)."""
    from samcache.families import get_family
    from samcache.engine.runner import ModelRunner

    runner = ModelRunner(tiny_checkpoints[family], get_family(family), device=torch.device("cpu"), dtype=dtype,
                         block_size=16, num_blocks=4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, runner.hidden_size, generator=g).to(dtype)
    positions = torch.randint(0, 500, (3, 37), generator=g)
    cos, sin = runner.rope(positions, x)
    cos_signed, sin_signed = runner.rope_signed(positions, x)
    assert torch.equal(cos_signed, cos)
    q, k, v = runner._project(0, x, cos, sin_signed)
    from samcache.engine.linear import linear

    attn = runner.layers[0].self_attn
    qkv = linear(x, *runner._qkv[0])  # the same fused projection: the rotation alone is compared
    nq, nk = runner.num_heads * runner.head_dim, runner.num_kv_heads * runner.head_dim
    want = [t.reshape(37, -1, runner.head_dim) for t in (qkv[:, :nq], qkv[:, nq: nq + nk], qkv[:, nq + nk:])]
    if runner.family.qk_norm:
        want[0], want[1] = attn.q_norm(want[0]), attn.k_norm(want[1])

    def rotate_half(t):
        half = t.shape[-1] // 2
        return torch.cat((-t[..., half:], t[..., :half]), dim=-1)

    c, s = cos[:, None, :], sin[:, None, :]
    for got, ref in ((q, want[0] * c + rotate_half(want[0]) * s), (k, want[1] * c + rotate_half(want[1]) * s), (v, want[2])):
        assert torch.equal(got, ref)
