"""rms_norm / add_rms_norm against a float64 RMS norm, and against Hugging Face's module."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from samcache.ops import add_rms_norm, rms_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative to the output's scale: float32 statistics, then up to two roundings to the dtype.
TOL = {torch.float32: 3e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def reference(x, weight, eps):
    """The norm in float64, with the rounding of the normalised row to x's dtype that the model
    does before the weight (so bfloat16 cases compare like with like)."""
    x64 = x.double()
    y = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double()
    return weight.double() * y


def random_rows(n, d, dtype, seed, stride_pad=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d + stride_pad, generator=g) * (1 + 10 * torch.rand(n, 1, generator=g))
    x = base.to(dtype)[:, :d]  # a row stride larger than d when padded
    weight = (torch.randn(d, generator=g) * 0.5 + 1).to(dtype)
    return x, weight


def check(got, want, dtype):
    scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert got.dtype == dtype and got.is_contiguous() and got.shape == want.shape
    if got.numel():
        assert ((got.double() - want).abs() / scale).max().item() <= TOL[dtype]


@given(n=st.integers(0, 40), d=st.integers(1, 70), dtype=st.sampled_from(DTYPES), pad=st.sampled_from([0, 3]),
       eps=st.sampled_from([1e-6, 1e-5, 0.0]), seed=st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_rms_norm_matches_reference(n, d, dtype, pad, eps, seed):
    x, weight = random_rows(n, d, dtype, seed, pad)
    before = x.clone()
    torch.full((max(1, n * d),), float("nan"))  # poison: what the output gets next
    out = rms_norm(x, weight, eps)
    assert out.shape == (n, d)
    check(out, reference(x, weight, eps), dtype)
    assert torch.equal(x, before), "rms_norm reads x only"


@given(n=st.integers(0, 40), d=st.integers(1, 70), dtype=st.sampled_from(DTYPES), pad=st.sampled_from([0, 5]),
       seed=st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_add_rms_norm_adds_in_place_then_norms(n, d, dtype, pad, seed):
    x, weight = random_rows(n, d, dtype, seed, pad)
    delta, _ = random_rows(n, d, dtype, seed + 1)
    want_sum = x + delta  # torch's own add: the in-place sum must be its bits
    out = add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(x, want_sum)
    check(out, reference(want_sum, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_the_hugging_face_module_closely(dtype):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(256, eps=1e-6)
    x, weight = random_rows(300, 256, dtype, 5)
    norm.weight.data = weight
    want = norm(x)
    got = rms_norm(x, norm.weight.data, norm.variance_epsilon)
    # Same steps in the same dtype; only the sum of squares is added up in another order.
    ulps = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=ulps, atol=ulps * want.abs().max().item())


def test_rows_do_not_depend_on_the_rest_of_the_call():
    x, weight = random_rows(64, 96, torch.float32, 9)
    whole = rms_norm(x, weight, 1e-6)
    for rows in (slice(0, 1), slice(5, 7), slice(13, 64)):
        assert torch.equal(rms_norm(x[rows], weight, 1e-6), whole[rows])


def test_bad_input():
    x, w = random_rows(4, 8, torch.float32, 0)
    cases = [
        (lambda: rms_norm(x[0], w, 1e-6), ValueError, "x must be \\[N, D\\]"),
        (lambda: rms_norm(x, w[:7], 1e-6), ValueError, "weight must be \\[8\\]"),
        (lambda: rms_norm(x, w.double(), 1e-6), TypeError, "weight must be Float"),
        (lambda: rms_norm(x.long(), w.long(), 1e-6), TypeError, "x must be float32"),
        (lambda: rms_norm(x.t(), w[:4], 1e-6), ValueError, "last dim must be contiguous"),
        (lambda: rms_norm(x, w, -1.0), ValueError, "eps must be"),
        (lambda: rms_norm(x, w, float("nan")), ValueError, "eps must be"),
        (lambda: rms_norm(x, "w", 1e-6), TypeError, "weight must be a torch.Tensor"),
        (lambda: rms_norm(torch.empty(3, 0), torch.empty(0), 1e-6), ValueError, "no columns"),
        (lambda: add_rms_norm(x, x[:3], w, 1e-6), ValueError, "delta must be"),
        (lambda: add_rms_norm(x, x.half(), w, 1e-6), TypeError, "delta must be Float"),
        (lambda: add_rms_norm(x, None, w, 1e-6), TypeError, "delta must be a torch.Tensor"),
        (lambda: add_rms_norm(x[:1].expand(4, 8), x, w, 1e-6), ValueError, "rows overlap"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_opcheck_and_compile():
    x, w = random_rows(6, 16, torch.float32, 3)
    d, _ = random_rows(6, 16, torch.float32, 4)
    torch.library.opcheck(torch.ops.samcache.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.samcache.add_rms_norm.default, (x.clone(), d, w, 1e-6))

    def step(x, d, w):
        return torch.ops.samcache.add_rms_norm(x, d, w, 1e-6).sum(-1) + torch.ops.samcache.rms_norm(x, w, 1e-6)[:, 0]

    want = step(x.clone(), d, w)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x.clone(), d, w)
    torch.testing.assert_close(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_reference(dtype):
    for seed, (n, d, pad) in enumerate([(300, 3584, 0), (37, 70, 3), (1, 1, 0), (5000, 256, 8)]):
        x, weight = random_rows(n, d, dtype, seed, pad)
        delta, _ = random_rows(n, d, dtype, seed + 1)
        xg, dg, wg = x.cuda(), delta.cuda(), weight.cuda()
        torch.full((n * d + 16,), float("nan"), device="cuda")
        check(rms_norm(xg, wg, 1e-6).cpu(), reference(x, weight, 1e-6), dtype)
        out = add_rms_norm(xg, dg, wg, 1e-6).cpu()
        assert torch.equal(xg.cpu(), x + delta)
        check(out, reference(x + delta, weight, 1e-6), dtype)


@pytest.mark.cuda
def test_cuda_bad_input_as_on_the_cpu():
    x, w = random_rows(4, 8, torch.float32, 0)
    for call in (lambda t, v: rms_norm(t, v[:7], 1e-6), lambda t, v: rms_norm(t, v.double(), 1e-6),
                 lambda t, v: add_rms_norm(t[:1].expand(4, 8), t, v, 1e-6), lambda t, v: rms_norm(t, v, -1.0)):
        with pytest.raises(Exception) as on_cpu:
            call(x, w)
        with pytest.raises(type(on_cpu.value)) as on_cuda:
            call(x.cuda(), w.cuda())
        assert str(on_cuda.value).split("\n")[0] == str(on_cpu.value).split("\n")[0]
    with pytest.raises(ValueError, match="weight on cpu"):
        rms_norm(x.cuda(), w, 1e-6)
