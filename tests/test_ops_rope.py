"""rope_rerotate / rope_rerotate_write against a float64 RoPE written from the transformers formulas."""


import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from samcache.ops import rope_rerotate, rope_rerotate_write

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
STYLES = ["neox", "gptj", "mrope", "mrope_interleaved"]
# Tolerance per key dtype (atol = rtol): keys are ~N(0, 1); fp16/bf16 carry their input rounding.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


# ---- float64 reference of the model's RoPE ---------------------------------------------------


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate_every_two(x):
    return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)


def rope_angles(pos, inv_freq, style, section):
    """Per-dim angles [N, rotary_dim] as the models build cos/sin (before .cos()/.sin())."""
    f = inv_freq.double()
    if style in ("neox", "gptj"):
        freqs = pos.double()[:, None] * f  # [N, half]
        return torch.cat([freqs, freqs], -1) if style == "neox" else freqs.repeat_interleave(2, -1)
    freqs3 = pos.double()[:, :, None] * f  # [3, N, half]: t, h, w
    if style == "mrope":  # Qwen2.5-VL apply_multimodal_rotary_pos_emb
        emb = torch.cat([freqs3, freqs3], -1)
        chunks = emb.split(list(section) * 2, dim=-1)
        return torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
    freqs_t = freqs3[0].clone()  # Qwen3-VL apply_interleaved_mrope
    for dim, offset in ((1, 1), (2, 2)):
        idx = slice(offset, section[dim] * 3, 3)
        freqs_t[..., idx] = freqs3[dim, ..., idx]
    return torch.cat([freqs_t, freqs_t], -1)


def rope_ref(k, pos, inv_freq, style, section=()):
    """RoPE(k, pos) in float64: k [N, H, D]; the first 2 * len(inv_freq) dims of each head rotate."""
    k = k.double()
    rd = 2 * inv_freq.numel()
    emb = rope_angles(pos, inv_freq, style, section)[:, None, :]  # [N, 1, rd]
    x = k[..., :rd]
    rot = rotate_every_two(x) if style == "gptj" else rotate_half(x)
    return torch.cat([x * emb.cos() + rot * emb.sin(), k[..., rd:]], dim=-1)


# ---- random cases --------------------------------------------------------------------------


def make_inv_freq(rotary_dim, theta=1e6):
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def random_section(half, g):
    cut = torch.sort(torch.randint(0, half + 1, (2,), generator=g)).values.tolist()
    return [cut[0], cut[1] - cut[0], half - cut[1]]


def random_case(style, n, heads, half, tail, seed, max_delta=100_000):
    g = torch.Generator().manual_seed(seed)
    head_dim = 2 * half + tail
    k_raw = torch.randn(n, heads, head_dim, generator=g, dtype=torch.float64)
    rows = 3 if style.startswith("mrope") else 1
    pos = torch.randint(0, 200_000, (rows, n), generator=g)
    delta = torch.randint(-max_delta, max_delta + 1, (rows, n), generator=g)
    if rows == 1:
        pos, delta = pos[0], delta[0]
    section = random_section(half, g) if rows == 3 else []
    return k_raw, pos, delta, make_inv_freq(2 * half), section


@given(
    style=st.sampled_from(STYLES),
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 12),
    heads=st.integers(1, 4),
    half=st.integers(1, 24),
    tail=st.sampled_from([0, 0, 2, 5]),
    seed=st.integers(0, 2**31),
)
def test_rerotate_moves_keys_to_new_positions(style, dtype, n, heads, half, tail, seed):
    k_raw, pos, delta, inv_freq, section = random_case(style, n, heads, half, tail, seed)
    key = rope_ref(k_raw, pos, inv_freq, style, section).to(dtype)
    before = key.clone()
    rope_rerotate(key, delta, inv_freq, style, section)
    want = rope_ref(k_raw, pos + delta, inv_freq, style, section)
    tol = TOL[dtype]
    torch.testing.assert_close(key.double(), want, atol=tol, rtol=tol)
    assert torch.equal(key[..., 2 * half :], before[..., 2 * half :]), "partial rotary: tail must be bit-exact"


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("spans", [1, 3, 60])
def test_rerotate_per_span_deltas(style, spans):
    """Images moved as a whole (few distinct deltas: cos/sin cached per worker) and deltas that
    change every token (cos/sin tables) give the same, correct result."""
    k_raw, pos, delta, inv_freq, section = random_case(style, 60, 2, 16, 4, seed=spans)
    span_of_token = torch.arange(60) * spans // 60
    delta = delta[..., :spans][..., span_of_token]
    for dtype in DTYPES:
        key = rope_ref(k_raw, pos, inv_freq, style, section).to(dtype)
        rope_rerotate(key, delta, inv_freq, style, section)
        want = rope_ref(k_raw, pos + delta, inv_freq, style, section)
        torch.testing.assert_close(key.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
        cache = torch.full((8, 8, 2, 36), float("nan"), dtype=dtype)
        rope_rerotate_write(rope_ref(k_raw, pos, inv_freq, style, section).to(dtype), delta, inv_freq, style, section,
                            cache, torch.arange(60))
        assert torch.equal(cache.view(-1, 2, 36)[:60], key)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rerotate_there_and_back_is_identity(style, dtype):
    k_raw, pos, delta, inv_freq, section = random_case(style, 64, 4, 32, 16, seed=7)
    key = k_raw.to(dtype)
    rope_rerotate(key, delta, inv_freq, style, section)
    rope_rerotate(key, -delta, inv_freq, style, section)
    tol = 2 * TOL[dtype]
    torch.testing.assert_close(key.double(), k_raw, atol=tol, rtol=tol)


def test_float32_precision_at_large_deltas():
    """The float64-reduced angle keeps float32 keys within ~1e-6 of float64 at |delta| ~ 1e5,
    where a float32 angle (delta * inv_freq in float32) would be off by ~1e-3."""
    k = torch.randn(256, 2, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    delta = torch.randint(50_000, 100_001, (256,), generator=torch.Generator().manual_seed(2))
    inv_freq = make_inv_freq(128, theta=1e4)
    want = rope_ref(k, delta, inv_freq, "neox")
    got = k.float()
    rope_rerotate(got, delta, inv_freq, "neox")
    err = (got.double() - want).abs().max().item()
    assert err < 5e-6, err
    naive_angle = (delta.float()[:, None] * inv_freq).double()  # what a float32 angle gives
    naive = torch.cat([naive_angle, naive_angle], -1)[:, None, :]
    naive_out = k * naive.cos() + rotate_half(k) * naive.sin()
    assert (naive_out - want).abs().max().item() > 100 * err


@pytest.mark.parametrize(
    "style,section,h_pairs,w_pairs",
    [
        # Qwen2.5-VL [16, 24, 24]: frequencies 16..39 follow h, 40..63 follow w.
        ("mrope", [16, 24, 24], set(range(16, 40)), set(range(40, 64))),
        # Qwen3-VL [24, 20, 20]: 1, 4, ..., 58 follow h; 2, 5, ..., 59 follow w; the rest t.
        ("mrope_interleaved", [24, 20, 20], set(range(1, 60, 3)), set(range(2, 60, 3))),
    ],
)
def test_mrope_axis_of_each_frequency(style, section, h_pairs, w_pairs):
    """Move only h (then only w): exactly the frequencies of that axis rotate."""
    inv_freq = make_inv_freq(128)
    k = torch.randn(1, 1, 128, dtype=torch.float64)
    for axis, pairs in ((1, h_pairs), (2, w_pairs)):
        delta = torch.zeros(3, 1, dtype=torch.long)
        delta[axis] = 1000
        key = k.clone().float()
        rope_rerotate(key, delta, inv_freq, style, section)
        moved = (key[0, 0, :64] - k[0, 0, :64].float()).abs() + (key[0, 0, 64:] - k[0, 0, 64:].float()).abs()
        assert {j for j in range(64) if moved[j] > 1e-6} == pairs


@given(
    style=st.sampled_from(STYLES),
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 10),
    heads=st.integers(1, 3),
    half=st.integers(1, 12),
    tail=st.sampled_from([0, 3, 8]),
    block_size=st.integers(1, 5),
    slot_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**31),
)
def test_rerotate_write_equals_rerotate_then_scatter(style, dtype, n, heads, half, tail, block_size, slot_dtype, seed):
    k_raw, pos, delta, inv_freq, section = random_case(style, n, heads, half, tail, seed)
    key = rope_ref(k_raw, pos, inv_freq, style, section).to(dtype)
    key_before = key.clone()
    num_blocks = (n + block_size - 1) // block_size + 2
    g = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[torch.rand(n, generator=g) < 0.25] = -1  # skipped tokens
    cache = torch.full((num_blocks, block_size, heads, 2 * half + tail), float("nan"), dtype=dtype)
    rope_rerotate_write(key, delta, inv_freq, style, section, cache, slots.to(slot_dtype))

    assert torch.equal(key, key_before), "the source keys must not change"
    expected = key.clone()
    rope_rerotate(expected, delta, inv_freq, style, section)
    flat = cache.view(-1, heads, 2 * half + tail)
    written = slots >= 0
    assert torch.equal(flat[slots[written]], expected[written])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[written]] = False
    assert flat[untouched].isnan().all(), "slots not written must stay poisoned"


def test_strided_key_and_cache_views():
    """Keys with padded heads and a cache that is a view of a [blocks, 2, bs, H, D] KV tensor."""
    k_raw, pos, delta, inv_freq, _ = random_case("neox", 9, 3, 8, 4, seed=5)
    padded = torch.zeros(9, 3, 24)
    padded[..., :20] = rope_ref(k_raw, pos, inv_freq, "neox").float()
    key = padded[..., :20]
    kv = torch.full((4, 2, 4, 3, 20), float("nan"))
    key_cache = kv[:, 0]
    slots = torch.tensor([3, 0, 15, -1, 7, 8, 1, 2, 12])
    rope_rerotate_write(key, delta, inv_freq, "neox", [], key_cache, slots)
    rope_rerotate(key, delta, inv_freq, "neox")
    want = rope_ref(k_raw, pos + delta, inv_freq, "neox")
    torch.testing.assert_close(key.double(), want, atol=2e-5, rtol=2e-5)
    assert padded[..., 20:].eq(0).all()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(key_cache[s // 4, s % 4], key[t])
    assert kv[:, 1].isnan().all(), "the value half of the KV tensor must stay untouched"


# ---- bad input ---------------------------------------------------------------------------


def _ok_args():
    key = torch.full((4, 2, 8), 7.0)
    return key, torch.arange(4), torch.ones(3), "neox", []


def test_rerotate_bad_input():
    key, delta, inv, style, sec = _ok_args()
    cases = [
        (lambda: rope_rerotate("k", delta, inv, style, sec), TypeError),
        (lambda: rope_rerotate(key[0], delta, inv, style, sec), ValueError),
        (lambda: rope_rerotate(key.int(), delta, inv, style, sec), TypeError),
        (lambda: rope_rerotate(key.transpose(1, 2), delta, inv, style, sec), ValueError),
        (lambda: rope_rerotate(key[:1].expand(4, 2, 8), delta, inv, style, sec), ValueError),
        (lambda: rope_rerotate(key, [0, 1, 2, 3], inv, style, sec), TypeError),
        (lambda: rope_rerotate(key, delta.int(), inv, style, sec), TypeError),
        (lambda: rope_rerotate(key, delta.float(), inv, style, sec), TypeError),
        (lambda: rope_rerotate(key, torch.arange(5), inv, style, sec), ValueError),
        (lambda: rope_rerotate(key, torch.zeros(3, 4, dtype=torch.long), inv, style, sec), ValueError),
        (lambda: rope_rerotate(key, delta, inv.double(), style, sec), TypeError),
        (lambda: rope_rerotate(key, delta, inv[None], style, sec), ValueError),
        (lambda: rope_rerotate(key, delta, torch.ones(5), style, sec), ValueError),
        (lambda: rope_rerotate(key, delta, torch.ones(0), style, sec), ValueError),
        (lambda: rope_rerotate(key, delta, inv, "rope", sec), ValueError),
        (lambda: rope_rerotate(key, delta, inv, 3, sec), TypeError),
        (lambda: rope_rerotate(key, delta, inv, style, [1, 1, 1]), ValueError),
        (lambda: rope_rerotate(key, delta, inv, "mrope", []), ValueError),
        (lambda: rope_rerotate(key, delta, inv, "mrope", [1, 1, 1]), ValueError),  # delta must be [3, N]
        (lambda: rope_rerotate(key, torch.zeros(3, 4, dtype=torch.long), inv, "mrope", [1, 1, 2]), ValueError),
        (lambda: rope_rerotate(key, torch.zeros(3, 4, dtype=torch.long), inv, "mrope", [4, -1, 0]), ValueError),
        (lambda: rope_rerotate(key, torch.zeros(3, 4, dtype=torch.long), inv, "mrope", [1, 2]), ValueError),
        (lambda: rope_rerotate(key, torch.zeros(3, 4, dtype=torch.long), inv, "mrope", ["a", 1, 2]), TypeError),
        # The op itself (no Python wrapper) rejects the same way.
        (lambda: torch.ops.samcache.rope_rerotate(key, delta, inv, "rope", []), ValueError),
        (lambda: torch.ops.samcache.rope_rerotate(key, delta, inv, "neox", [1, 1, 1]), ValueError),
        (lambda: torch.ops.samcache.rope_rerotate(key, delta, inv, "mrope_interleaved", [1, 1, 1]), ValueError),
    ]
    for i, (call, exc) in enumerate(cases):
        before = key.clone()
        with pytest.raises(exc):
            call()
        assert torch.equal(key, before), f"case {i}: a rejected call must not write"


def test_rerotate_write_bad_input():
    key, delta, inv, style, sec = _ok_args()
    cache = torch.full((3, 2, 2, 8), float("nan"))
    cache[0] = 5.0
    slots = torch.tensor([0, 1, -1, 5])
    cases = [
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, "c", slots), TypeError),
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, cache, [0, 1, 2, 3]), TypeError),
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, cache[0], slots), ValueError),
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, torch.zeros(3, 2, 3, 8), slots), ValueError),
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, torch.zeros(3, 2, 2, 9), slots), ValueError),
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, cache.half(), slots), TypeError),
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, cache.transpose(2, 3), slots), ValueError),
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, cache[:1].expand(3, 2, 2, 8), slots), ValueError),
        (lambda: rope_rerotate_write(cache.view(6, 2, 8)[:4], delta, inv, style, sec, cache, slots), ValueError),  # aliasing
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, cache, slots.float()), TypeError),
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, cache, slots[:3]), ValueError),
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, cache, slots[None]), ValueError),
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, cache, torch.tensor([0, 1, 2, 6])), IndexError),
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, cache, torch.tensor([0, 1, 2, -2])), IndexError),
        (lambda: rope_rerotate_write(key, delta, inv, style, sec, cache, torch.tensor([0, 1, 2, 1])), ValueError),
        (lambda: rope_rerotate_write(key, delta.int(), inv, style, sec, cache, slots), TypeError),
        (lambda: rope_rerotate_write(key, delta, inv, "gptj", [2, 0, 1], cache, slots), ValueError),
        (lambda: rope_rerotate_write(key.int(), delta, inv, style, sec, cache, slots), TypeError),
    ]
    for i, (call, exc) in enumerate(cases):
        key_before, cache_before = key.clone(), cache.clone()
        with pytest.raises(exc):
            call()
        assert torch.equal(key, key_before), f"case {i}: key changed"
        torch.testing.assert_close(cache, cache_before, rtol=0, atol=0, equal_nan=True, msg=f"case {i}: cache written")


def test_empty_inputs_are_no_ops():
    inv = torch.ones(2)
    rope_rerotate(torch.zeros(0, 2, 4), torch.zeros(0, dtype=torch.long), inv, "neox")
    rope_rerotate(torch.zeros(3, 0, 4), torch.zeros(3, dtype=torch.long), inv, "gptj")
    cache = torch.full((2, 2, 1, 4), float("nan"))
    rope_rerotate_write(torch.zeros(0, 1, 4), torch.zeros(3, 0, dtype=torch.long), inv, "mrope", [1, 1, 0], cache,
                        torch.zeros(0, dtype=torch.long))
    assert cache.isnan().all()


# ---- torch.library contract ------------------------------------------------------------------


def test_opcheck_and_compile():
    k_raw, pos, delta, inv_freq, section = random_case("mrope_interleaved", 6, 2, 8, 4, seed=11)
    key = rope_ref(k_raw, pos, inv_freq, "mrope_interleaved", section).float()
    cache = torch.zeros(4, 2, 2, 20)
    slots = torch.tensor([0, 7, -1, 3, 4, 5])
    torch.library.opcheck(torch.ops.samcache.rope_rerotate.default, (key.clone(), delta, inv_freq, "mrope_interleaved", section))
    torch.library.opcheck(
        torch.ops.samcache.rope_rerotate_write.default,
        (key, delta, inv_freq, "mrope_interleaved", section, cache, slots),
    )

    def step(k, d, f, c, s):
        torch.ops.samcache.rope_rerotate_write(k, d, f, "mrope_interleaved", section, c, s)
        return c.sum(dim=(1, 2, 3))

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    cache.zero_()
    out = compiled(key, delta, inv_freq, cache, slots)
    expected = key.clone()
    rope_rerotate(expected, delta, inv_freq, "mrope_interleaved", section)
    want_cache = torch.zeros_like(cache)
    want_cache.view(-1, 2, 20)[slots[slots >= 0]] = expected[slots >= 0]
    assert torch.equal(cache, want_cache)
    torch.testing.assert_close(out, want_cache.sum(dim=(1, 2, 3)))


# ---- CUDA against the same float64 reference -------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_rerotate_matches_reference(style, dtype):
    # Shapes exercise the vector path (D = 128) and the scalar/tail paths (odd sizes, partial rotary).
    for seed, (n, heads, half, tail) in enumerate([(300, 8, 64, 0), (37, 3, 5, 3), (2000, 1, 32, 64), (5, 40, 8, 8)]):
        k_raw, pos, delta, inv_freq, section = random_case(style, n, heads, half, tail, seed)
        key = rope_ref(k_raw, pos, inv_freq, style, section).to(dtype)
        want = rope_ref(k_raw, pos + delta, inv_freq, style, section)
        key_gpu = key.cuda()
        rope_rerotate(key_gpu, delta.cuda(), inv_freq.cuda(), style, section)
        got = key_gpu.cpu()
        torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
        assert torch.equal(got[..., 2 * half :], key[..., 2 * half :])


@pytest.mark.cuda
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cuda_rerotate_write_matches_reference(style, dtype, slot_dtype):
    for seed, (n, heads, half, tail, block_size) in enumerate([(500, 8, 64, 0, 16), (37, 3, 5, 3, 7)]):
        k_raw, pos, delta, inv_freq, section = random_case(style, n, heads, half, tail, seed)
        key = rope_ref(k_raw, pos, inv_freq, style, section).to(dtype)
        want = rope_ref(k_raw, pos + delta, inv_freq, style, section)
        num_blocks = n // block_size + 3
        slots = torch.randperm(num_blocks * block_size)[:n]
        slots[::5] = -1
        slots[1] = num_blocks * block_size + 9  # out of range on the GPU: skipped, not written
        cache = torch.full((num_blocks, block_size, heads, 2 * half + tail), float("nan"), dtype=dtype, device="cuda")
        rope_rerotate_write(key.cuda(), delta.cuda(), inv_freq.cuda(), style, section, cache, slots.to(slot_dtype).cuda())
        flat = cache.cpu().view(-1, heads, 2 * half + tail)
        ok = (slots >= 0) & (slots < flat.shape[0])
        torch.testing.assert_close(flat[slots[ok]].double(), want[ok], atol=TOL[dtype], rtol=TOL[dtype])
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[ok]] = False
        assert flat[untouched].isnan().all()
