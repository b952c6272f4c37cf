"""paged_write / paged_gather / swap_blocks against plain float64 references, with poisoned outputs.

The ops copy bytes, so every dtype must come back bit-exact (tolerance 0 for all dtypes); NaN
poison marks every element an op must not touch, and equality with equal_nan checks both.
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from samcache import BlockPool, _C
from samcache.ops import copy_blocks, paged_gather, paged_write, swap_blocks

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]
INDEX_DTYPES = [torch.int32, torch.int64]


def poison(dtype):
    return -99 if dtype == torch.int8 else float("nan")


def random_tensor(shape, dtype, g, device="cpu"):
    return (torch.randn(shape, generator=g) * 8).to(dtype).to(device)


def assert_same(got, want):
    torch.testing.assert_close(got.cpu().to(torch.float64), want, rtol=0, atol=0, equal_nan=True)


# ---- plain references (float64, one token / block at a time) ---------------------------------
def reference_write(key, value, key_cache, value_cache, slots):
    kc, vc = key_cache.cpu().double().clone(), value_cache.cpu().double().clone()
    key, value = key.cpu().double(), value.cpu().double()
    block_size = kc.shape[1]
    for i, slot in enumerate(slots.tolist()):
        if slot == -1:
            continue
        kc[slot // block_size, slot % block_size] = key[i]
        vc[slot // block_size, slot % block_size] = value[i]
    return kc, vc


def reference_gather(key_cache, value_cache, table, num_tokens):
    key_cache, value_cache = key_cache.cpu().double(), value_cache.cpu().double()
    block_size, heads, dim = key_cache.shape[1:]
    k = torch.empty(num_tokens, heads, dim, dtype=torch.float64)
    v = torch.empty(num_tokens, heads, dim, dtype=torch.float64)
    for t in range(num_tokens):
        block = int(table[t // block_size])
        k[t] = key_cache[block, t % block_size]
        v[t] = value_cache[block, t % block_size]
    return k, v


def reference_swap(src, dst, pairs):
    out, src = dst.cpu().double().clone(), src.cpu().double()
    for s, d in pairs.tolist():
        out[d] = src[s]
    return out


# ---- token-major inputs with the layouts a model produces ------------------------------------
def token_major(n, heads, dim, dtype, layout, g, device="cpu"):
    """key-like [n, heads, dim]: contiguous, a slice of a fused QKV tensor (token stride larger than
    heads * dim), or heads interleaved with another tensor (head stride larger than dim)."""
    if layout == "contiguous":
        return random_tensor((n, heads, dim), dtype, g, device)
    if layout == "fused":
        fused = random_tensor((n, heads + 3, dim), dtype, g, device)
        return fused[:, 2 : 2 + heads]
    return random_tensor((n, heads, 2, dim), dtype, g, device)[:, :, 1]


@st.composite
def write_cases(draw):
    num_blocks, block_size = draw(st.integers(1, 10)), draw(st.integers(1, 8))
    heads, dim = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    num_slots = num_blocks * block_size
    n_written = draw(st.integers(0, num_slots))
    n_padding = draw(st.integers(0, 4))
    return dict(
        shape=(num_blocks, block_size, heads, dim),
        n_written=n_written,
        n_padding=n_padding,
        dtype=draw(st.sampled_from(DTYPES)),
        index_dtype=draw(st.sampled_from(INDEX_DTYPES)),
        key_layout=draw(st.sampled_from(["contiguous", "fused", "interleaved"])),
        value_layout=draw(st.sampled_from(["contiguous", "fused", "interleaved"])),
        seed=draw(st.integers(0, 2**31)),
    )


def make_write_case(c, device="cpu"):
    g = torch.Generator().manual_seed(c["seed"])
    num_blocks, block_size, heads, dim = c["shape"]
    n = c["n_written"] + c["n_padding"]
    slots = torch.randperm(num_blocks * block_size, generator=g)[: c["n_written"]]
    slots = torch.cat([slots, torch.full((c["n_padding"],), -1)])[torch.randperm(n, generator=g)]
    key = token_major(n, heads, dim, c["dtype"], c["key_layout"], g, device)
    value = token_major(n, heads, dim, c["dtype"], c["value_layout"], g, device)
    key_cache = torch.full(c["shape"], poison(c["dtype"]), dtype=c["dtype"], device=device)
    value_cache = torch.full(c["shape"], poison(c["dtype"]), dtype=c["dtype"], device=device)
    return key, value, key_cache, value_cache, slots.to(c["index_dtype"]).to(device)


@given(write_cases())
def test_paged_write_matches_reference(case):
    key, value, key_cache, value_cache, slots = make_write_case(case)
    want_k, want_v = reference_write(key, value, key_cache, value_cache, slots)
    paged_write(key, value, key_cache, value_cache, slots)
    assert_same(key_cache, want_k)
    assert_same(value_cache, want_v)


@given(
    num_blocks=st.integers(1, 10),
    block_size=st.integers(1, 8),
    heads=st.integers(1, 4),
    dim=st.integers(1, 9),
    dtype=st.sampled_from(DTYPES),
    index_dtype=st.sampled_from(INDEX_DTYPES),
    data=st.data(),
)
def test_paged_gather_matches_reference(num_blocks, block_size, heads, dim, dtype, index_dtype, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    shape = (num_blocks, block_size, heads, dim)
    key_cache, value_cache = random_tensor(shape, dtype, g), random_tensor(shape, dtype, g)
    # Table entries may repeat (gather only reads); blocks outside the used part are poisoned so
    # a token read from the wrong block shows.
    table = torch.randint(0, num_blocks, (data.draw(st.integers(0, 6)),), generator=g)
    num_tokens = data.draw(st.integers(0, len(table) * block_size))
    used = table[: -(-num_tokens // block_size)]
    unused = torch.ones(num_blocks, dtype=torch.bool)
    unused[used] = False
    key_cache[unused] = poison(dtype)
    value_cache[unused] = poison(dtype)
    want_k, want_v = reference_gather(key_cache, value_cache, table, num_tokens)
    k, v = paged_gather(key_cache, value_cache, table.to(index_dtype), num_tokens)
    assert k.shape == v.shape == (num_tokens, heads, dim) and k.is_contiguous() and v.is_contiguous()
    assert k.dtype == v.dtype == dtype
    assert_same(k, want_k)
    assert_same(v, want_v)


@given(
    src_blocks=st.integers(1, 12),
    dst_blocks=st.integers(1, 12),
    tail=st.lists(st.integers(1, 6), min_size=0, max_size=3),
    dtype=st.sampled_from(DTYPES),
    index_dtype=st.sampled_from(INDEX_DTYPES),
    data=st.data(),
)
def test_swap_blocks_matches_reference(src_blocks, dst_blocks, tail, dtype, index_dtype, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    src = random_tensor((src_blocks, *tail), dtype, g)
    dst = torch.full((dst_blocks, *tail), poison(dtype), dtype=dtype)
    n = data.draw(st.integers(0, dst_blocks))
    if data.draw(st.booleans()):  # consecutive runs, which the op merges into single copies
        start_s = data.draw(st.integers(0, max(0, src_blocks - n)))
        start_d = data.draw(st.integers(0, dst_blocks - n))
        srcs = (torch.arange(n) + start_s) % src_blocks
        dsts = torch.arange(n) + start_d
        order = torch.randperm(n, generator=g)
        pairs = torch.stack([srcs[order], dsts[order]], dim=1)
    else:  # scattered; a source may feed several destinations
        pairs = torch.stack([torch.randint(0, src_blocks, (n,), generator=g), torch.randperm(dst_blocks, generator=g)[:n]], 1)
    want = reference_swap(src, dst, pairs)
    swap_blocks(src, dst, pairs.to(index_dtype))
    assert_same(dst, want)


def test_swap_blocks_within_one_tensor():
    cache = torch.arange(6 * 4.0).reshape(6, 4)
    want = reference_swap(cache, cache, torch.tensor([[0, 3], [1, 4], [1, 5]]))
    swap_blocks(cache, cache, np.array([[0, 3], [1, 4], [1, 5]]))
    assert_same(cache, want)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    _C.parallel_stats(reset=True)
    yield
    torch.set_num_threads(before)


def ran_in_parallel():
    tasks, threads = _C.parallel_stats(reset=True)
    return tasks > 1 and threads == 2


def test_large_inputs_take_the_parallel_paths(two_threads):
    g = torch.Generator().manual_seed(0)
    shape = (64, 16, 8, 64)  # 2 KiB token rows: many parallel tasks per op
    key_cache = torch.full(shape, float("nan"))
    value_cache = torch.full(shape, float("nan"))
    slots = torch.randperm(64 * 16, generator=g)[:700]
    key, value = torch.randn(700, 8, 64, generator=g), torch.randn(700, 8, 64, generator=g)
    want_k, want_v = reference_write(key, value, key_cache, value_cache, slots)
    paged_write(key, value, key_cache, value_cache, slots)
    assert ran_in_parallel()
    assert_same(key_cache, want_k)
    assert_same(value_cache, want_v)
    table = torch.randperm(64, generator=g).to(torch.int32)
    k, v = paged_gather(key_cache, value_cache, table, 1000)
    assert ran_in_parallel()
    want_k, want_v = reference_gather(key_cache, value_cache, table, 1000)
    assert_same(k, want_k)
    assert_same(v, want_v)
    host = torch.full((80, 16, 8, 64), float("nan"))
    pairs = torch.stack([torch.arange(64), torch.randperm(80, generator=g)[:64]], 1)
    want = reference_swap(key_cache, host, pairs)
    swap_blocks(key_cache, host, pairs)
    assert ran_in_parallel()
    assert_same(host, want)


def test_small_inputs_stay_on_one_task(two_threads):
    # The counter the test above reads can say no: a copy smaller than one task's share.
    key_cache = torch.zeros(4, 4, 1, 8)
    paged_write(torch.ones(3, 1, 8), torch.ones(3, 1, 8), key_cache, torch.zeros_like(key_cache),
                torch.tensor([0, 5, 9]))
    assert _C.parallel_stats(reset=True) == (1, 1)


# ---- the BlockPool contract -------------------------------------------------------------------
def test_block_pool_slots_write_then_gather_in_token_order():
    """append_tokens slots -> paged_write -> paged_gather(block_table, n) gives back exactly the
    written K/V in token order, across a prefill, decode steps and a copy-on-write fork."""
    block_size, heads, dim = 4, 2, 8
    pool = BlockPool(16, block_size)
    key_cache = torch.full((16, block_size, heads, dim), float("nan"), dtype=torch.bfloat16)
    value_cache = torch.full_like(key_cache, float("nan"))
    g = torch.Generator().manual_seed(1)
    written = {}

    def append(seq, tokens, history):
        slots, copies = pool.append_tokens(seq, np.asarray(tokens, dtype=np.int32))
        copy_blocks([key_cache, value_cache], copies)  # CoW first, as the pool requires
        k = torch.randn(len(tokens), heads, dim, generator=g).to(torch.bfloat16)
        v = torch.randn(len(tokens), heads, dim, generator=g).to(torch.bfloat16)
        paged_write(k, v, key_cache, value_cache, slots)
        history.append((k, v))

    def check(seq, history):
        k, v = paged_gather(key_cache, value_cache, pool.block_table(seq), pool.num_tokens(seq))
        assert torch.equal(k, torch.cat([h[0] for h in history]))
        assert torch.equal(v, torch.cat([h[1] for h in history]))

    parent = pool.new_sequence()
    written[parent] = []
    append(parent, list(range(13)), written[parent])  # prefill: 3 full blocks + 1 token
    for t in range(3):  # decode
        append(parent, [100 + t], written[parent])
    check(parent, written[parent])
    child = pool.fork(parent)
    written[child] = list(written[parent])
    append(child, [7, 8, 9], written[child])  # starts in the shared partial block: CoW
    append(parent, [5], written[parent])
    check(child, written[child])
    check(parent, written[parent])


def test_swap_round_trip_cpu():
    """Blocks swapped out to a host tier and back into other blocks read back unchanged."""
    g = torch.Generator().manual_seed(2)
    gpu_like = torch.randn(10, 4, 2, 8, generator=g).to(torch.float16)
    host = torch.full((6, 4, 2, 8), float("nan"), dtype=torch.float16)
    out_pairs = torch.tensor([[3, 0], [4, 1], [5, 2], [9, 5]])
    swap_blocks(gpu_like, host, out_pairs)
    before = gpu_like.clone()
    gpu_like[[3, 4, 5, 9]] = float("nan")
    swap_blocks(host, gpu_like, torch.tensor([[0, 3], [1, 4], [2, 5], [5, 9]]))
    assert torch.equal(gpu_like, before)


# ---- bad input: the right exception, and nothing written --------------------------------------
def write_args():
    key_cache = torch.zeros(4, 2, 3, 5)
    return dict(
        key=torch.ones(3, 3, 5),
        value=torch.ones(3, 3, 5),
        key_cache=key_cache,
        value_cache=key_cache.clone(),
        slot_mapping=torch.tensor([0, 5, -1]),
    )


PAGED_WRITE_BAD = [
    ("key", "not a tensor", TypeError),
    ("value", [[1.0]], TypeError),
    ("key_cache", None, TypeError),
    ("value_cache", 3, TypeError),
    ("slot_mapping", [0, 5, -1], TypeError),
    ("slot_mapping", np.array([0.0, 5.0, -1.0]), TypeError),
    ("key", torch.ones(3, 15), ValueError),
    ("key", torch.ones(3, 2, 5), ValueError),
    ("key", torch.ones(3, 3, 4), ValueError),
    ("key", torch.ones(3, 3, 5, dtype=torch.float16), ValueError),
    ("key", torch.ones(3, 5, 3).transpose(1, 2), ValueError),
    ("value", torch.ones(2, 3, 5), ValueError),
    ("value", torch.ones(3, 3, 5, dtype=torch.float64), ValueError),
    ("key_cache", torch.zeros(4, 2, 15), ValueError),
    ("value_cache", torch.zeros(5, 2, 3, 5), ValueError),
    ("value_cache", torch.zeros(4, 2, 3, 5, dtype=torch.bfloat16), ValueError),
    ("key_cache", torch.zeros(2, 4, 3, 5).transpose(0, 1), ValueError),
    ("slot_mapping", torch.tensor([0.0, 5.0, -1.0]), ValueError),
    ("slot_mapping", torch.tensor([[0, 5, -1]]), ValueError),
    ("slot_mapping", torch.tensor([0, 5]), ValueError),
    ("slot_mapping", torch.tensor([0, 8, -1]), IndexError),
    ("slot_mapping", torch.tensor([0, -2, 1]), IndexError),
    ("slot_mapping", torch.tensor([1, 5, 1], dtype=torch.int32), ValueError),
]


@pytest.mark.parametrize("name,bad,exc", PAGED_WRITE_BAD)
def test_paged_write_bad_input(name, bad, exc, rejects_without_writing):
    args = write_args()
    caches = [args["key_cache"], args["value_cache"]]
    args[name] = bad
    rejects_without_writing(lambda: paged_write(**args), exc, caches)


def test_paged_write_zero_block_size_and_empty():
    with pytest.raises(ValueError):
        paged_write(torch.ones(0, 3, 5), torch.ones(0, 3, 5), torch.zeros(4, 0, 3, 5), torch.zeros(4, 0, 3, 5), torch.zeros(0, dtype=torch.long))
    args = write_args()
    paged_write(torch.ones(0, 3, 5), torch.ones(0, 3, 5), args["key_cache"], args["value_cache"], np.zeros(0, np.int32))
    assert not args["key_cache"].any()


def gather_args():
    key_cache = torch.randn(4, 2, 3, 5)
    return dict(key_cache=key_cache, value_cache=key_cache.clone(), block_table=torch.tensor([2, 0], dtype=torch.int32), num_tokens=3)


PAGED_GATHER_BAD = [
    ("key_cache", "x", TypeError),
    ("value_cache", None, TypeError),
    ("block_table", [2, 0], TypeError),
    ("block_table", np.array([2.0, 0.0]), TypeError),
    ("num_tokens", 3.0, TypeError),
    ("num_tokens", True, TypeError),
    ("key_cache", torch.randn(4, 2, 15), ValueError),
    ("value_cache", torch.randn(4, 2, 3, 4), ValueError),
    ("value_cache", torch.randn(4, 2, 3, 5, dtype=torch.float16), ValueError),
    ("key_cache", torch.randn(2, 4, 3, 5).transpose(0, 1), ValueError),
    ("block_table", torch.tensor([2.0, 0.0]), ValueError),
    ("block_table", torch.tensor([[2, 0]]), ValueError),
    ("num_tokens", -1, ValueError),
    ("num_tokens", 5, ValueError),
    ("block_table", torch.tensor([4, 0]), IndexError),
    ("block_table", torch.tensor([2, -1]), IndexError),
]


@pytest.mark.parametrize("name,bad,exc", PAGED_GATHER_BAD)
def test_paged_gather_bad_input(name, bad, exc, rejects_without_writing):
    args = gather_args()
    caches = [args["key_cache"], args["value_cache"]]
    args[name] = bad
    rejects_without_writing(lambda: paged_gather(**args), exc, caches, "gather must never write its inputs")


def test_paged_gather_reads_only_the_used_table_entries():
    args = gather_args()
    k, _ = paged_gather(args["key_cache"], args["value_cache"], np.array([1, 99, -5]), 2)
    assert torch.equal(k, args["key_cache"][1])
    k, v = paged_gather(args["key_cache"], args["value_cache"], np.zeros(0, np.int32), 0)
    assert k.shape == v.shape == (0, 3, 5)


def swap_args():
    return dict(src=torch.randn(4, 2, 3), dst=torch.zeros(3, 2, 3), block_pairs=torch.tensor([[0, 1], [3, 2]]))


SWAP_BAD = [
    ("src", "x", TypeError),
    ("dst", None, TypeError),
    ("block_pairs", [[0, 1]], TypeError),
    ("block_pairs", np.array([[0.0, 1.0]]), TypeError),
    ("src", torch.randn(4, 3, 2), ValueError),
    ("src", torch.randn(4, 2, 3, dtype=torch.float16), ValueError),
    ("src", torch.tensor(1.0), ValueError),
    ("src", torch.randn(4, 3, 2).transpose(1, 2), ValueError),
    ("block_pairs", torch.tensor([[0.0, 1.0]]), ValueError),
    ("block_pairs", torch.tensor([0, 1]), ValueError),
    ("block_pairs", torch.tensor([[0, 1, 2]]), ValueError),
    ("block_pairs", torch.tensor([[4, 1]]), IndexError),
    ("block_pairs", torch.tensor([[-1, 1]]), IndexError),
    ("block_pairs", torch.tensor([[0, 3]]), IndexError),
    ("block_pairs", torch.tensor([[0, 1], [2, 1]]), ValueError),
]


@pytest.mark.parametrize("name,bad,exc", SWAP_BAD)
def test_swap_blocks_bad_input(name, bad, exc):
    args = swap_args()
    dst = args["dst"]
    args[name] = bad
    with pytest.raises(exc):
        swap_blocks(**args)
    assert not dst.any(), "a rejected call must not write"


def test_swap_blocks_rejects_order_dependent_aliasing():
    buf = torch.arange(8 * 2.0).reshape(8, 2)
    before = buf.clone()
    with pytest.raises(ValueError):  # same tensor, block 1 is read and written
        swap_blocks(buf, buf, torch.tensor([[0, 1], [1, 2]]))
    with pytest.raises(ValueError):  # views that overlap partially
        swap_blocks(buf[0:4], buf[2:6], torch.tensor([[0, 3]]))
    assert torch.equal(buf, before)
    swap_blocks(buf[0:4], buf[4:8], torch.tensor([[0, 0]]))  # disjoint views of one storage
    assert torch.equal(buf[4], before[0])


# ---- torch.library integration ------------------------------------------------------------------
def test_opcheck_all_ops():
    case = dict(shape=(6, 4, 2, 8), n_written=10, n_padding=2, dtype=torch.float32, index_dtype=torch.int64,
                key_layout="fused", value_layout="contiguous", seed=5)
    key, value, key_cache, value_cache, slots = make_write_case(case)
    key_cache.normal_(), value_cache.normal_()  # opcheck compares outputs without equal_nan
    torch.library.opcheck(torch.ops.samcache.paged_write.default, (key, value, key_cache, value_cache, slots))
    table = torch.tensor([3, 1, 4], dtype=torch.int32)
    torch.library.opcheck(torch.ops.samcache.paged_gather.default, (key_cache, value_cache, table, 10))
    host = torch.zeros(5, 4, 2, 8)
    torch.library.opcheck(torch.ops.samcache.swap_blocks.default, (key_cache, host, torch.tensor([[0, 4], [1, 0]])))


def test_compile_fullgraph():
    def step(key, value, key_cache, value_cache, slots, table, host, pairs):
        torch.ops.samcache.paged_write(key, value, key_cache, value_cache, slots)
        k, v = torch.ops.samcache.paged_gather(key_cache, value_cache, table, 6)
        torch.ops.samcache.swap_blocks(key_cache, host, pairs)
        return k * 2 + v

    g = torch.Generator().manual_seed(4)
    key_cache, value_cache = torch.zeros(4, 4, 2, 3), torch.zeros(4, 4, 2, 3)
    key, value = torch.randn(6, 2, 3, generator=g), torch.randn(6, 2, 3, generator=g)
    slots = torch.tensor([8, 9, 10, 11, 0, 1])
    table = torch.tensor([2, 0], dtype=torch.int32)
    host, pairs = torch.zeros(2, 4, 2, 3), torch.tensor([[2, 1]])
    out = torch.compile(step, backend="aot_eager", fullgraph=True)(key, value, key_cache, value_cache, slots, table, host, pairs)
    torch.testing.assert_close(out, key * 2 + value)
    assert torch.equal(host[1], key_cache[2])


# ---- CUDA: the same references ------------------------------------------------------------------
CUDA_SHAPES = [(64, 16, 8, 128), (7, 3, 5, 9), (33, 16, 1, 64), (5, 1, 3, 256)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_paged_write_cuda_matches_reference(dtype, index_dtype):
    for seed, shape in enumerate(CUDA_SHAPES):
        for layout in ["contiguous", "fused", "interleaved"]:
            slots_total = shape[0] * shape[1]
            case = dict(shape=shape, n_written=slots_total * 2 // 3, n_padding=3, dtype=dtype, index_dtype=index_dtype,
                        key_layout=layout, value_layout="fused", seed=seed)
            key, value, key_cache, value_cache, slots = make_write_case(case, device="cuda")
            want_k, want_v = reference_write(key, value, key_cache, value_cache, slots)
            paged_write(key, value, key_cache, value_cache, slots)
            torch.cuda.synchronize()
            assert_same(key_cache, want_k)
            assert_same(value_cache, want_v)


@pytest.mark.cuda
def test_paged_write_cuda_skips_out_of_range_slots():
    key_cache = torch.zeros(4, 2, 3, 8, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    key = torch.ones(4, 3, 8, device="cuda")
    paged_write(key, key, key_cache, value_cache, torch.tensor([8, -7, 1, 2**40], device="cuda"))
    torch.cuda.synchronize()
    assert key_cache.view(-1, 3, 8).sum(dim=(1, 2)).tolist() == [0, 24, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError):  # slot_mapping must live with the caches
        paged_write(key, key, key_cache, value_cache, torch.tensor([0, 1, 2, 3]))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("table_device", ["cpu", "cuda"])
def test_paged_gather_cuda_matches_reference(dtype, table_device):
    g = torch.Generator().manual_seed(7)
    for shape in CUDA_SHAPES:
        key_cache, value_cache = random_tensor(shape, dtype, g, "cuda"), random_tensor(shape, dtype, g, "cuda")
        table = torch.randperm(shape[0], generator=g).to(torch.int32)
        for n in [0, 1, shape[1], len(table) * shape[1] - 1, len(table) * shape[1]]:
            want_k, want_v = reference_gather(key_cache, value_cache, table, n)
            k, v = paged_gather(key_cache, value_cache, table.to(table_device), n)
            assert k.device.type == "cuda" and k.shape == (n, *shape[2:])
            assert_same(k, want_k)
            assert_same(v, want_v)


@pytest.mark.cuda
def test_paged_gather_cuda_device_table_zero_fills_bad_blocks():
    key_cache = torch.ones(4, 2, 3, 8, device="cuda")
    k, v = paged_gather(key_cache, key_cache, torch.tensor([1, 9, -1], device="cuda"), 6)
    assert k[:2].eq(1).all() and k[2:].eq(0).all() and v[2:].eq(0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("pinned", [True, False])
def test_swap_round_trip_cuda_host(pinned):
    g = torch.Generator().manual_seed(3)
    gpu = random_tensor((32, 16, 4, 64), torch.bfloat16, g, "cuda")
    host = torch.full((20, 16, 4, 64), float("nan"), dtype=torch.bfloat16)
    if pinned:
        host = host.pin_memory()
    out_pairs = torch.tensor([[3, 0], [4, 1], [5, 2], [9, 7], [31, 19], [10, 8]])  # runs and singles
    want = reference_swap(gpu, host, out_pairs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        swap_blocks(gpu, host, out_pairs)
    stream.synchronize()
    assert_same(host, want)
    before = gpu.clone()
    gpu[out_pairs[:, 0].cuda()] = float("nan")
    stream.wait_stream(torch.cuda.current_stream())  # the poison lands before the copy back
    with torch.cuda.stream(stream):
        swap_blocks(host, gpu, out_pairs.flip(1))
    stream.synchronize()
    assert torch.equal(gpu, before)


SWAP_PLACES = [("cuda", "cuda"), ("cuda", "pinned"), ("pinned", "cuda"), ("cuda", "pageable"), ("pageable", "cuda")]
# (src blocks, dst blocks, per-block shape, dtype): 16-byte vectors (32 KiB and 128 B blocks),
# 2-byte and 1-byte vectors (6-byte fp16 blocks, 15-byte int8 blocks), more 16 KiB tiles than the
# grid has CTAs (3000 small blocks), 64 KiB blocks of 4 tiles.
SWAP_SHAPES = [(64, 48, (16, 8, 128), torch.bfloat16), (40, 30, (2, 16), torch.float32), (9, 7, (3,), torch.float16),
               (30, 40, (5, 3), torch.int8), (3000, 2500, (4,), torch.float32), (6, 5, (16, 8, 128), torch.float32)]


def place(t, where):
    """t (CPU) on the GPU, in pinned host memory, or left in pageable host memory."""
    return t.cuda() if where == "cuda" else (t.pin_memory() if where == "pinned" else t.clone())


def swap_pairs(src_blocks, dst_blocks, layout, g):
    """[n, 2] pairs: 'runs' of consecutive blocks (shuffled; the op merges them), 'scattered' (a
    source may feed several destinations), or 'mixed' (one run among scattered pairs)."""
    n = min(src_blocks, dst_blocks) - int(torch.randint(0, 3, (1,), generator=g)) if min(src_blocks, dst_blocks) > 3 else 1
    run = n if layout == "runs" else (n // 2 if layout == "mixed" else 0)
    s0 = int(torch.randint(0, src_blocks - run + 1, (1,), generator=g))
    d0 = int(torch.randint(0, dst_blocks - run + 1, (1,), generator=g))
    rest = torch.tensor([d for d in torch.randperm(dst_blocks, generator=g).tolist() if not d0 <= d < d0 + run],
                        dtype=torch.int64)
    srcs = torch.cat([torch.arange(run) + s0, torch.randint(0, src_blocks, (n - run,), generator=g)])
    dsts = torch.cat([torch.arange(run) + d0, rest[: n - run]])
    return torch.stack([srcs, dsts], 1)[torch.randperm(n, generator=g)]


@pytest.mark.cuda
@pytest.mark.parametrize("src_at,dst_at", SWAP_PLACES)
@pytest.mark.parametrize("path", ["auto", "kernel", "memcpy"])
def test_swap_blocks_cuda_matches_reference(src_at, dst_at, path, monkeypatch):
    """Every pair of places, each path (SAMCACHE_SWAP_BLOCKS; pageable memory always takes the
    copy engines), scattered pairs and runs, vector widths from 16 bytes down to 1, a grid-stride
    loop; destinations poisoned, compared with a plain per-block reference."""
    monkeypatch.setenv("SAMCACHE_SWAP_BLOCKS", path)
    g = torch.Generator().manual_seed(11)
    for src_blocks, dst_blocks, tail, dtype in SWAP_SHAPES:
        src = place(random_tensor((src_blocks, *tail), dtype, g), src_at)
        for layout in ["scattered", "runs", "mixed"]:
            dst = place(torch.full((dst_blocks, *tail), poison(dtype), dtype=dtype), dst_at)
            pairs = swap_pairs(src_blocks, dst_blocks, layout, g)
            want = reference_swap(src, dst, pairs)
            swap_blocks(src, dst, pairs.to(torch.int32 if layout == "mixed" else torch.int64))
            torch.cuda.synchronize()
            assert_same(dst, want)


@pytest.mark.cuda
@pytest.mark.parametrize("src_at,dst_at", SWAP_PLACES[:3])
def test_swap_blocks_cuda_misaligned_views(src_at, dst_at):
    """Views one element into their storage (2-byte aligned pointers): the kernel narrows its vectors."""
    g = torch.Generator().manual_seed(12)
    src_base = place(random_tensor((1 + 12 * 40,), torch.float16, g), src_at)
    dst_base = place(torch.full((1 + 10 * 40,), float("nan"), dtype=torch.float16), dst_at)
    src, dst = src_base[1:].view(12, 5, 8), dst_base[1:].view(10, 5, 8)
    pairs = torch.tensor([[3, 0], [4, 1], [5, 2], [11, 9], [0, 5]])
    want = reference_swap(src, dst, pairs)
    swap_blocks(src, dst, pairs)
    torch.cuda.synchronize()
    assert_same(dst, want)
    assert dst_base[:1].isnan().all(), "nothing before the view is written"


@pytest.mark.cuda
def test_swap_blocks_cuda_within_one_tensor():
    cache = torch.arange(6 * 4.0, device="cuda").reshape(6, 4)
    pairs = torch.tensor([[0, 3], [1, 4], [1, 5]])
    want = reference_swap(cache, cache, pairs)
    swap_blocks(cache, cache, pairs)
    torch.cuda.synchronize()
    assert_same(cache, want)


@pytest.mark.cuda
def test_swap_blocks_cuda_bad_pairs_raise_the_cpu_error():
    """Bad pairs are refused before anything is copied, with the CPU's exception and message."""
    bad = [([[4, 1]], IndexError), ([[-1, 1]], IndexError), ([[0, 3]], IndexError), ([[0, 1], [2, 1]], ValueError)]
    for pairs, exc in bad:
        pairs = torch.tensor(pairs)
        with pytest.raises(exc) as cpu_err:
            swap_blocks(torch.randn(4, 2, 3), torch.zeros(3, 2, 3), pairs)
        for src_at, dst_at in SWAP_PLACES:
            dst = place(torch.zeros(3, 2, 3), dst_at)
            with pytest.raises(exc) as err:
                swap_blocks(place(torch.randn(4, 2, 3), src_at), dst, pairs)
            assert str(err.value).splitlines()[0] == str(cpu_err.value).splitlines()[0]
            assert not dst.any(), "a rejected call must not write"
    cache = torch.zeros(8, 2, device="cuda")
    with pytest.raises(ValueError):  # same tensor, block 1 is read and written
        swap_blocks(cache, cache, torch.tensor([[0, 1], [1, 2]]))


@pytest.mark.cuda
def test_opcheck_cuda():
    key_cache = torch.zeros(6, 4, 2, 8, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(5, 2, 8, device="cuda")
    slots = torch.tensor([0, 3, 9, -1, 22], device="cuda")
    torch.library.opcheck(torch.ops.samcache.paged_write.default, (key, key, key_cache, value_cache, slots))
    torch.library.opcheck(torch.ops.samcache.paged_gather.default, (key_cache, value_cache, torch.tensor([5, 2]), 7))
    host = torch.zeros(3, 4, 2, 8).pin_memory()
    torch.library.opcheck(torch.ops.samcache.swap_blocks.default, (key_cache, host, torch.tensor([[5, 0], [1, 2]])))


def test_strided_index_tensors():
    """Index tensors are read through their strides (views of larger index arrays)."""
    g = torch.Generator().manual_seed(9)
    key_cache = torch.full((4, 2, 1, 3), float("nan"))
    value_cache = key_cache.clone()
    key, value = torch.randn(3, 1, 3, generator=g), torch.randn(3, 1, 3, generator=g)
    slots = torch.tensor([[6, 0], [-1, 0], [1, 0]])[:, 0]  # stride 2
    want_k, want_v = reference_write(key, value, key_cache, value_cache, slots)
    paged_write(key, value, key_cache, value_cache, slots)
    assert_same(key_cache, want_k)
    assert_same(value_cache, want_v)
    table = torch.tensor([3, 9, 0, 9], dtype=torch.int32)[::2]
    k, v = paged_gather(key_cache, value_cache, table, 3)
    want_k, want_v = reference_gather(key_cache, value_cache, table, 3)
    assert_same(k, want_k)
    assert_same(v, want_v)
    pairs = torch.tensor([[3, 0], [1, 2]]).t()  # [2, 2] transposed view: (3, 1) and (0, 2)
    dst = torch.full((3, 2, 1, 3), float("nan"))
    want = reference_swap(key_cache, dst, pairs)
    swap_blocks(key_cache, dst, pairs)
    assert_same(dst, want)
