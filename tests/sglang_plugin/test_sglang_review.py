"""Review tests for the SGLang plugin (attention backend, planning, identity, row runner, registration).

The first group pins down problems found in review and fixed (full hidden-state capture and input
logprobs read every row, cache_salt is part of the tenant, Qwen3-VL-MoE's fingerprint names the
checkpoint, the version is checked before version-specific imports, spliced keys stay on the
cache's device); the others pin down behaviour the review checked and found right (chunked
prefill, prefixes, MIXED batches, paged pools).
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

import sglang_harness as H
from samcache.integrations.settings import ReuseSettings
from samcache.integrations.sglang.attention import SamcacheAttnBackend
from samcache.integrations.sglang.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Qwen25Override
from samcache.integrations.sglang.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration as Qwen3MoeOverride
from samcache.integrations.sglang.reuse import ModelReuse, reset_stats, stats
from samcache.cache.stores import TensorStore

GRID_A, GRID_B = (1, 8, 8), (1, 8, 12)  # 16 and 24 image tokens


@pytest.fixture(autouse=True)
def fresh_vit_cache():
    H.setup_sglang()
    H.reset_mm_embedding_cache()


def _override(cls, cfg, weights, settings, seed=0, store=None):
    model = H._build_from_hf(cls, cfg, seed, weights)
    model._samcache_reuse = ModelReuse(model, settings, store if store is not None else TensorStore("t", 1 << 28))
    return model


def _prompts(cfg, first_prefix, second_prefix):
    first = H.prompt_with_images(cfg, [first_prefix, GRID_A, [7, 8, 9], GRID_B, [10, 11, 12]], seed=0)
    ids, items = H.prompt_with_images(cfg, [second_prefix, GRID_B, [20, 21], GRID_A, [13, 14, 15, 16]], seed=0)
    items[0].feature, items[1].feature = first[1][1].feature.clone(), first[1][0].feature.clone()
    return first, (ids, items)


def _run(model, prompt, backend_factory=None, pools=None, full_hidden=False):
    pools = pools or H.Pools.for_model(model, backend_factory=backend_factory)
    req = H.Request.create(model, pools, *prompt)
    return H.run_batch(model, pools, [req.extend()], capture_full_hidden=full_hidden), req, pools


@pytest.fixture(scope="module")
def one_layer():
    """A one-layer Qwen2.5-VL: a spliced image's KV is then exact, so any difference from the stock
    model is the plugin's, not the approximation's."""
    H.setup_sglang()
    cfg = H.tiny_qwen2_5_vl_config(text_config={"num_hidden_layers": 1})
    return cfg, H.build_qwen2_5_vl(cfg, seed=3)


# ------------------------------------------------------------------------------------------------
# Problems
# ------------------------------------------------------------------------------------------------

def test_full_hidden_state_capture_returns_every_row(one_layer):
    """``ForwardBatch.capture_hidden_mode == FULL`` (a request with ``return_hidden_states``; EAGLE's
    target prefill) makes SGLang's LogitsProcessor return the hidden state of EVERY extend row. The
    row runner leaves the spliced rows at zero, so SGLang hands zeros to the user / the draft model.
    With one layer the splice is exact, so the stock model's hidden states are the right answer."""
    cfg, stock = one_layer
    model = _override(Qwen25Override, cfg, H.hf_reference_qwen2_5_vl, ReuseSettings(keep_image_order=False, recompute_ratio=0.0), seed=3)
    first, second = _prompts(cfg, [1, 2, 3], [4, 5, 6, 7, 8, 9])
    _run(model, first, SamcacheAttnBackend)
    got, _, _ = _run(model, second, SamcacheAttnBackend, full_hidden=True)  # CaptureHiddenMode.FULL
    want, _, _ = _run(stock, second, full_hidden=True)
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=1e-4, rtol=1e-4)  # holds
    image = torch.tensor(second[0]) == cfg.image_token_id
    assert got.hidden_states[image].abs().sum() > 0, "spliced rows' hidden states are all zero"
    torch.testing.assert_close(got.hidden_states, want.hidden_states, atol=1e-4, rtol=1e-4)


def test_input_logprobs_of_a_reusing_request(one_layer):
    """A request with ``return_logprob`` and ``logprob_start_len=0`` gets input-token logprobs for
    every prompt row from SGLang's LogitsProcessor; with reuse the image rows' logprobs are computed
    from zero hidden states (log(1/V) or worse), not the model's."""
    cfg, stock = one_layer
    model = _override(Qwen25Override, cfg, H.hf_reference_qwen2_5_vl, ReuseSettings(keep_image_order=False, recompute_ratio=0.0), seed=3)
    first, second = _prompts(cfg, [1, 2, 3], [4, 5, 6, 7, 8, 9])
    _run(model, first, SamcacheAttnBackend)

    def input_logprobs(m, backend_factory):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        pools = H.Pools.for_model(m, backend_factory=backend_factory)
        req = H.Request.create(m, pools, *second)
        fb = H.build_forward_batch(pools, [req.extend()], "extend", capture_full_hidden=False)
        n = len(second[0])
        fb.return_logprob = True
        fb.top_logprobs_nums = [0]
        fb.token_ids_logprobs = [None]
        fb.extend_logprob_start_lens_cpu = [0]
        nxt = torch.tensor(second[0][1:] + [0], dtype=torch.int64).clamp(max=H.TEXT_VOCAB - 1)
        fb.extend_input_logprob_token_ids_gpu = nxt
        pools.attn_backend.init_forward_metadata(fb)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=pools.attn_backend), forward_batch=fb):
            out = m.forward(fb.input_ids.clone(), fb.positions, fb)
        lp = out.input_token_logprobs
        assert lp is not None and lp.numel() == n
        return lp

    want = input_logprobs(stock, None)
    got = input_logprobs(model, SamcacheAttnBackend)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _fake_batch(reqs):
    return types.SimpleNamespace(reqs=reqs)


def test_cache_salt_separates_tenants():
    """In SGLang 0.5.23 ``Req.cache_salt`` is its own field (``RadixKey(extra_key, cache_salt)``;
    the radix tree and samcache's own radix backend scope prefixes by it); ``extra_key`` no longer
    carries the salt. Two users who set different ``cache_salt`` must not share image KV."""
    from samcache.integrations import sglang as plugin

    fb = types.SimpleNamespace()
    reqs = [types.SimpleNamespace(extra_key=None, cache_salt="user-a"),
            types.SimpleNamespace(extra_key=None, cache_salt="user-b")]
    plugin._record_extra_keys(fb, object, _fake_batch(reqs), None)
    reuse = ModelReuse.__new__(ModelReuse)           # only namespace_of is exercised
    reuse.settings, reuse.model_id = ReuseSettings(), "m"
    ns = reuse.namespace_of(fb)
    # (Namespace has no __eq__: compare digests, an identity comparison is always "different")
    assert ns(0).digest != ns(1).digest


def test_qwen3_vl_moe_fingerprint_names_the_checkpoint():
    from samcache.integrations.sglang.identity import model_id

    cfg = H.tiny_qwen3_vl_moe_config()
    model = H._build_from_hf(Qwen3MoeOverride, cfg, 0,
                             lambda c, s: H._CheckpointLayoutState(H.hf_reference_qwen3_vl_moe(c, s)))
    fp = model_id(model, torch.float32)
    assert "Qwen3VLMoeForConditionalGeneration" in fp


def test_version_is_checked_before_version_specific_imports(monkeypatch):
    """On an SGLang outside the range (0.4.x has no ``sglang.srt.arg_groups`` / ``plugins.hook_registry``)
    the user must read 'supports sglang>=0.5.23,<0.6', not a ModuleNotFoundError."""
    import sglang

    from samcache.integrations import sglang as plugin

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.delenv("SAMCACHE_SGLANG_PLUGIN", raising=False)
    monkeypatch.setattr(sglang, "__version__", "0.4.9")
    monkeypatch.setitem(sys.modules, "sglang.srt.arg_groups.choices", None)  # absent in old releases
    with pytest.raises(RuntimeError, match=r"supports sglang>=0\.5\.23,<0\.6"):
        plugin.register()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: spliced keys must stay on the cache's device")
def test_splice_image_with_cuda_entry():
    """SGLang's store holds image KV read back from the CUDA pool (``PoolWriter.read``); splice_image
    computes ``delta`` with ``.cpu()`` and hands it to rope_rerotate with CUDA keys, whose argument
    check requires delta on key's device: every reuse step raises on a GPU."""
    from samcache.integrations.forward_plan import ImageKV, Rotary, splice_image

    dev = torch.device("cuda")
    L, n, Hh, D = 2, 5, 2, 32
    entry = ImageKV(torch.randn(L, n, Hh, D, device=dev), torch.randn(L, n, Hh, D, device=dev),
                    torch.arange(3 * n).view(3, n))
    rotary = Rotary(torch.rand(16), "mrope", (4, 6, 6))
    written = []

    class Cache:
        def write(self, layer, k, v, slots):
            written.append((layer, k, v, slots))

    splice_image(entry, slice(0, n), torch.arange(3 * n).view(3, n) + 7, torch.arange(n, device=dev), Cache(),
                 rotary, L)
    assert len(written) == L


# ------------------------------------------------------------------------------------------------
# Checked and found right
# ------------------------------------------------------------------------------------------------

def _chunked(model, prompt, cuts, backend_factory=None):
    """Run ``prompt`` as chunked prefill, cut at token indices ``cuts``; the last chunk's output."""
    pools = H.Pools.for_model(model, backend_factory=backend_factory)
    req = H.Request.create(model, pools, *prompt)
    out, done = None, 0
    for cut in list(cuts) + [len(prompt[0])]:
        out = H.run_batch(model, pools, [req.extend(cut - done)], capture_full_hidden=False)
        done = cut
    return out


@pytest.mark.parametrize("where", ["inside_first_image", "between_images", "inside_second_image"])
def test_chunked_prefill_exact_on_one_layer(where, one_layer):
    """Nothing recomputed (ratio 0) on a one-layer model: exact, so any slot/row/offset mistake in
    chunk handling shows up in the logits."""
    cfg, stock = one_layer
    model = _override(Qwen25Override, cfg, H.hf_reference_qwen2_5_vl, ReuseSettings(keep_image_order=False, recompute_ratio=0.0), seed=3)
    first, second = _prompts(cfg, [1, 2, 3], [4, 5, 6, 7])
    _run(model, first, SamcacheAttnBackend)
    ids = np.array(second[0])
    img = np.flatnonzero(ids == cfg.image_token_id)
    cut = {"inside_first_image": int(img[10]), "between_images": int(img[24]) + 1,
           "inside_second_image": int(img[30])}[where]
    reset_stats()
    got = _chunked(model, second, [cut], SamcacheAttnBackend)
    want = _chunked(stock, second, [cut])
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=1e-4, rtol=1e-4)
    # Both images spliced: the one the boundary cuts from its first token in the second chunk (the
    # first chunk computed its head), as the engine splices an image its prefix holds in part.
    assert stats().image_kv_hits == 2


def test_images_in_the_cached_prefix_and_text_request_in_mixed_batch(one_layer):
    """A request whose images sit wholly in its cached prefix, one that decodes and one without
    images, in one MIXED batch beside a reusing extend (one layer, ratio 0: exact)."""
    cfg, stock = one_layer
    model = _override(Qwen25Override, cfg, H.hf_reference_qwen2_5_vl, ReuseSettings(keep_image_order=False, recompute_ratio=0.0), seed=3)
    first, second = _prompts(cfg, [1, 2, 3], [4, 5, 6])
    _run(model, first, SamcacheAttnBackend)

    def scenario(m, factory):
        pools = H.Pools.for_model(m, backend_factory=factory)
        decoding = H.Request.create(m, pools, *first)
        H.run_batch(m, pools, [decoding.extend()], capture_full_hidden=False)  # all of `first` cached
        prefixed = H.Request.create(m, pools, list(first[0]) + [30, 31], first[1])
        pools.copy_prefix(decoding.row, prefixed.row, len(first[0]))  # a radix hit over both images
        prefixed.kv_len = len(first[0])
        fresh = H.Request.create(m, pools, *second)
        text = H.Request.create(m, pools, [1, 2, 3, 4, 5], None)
        steps = [fresh.extend(), prefixed.extend(), text.extend(), decoding.decode(40)]
        return H.run_batch(m, pools, steps, mode="mixed", capture_full_hidden=False)

    reset_stats()
    got = scenario(model, SamcacheAttnBackend)
    assert stats().image_kv_hits == 4 and stats().steps == 2  # the warm-up extend and the MIXED step
    want = scenario(stock, None)
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=1e-4, rtol=1e-4)


def test_sparse_rows_on_a_paged_pool():
    """use_rows on a page_size-4 pool, pages shuffled: the same as page_size 1's reference."""
    import test_sglang_attention as T
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    rng = np.random.default_rng(5)
    batch = T.Batch(rng, num_layers=2, q_heads=4, kv_heads=2, head_dim=32, prefix=[5, 0, 9], new=[13, 21, 6],
                    page_size=4)
    q, k, v = T._inputs(rng, batch, 2, 4, 2, 32)
    n = sum(batch.new)
    keep = torch.from_numpy(np.sort(rng.choice(n, size=n // 2, replace=False)))
    rows = [keep, keep[::2].contiguous()]
    got = batch.run(SamcacheAttnBackend, ForwardMode.EXTEND, q, k, v, rows=rows)
    for i in range(2):
        want = T._reference(batch, i, q[i][rows[i]], rows[i], 4, 2, 32)
        torch.testing.assert_close(got[i].double(), want, atol=1e-5, rtol=1e-5)


def test_use_rows_cleared_after_a_failing_forward(one_layer):
    cfg, _ = one_layer
    model = _override(Qwen25Override, cfg, H.hf_reference_qwen2_5_vl, ReuseSettings(keep_image_order=False, recompute_ratio=0.0), seed=3)
    first, second = _prompts(cfg, [1, 2, 3], [4, 5, 6, 7, 8, 9])
    _run(model, first, SamcacheAttnBackend)
    pools = H.Pools.for_model(model, backend_factory=SamcacheAttnBackend)
    req = H.Request.create(model, pools, *second)

    def boom(*a, **k):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _run_with(model, pools, req, boom)
    assert pools.attn_backend._rows is None


def _run_with(model, pools, req, routine):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    fb = H.build_forward_batch(pools, [req.extend()], capture_full_hidden=False)
    pools.attn_backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=pools.attn_backend), forward_batch=fb):
        step = model._samcache_reuse.begin(fb)
        assert step is not None and step.sparse
        model._samcache_reuse.hidden_states(model, step, fb.input_ids, fb, routine)
