"""sparse_attention against a plain float64 reference: batches of sequences, rows at any
positions (both CPU paths: few rows read the cache directly, many go through the GEMM path),
causal by position, GQA, window, cap, lse; malformed metadata refused."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from samcache.ops import AttentionMetadata, sparse_attention

DTYPES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def reference(q, meta, kc, vc, scale, window, cap):
    """Per sequence: gather its KV, then dense attention with an explicit mask, in float64."""
    bs = kc.shape[1]
    qo, kvp = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    outs, lses = [], []
    for b in range(meta.num_seqs):
        rows = slice(qo[b], qo[b + 1])
        if qo[b + 1] == qo[b]:
            continue
        pages = meta.kv_indices[kvp[b]: kvp[b + 1]].long()
        n = (len(pages) - 1) * bs + int(meta.kv_last_page_len[b])
        tok = torch.arange(n)
        k = kc[pages[tok // bs], tok % bs].double()
        v = vc[pages[tok // bs], tok % bs].double()
        g = q.shape[1] // kc.shape[2]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q[rows].double(), k) * scale
        if cap > 0:
            logits = cap * torch.tanh(logits / cap)
        pos = meta.q_pos[rows].long()[:, None]
        visible = tok[None, :] <= pos
        if window > 0:
            visible &= tok[None, :] > pos - window
        logits = logits.masked_fill(~visible[None], float("-inf"))
        lses.append(torch.logsumexp(logits, dim=-1).t())
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v))
    return torch.cat(outs), torch.cat(lses)


def make_batch(seed, lengths, rows, num_blocks_extra, bs, hkv, g, d, dtype):
    """Sequences of ``lengths`` KV tokens over shuffled pages; ``rows[b]`` query rows each at
    random distinct positions (the last position always among them, as a prefill's or decode's)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    pages_needed = [-(-n // bs) for n in lengths]
    num_blocks = sum(pages_needed) + num_blocks_extra
    kc = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    perm = rng.permutation(num_blocks)
    tables, positions, used = [], [], 0
    for n, p, m in zip(lengths, pages_needed, rows):
        tables.append(perm[used: used + p])
        used += p
        chosen = rng.choice(n - 1, min(m, n) - 1, replace=False) if n > 1 and m > 1 else np.zeros(0, np.int64)
        positions.append(np.sort(np.concatenate([chosen, [n - 1]])))
    meta = AttentionMetadata.build(positions, tables, lengths, bs)
    q = torch.randn(int(meta.q_pos.numel()), hkv * g, d, generator=gen).to(dtype)
    return q, meta, kc, vc


@given(
    lengths=st.lists(st.integers(1, 600), min_size=1, max_size=4),
    rows=st.lists(st.integers(1, 300), min_size=4, max_size=4),
    bs=st.sampled_from([1, 4, 16]),
    hkv=st.integers(1, 3),
    g=st.sampled_from([1, 2, 3, 4, 7]),
    d=st.sampled_from([8, 32, 40, 64, 128]),
    window=st.sampled_from([-1, 0, 1, 7, 300]),
    cap=st.sampled_from([0.0, 5.0]),
    dtype=st.sampled_from(list(DTYPES)),
    seed=st.integers(0, 2**31),
)
def test_matches_reference(lengths, rows, bs, hkv, g, d, window, cap, dtype, seed):
    q, meta, kc, vc = make_batch(seed, lengths, rows, 3, bs, hkv, g, d, dtype)
    scale = 1 / math.sqrt(d)
    out, lse = sparse_attention(q, meta, kc, vc, scale=scale, window=window, logit_cap=cap)
    ref_out, ref_lse = reference(q, meta, kc, vc, scale, window, cap)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    tol = DTYPES[dtype]
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [1, 3, 200])  # the direct path (<= 8 query-head rows) and the GEMM path
def test_a_batch_equals_each_sequence_alone(rows):
    """Batching changes nothing: each sequence's rows come out bit for bit as when served alone."""
    lengths = [700, 33, 1500, 260]
    q, meta, kc, vc = make_batch(11, lengths, [rows] * 4, 2, 16, 2, 2, 64, torch.float32)
    out, lse = sparse_attention(q, meta, kc, vc)
    qo, kvp = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    for b, n in enumerate(lengths):
        alone = AttentionMetadata(meta.q_pos[qo[b]: qo[b + 1]], torch.tensor([0, qo[b + 1] - qo[b]], dtype=torch.int32),
                                  torch.tensor([0, kvp[b + 1] - kvp[b]], dtype=torch.int32),
                                  meta.kv_indices[kvp[b]: kvp[b + 1]], meta.kv_last_page_len[b: b + 1], n)
        o, l = sparse_attention(q[qo[b]: qo[b + 1]], alone, kc, vc)
        assert torch.equal(o, out[qo[b]: qo[b + 1]]) and torch.equal(l, lse[qo[b]: qo[b + 1]])


def test_full_density_equals_causal_sdpa():
    """With every token as a row, the op is ordinary causal attention (checked against torch SDPA)."""
    q, meta, kc, vc = make_batch(0, [96], [96], 0, 16, 2, 3, 32, torch.float32)
    out, _ = sparse_attention(q, meta, kc, vc)
    pages = meta.kv_indices.long()
    k = kc[pages].flatten(0, 1)[:96].repeat_interleave(3, dim=1)
    v = vc[pages].flatten(0, 1)[:96].repeat_interleave(3, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)


def test_lse_merges_partial_results():
    """Two calls over disjoint key windows merge through their lse into the full result."""
    q, meta, kc, vc = make_batch(1, [64], [1], 0, 16, 1, 2, 16, torch.float32)
    full, full_lse = sparse_attention(q, meta, kc, vc)
    recent, lse_r = sparse_attention(q, meta, kc, vc, window=20)  # keys 44..63
    older_meta = AttentionMetadata(torch.tensor([43], dtype=torch.int32), meta.qo_indptr, meta.kv_indptr,
                                   meta.kv_indices, meta.kv_last_page_len, 64)
    older, lse_o = sparse_attention(q, older_meta, kc, vc)  # keys 0..43
    merged_lse = torch.logaddexp(lse_r, lse_o)
    merged = recent * (lse_r - merged_lse).exp()[..., None] + older * (lse_o - merged_lse).exp()[..., None]
    torch.testing.assert_close(merged_lse, full_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-5)


def test_empty_queries_and_sequences_without_rows():
    q, meta, kc, vc = make_batch(2, [32, 40], [1, 1], 0, 16, 1, 1, 8, torch.float32)
    none = AttentionMetadata(torch.zeros(0, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), meta.kv_indptr,
                             meta.kv_indices, meta.kv_last_page_len, 40)
    out, lse = sparse_attention(q[:0], none, kc, vc)
    assert out.shape == (0, 1, 8) and lse.shape == (0, 1)
    one = AttentionMetadata(meta.q_pos[1:], torch.tensor([0, 0, 1], dtype=torch.int32), meta.kv_indptr,
                            meta.kv_indices, meta.kv_last_page_len, 40)
    out, _ = sparse_attention(q[1:], one, kc, vc)  # sequence 0 has no rows this step
    torch.testing.assert_close(out, sparse_attention(q, meta, kc, vc)[0][1:])


def test_zero_query_heads():
    q, meta, kc, vc = make_batch(6, [32], [3], 0, 16, 1, 1, 8, torch.float32)
    out, lse = sparse_attention(q[:, :0], meta, kc, vc)
    assert out.shape == (3, 0, 8) and lse.shape == (3, 0)


def _raw(query, meta, kc, vc, **change):
    args = dict(q=query, q_pos=meta.q_pos, qo_indptr=meta.qo_indptr, kv_indptr=meta.kv_indptr, kv_indices=meta.kv_indices,
                kv_last_page_len=meta.kv_last_page_len, key_cache=kc, value_cache=vc)
    args.update(change)
    return torch.ops.samcache.sparse_attention(*args.values(), 0.25, -1, 0.0, -1)


def test_bad_input():
    q, meta, kc, vc = make_batch(3, [40, 20], [5, 2], 2, 16, 2, 2, 8, torch.float32)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    cases = [
        (dict(q=q[0]), ValueError, "q must be"),
        (dict(q=q[:, :3]), ValueError, "multiple of num_kv_heads"),
        (dict(q=q[..., :4]), ValueError, "head_dim"),
        (dict(q=q.double()), ValueError, "float32, float16 or bfloat16"),
        (dict(key_cache=kc.half()), ValueError, "share a dtype"),
        (dict(value_cache=vc[:2]), ValueError, "must match key_cache"),
        (dict(key_cache=kc.transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "contiguous"),
        (dict(q_pos=meta.q_pos.float()), ValueError, "q_pos must be"),
        (dict(q_pos=meta.q_pos[:2]), ValueError, "q_pos must have"),
        (dict(q_pos=i32(0, 1, 2, 3, 40, 0, 19)), IndexError, "outside sequence 0"),
        (dict(q_pos=i32(0, 1, 2, 3, 39, 0, 20)), IndexError, "outside sequence 1"),
        (dict(q_pos=i32(0, 1, 2, 3, -1, 0, 19)), IndexError, "q_pos"),
        (dict(qo_indptr=i32(0)), ValueError, "7 query rows but no sequences"),
        (dict(qo_indptr=i32(1, 5, 7)), ValueError, "qo_indptr must run from 0"),
        (dict(qo_indptr=i32(0, 5, 6)), ValueError, "qo_indptr must run from 0 to num_rows=7"),
        (dict(qo_indptr=i32(0, 8, 7)), ValueError, "must not decrease"),
        (dict(kv_indptr=i32(0, 3, 2)), ValueError, "must not decrease"),
        (dict(kv_indptr=i32(0, 3, 9)), ValueError, "end within kv_indices"),
        (dict(kv_indptr=i32(0, 3)), ValueError, "kv_indptr must have 3 entries"),
        (dict(kv_indptr=i32(0, 0, 2)), ValueError, "query rows but no KV pages"),
        (dict(kv_last_page_len=i32(8, 0)), ValueError, r"kv_last_page_len\[1\] = 0"),
        (dict(kv_last_page_len=i32(17, 4)), ValueError, "must be in"),
        (dict(kv_indices=torch.tensor([0, 1, 99, 3, 4], dtype=torch.int32)), IndexError, "outside the cache"),
        (dict(kv_indices=meta.kv_indices.float()), ValueError, "kv_indices must be"),
        # strided int64 views are read as the op reads them
        (dict(kv_indices=torch.tensor([0, 0, 1, 0, 10**12, 0, 3, 0, 4, 0], dtype=torch.long)[::2]), IndexError, "kv_indices"),
    ]
    for change, exc, match in cases:
        with pytest.raises(exc, match=match):
            _raw(q, meta, kc, vc, **change)
    with pytest.raises(ValueError, match="scale"):
        sparse_attention(q, meta, kc, vc, scale=-1.0)
    with pytest.raises(ValueError, match="logit_cap"):
        sparse_attention(q, meta, kc, vc, logit_cap=float("nan"))
    with pytest.raises(TypeError, match="meta must be an AttentionMetadata"):
        sparse_attention(q, (meta.q_pos,), kc, vc)
    with pytest.raises(TypeError, match="q must be a tensor"):
        sparse_attention("q", meta, kc, vc)
    with pytest.raises(ValueError, match="blocks, its block table has"):
        AttentionMetadata.build([np.array([0])], [np.array([0])], [20], 16)
    with pytest.raises(ValueError, match="one entry per sequence"):
        AttentionMetadata.build([np.array([0])], [], [20], 16)
    build_cases = [  # (positions, table, kv_len, message)
        (np.array([0.7, 1.9]), np.array([0]), 2, "positions must be a 1-D integer array"),
        (np.array([0, 2]), np.array([0]), 2, r"positions must lie in \[0, 2\)"),
        (np.array([-1]), np.array([0]), 2, "positions must lie"),
        (np.array([0]), np.array([0]), 2.9, "kv_len must be an int"),
        (np.array([0]), np.array([-3]), 2, "entries must be >= 0"),
        (np.array([0]), np.array([0.0]), 2, "block table must be a 1-D integer array"),
    ]
    for p, table, n, match in build_cases:
        with pytest.raises(ValueError, match=match):
            AttentionMetadata.build([p], [table], [n], 16)
    with pytest.raises(ValueError, match="rows_per_seq must be 2 ints"):
        meta.select(torch.arange(3), [1, 1, 1])
    with pytest.raises(ValueError, match="rows must be a 1-D tensor of sum"):
        meta.select(torch.arange(3), [1, 1])


def test_opcheck_and_compile():
    q, meta, kc, vc = make_batch(4, [50, 30], [7, 1], 0, 16, 2, 2, 16, torch.float32)
    args = (q, meta.q_pos, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, kc, vc)
    torch.library.opcheck(torch.ops.samcache.sparse_attention.default, (*args, 0.25, -1, 0.0, 50))

    def step(*a):
        out, lse = torch.ops.samcache.sparse_attention(*a, 0.25, 8, 0.0, 50)
        return out * 2, lse

    out, lse = torch.compile(step, backend="aot_eager", fullgraph=True)(*args)
    ref_out, _ = reference(q, meta, kc, vc, 0.25, 8, 0.0)
    torch.testing.assert_close(out.double(), 2 * ref_out, rtol=1e-5, atol=1e-5)


def cuda_kernels(fn) -> list[str]:
    """Names of the CUDA kernels fn launches (torch.profiler's device activity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


# Batches: (lengths, rows per sequence, block_size, kv_heads, heads per kv head, head_dim). The
# second uses several key splits (few rows) and two head groups (12 heads per kv head).
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape",
    [([3000], [150], 16, 4, 2, 128), ([4096, 300, 2000], [2, 1, 1], 16, 2, 12, 128),
     ([700, 90], [700, 5], 16, 2, 4, 96), ([257], [3], 1, 1, 8, 64)],
)
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_cuda_matches_reference(dtype, shape, tensor_cores, monkeypatch):
    """samcache's CUDA kernels (backend "native"). SAMCACHE_SPARSE_ATTENTION_TC=1 takes the CuTe
    tensor-core kernel where it applies (one sequence, bf16/fp16, head_dim 64 or 128), the
    CUDA-core kernel otherwise: the profiler says which ran."""
    monkeypatch.setenv("SAMCACHE_SPARSE_ATTENTION_TC", "1" if tensor_cores else "0")
    lengths, rows, bs, hkv, g, d = shape
    q, meta, kc, vc = make_batch(5, lengths, rows, 2, bs, hkv, g, d, dtype)
    cuda_meta = AttentionMetadata(*(t.cuda() for t in (meta.q_pos, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                                       meta.kv_last_page_len)), meta.max_kv_len)
    tc_applies = tensor_cores and len(lengths) == 1 and dtype != torch.float32 and d in (64, 128)
    for window, cap in ((-1, 0.0), (100, 30.0)):
        ref_out, ref_lse = reference(q, meta, kc, vc, d**-0.5, window, cap)
        got = []
        kernels = cuda_kernels(lambda: got.append(sparse_attention(q.cuda(), cuda_meta, kc.cuda(), vc.cuda(), window=window,
                                                                   logit_cap=cap, backend="native")))
        out, lse = got[0]
        assert any(("tc_kernel" if tc_applies else "split_kernel") in k for k in kernels), kernels
        assert tc_applies or not any("tc_kernel" in k for k in kernels), kernels
        tol = DTYPES[dtype]
        torch.testing.assert_close(out.cpu().double(), ref_out, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["native", "triton"])
def test_cuda_out_of_range_position_gives_nan_not_a_fault(backend):
    q, meta, kc, vc = make_batch(7, [64], [4], 0, 16, 1, 2, 64, torch.float16)
    bad = AttentionMetadata(torch.tensor([3, 64, 10, 2**30], dtype=torch.int32).cuda(), meta.qo_indptr.cuda(),
                            meta.kv_indptr.cuda(), meta.kv_indices.cuda(), meta.kv_last_page_len.cuda(), 64)
    out, lse = sparse_attention(q.cuda(), bad, kc.cuda(), vc.cuda(), backend=backend)  # not checked on the host
    assert out[[1, 3]].isnan().all() and lse[[1, 3]].isnan().all()
    assert not out[[0, 2]].isnan().any()


@pytest.mark.cuda
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_cuda_inconsistent_metadata_gives_nan_not_a_fault(tensor_cores, monkeypatch):
    """Device metadata is checked by the kernels, row by row: only the rows it makes
    inconsistent get NaN; int64 values are never narrowed (2**32 + 1 must not wrap to page 1)."""
    monkeypatch.setenv("SAMCACHE_SPARSE_ATTENTION_TC", "1" if tensor_cores else "0")
    q, meta, kc, vc = make_batch(8, [64], [4], 0, 16, 1, 2, 64, torch.float16)
    ref_out, _ = reference(q, meta, kc, vc, 64**-0.5, -1, 0.0)
    i64 = lambda *v: torch.tensor(v, dtype=torch.long).cuda()  # noqa: E731
    good = dict(q_pos=meta.q_pos, qo_indptr=meta.qo_indptr, kv_indptr=meta.kv_indptr, kv_indices=meta.kv_indices,
                kv_last_page_len=meta.kv_last_page_len)
    cases = [  # (change, rows that must be NaN)
        (dict(qo_indptr=i64(0, 2)), [2, 3]),                       # rows past the last sequence
        (dict(kv_indptr=i64(0, 9)), [0, 1, 2, 3]),                 # pages past kv_indices
        (dict(kv_indptr=i64(-1, 3)), [0, 1, 2, 3]),                # pages before kv_indices
        (dict(kv_last_page_len=i64(17)), [0, 1, 2, 3]),            # more than a block
        (dict(kv_indices=meta.kv_indices.long().cuda() + 2**32), [0, 1, 2, 3]),  # no wrap to a valid page
    ]
    for change, nan_rows in cases:
        parts = {k: (v.cuda() if k not in change else change[k]) for k, v in good.items()}
        bad = AttentionMetadata(parts["q_pos"], parts["qo_indptr"], parts["kv_indptr"], parts["kv_indices"],
                                parts["kv_last_page_len"], 64)
        out, lse = sparse_attention(q.cuda(), bad, kc.cuda(), vc.cuda(), backend="native")
        torch.cuda.synchronize()
        ok_rows = [r for r in range(q.shape[0]) if r not in nan_rows]
        assert out[nan_rows].isnan().all() and lse[nan_rows].isnan().all(), (change, out[nan_rows], lse[nan_rows])
        torch.testing.assert_close(out[ok_rows].cpu().double(), ref_out[ok_rows], rtol=2e-3, atol=2e-3, msg=str(change))


@pytest.mark.parametrize("n, m, hq, hkv, d", [(1, 1, 1, 1, 8), (37, 37, 4, 4, 16), (600, 600, 4, 2, 16), (5, 70, 2, 1, 64)])
def test_full_attention_equals_a_float64_softmax_over_every_key(n, m, hq, hkv, d):
    from samcache.ops import full_attention

    g = torch.Generator().manual_seed(n * 7 + m)
    q, k, v = (torch.randn(rows, h, d, generator=g) for rows, h in ((n, hq), (m, hkv), (m, hkv)))
    scale = 0.3
    kk, vv = (t.double().repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    logits = torch.einsum("nhd,mhd->hnm", q.double(), kk) * scale
    want = torch.einsum("hnm,mhd->nhd", logits.softmax(-1), vv)
    out = full_attention(q, k, v, scale=scale)
    assert out.shape == (n, hq, d) and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="k and v must be"):
        full_attention(q, k, v[:, :, :-1], scale=scale)
