"""quantize_kv_blocks / dequantize_kv_blocks against plain float64 references and error bounds."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from samcache.ops import dequantize_kv_blocks, quantize_kv_blocks
from samcache.ops.kv_quant import QMAX, QTYPES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative rounding of the cache dtype (the dequantized value is rounded to it once more).
DTYPE_EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DTYPE_TINY = {torch.float32: 1e-44, torch.float16: 6e-8, torch.bfloat16: 1e-38}


def reference_scales(cache, ids, qtype, per_head):
    """One float32 scale = amax / qmax per group (NaN when the group is not finite), in float64."""
    x = cache.double()[ids.long()]
    n, _, heads, _ = x.shape
    scales = torch.empty(n, heads if per_head else 1, dtype=torch.float64)
    for k in range(n):
        for h in range(scales.shape[1]):
            group = x[k, :, h] if per_head else x[k]
            if not torch.isfinite(group).all():
                scales[k, h] = math.nan
            else:
                scales[k, h] = float(np.float32(group.abs().max().item()) / np.float32(QMAX[qtype]))
    return scales if per_head else scales[:, 0]


def per_element(scales, per_head):
    return scales[:, None, :, None] if per_head else scales[:, None, None, None]


def check_quantized(cache, ids, q, scales, qtype, per_head):
    """Scales exact; every element within the format's rounding bound; non-finite groups q = 0."""
    assert q.dtype == QTYPES[qtype] and scales.dtype == torch.float32
    want = reference_scales(cache, ids, qtype, per_head)
    torch.testing.assert_close(scales.double(), want, rtol=0, atol=0, equal_nan=True)
    x = cache.double()[ids.long()]
    s = per_element(scales.double(), per_head).expand_as(x)
    qv = q.double()
    bad = s.isnan()
    assert (qv[bad] == 0).all(), "a non-finite group stores zeros"
    x, s, qv = x[~bad], s[~bad], qv[~bad]
    assert qv.abs().max().item() <= QMAX[qtype] if qv.numel() else True
    err = (x - qv * s).abs()
    # Half a step of the format, plus float32 rounding of the scale and of x * (1 / scale).
    slack = x.abs() * 2**-22
    if qtype == "int8":
        assert (qv == qv.round()).all()
        bound = s / 2 + slack
    else:
        normal = x.abs() >= s * 2**-6
        bound = torch.where(normal, x.abs() * 2**-4, s * 2**-10) + slack
    tiny_scale = s < 2**-126  # subnormal float32 scales lose precision (documented)
    assert (err[~tiny_scale] <= bound[~tiny_scale]).all(), (err - bound).max()


def check_dequantized(cache, ids, q, scales, per_head, dtype):
    want = (q.double() * per_element(scales.double(), per_head)).to(dtype)
    got = cache[ids.long()]
    torch.testing.assert_close(got.double(), want.double(), rtol=DTYPE_EPS[dtype] * 2, atol=DTYPE_TINY[dtype], equal_nan=True)


def random_cache(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    # Spread magnitudes over many binades so subnormal fp8 codes and saturation both occur.
    x = x * torch.exp2(torch.randint(-12, 4, shape, generator=g).float())
    return x.to(dtype).to(device)


@given(
    shape=st.tuples(st.integers(1, 8), st.integers(1, 5), st.integers(1, 3), st.integers(1, 20)),
    dtype=st.sampled_from(DTYPES),
    qtype=st.sampled_from(list(QTYPES)),
    per_head=st.booleans(),
    id_dtype=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_round_trip_matches_reference(shape, dtype, qtype, per_head, id_dtype, data):
    seed = data.draw(st.integers(0, 2**31))
    cache = random_cache(shape, dtype, seed)
    if data.draw(st.booleans()):  # an all-zero block
        cache[data.draw(st.integers(0, shape[0] - 1))] = 0
    n = data.draw(st.integers(0, shape[0]))
    ids = torch.randperm(shape[0], generator=torch.Generator().manual_seed(seed))[:n].to(id_dtype)
    before = cache.clone()
    q, scales = quantize_kv_blocks(cache, ids, qtype, per_head)
    assert torch.equal(cache, before), "quantize must not write the cache"
    assert q.shape == (n, *shape[1:]) and scales.shape == ((n, shape[2]) if per_head else (n,))
    check_quantized(cache, ids, q, scales, qtype, per_head)
    out = torch.full_like(cache, float("nan"))  # poisoned: unwritten elements show
    dequantize_kv_blocks(q, scales, out, ids)
    check_dequantized(out, ids, q, scales, per_head, dtype)
    untouched = torch.ones(shape[0], dtype=torch.bool)
    untouched[ids.long()] = False
    assert out[untouched].isnan().all(), "blocks not in block_ids must not be written"


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_codes_round_to_nearest_even_like_torch(qtype, dtype):
    """Codes equal torch's own conversion of x * (1 / scale) (the kernel's documented arithmetic)."""
    cache = random_cache((6, 4, 2, 16), dtype, seed=7)
    ids = torch.tensor([5, 0, 3])
    for per_head in (False, True):
        q, scales = quantize_kv_blocks(cache, ids, qtype, per_head)
        x = cache.float()[ids]
        inv = 1.0 / per_element(scales, per_head)
        v = (x * inv).clamp(-QMAX[qtype], QMAX[qtype])
        want = v.to(torch.float8_e4m3fn) if qtype == "fp8_e4m3" else v.round().to(torch.int8)
        assert torch.equal(q.view(torch.int8), want.view(torch.int8))


def encoder_sweep():
    """Every finite e4m3 value, the midpoints between neighbours (ties) and one float32 ulp either
    side of each midpoint, over [-448, 448]; 448 itself makes the scale exactly 1."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    levels = codes[codes.isfinite()].unique()
    mids = (levels[1:] + levels[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    return torch.cat([levels, near, torch.tensor([448.0])])


def test_fp8_encoder_matches_torch_on_every_tie():
    values = encoder_sweep()
    cache = values.reshape(1, 1, 1, -1)
    q, s = quantize_kv_blocks(cache, torch.tensor([0]), "fp8_e4m3")
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.int8).flatten(), values.to(torch.float8_e4m3fn).view(torch.int8))


def test_int8_rounds_ties_to_even():
    values = torch.cat([torch.arange(-127, 127) + 0.5, torch.tensor([127.0])])
    q, s = quantize_kv_blocks(values.reshape(1, 1, 1, -1), torch.tensor([0]), "int8")
    assert s.item() == 1.0
    assert torch.equal(q.flatten(), values.round().to(torch.int8))


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_every_float16_input_and_output(qtype):
    """The CPU path has its own float16 conversions: check all of them against torch's."""
    halves = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    halves = halves[halves.isfinite()]
    cache = halves.reshape(1, 1, 1, -1)
    q, s = quantize_kv_blocks(cache, torch.tensor([0]), qtype)
    want = (cache.float() * (1.0 / s)).clamp(-QMAX[qtype], QMAX[qtype])
    want = want.to(torch.float8_e4m3fn) if qtype == "fp8_e4m3" else want.round().to(torch.int8)
    assert torch.equal(q.view(torch.int8), want.view(torch.int8))
    # Way back: every code times scales from float16's subnormals to past its overflow.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(QTYPES[qtype])
    scales = torch.exp2(torch.arange(-40.0, 21.0)) * 1.37
    out = torch.full((len(scales), 1, 1, 256), float("nan"), dtype=torch.float16)
    q = codes.reshape(1, 1, 1, 256).expand(len(scales), 1, 1, 256).contiguous()
    dequantize_kv_blocks(q, scales.float(), out, torch.arange(len(scales)))
    want = (q.float() * scales[:, None, None, None].float()).to(torch.float16)
    assert torch.equal(out.isnan(), want.isnan())  # NaN payloads may differ; every other bit may not
    assert torch.equal(out.view(torch.int16)[~out.isnan()], want.view(torch.int16)[~want.isnan()])


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_saturation_zero_blocks_and_exact_zeros(qtype):
    cache = torch.zeros(3, 2, 2, 4)
    cache[1, 0, 0, 0] = -3.0e38  # the block maximum maps to -qmax exactly, nothing beyond
    cache[1, 1, 1, 3] = 1.0
    cache[2] = torch.linspace(-5, 5, 16).reshape(2, 2, 4)
    q, scales = quantize_kv_blocks(cache, torch.tensor([0, 1, 2]), qtype)
    assert scales[0].item() == 0.0 and (q[0].double() == 0).all()
    assert q[1, 0, 0, 0].double().item() == -QMAX[qtype]
    assert q[2].double().abs().max().item() == QMAX[qtype]
    if qtype == "fp8_e4m3":
        assert not q.double().isnan().any(), "saturate, never the NaN code"
    out = torch.full_like(cache, float("nan"))
    dequantize_kv_blocks(q, scales, out, torch.tensor([0, 1, 2]))
    assert (out[0] == 0).all(), "an all-zero block restores exact zeros"
    assert (out[2][cache[2] == 0] == 0).all() and (out[1][cache[1] == 0] == 0).all()
    torch.testing.assert_close(out[1, 0, 0, 0], cache[1, 0, 0, 0], rtol=2**-4, atol=0)


def test_float16_extremes():
    cache = torch.tensor([65504.0, -65504.0, 6e-8, 0.0], dtype=torch.float16).reshape(1, 1, 1, 4)
    for qtype in QTYPES:
        q, s = quantize_kv_blocks(cache, torch.tensor([0]), qtype)
        check_quantized(cache, torch.tensor([0]), q, s, qtype, False)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_non_finite_group_is_marked_invalid(per_head, poison):
    cache = random_cache((4, 3, 2, 8), torch.float32, seed=1)
    cache[2, 1, 1, 5] = poison
    ids = torch.tensor([2, 0])
    q, scales = quantize_kv_blocks(cache, ids, "fp8_e4m3", per_head)
    check_quantized(cache, ids, q, scales, "fp8_e4m3", per_head)
    bad = scales[0, 1] if per_head else scales[0]
    assert bad.isnan() and not scales[1].isnan().any()
    if per_head:
        assert not scales[0, 0].isnan()
    out = torch.zeros_like(cache)
    dequantize_kv_blocks(q, scales, out, ids)
    poisoned = out[2, :, 1] if per_head else out[2]
    assert poisoned.isnan().all(), "an invalid group restores as NaN, never as plausible numbers"
    assert torch.isfinite(out[0]).all()


def test_subnormal_scale_divides_instead():
    cache = torch.zeros(1, 1, 1, 4)
    cache[0, 0, 0] = torch.tensor([1e-40, -5e-41, 3e-41, 0.0])
    for qtype in QTYPES:
        q, s = quantize_kv_blocks(cache, torch.tensor([0]), qtype)
        out = torch.full_like(cache, float("nan"))
        dequantize_kv_blocks(q, s, out, torch.tensor([0]))
        assert torch.isfinite(out).all()
        assert (out - cache).abs().max().item() <= 0.1 * 1e-40


def test_strided_cache_view():
    """kv[:, 0] of a [B, 2, ...] cache: dense blocks, block stride twice the block size."""
    kv = random_cache((5, 2, 4, 2, 8), torch.bfloat16, seed=2)
    k = kv[:, 1]
    ids = torch.tensor([4, 1])
    for per_head in (False, True):
        q, s = quantize_kv_blocks(k, ids, "int8", per_head)
        check_quantized(k.contiguous(), ids, q, s, "int8", per_head)
        other = kv[:, 0].clone()
        k[ids] = float("nan")
        dequantize_kv_blocks(q, s, k, ids)
        check_dequantized(k, ids, q, s, per_head, torch.bfloat16)
        assert torch.equal(kv[:, 0], other), "the V half of the cache is untouched"


def test_accepts_numpy_ids_and_empty():
    cache = random_cache((3, 2, 1, 4), torch.float32, seed=4)
    q, s = quantize_kv_blocks(cache, np.array([2], dtype=np.int32))
    assert q.shape == (1, 2, 1, 4)
    q2, s2 = quantize_kv_blocks(cache, torch.tensor([1, 1]), "int8")  # repeats are fine when reading
    assert torch.equal(q2[0], q2[1]) and s2[0] == s2[1]
    q0, s0 = quantize_kv_blocks(cache, torch.zeros(0, dtype=torch.long), "int8", True)
    assert q0.shape == (0, 2, 1, 4) and s0.shape == (0, 1)
    dequantize_kv_blocks(q0, s0, cache, np.zeros(0, dtype=np.int64))


def test_bad_input():
    cache = random_cache((4, 2, 2, 4), torch.float32, seed=5)
    ids = torch.tensor([0, 2])
    q, s = quantize_kv_blocks(cache, ids, "int8", True)
    target = torch.zeros_like(cache)
    quant_cases = [
        (lambda: quantize_kv_blocks(cache, ids, "fp4"), ValueError),
        (lambda: torch.ops.samcache.quantize_kv_blocks(cache, ids, "int4", False), ValueError),
        (lambda: quantize_kv_blocks(cache, ids, 8), TypeError),
        (lambda: quantize_kv_blocks(cache, ids, "int8", 1), TypeError),
        (lambda: quantize_kv_blocks(cache.double(), ids), TypeError),
        (lambda: quantize_kv_blocks(cache.to(torch.int32), ids), TypeError),
        (lambda: quantize_kv_blocks(cache[0], ids), ValueError),
        (lambda: quantize_kv_blocks(cache.transpose(2, 3), ids), ValueError),
        (lambda: quantize_kv_blocks(cache, ids.float()), TypeError),
        (lambda: quantize_kv_blocks(cache, ids[None]), ValueError),
        (lambda: quantize_kv_blocks(cache, torch.tensor([4])), IndexError),
        (lambda: quantize_kv_blocks(cache, torch.tensor([-1])), IndexError),
        (lambda: quantize_kv_blocks(cache, [0, 1]), TypeError),
        (lambda: quantize_kv_blocks("cache", ids), TypeError),
    ]
    for call, exc in quant_cases:
        with pytest.raises(exc):
            call()
    dequant_cases = [
        (lambda: dequantize_kv_blocks(q.to(torch.float16), s, target, ids), TypeError),
        (lambda: dequantize_kv_blocks(q, s.double(), target, ids), TypeError),
        (lambda: dequantize_kv_blocks(q, s, target.double(), ids), TypeError),
        (lambda: dequantize_kv_blocks(q, s, target, ids.float()), TypeError),
        (lambda: dequantize_kv_blocks(q[:, :1], s, target, ids), ValueError),
        (lambda: dequantize_kv_blocks(q[:1], s[:1], target, ids), ValueError),
        (lambda: dequantize_kv_blocks(q, s[:, :1], target, ids), ValueError),
        (lambda: dequantize_kv_blocks(q, s[:1], target, ids), ValueError),
        (lambda: dequantize_kv_blocks(q, s[None], target, ids), ValueError),
        (lambda: dequantize_kv_blocks(q, s, target[0], ids), ValueError),
        (lambda: dequantize_kv_blocks(q, s, target, torch.tensor([0, 0])), ValueError),
        (lambda: dequantize_kv_blocks(q, s, target, torch.tensor([0, 4])), IndexError),
        (lambda: dequantize_kv_blocks(q, s, target, torch.tensor([-1, 0])), IndexError),
        (lambda: dequantize_kv_blocks(q, s, target, [0, 2]), TypeError),
        (lambda: dequantize_kv_blocks(q, "s", target, ids), TypeError),
    ]
    for call, exc in dequant_cases:
        with pytest.raises(exc):
            call()
        assert (target == 0).all(), "a rejected call must not write"
    # Caches whose blocks share memory would turn writes to distinct ids into a race.
    shared = torch.zeros(1, 2, 2, 4).expand(4, 2, 2, 4)
    overlapping = torch.zeros(64).as_strided((4, 2, 2, 4), (4, 8, 4, 1))
    for bad_cache in (shared, overlapping):
        with pytest.raises(ValueError, match="overlap"):
            dequantize_kv_blocks(q, s, bad_cache, ids)


def test_opcheck_and_compile():
    cache = random_cache((6, 4, 2, 8), torch.float16, seed=6)
    ids = torch.tensor([1, 4, 2])
    for qtype in QTYPES:
        for per_head in (False, True):
            torch.library.opcheck(torch.ops.samcache.quantize_kv_blocks.default, (cache, ids, qtype, per_head))
            q, s = quantize_kv_blocks(cache, ids, qtype, per_head)
            # SchemaCheckMode cannot compare float8 inputs (no CPU mul for them): the int8 runs
            # check the same schema.
            utils = ("test_faketensor", "test_aot_dispatch_dynamic") if qtype == "fp8_e4m3" else None
            kwargs = {"test_utils": utils} if utils else {}
            torch.library.opcheck(torch.ops.samcache.dequantize_kv_blocks.default, (q, s, cache.clone(), ids), **kwargs)

    def evict_and_restore(c, cold, i):
        q, s = torch.ops.samcache.quantize_kv_blocks(c, i, "fp8_e4m3", True)
        torch.ops.samcache.dequantize_kv_blocks(q, s, cold, i)
        return s.sum()

    compiled = torch.compile(evict_and_restore, backend="aot_eager", fullgraph=True)
    cold = torch.zeros_like(cache)
    total = compiled(cache, cold, ids)
    q, s = quantize_kv_blocks(cache, ids, "fp8_e4m3", True)
    check_dequantized(cold, ids, q, s, True, torch.float16)
    torch.testing.assert_close(total, s.sum())


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
def test_cuda_matches_reference(qtype, dtype, per_head):
    for seed, shape in enumerate([(64, 16, 8, 128), (9, 3, 5, 7), (300, 16, 2, 64), (4, 1, 1, 1)]):
        cache = random_cache(shape, dtype, seed, device="cuda")
        cache[0, 0, 0, 0] = float("nan")
        n = shape[0] // 2 + 1
        ids = torch.randperm(shape[0])[:n]
        for dev_ids in (ids, ids.cuda()):
            q, s = quantize_kv_blocks(cache, dev_ids, qtype, per_head)
            q_cpu, s_cpu = quantize_kv_blocks(cache.cpu(), ids, qtype, per_head)
            assert torch.equal(q.cpu().view(torch.int8), q_cpu.view(torch.int8))
            torch.testing.assert_close(s.cpu(), s_cpu, rtol=0, atol=0, equal_nan=True)
            check_quantized(cache.cpu(), ids, q.cpu(), s.cpu(), qtype, per_head)
            out = torch.full_like(cache, float("nan"))
            dequantize_kv_blocks(q, s, out, dev_ids)
            check_dequantized(out.cpu(), ids, q.cpu(), s.cpu(), per_head, dtype)
            untouched = torch.ones(shape[0], dtype=torch.bool)
            untouched[ids] = False
            assert out.cpu()[untouched].isnan().all()


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_dequantize_equals_cpu(qtype, dtype):
    """CUDA writes exactly the CPU's values (the same float32 product, the same rounding): blocks of
    several 1024-vector tiles, per block and per head, a cache view with a block stride of two
    blocks, the scalar path (odd head_dim), a NaN group; everything else keeps its poison."""
    cases = [((64, 16, 8, 128), False, False), ((64, 16, 8, 128), True, True), ((33, 16, 2, 64), True, False),
             ((9, 3, 5, 7), True, True), ((7, 64, 8, 128), False, True), ((5, 1, 1, 1), False, False)]
    for seed, (shape, per_head, view) in enumerate(cases):
        cache = random_cache(shape, dtype, seed)
        ids = torch.randperm(shape[0], generator=torch.Generator().manual_seed(seed))[: shape[0] // 2 + 1]
        cache[ids[0], 0, 0, 0] = float("nan")  # that group dequantizes to NaN
        q, s = quantize_kv_blocks(cache, ids, qtype, per_head)

        def poisoned(device):
            full = torch.full((shape[0], 2, *shape[1:]), -7.0, dtype=dtype, device=device)
            return full, (full[:, 1] if view else full[:, 0].contiguous())

        full_cpu, out_cpu = poisoned("cpu")
        dequantize_kv_blocks(q, s, out_cpu, ids)
        for dev_ids in (ids, ids.cuda()):
            full_gpu, out_gpu = poisoned("cuda")
            dequantize_kv_blocks(q.cuda(), s.cuda(), out_gpu, dev_ids)
            torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(full_gpu.cpu(), full_cpu, rtol=0, atol=0, equal_nan=True)


@pytest.mark.cuda
def test_cuda_device_ids_out_of_range_are_skipped():
    cache = random_cache((4, 2, 2, 8), torch.float16, seed=0, device="cuda")
    ids = torch.tensor([1, 7, -1, 2], device="cuda")
    q, s = quantize_kv_blocks(cache, ids, "int8")
    assert s[1].isnan() and s[2].isnan() and (q[1:3].cpu() == 0).all()
    out = torch.zeros_like(cache)
    dequantize_kv_blocks(q, s, out, ids)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and (out[[0, 3]] == 0).all()


@pytest.mark.cuda
def test_cuda_codes_and_schema():
    """Every e4m3 tie and every int8 tie round as on the CPU; the CUDA kernels pass opcheck."""
    values = encoder_sweep().reshape(1, 1, 1, -1)
    for qtype, x in (("fp8_e4m3", values), ("int8", torch.cat([torch.arange(-127, 127) + 0.5, torch.tensor([127.0])]).reshape(1, 1, 1, -1))):
        q, s = quantize_kv_blocks(x.cuda(), torch.tensor([0]), qtype)
        q_cpu, s_cpu = quantize_kv_blocks(x, torch.tensor([0]), qtype)
        assert torch.equal(q.cpu().view(torch.int8), q_cpu.view(torch.int8)) and torch.equal(s.cpu(), s_cpu)
    cache = random_cache((6, 4, 2, 8), torch.float16, seed=6, device="cuda")
    ids = torch.tensor([1, 4, 2], device="cuda")
    torch.library.opcheck(torch.ops.samcache.quantize_kv_blocks.default, (cache, ids, "int8", True))
    q, s = quantize_kv_blocks(cache, ids, "int8", True)
    torch.library.opcheck(torch.ops.samcache.dequantize_kv_blocks.default, (q, s, cache.clone(), ids))
