"""Kernel inputs at the edges: views of the very cache being written, float32 limits, empty
shapes and malformed spans must raise a clear Python error (or work), never corrupt memory."""

import numpy as np
import pytest
import torch

from samcache import _C
from samcache.ops import AttentionMetadata, paged_write, quantize_kv_blocks, rope_rerotate, rope_rerotate_write, sparse_attention, token_merge


def test_rope_write_refuses_a_source_that_is_a_view_of_the_cache(rejects_without_writing):
    kv = torch.arange(2 * 2 * 4 * 1 * 4, dtype=torch.float32).reshape(2, 2, 4, 1, 4)
    key_cache = kv[:, 0]  # a strided view: ATen's overlap test cannot decide it
    key = key_cache[0, 0:3]  # tokens 0-2 of block 0, to be moved one slot up
    before = kv.clone()
    rejects_without_writing(lambda: rope_rerotate_write(key, torch.zeros(3, dtype=torch.long), torch.ones(2), "neox",
                                                        [], key_cache, torch.tensor([1, 2, 3])),
                            ValueError, [kv], match="key and key_cache must not share memory")
    # a copy of the same rows is the supported way, and moves them intact (delta 0)
    rope_rerotate_write(key.clone(), torch.zeros(3, dtype=torch.long), torch.ones(2), "neox", [], key_cache,
                        torch.tensor([1, 2, 3]))
    assert torch.equal(key_cache[0, 1:4], before[:, 0][0, 0:3])


def test_rope_write_refuses_a_cache_whose_blocks_overlap():
    base = torch.zeros(64)
    key_cache = base.as_strided((4, 4, 1, 4), (8, 4, 4, 1))  # block b+1 starts halfway through block b
    with pytest.raises(ValueError, match="key_cache has elements sharing memory"):
        rope_rerotate_write(torch.ones(2, 1, 4), torch.zeros(2, dtype=torch.long), torch.ones(2), "neox", [],
                            key_cache, torch.tensor([0, 5]))
    assert base.eq(0).all()


def test_rope_in_place_refuses_self_overlapping_keys_and_accepts_strided_views():
    base = torch.randn(64)
    overlapping = base.as_strided((4, 1, 4), (2, 4, 1))  # token t shares 2 elements with token t+1
    with pytest.raises(ValueError, match="sharing memory"):
        rope_rerotate(overlapping, torch.ones(4, dtype=torch.long), torch.ones(2), "neox")
    big = torch.randn(8, 2, 6)
    view = big[::2, :, :4]  # every other token, 4 of 6 dims: not dense, but no element shared
    expect = view.clone()
    rope_rerotate(expect, torch.arange(4), torch.tensor([1.0, 0.1]), "neox")
    rope_rerotate(view, torch.arange(4), torch.tensor([1.0, 0.1]), "neox")
    torch.testing.assert_close(view, expect, atol=0, rtol=0)
    empty = torch.empty(0, 1, 4).expand(0, 3, 4)  # stride 0 but no elements: nothing to share
    rope_rerotate(empty, torch.zeros(0, dtype=torch.long), torch.ones(2), "neox")


def test_paged_write_refuses_aliasing_caches_and_sources(rejects_without_writing):
    kc, vc = torch.zeros(2, 4, 1, 4), torch.zeros(2, 4, 1, 4)
    k, v = torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    slots = torch.tensor([0, 1, 5])
    rejects_without_writing(lambda: paged_write(k, v, kc, kc, slots), ValueError, [kc],
                            match="key_cache and value_cache must not share memory")
    for key, value, name in ((kc.view(-1, 1, 4)[0:3], v, "key"), (k, vc.view(-1, 1, 4)[4:7], "value"),
                             (k, kc.view(-1, 1, 4)[2:5], "value")):
        rejects_without_writing(lambda: paged_write(key, value, kc, vc, slots), ValueError, [kc, vc],
                                match=f"{name} must not share memory with the caches")
    kv = torch.zeros(2, 2, 4, 1, 4)  # vLLM-style [2, blocks, ...]: K and V are disjoint halves of one tensor
    paged_write(k, v, kv[0], kv[1], slots)
    assert torch.equal(kv[0].view(-1, 1, 4)[5], k[2]) and torch.equal(kv[1].view(-1, 1, 4)[0], v[0])
    paged_write(k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, 1, 4)[5], k[2]) and torch.equal(vc.view(-1, 1, 4)[1], v[1])


@pytest.mark.parametrize("kw,match", [(dict(logit_cap=1e-46), "logit_cap"), (dict(scale=1e39), "scale"),
                                      (dict(logit_cap=1e39), "logit_cap"), (dict(scale=1e-46), "scale")])
def test_sparse_attention_checks_scale_and_cap_in_float32(kw, match):
    kc, vc = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8)
    q = torch.randn(3, 2, 8)
    meta = AttentionMetadata.build([np.array([0, 3, 7])], [np.array([0, 1])], [8], 4)
    with pytest.raises(ValueError, match=match):
        sparse_attention(q, meta, kc, vc, **kw)
    out, lse = sparse_attention(q, meta, kc, vc, logit_cap=30.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_token_merge_refuses_weights_that_overflow_float32():
    hidden = torch.ones(2, 3)
    with pytest.raises(ValueError, match="sum past the float32 range"):
        token_merge(hidden, torch.tensor([0, 0]), torch.tensor([3e38, 3e38]))
    merged, kept = token_merge(hidden, torch.tensor([0, 0]), torch.tensor([1e38, 1e38]))
    assert torch.equal(merged, torch.ones(1, 3)) and kept.tolist() == [0]


def test_quantize_an_empty_cache_gives_empty_outputs():
    codes, scales = quantize_kv_blocks(torch.randn(3, 4, 0, 8), torch.tensor([0, 1]), "int8")
    assert codes.shape == (2, 4, 0, 8) and scales.shape == (2,)  # one (unused) scale per block


@pytest.mark.parametrize("shape", [(3, 0), (3_000_000, 0), (2, 3), (4,)])
def test_native_span_bounds_must_be_k_by_2(shape):
    pool = _C.BlockPool(8, 4)
    bounds = np.zeros(shape, np.int64)
    k = shape[0] if len(shape) == 2 else 0
    with pytest.raises(ValueError, match=r"span bounds must have shape \[K, 2\]"):
        pool.match_prefix(bytes(16), np.arange(8, dtype=np.int32), bounds, bytes(16 * k))
    assert pool.match_prefix(bytes(16), np.arange(8, dtype=np.int32), np.zeros((0, 2), np.int64), b"").size == 0
