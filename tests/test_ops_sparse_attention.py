"""sparse_attention against a plain float64 reference: causal by index, GQA, window, cap, lse."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from samcache.ops import sparse_attention

DTYPES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def reference(q, q_index, kc, vc, table, n, scale, window, cap):
    """Gather the sequence's KV, then dense attention with an explicit mask, in float64."""
    bs = kc.shape[1]
    tok = torch.arange(n)
    k = kc[table.long()[tok // bs], tok % bs].double()  # [n, Hkv, D]
    v = vc[table.long()[tok // bs], tok % bs].double()
    g = q.shape[1] // kc.shape[2]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if cap > 0:
        logits = cap * torch.tanh(logits / cap)
    qi = q_index.long()[:, None]
    visible = tok[None, :] <= qi
    if window > 0:
        visible &= tok[None, :] > qi - window
    logits = logits.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [H, Q]
    out = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)
    return out, lse.t()


def make_case(seed, n, num_blocks, bs, hkv, g, d, nq, dtype):
    gen = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: -(-n // bs)].to(torch.int32)
    q_index = torch.randperm(n, generator=gen)[:nq]
    q = torch.randn(nq, hkv * g, d, generator=gen).to(dtype)
    return q, q_index, kc, vc, table


@given(
    n=st.integers(1, 700),
    bs=st.sampled_from([1, 4, 16]),
    hkv=st.integers(1, 3),
    g=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([8, 32, 40, 64]),
    density=st.floats(0.01, 1.0),
    window=st.sampled_from([-1, 0, 1, 7, 300]),
    cap=st.sampled_from([0.0, 5.0]),
    dtype=st.sampled_from(list(DTYPES)),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**31),
)
def test_matches_reference(n, bs, hkv, g, d, density, window, cap, dtype, index_dtype, seed):
    nq = max(1, int(n * density))
    num_blocks = -(-n // bs) + 3
    q, q_index, kc, vc, table = make_case(seed, n, num_blocks, bs, hkv, g, d, nq, dtype)
    scale = 1 / math.sqrt(d)
    out, lse = sparse_attention(q, q_index.to(index_dtype), kc, vc, table, n, scale=scale, window=window, logit_cap=cap)
    ref_out, ref_lse = reference(q, q_index, kc, vc, table, n, scale, window, cap)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    tol = DTYPES[dtype]
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)


def test_full_density_equals_causal_sdpa():
    """With every token as a query, the op is ordinary causal attention (checked against torch SDPA)."""
    q, q_index, kc, vc, table = make_case(0, 96, 8, 16, 2, 3, 32, 96, torch.float32)
    q_index = torch.arange(96)
    out, _ = sparse_attention(q, q_index, kc, vc, table, 96)
    k = kc[table.long()].flatten(0, 1)[:96].repeat_interleave(3, dim=1)
    v = vc[table.long()].flatten(0, 1)[:96].repeat_interleave(3, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)


def test_lse_merges_partial_results():
    """Two calls over disjoint key windows merge through their lse into the full result."""
    q, _, kc, vc, table = make_case(1, 64, 4, 16, 1, 2, 16, 1, torch.float32)
    q_index = torch.tensor([63])
    full, full_lse = sparse_attention(q, q_index, kc, vc, table, 64)
    recent, lse_r = sparse_attention(q, q_index, kc, vc, table, 64, window=20)  # keys 44..63
    older, lse_o = sparse_attention(q, torch.tensor([43]), kc, vc, table, 64)  # keys 0..43
    merged_lse = torch.logaddexp(lse_r, lse_o)
    merged = recent * (lse_r - merged_lse).exp()[..., None] + older * (lse_o - merged_lse).exp()[..., None]
    torch.testing.assert_close(merged_lse, full_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-5)


def test_empty_queries():
    q, _, kc, vc, table = make_case(2, 32, 2, 16, 1, 1, 8, 1, torch.float32)
    out, lse = sparse_attention(q[:0], torch.zeros(0, dtype=torch.long), kc, vc, table, 32)
    assert out.shape == (0, 1, 8) and lse.shape == (0, 1)


def test_bad_input():
    q, q_index, kc, vc, table = make_case(3, 40, 4, 16, 2, 2, 8, 5, torch.float32)
    ok = dict(q=q, q_index=q_index, key_cache=kc, value_cache=vc, block_table=table, num_kv_tokens=40)
    cases = [
        (dict(q=q[0]), ValueError),
        (dict(q=q[:, :3]), ValueError),  # 3 q heads over 2 kv heads
        (dict(q=q[..., :4]), ValueError),
        (dict(q=q.double()), ValueError),
        (dict(key_cache=kc.half()), ValueError),
        (dict(value_cache=vc[:2]), ValueError),
        (dict(key_cache=kc.transpose(0, 1).contiguous().transpose(0, 1)), ValueError),
        (dict(q_index=q_index.float()), ValueError),
        (dict(q_index=q_index[:2]), ValueError),
        (dict(q_index=torch.tensor([0, 1, 2, 3, 40])), IndexError),
        (dict(q_index=torch.tensor([0, 1, 2, 3, -1])), IndexError),
        (dict(block_table=table.float()), ValueError),
        (dict(block_table=torch.tensor([0, 1, 9], dtype=torch.int32)), IndexError),
        (dict(num_kv_tokens=49), ValueError),
        (dict(num_kv_tokens=0), ValueError),
        (dict(num_kv_tokens=4.0), TypeError),
        # strided int64 views must be checked as the op reads them
        (dict(block_table=torch.tensor([0, 0, 2, 0, 10**12, 0], dtype=torch.long)[::2]), IndexError),
        (dict(q_index=torch.tensor([5, 0, 1, 0, 2, 0, 3, 0, 10**6, 0])[::2]), IndexError),
        (dict(q="q"), TypeError),
    ]
    for change, exc in cases:
        with pytest.raises(exc):
            sparse_attention(**{**ok, **change})
    with pytest.raises(ValueError):
        sparse_attention(**ok, scale=-1.0)
    with pytest.raises(ValueError):
        sparse_attention(**ok, logit_cap=float("nan"))


def test_opcheck_and_compile():
    q, q_index, kc, vc, table = make_case(4, 50, 4, 16, 2, 2, 16, 7, torch.float32)
    torch.library.opcheck(torch.ops.samcache.sparse_attention.default, (q, q_index, kc, vc, table, 50, 0.25, -1, 0.0))

    def step(q, q_index, kc, vc, table):
        out, lse = torch.ops.samcache.sparse_attention(q, q_index, kc, vc, table, 50, 0.25, 8, 0.0)
        return out * 2, lse

    out, lse = torch.compile(step, backend="aot_eager", fullgraph=True)(q, q_index, kc, vc, table)
    ref_out, ref_lse = reference(q, q_index, kc, vc, table, 50, 0.25, 8, 0.0)
    torch.testing.assert_close(out.double(), 2 * ref_out, rtol=1e-5, atol=1e-5)


def test_zero_query_heads():
    q, q_index, kc, vc, table = make_case(6, 32, 2, 16, 1, 1, 8, 3, torch.float32)
    out, lse = sparse_attention(q[:, :0], q_index, kc, vc, table, 32)
    assert out.shape == (3, 0, 8) and lse.shape == (3, 0)


# Shapes: (keys, block_size, kv_heads, heads per kv head, head_dim, queries). The second and
# fourth use several key splits (few queries) and two head groups (12 heads per kv head).
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape",
    [(3000, 16, 4, 2, 128, 150), (4096, 16, 2, 12, 128, 2), (700, 16, 2, 4, 96, 700), (257, 1, 1, 8, 64, 3)],
)
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_cuda_matches_reference(dtype, shape, tensor_cores, monkeypatch):
    # SAMCACHE_SPARSE_ATTENTION_TC=1 takes the CuTe tensor-core kernel where it applies
    # (bf16/fp16, head_dim 64 or 128); other cases fall back to the CUDA-core kernel.
    monkeypatch.setenv("SAMCACHE_SPARSE_ATTENTION_TC", "1" if tensor_cores else "0")
    n, bs, hkv, g, d, nq = shape
    q, q_index, kc, vc, table = make_case(5, n, -(-n // bs) + 2, bs, hkv, g, d, nq, dtype)
    for window, cap in ((-1, 0.0), (100, 30.0)):
        ref_out, ref_lse = reference(q, q_index, kc, vc, table, n, d**-0.5, window, cap)
        out, lse = sparse_attention(q.cuda(), q_index.cuda(), kc.cuda(), vc.cuda(), table.cuda(), n,
                                    window=window, logit_cap=cap)
        tol = DTYPES[dtype]
        torch.testing.assert_close(out.cpu().double(), ref_out, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=tol, atol=tol)
    torch.testing.assert_close(
        sparse_attention(q.cuda(), q_index.cuda(), kc.cuda(), vc.cuda(), table.long().cuda(), n)[0].cpu().double(),
        reference(q, q_index, kc, vc, table, n, d**-0.5, -1, 0.0)[0], rtol=DTYPES[dtype], atol=DTYPES[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_cuda_out_of_range_index_gives_nan_not_a_fault(tensor_cores, monkeypatch):
    monkeypatch.setenv("SAMCACHE_SPARSE_ATTENTION_TC", "1" if tensor_cores else "0")
    q, q_index, kc, vc, table = make_case(7, 64, 4, 16, 1, 2, 64, 4, torch.float16)
    bad_index = torch.tensor([3, 64, 10, 2**40]).cuda()  # device indices are not checked on the host
    out, lse = sparse_attention(q.cuda(), bad_index, kc.cuda(), vc.cuda(), table.cuda(), 64)
    assert out[[1, 3]].isnan().all() and lse[[1, 3]].isnan().all()
    assert not out[[0, 2]].isnan().any()
