"""rope_qkv_write against a float64 RoPE of q and k and a plain scatter into the paged caches,
and against the layer loop's torch expression (the same bits)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from samcache.ops import paged_write, rope_qkv_write

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def signed(sin):
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def case(n, heads, kv_heads, d, dtype, seed, pad=0):
    g = torch.Generator().manual_seed(seed)
    cols = (heads + 2 * kv_heads) * d
    qkv = torch.randn(n, cols + pad, generator=g).to(dtype)[:, :cols]
    angle = torch.rand(n, d // 2, generator=g).double() * 50
    angle = torch.cat((angle, angle), -1)
    return qkv, angle


def reference(qkv, angle, heads, kv_heads):
    """q, k rotated in float64 (rotate_half, the transformers formula) and v, as [N, heads, D]."""
    n, d = angle.shape
    x = qkv.double().view(n, heads + 2 * kv_heads, d)
    half = d // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), -1)
    rotated = x * angle.cos()[:, None] + rot * angle.sin()[:, None]
    return rotated[:, :heads], rotated[:, heads:heads + kv_heads], x[:, heads + kv_heads:]


def run(qkv, angle, heads, kv_heads, block_size, slots, dtype, device="cpu"):
    n, d = angle.shape
    num_blocks = max(1, -(-(int(slots.max()) + 1 if n else 1) // block_size)) + 1
    caches = [torch.full((num_blocks, block_size, kv_heads, d), float("nan"), dtype=dtype, device=device)
              for _ in range(2)]
    q = rope_qkv_write(qkv.to(device), angle.cos().to(dtype).to(device), signed(angle.sin()).to(dtype).to(device),
                       heads, kv_heads, caches[0], caches[1], slots.to(device))
    return q, caches


@given(n=st.integers(0, 30), heads=st.integers(1, 6), group=st.sampled_from([1, 2, 3]), half=st.integers(1, 20),
       dtype=st.sampled_from(DTYPES), block_size=st.sampled_from([1, 4, 16]), pad=st.sampled_from([0, 7]),
       slot_dtype=st.sampled_from([torch.int32, torch.int64]), seed=st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_matches_reference(n, heads, group, half, dtype, block_size, pad, slot_dtype, seed):
    kv_heads = max(1, heads // group)
    d = 2 * half
    qkv, angle = case(n, heads, kv_heads, d, dtype, seed, pad)
    slots = torch.randperm(n + 9, generator=torch.Generator().manual_seed(seed))[:n]
    slots[::4] = -1  # padding rows: nothing written
    slots = slots.to(slot_dtype)
    before = qkv.clone()
    q, (kc, vc) = run(qkv, angle, heads, kv_heads, block_size, slots, dtype)
    want_q, want_k, want_v = reference(qkv, angle, heads, kv_heads)
    assert q.shape == (n, heads, d) and q.dtype == dtype and q.is_contiguous()
    torch.testing.assert_close(q.double(), want_q, atol=TOL[dtype], rtol=TOL[dtype])
    flat_k, flat_v = kc.view(-1, kv_heads, d), vc.view(-1, kv_heads, d)
    keep = slots >= 0
    written = slots[keep].long()
    torch.testing.assert_close(flat_k[written].double(), want_k[keep], atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(flat_v[written].double(), want_v[keep])  # values copied bit for bit
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()
    assert torch.equal(qkv, before), "qkv is read only"


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_bits_as_the_torch_expression_it_replaces(dtype):
    heads, kv_heads, d, n = 8, 2, 64, 50
    qkv, angle = case(n, heads, kv_heads, d, dtype, 3)
    cos, sin = angle.cos().to(dtype), signed(angle.sin()).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d)
    half = d // 2
    rotated = qk * cos[:, None, :] + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin[:, None, :]
    v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
    kc_want = torch.zeros(8, 16, kv_heads, d, dtype=dtype)
    vc_want = torch.zeros_like(kc_want)
    slots = torch.randperm(128)[:n]
    paged_write(rotated[:, heads:], v, kc_want, vc_want, slots)
    kc, vc = torch.zeros_like(kc_want), torch.zeros_like(kc_want)
    q = rope_qkv_write(qkv, cos, sin, heads, kv_heads, kc, vc, slots)
    assert torch.equal(q, rotated[:, :heads]) and torch.equal(kc, kc_want) and torch.equal(vc, vc_want)


def test_bad_input():
    qkv, angle = case(4, 2, 1, 8, torch.float32, 0)
    cos, sin = angle.cos().float(), angle.sin().float()
    kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    slots = torch.tensor([0, 1, 2, 3])
    cases = [
        (dict(qkv=qkv[:, :-1]), ValueError, "qkv must have"),
        (dict(cos=cos.double()), TypeError, "cos must be Float like qkv"),
        (dict(qkv=qkv.long()), TypeError, "qkv must be float32"),
        (dict(cos=cos[:3]), ValueError, "cos must be \\[4, head_dim\\]"),
        (dict(sin=sin[:, :6]), ValueError, "sin must be \\[4, 8\\]"),
        (dict(cos=cos[:, :7], sin=sin[:, :7]), ValueError, "must be even"),
        (dict(num_heads=0), ValueError, "num_heads and num_kv_heads must be > 0"),
        (dict(num_heads=2.0), TypeError, "num_heads must be an int"),
        (dict(slots=torch.tensor([0, 1, 2, 99])), IndexError, "out of range"),
        (dict(slots=torch.tensor([0, 1, 1, 3])), ValueError, "appears twice"),
        (dict(slots=slots[:3]), ValueError, "one slot per token"),
        (dict(slots=slots.float()), ValueError, "slot_mapping must be int32 or int64"),
        (dict(kc=torch.zeros(2, 4, 2, 8)), ValueError, "."),
        (dict(vc=kc), ValueError, "must not share memory"),
        (dict(kc="cache"), TypeError, "key_cache must be a torch.Tensor"),
    ]
    for change, error, message in cases:
        a = dict(qkv=qkv, cos=cos, sin=sin, num_heads=2, num_kv_heads=1, kc=kc, vc=vc, slots=slots) | change
        with pytest.raises(error, match=message):
            rope_qkv_write(a["qkv"], a["cos"], a["sin"], a["num_heads"], a["num_kv_heads"], a["kc"], a["vc"], a["slots"])
    assert torch.equal(kc, torch.zeros_like(kc)), "nothing written on a refused call"


def test_opcheck_and_compile():
    qkv, angle = case(6, 2, 1, 8, torch.float32, 1)
    cos, sin = angle.cos().float(), signed(angle.sin()).float()
    slots = torch.tensor([0, 7, -1, 3, 4, 5])
    kc, vc = torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)
    torch.library.opcheck(torch.ops.samcache.rope_qkv_write.default, (qkv, cos, sin, 2, 1, kc, vc, slots))

    def step(qkv, cos, sin, kc, vc, slots):
        q = torch.ops.samcache.rope_qkv_write(qkv, cos, sin, 2, 1, kc, vc, slots)
        return q.sum() + kc.sum() + vc.sum()

    kc.zero_(), vc.zero_()
    want = step(qkv, cos, sin, kc, vc, slots)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(qkv, cos, sin, kc2, vc2, slots)
    torch.testing.assert_close(got, want)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cuda_matches_reference_and_the_cpu(dtype, slot_dtype):
    for seed, (n, heads, kv_heads, d, block_size) in enumerate([(500, 28, 4, 128, 16), (37, 3, 1, 10, 7),
                                                                (1, 1, 1, 2, 1)]):
        qkv, angle = case(n, heads, kv_heads, d, dtype, seed, pad=3)
        slots = torch.randperm(n + 20)[:n]
        slots[::5] = -1
        q, (kc, vc) = run(qkv, angle, heads, kv_heads, block_size, slots.to(slot_dtype), dtype, "cuda")
        q_cpu, (kc_cpu, vc_cpu) = run(qkv, angle, heads, kv_heads, block_size, slots.to(slot_dtype), dtype)
        want_q, _, _ = reference(qkv, angle, heads, kv_heads)
        torch.testing.assert_close(q.cpu().double(), want_q, atol=TOL[dtype], rtol=TOL[dtype])
        # Same roundings in the same order: the devices agree bit for bit.
        assert torch.equal(q.cpu(), q_cpu)
        assert torch.equal(kc.cpu().nan_to_num(7.0), kc_cpu.nan_to_num(7.0))
        assert torch.equal(vc.cpu().nan_to_num(7.0), vc_cpu.nan_to_num(7.0))


@pytest.mark.cuda
def test_cuda_skips_out_of_range_slots_and_refuses_as_the_cpu():
    qkv, angle = case(4, 2, 1, 8, torch.float32, 0)
    slots = torch.tensor([0, 99, -1, 3])
    q, (kc, vc) = run(qkv, angle, 2, 1, 4, torch.tensor([0, 1, -1, 3]), torch.float32, "cuda")
    kc.fill_(float("nan"))
    rope_qkv_write(qkv.cuda(), angle.cos().float().cuda(), signed(angle.sin()).float().cuda(), 2, 1, kc, vc,
                   slots.cuda())
    assert kc.view(-1, 1, 8)[[1, 2]].isnan().all()
    with pytest.raises(ValueError, match="qkv must have"):
        rope_qkv_write(qkv[:, :-1].cuda(), angle.cos().float().cuda(), angle.sin().float().cuda(), 2, 1, kc, vc,
                       slots.cuda())
