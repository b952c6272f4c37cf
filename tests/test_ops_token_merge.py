"""token_merge against a plain float64 index_add reference, on random merge plans."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from samcache.ops import token_merge

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative tolerance per dtype (float32 accumulation, one rounding to the output dtype).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def reference_token_merge(hidden, target, weight):
    """Weighted mean of each anchor's members, in float64, with plain loops and index_add_."""
    n, d = hidden.shape
    kept = [i for i in range(n) if int(target[i]) == i]
    num = torch.zeros(n, d, dtype=torch.float64).index_add_(0, target, hidden.double() * weight.double()[:, None])
    den = torch.zeros(n, dtype=torch.float64).index_add_(0, target, weight.double())
    return num[kept] / den[kept, None], torch.tensor(kept, dtype=torch.int64)


def poison_allocator(nbytes, device):
    """Leave NaN in memory the allocator will likely hand out next, so unwritten outputs show."""
    junk = torch.full((max(1, nbytes // 4),), float("nan"), device=device)
    del junk


def random_plan(n, mode, seed):
    g = torch.Generator().manual_seed(seed)
    if mode == "all_kept":
        anchors = torch.arange(n)
    elif mode == "one_anchor":
        anchors = torch.randint(0, n, (1,), generator=g)
    else:
        anchors = torch.randperm(n, generator=g)[: int(torch.randint(1, n + 1, (1,), generator=g))]
    target = anchors[torch.randint(0, len(anchors), (n,), generator=g)]
    target[anchors] = anchors
    weight = torch.rand(n, generator=g)
    weight[torch.rand(n, generator=g) < 0.3] = 0.0  # members of weight 0 are allowed ...
    weight[anchors] += 0.05  # ... as long as each anchor's total is positive
    return target, weight


def check_merge(hidden, target, weight, merged, kept):
    want, want_kept = reference_token_merge(hidden.cpu(), target.cpu(), weight.cpu())
    assert kept.dtype == torch.int64 and torch.equal(kept.cpu(), want_kept)
    assert merged.dtype == hidden.dtype and merged.shape == want.shape
    scale = hidden.double().abs().max().item() if hidden.numel() else 1.0
    tol = TOL[hidden.dtype]
    torch.testing.assert_close(merged.cpu().double(), want, rtol=tol, atol=tol * scale)


@given(
    n=st.integers(1, 40),
    d=st.integers(1, 33),
    dtype=st.sampled_from(DTYPES),
    mode=st.sampled_from(["random", "all_kept", "one_anchor"]),
    seed=st.integers(0, 2**31),
)
def test_token_merge_matches_reference(n, d, dtype, mode, seed):
    target, weight = random_plan(n, mode, seed)
    hidden = (torch.randn(n, d, generator=torch.Generator().manual_seed(seed + 1)) * 4).to(dtype)
    before = (hidden.clone(), target.clone(), weight.clone())
    poison_allocator(n * d * 4, "cpu")
    merged, kept = token_merge(hidden, target, weight)
    check_merge(hidden, target, weight, merged, kept)
    assert all(torch.equal(a, b) for a, b in zip((hidden, target, weight), before)), "inputs are read-only"


def test_token_merge_exact_cases():
    hidden = torch.tensor([[1.0, 2.0], [3.0, 4.0], [10.0, 20.0], [5.0, 7.0]])
    target = torch.tensor([0, 0, 2, 2])
    weight = torch.tensor([1.0, 3.0, 0.0, 2.0])  # anchor 2 itself weighs 0: only token 3 counts
    merged, kept = token_merge(hidden, target, weight)
    assert kept.tolist() == [0, 2]
    assert merged.tolist() == [[2.5, 3.5], [5.0, 7.0]]
    merged, kept = token_merge(hidden, torch.arange(4), torch.ones(4))  # all kept: identity
    assert torch.equal(merged, hidden) and kept.tolist() == [0, 1, 2, 3]


def test_token_merge_strided_hidden_and_empty():
    base = torch.randn(12, 10)
    hidden = base[::2, 1:9]  # row stride 20, column stride 1
    target, weight = random_plan(6, "random", seed=3)
    merged, kept = token_merge(hidden, target, weight)
    check_merge(hidden, target, weight, merged, kept)
    merged, kept = token_merge(base.t(), *random_plan(10, "random", seed=4))  # column stride != 1
    check_merge(base.t(), *random_plan(10, "random", seed=4), merged, kept)
    merged, kept = token_merge(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), torch.zeros(0))
    assert merged.shape == (0, 5) and kept.shape == (0,)


def test_token_merge_bad_input():
    hidden = torch.randn(4, 3)
    target = torch.tensor([0, 0, 2, 2])
    weight = torch.ones(4)
    cases = [
        ((hidden, torch.tensor([0, 4, 2, 2]), weight), IndexError, r"target\[1\] = 4"),
        ((hidden, torch.tensor([0, -1, 2, 2]), weight), IndexError, r"target\[1\] = -1"),
        ((hidden, torch.tensor([0, 0, 1, 2]), weight), ValueError, r"target\[2\] = 1 is not an anchor"),
        ((hidden, target, torch.tensor([1.0, -0.5, 1.0, 1.0])), ValueError, r"weight\[1\]"),
        ((hidden, target, torch.tensor([1.0, 1.0, float("nan"), 1.0])), ValueError, r"weight\[2\]"),
        ((hidden, target, torch.tensor([1.0, float("inf"), 1.0, 1.0])), ValueError, r"weight\[1\]"),
        ((hidden, target, torch.tensor([1.0, 1.0, 0.0, 0.0])), ValueError, "anchor 2 has total weight 0"),
        ((hidden[0], target, weight), ValueError, "hidden"),
        ((hidden[None], target, weight), ValueError, "hidden"),
        ((hidden.double(), target, weight), TypeError, "hidden"),
        ((hidden.to(torch.int32), target, weight), TypeError, "hidden"),
        ((hidden, target.int(), weight), TypeError, "target"),
        ((hidden, target.float(), weight), TypeError, "target"),
        ((hidden, target[:3], weight), ValueError, "target"),
        ((hidden, target[None], weight), ValueError, "target"),
        ((hidden, target, weight.double()), TypeError, "weight"),
        ((hidden, target, weight[:3]), ValueError, "weight"),
        ((hidden, target, weight[None]), ValueError, "weight"),
        ((hidden, [0, 0, 2, 2], weight), TypeError, "target"),
        (("hidden", target, weight), TypeError, "hidden"),
    ]
    for args, exc, match in cases:
        saved = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(exc, match=match):
            token_merge(*args)
        for a, s in zip(args, saved):
            if isinstance(a, torch.Tensor):  # inputs untouched
                torch.testing.assert_close(a, s, rtol=0, atol=0, equal_nan=True)


def test_token_merge_first_problem_is_reported():
    """Checks run kind by kind: an out-of-range target wins over an earlier bad weight."""
    hidden = torch.randn(5, 2)
    with pytest.raises(IndexError, match=r"target\[4\]"):
        token_merge(hidden, torch.tensor([0, 0, 2, 3, 9]), torch.tensor([-1.0, 1, 1, 1, 1]))


def test_token_merge_opcheck_and_compile():
    target, weight = random_plan(24, "random", seed=5)
    hidden = torch.randn(24, 16, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.samcache.token_merge.default, (hidden, target, weight))

    def compress(h, t, w):
        merged, kept = torch.ops.samcache.token_merge(h, t, w)
        return merged.float().sum(dim=1), kept + 1

    compiled = torch.compile(compress, backend="aot_eager", fullgraph=True)
    sums, kept1 = compiled(hidden, target, weight)
    merged, kept = token_merge(hidden, target, weight)
    assert torch.equal(kept1, kept + 1)
    torch.testing.assert_close(sums, merged.float().sum(dim=1))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_token_merge_cuda_matches_reference(dtype):
    cases = [(4096, 128, "random"), (1000, 3584, "random"), (333, 77, "random"), (5000, 64, "one_anchor"),
             (2048, 1024, "all_kept"), (1, 8, "all_kept")]
    for seed, (n, d, mode) in enumerate(cases):
        target, weight = random_plan(n, mode, seed)
        hidden = (torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)
        h, t, w = hidden.cuda(), target.cuda(), weight.cuda()
        poison_allocator(n * d * 4, "cuda")
        merged, kept = token_merge(h, t, w)
        check_merge(hidden, target, weight, merged, kept)
        again, _ = token_merge(h, t, w)
        assert torch.equal(merged.view(torch.uint8), again.view(torch.uint8)), "bitwise reproducible"
        cpu_merged, _ = token_merge(hidden, target, weight)
        tol = TOL[dtype]
        torch.testing.assert_close(merged.cpu().double(), cpu_merged.double(), rtol=tol, atol=tol * 4)


def plan_with_rows(lengths, seed):
    """A plan whose anchors have exactly the given member counts (anchor included), members
    interleaved at random positions."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    perm = torch.randperm(n, generator=g)
    target = torch.empty(n, dtype=torch.int64)
    start = 0
    for length in lengths:
        members = perm[start : start + length]
        anchor = members.min()
        target[members] = anchor
        start += length
    weight = torch.rand(n, generator=g) + 0.01
    return target, weight


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_token_merge_cuda_rows_of_every_length(dtype):
    """Rows of one chunk (<= 32 members) and rows cut into chunks (33 .. 2049+ members) side by
    side, on the vector path and the scalar path (odd width, strided and misaligned rows)."""
    lengths = [1, 2, 31, 32, 33, 64, 65, 100, 2048, 2049, 3000, 1, 5]
    for seed, d in enumerate([64, 1000, 77]):
        target, weight = plan_with_rows(lengths, seed)
        n = len(target)
        full = (torch.randn(n, d + 3, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)
        for strided in (False, True):  # packed rows; rows d + 3 apart starting one element in
            hidden = full[:, 1 : d + 1] if strided else full[:, :d].contiguous()
            h = full.cuda()[:, 1 : d + 1] if strided else hidden.cuda()
            t, w = target.cuda(), weight.cuda()
            poison_allocator(n * (d + 3) * 4, "cuda")
            merged, kept = token_merge(h, t, w)
            check_merge(hidden, target, weight, merged, kept)
            again, kept_again = token_merge(h, t, w)
            assert torch.equal(merged.view(torch.uint8), again.view(torch.uint8)), "bitwise reproducible"
            assert torch.equal(kept, kept_again)


@pytest.mark.cuda
def test_token_merge_cuda_zero_width_and_tiny():
    for n, d in [(1, 0), (40, 0), (1, 1), (3, 5)]:
        target, weight = random_plan(n, "random", seed=n + d)
        merged, kept = token_merge(torch.randn(n, d).cuda(), target.cuda(), weight.cuda())
        want_merged, want_kept = token_merge(torch.randn(n, d), target, weight)
        assert merged.shape == want_merged.shape and torch.equal(kept.cpu(), want_kept)
    merged, kept = token_merge(torch.zeros(0, 7).cuda(), torch.zeros(0, dtype=torch.long).cuda(), torch.zeros(0).cuda())
    assert merged.shape == (0, 7) and kept.shape == (0,) and merged.is_cuda and kept.is_cuda


@pytest.mark.cuda
def test_token_merge_cuda_bad_input_matches_cpu():
    """Every kind of bad plan raises the CPU's exception with the CPU's message, and the process
    (and later CUDA work) is unharmed."""
    hidden = torch.randn(4, 8)
    target = torch.tensor([0, 0, 2, 2])
    bad = [
        (torch.tensor([0, 4, 2, 2]), torch.ones(4), IndexError),
        (torch.tensor([0, -1, 2, 2]), torch.ones(4), IndexError),
        (torch.tensor([0, 2**40, 2, 2]), torch.ones(4), IndexError),
        (torch.tensor([0, 0, 1, 2]), torch.ones(4), ValueError),
        (target, torch.tensor([1.0, -0.5, 1.0, 1.0]), ValueError),
        (target, torch.tensor([1.0, 1.0, float("nan"), 1.0]), ValueError),
        (target, torch.tensor([1.0, float("inf"), 1.0, 1.0]), ValueError),
        (target, torch.tensor([1.0, 1.0, 0.0, 0.0]), ValueError),
        (target, torch.tensor([3e38, 3e38, 1.0, 1.0]), ValueError),  # anchor 0's total overflows float32
    ]
    big = torch.randn(5, 8)  # an out-of-range target wins over an earlier bad weight
    cases = [((hidden, t, w), exc) for t, w, exc in bad]
    cases.append(((big, torch.tensor([0, 0, 2, 3, 9]), torch.tensor([-1.0, 1, 1, 1, 1])), IndexError))
    for (h, t, w), exc in cases:
        with pytest.raises(exc) as cpu_err:
            token_merge(h, t, w)
        with pytest.raises(exc) as cuda_err:
            token_merge(h.cuda(), t.cuda(), w.cuda())
        assert str(cpu_err.value).splitlines()[0] == str(cuda_err.value).splitlines()[0]
    with pytest.raises(ValueError):
        token_merge(hidden.cuda(), target, torch.ones(4).cuda())  # mixed devices
    # Huge weights whose totals stay finite take the host check and still merge.
    w = torch.tensor([3e38, 1.0, 3e38, 1.0])
    small = torch.rand(4, 8)  # |x| < 1: no weighted row overflows either
    merged, kept = token_merge(small.cuda(), target.cuda(), w.cuda())
    want, want_kept = token_merge(small, target, w)
    assert torch.equal(kept.cpu(), want_kept)
    torch.testing.assert_close(merged.cpu(), want, rtol=1e-6, atol=1e-6)
    merged, _ = token_merge(hidden.cuda(), target.cuda(), torch.ones(4).cuda())  # CUDA still works
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_token_merge_cuda_opcheck():
    target, weight = random_plan(64, "random", seed=8)
    hidden = torch.randn(64, 40, dtype=torch.float16)
    torch.library.opcheck(torch.ops.samcache.token_merge.default, (hidden.cuda(), target.cuda(), weight.cuda()))
