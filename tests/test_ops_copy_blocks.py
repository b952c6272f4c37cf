"""torch.ops.samcache kernels against plain float64 references, with poisoned outputs."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import samcache
from samcache import BlockPool
from samcache.ops import copy_blocks

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


def reference_copy_blocks(caches, pairs):
    out = [c.to(torch.float64).clone() for c in caches]
    for src, dst in pairs.tolist():
        for c in out:
            c[dst] = c[src]
    return out


def random_case(draw_shape, dtype, n_caches, n_pairs, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(draw_shape, generator=g) * 8).to(dtype).to(device) for _ in range(n_caches)]
    perm = torch.randperm(draw_shape[0], generator=g)
    pairs = torch.stack([perm[:n_pairs], perm[n_pairs : 2 * n_pairs]], dim=1)  # distinct dsts, dst ∉ src
    return caches, pairs


@given(
    num_blocks=st.integers(2, 24),
    tail=st.lists(st.integers(1, 9), min_size=0, max_size=3),
    dtype=st.sampled_from(DTYPES),
    n_caches=st.integers(1, 4),
    data=st.data(),
)
def test_copy_blocks_matches_reference(num_blocks, tail, dtype, n_caches, data):
    shape = (num_blocks, *tail)
    n_pairs = data.draw(st.integers(0, num_blocks // 2))
    caches, pairs = random_case(shape, dtype, n_caches, n_pairs, data.draw(st.integers(0, 2**31)))
    expected = reference_copy_blocks(caches, pairs)
    for c in caches:  # poison every destination: unwritten elements must show
        c[pairs[:, 1]] = torch.tensor(-99, dtype=dtype) if dtype == torch.int8 else torch.tensor(float("nan"), dtype=dtype)
    copy_blocks(caches, pairs.to(data.draw(st.sampled_from([torch.int32, torch.int64]))))
    for got, want in zip(caches, expected):
        torch.testing.assert_close(got.to(torch.float64), want, rtol=0, atol=0)


def test_copy_blocks_performs_block_pool_copies():
    """The (src, dst) pairs of a CoW append, applied by the op, give the child its own copy."""
    pool = BlockPool(8, 4)
    k = torch.zeros(8, 4, 2, 3)
    parent = pool.new_sequence()
    k.view(-1, 2, 3)[torch.from_numpy(pool.append_slots(parent, 6).slots).long()] = 1.0
    child = pool.fork(parent)
    res = pool.append_slots(child, 1)
    copy_blocks([k], res.copies)
    k.view(-1, 2, 3)[torch.from_numpy(res.slots).long()] = 2.0
    flat = k.view(-1, 2, 3)
    table_c, table_p = pool.block_table(child), pool.block_table(parent)
    child_slots = [table_c[i // 4] * 4 + i % 4 for i in range(7)]
    parent_slots = [table_p[i // 4] * 4 + i % 4 for i in range(6)]
    assert flat[child_slots[:6]].eq(1).all() and flat[child_slots[6]].eq(2).all()
    assert flat[parent_slots].eq(1).all()  # the parent never sees the child's write


def test_copy_blocks_bad_input(rejects_without_writing):
    c = torch.zeros(4, 2)
    ok = torch.tensor([[0, 1]])
    cases = [
        (lambda: copy_blocks([], ok), ValueError),
        (lambda: copy_blocks([c, torch.zeros(5, 2)], ok), ValueError),
        (lambda: copy_blocks([c, torch.zeros(4, 2, dtype=torch.float16)], ok), ValueError),
        (lambda: copy_blocks([torch.zeros(2, 4).t()], ok), ValueError),
        (lambda: copy_blocks([c], torch.tensor([[0.0, 1.0]])), ValueError),
        (lambda: copy_blocks([c], torch.tensor([0, 1])), ValueError),
        (lambda: copy_blocks([c], torch.tensor([[0, 4]])), IndexError),
        (lambda: copy_blocks([c], torch.tensor([[-1, 2]])), IndexError),
        (lambda: copy_blocks([c], torch.tensor([[0, 1], [2, 1]])), ValueError),
        (lambda: copy_blocks([c], torch.tensor([[0, 1], [1, 2]])), ValueError),
        (lambda: copy_blocks([c], [[0, 1]]), TypeError),
        (lambda: copy_blocks([c, "x"], ok), TypeError),
        (lambda: copy_blocks([c, c], ok), ValueError),  # the same memory twice would race
        (lambda: copy_blocks([c, c.view(4, 2)], ok), ValueError),
    ]
    for call, exc in cases:
        rejects_without_writing(call, exc, [c])


def test_copy_blocks_accepts_numpy_pairs_and_empty():
    c = torch.arange(8.0).reshape(4, 2)
    copy_blocks([c], np.zeros((0, 2), dtype=np.int32))
    copy_blocks([c], np.array([[3, 0]], dtype=np.int32))
    assert c[0].tolist() == [6.0, 7.0]


def test_copy_blocks_opcheck_and_compile():
    caches, pairs = random_case((6, 4, 2), torch.float32, 2, 2, seed=3)
    torch.library.opcheck(torch.ops.samcache.copy_blocks.default, (caches, pairs))

    def step(a, b, p):
        torch.ops.samcache.copy_blocks([a, b], p)
        return a.sum() + b.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    a, b = caches
    ref_a, ref_b = reference_copy_blocks([a, b], pairs)
    out = compiled(a, b, pairs)
    torch.testing.assert_close(a.double(), ref_a)
    torch.testing.assert_close(out.double(), ref_a.sum() + ref_b.sum())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_copy_blocks_cuda_matches_reference(dtype):
    for seed, shape in enumerate([(64, 16, 8, 128), (7, 3, 5), (1024, 16, 2, 64)]):
        caches, pairs = random_case(shape, dtype, 3, shape[0] // 3, seed, device="cuda")
        expected = reference_copy_blocks([c.cpu() for c in caches], pairs)
        for c in caches:
            c[pairs[:, 1].cuda()] = float("nan")
        copy_blocks(caches, pairs)
        torch.cuda.synchronize()
        for got, want in zip(caches, expected):
            torch.testing.assert_close(got.cpu().to(torch.float64), want, rtol=0, atol=0)
