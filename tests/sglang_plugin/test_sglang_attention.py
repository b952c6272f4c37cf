"""samcache's SGLang attention backend against SGLang's torch_native backend, on SGLang's real
``ReqToTokenPool``, ``MHATokenToKVPool``, ``RadixAttention`` and ``ForwardBatch``: EXTEND with cached
prefixes, DECODE and MIXED batches of several requests, random shapes, GQA; and the sparse path
(queries at arbitrary rows) against a float64 reference."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

from samcache.integrations.sglang.attention import SamcacheAttnBackend


class Batch:
    """Requests with ``prefix[i]`` tokens already in the pool and ``new[i]`` tokens this step."""

    def __init__(self, rng, *, num_layers, q_heads, kv_heads, head_dim, prefix, new, page_size=1,
                 dtype=torch.float32, sliding_window=-1):
        self.prefix, self.new = list(prefix), list(new)
        seq = [p + n for p, n in zip(prefix, new)]
        pages = sum(-(-s // page_size) for s in seq) + 4
        self.req_pool = ReqToTokenPool(size=len(seq) + 2, max_context_len=max(seq) + page_size, device="cpu",
                                       enable_memory_saver=False)
        self.kv_pool = MHATokenToKVPool(size=pages * page_size, page_size=page_size, dtype=dtype, head_num=kv_heads,
                                        head_dim=head_dim, layer_num=num_layers, device="cpu",
                                        enable_memory_saver=False)
        # Random, shuffled page placement: a sequence's pages are never contiguous.
        free = list(rng.permutation(np.arange(1, pages)))
        self.rows = list(rng.permutation(np.arange(1, len(seq) + 1)))[: len(seq)]
        out_loc = []
        for r, s, p in zip(self.rows, seq, prefix):
            slots = np.concatenate([np.arange(pg * page_size, (pg + 1) * page_size)
                                    for pg in (free.pop() for _ in range(-(-s // page_size)))])[:s]
            self.req_pool.req_to_token[r, :s] = torch.from_numpy(slots).to(torch.int32)
            out_loc.append(slots[p:])
        self.layers = [RadixAttention(q_heads, head_dim, 1.0 / math.sqrt(head_dim), kv_heads, layer_id=i,
                                      sliding_window_size=sliding_window) for i in range(num_layers)]
        self.runner = types.SimpleNamespace(device="cpu", req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool)
        g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
        for i in range(num_layers):  # the cached prefixes' KV (and garbage everywhere else)
            self.kv_pool.k_buffer[i].copy_(torch.randn(self.kv_pool.k_buffer[i].shape, generator=g))
            self.kv_pool.v_buffer[i].copy_(torch.randn(self.kv_pool.v_buffer[i].shape, generator=g))
        self.seq = seq
        self.out_cache_loc = torch.from_numpy(np.concatenate(out_loc)).to(torch.int64)
        self.dtype = dtype

    def forward_batch(self, mode: ForwardMode) -> ForwardBatch:
        seq = torch.tensor(self.seq, dtype=torch.int64)
        n = sum(self.new)
        kw = {}
        if mode != ForwardMode.DECODE:
            kw = dict(extend_prefix_lens=torch.tensor(self.prefix), extend_prefix_lens_cpu=list(self.prefix),
                      extend_seq_lens=torch.tensor(self.new), extend_seq_lens_cpu=list(self.new),
                      extend_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(self.new)[:-1]])),
                      extend_num_tokens=n)
        return ForwardBatch(forward_mode=mode, batch_size=len(self.seq), input_ids=torch.zeros(n, dtype=torch.int64),
                            req_pool_indices=torch.tensor(self.rows, dtype=torch.int64), seq_lens=seq,
                            seq_lens_cpu=seq, out_cache_loc=self.out_cache_loc, seq_lens_sum=int(seq.sum()),
                            positions=torch.zeros(n, dtype=torch.int64), **kw)

    def run(self, backend_cls, mode, q, k, v, rows=None):
        backend = backend_cls(self.runner)
        fb = self.forward_batch(mode)
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        if rows is not None:
            backend.use_rows(rows)
        out = []
        with forward_context(ForwardContext(attn_backend=backend)):  # how SGLang's layers find it
            for i, layer in enumerate(self.layers):
                sel = slice(None) if rows is None else rows[i]
                out.append(layer(q[i][sel], k[i][sel], v[i][sel], fb))
        return out


def _inputs(rng, batch: Batch, layers, q_heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    n = sum(batch.new)
    make = lambda h: [torch.randn(n, h * head_dim, generator=g).to(batch.dtype) for _ in range(layers)]  # noqa: E731
    return make(q_heads), make(kv_heads), make(kv_heads)


def _fresh_copy(batch: Batch):
    return [b.clone() for b in batch.kv_pool.k_buffer], [b.clone() for b in batch.kv_pool.v_buffer]


def _restore(batch: Batch, saved):
    for buf, old in zip(batch.kv_pool.k_buffer, saved[0]):
        buf.copy_(old)
    for buf, old in zip(batch.kv_pool.v_buffer, saved[1]):
        buf.copy_(old)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE])
def test_matches_torch_native(seed, mode):
    rng = np.random.default_rng(seed)
    kv_heads = int(rng.choice([1, 2, 4]))
    q_heads = kv_heads * int(rng.choice([1, 2, 4]))
    head_dim = int(rng.choice([16, 32, 64]))
    layers, reqs = 2, int(rng.integers(1, 5))
    prefix = rng.integers(0, 40, reqs).tolist()
    if mode == ForwardMode.DECODE:
        prefix = [p + 1 for p in prefix]
        new = [1] * reqs
    elif mode == ForwardMode.MIXED:  # some requests decode (1 new token) beside extends
        new = [1 if rng.random() < 0.5 else int(rng.integers(1, 30)) for _ in range(reqs)]
        prefix = [max(p, 1) if n == 1 else p for p, n in zip(prefix, new)]
    else:
        new = rng.integers(1, 30, reqs).tolist()
    page_size = 1 if mode == ForwardMode.DECODE or seed % 2 == 0 else 4
    batch = Batch(rng, num_layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, prefix=prefix,
                  new=new, page_size=page_size)
    q, k, v = _inputs(rng, batch, layers, q_heads, kv_heads, head_dim)
    saved = _fresh_copy(batch)
    want = batch.run(TorchNativeAttnBackend, mode, q, k, v)
    pool_want = _fresh_copy(batch)
    _restore(batch, saved)
    got = batch.run(SamcacheAttnBackend, mode, q, k, v)
    for w, o in zip(want, got):
        torch.testing.assert_close(o, w, atol=2e-5, rtol=2e-5)
    for a, b in zip(_fresh_copy(batch), pool_want):  # the KV written is SGLang's, slot for slot
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def _reference(batch: Batch, layer: int, q, rows, q_heads, kv_heads, head_dim):
    """Float64 attention of the given flattened rows against the pool, causal by position."""
    starts = np.concatenate([[0], np.cumsum(batch.new)])
    out = torch.empty(len(rows), q_heads * head_dim, dtype=torch.float64)
    k_buf = batch.kv_pool.k_buffer[layer].double()
    v_buf = batch.kv_pool.v_buffer[layer].double()
    for j, row in enumerate(rows.tolist()):
        b = int(np.searchsorted(starts, row, side="right") - 1)
        pos = batch.prefix[b] + row - starts[b]
        slots = batch.req_pool.req_to_token[batch.rows[b], : pos + 1].long()
        keys, vals = k_buf[slots], v_buf[slots]                          # [n, Hkv, D]
        qh = q[j].double().view(q_heads, head_dim)
        group = q_heads // kv_heads
        for h in range(q_heads):
            s = keys[:, h // group] @ qh[h] / math.sqrt(head_dim)
            out[j, h * head_dim:(h + 1) * head_dim] = torch.softmax(s, 0) @ vals[:, h // group]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_sparse_rows_match_reference(seed):
    """Layers restricted to row subsets (shrinking with depth), as the model override runs them: only
    those rows' KV is written and each row attends at its own position."""
    rng = np.random.default_rng(100 + seed)
    kv_heads, q_heads, head_dim, layers = 2, 4, 32, 3
    reqs = int(rng.integers(1, 4))
    prefix, new = rng.integers(0, 20, reqs).tolist(), rng.integers(8, 40, reqs).tolist()
    batch = Batch(rng, num_layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, prefix=prefix,
                  new=new, page_size=1)
    q, k, v = _inputs(rng, batch, layers, q_heads, kv_heads, head_dim)
    n = sum(new)
    keep = torch.from_numpy(np.sort(rng.choice(n, size=max(1, n // 2), replace=False)))
    rows = [keep, keep, keep[::2].contiguous()]
    before = _fresh_copy(batch)
    got = batch.run(SamcacheAttnBackend, ForwardMode.EXTEND, q, k, v, rows=rows)
    loc = batch.out_cache_loc
    for i in range(layers):
        written = loc[rows[i]]
        torch.testing.assert_close(batch.kv_pool.k_buffer[i][written], k[i][rows[i]].view(-1, kv_heads, head_dim))
        untouched = np.setdiff1d(loc.numpy(), written.numpy())
        assert torch.equal(batch.kv_pool.k_buffer[i][untouched], before[0][i][untouched])
        want = _reference(batch, i, q[i][rows[i]], rows[i], q_heads, kv_heads, head_dim)
        torch.testing.assert_close(got[i].double(), want, atol=1e-5, rtol=1e-5)


def test_sliding_window_matches_torch_native():
    rng = np.random.default_rng(7)
    batch = Batch(rng, num_layers=1, q_heads=4, kv_heads=2, head_dim=32, prefix=[10, 0], new=[12, 20],
                  sliding_window=5)
    q, k, v = _inputs(rng, batch, 1, 4, 2, 32)
    saved = _fresh_copy(batch)
    want = batch.run(TorchNativeAttnBackend, ForwardMode.EXTEND, q, k, v)
    _restore(batch, saved)
    got = batch.run(SamcacheAttnBackend, ForwardMode.EXTEND, q, k, v)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)


def test_refuses_what_it_cannot_do():
    rng = np.random.default_rng(3)
    batch = Batch(rng, num_layers=1, q_heads=2, kv_heads=2, head_dim=16, prefix=[0], new=[4])
    backend = SamcacheAttnBackend(batch.runner)
    with pytest.raises(NotImplementedError, match="--cuda-graph-backend-decode=disabled"):
        backend.init_cuda_graph_state(8, 64)
    fb = batch.forward_batch(ForwardMode.EXTEND)
    q, k, v = _inputs(rng, batch, 1, 2, 2, 16)
    with forward_context(ForwardContext(attn_backend=backend)):
        with pytest.raises(RuntimeError, match="init_forward_metadata"):
            batch.layers[0](q[0], k[0], v[0], fb)
        backend.init_forward_metadata(fb)
        with pytest.raises(ValueError, match="query rows"):
            batch.layers[0](q[0][:2], k[0][:2], v[0][:2], fb)
