"""sparse_attention on the GPU through Triton: query rows at any positions, paged KV, GQA packed.

One program serves one tile of a sequence's query rows for one KV head (and one split of the
tile's key range): the ``G`` query heads sharing that KV head are packed with the tile's rows
into the matrix dimension (``BLOCK_M = rows x G``), so every K/V block read from the cache
serves all of them, and both products run on the tensor cores. Decode (one row per sequence)
becomes a ``G``-row tile and long key ranges split across programs (flash-decoding), merged by a
second kernel through each split's (max, sum).

Device metadata cannot be read on the host without a synchronisation, so the kernel checks every
value it reads, as the CUDA kernels do (``cuda/sparse_attention.cuh``, ``row_keys``): a row whose
sequence, position or pages are inconsistent comes out NaN, and nothing outside the tensors is
read. A row at or after a key whose page lies outside the cache is NaN as well (the page is
never read), and rows no tile covers (``qo_indptr`` inconsistent) keep the NaN the output
starts with.

Importing this module needs Triton; callers check :func:`available` first. The kernels run in
Triton's interpreter on the CPU (``TRITON_INTERPRET=1``), which the tests use.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_MIN_KEYS_PER_SPLIT = 512
# Kernel constants (Triton reads module globals only as constexpr).
LOG2E = tl.constexpr(_LOG2E)
LN2 = tl.constexpr(0.6931471805599453)
NO_KEY = tl.constexpr(2**31 - 1)  # beyond any key index (positions are int32 in the loops)


@triton.jit
def _sequence_of(indptr, value, num_seqs, STEPS: tl.constexpr):
    """The last b in [0, num_seqs) with indptr[b] <= value (value a scalar or a vector)."""
    lo = value * 0
    hi = lo + num_seqs
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        go = (hi - lo > 1) & (tl.load(indptr + mid, mask=hi - lo > 1, other=0).to(tl.int64) <= value)
        stay = (hi - lo > 1) & ~go
        lo = tl.where(go, mid, lo)
        hi = tl.where(stay, mid, hi)
    return lo


@triton.jit
def _attend_block(q, acc, m_i, l_i, first_bad, k0, end, pos, K, V, kv_indices, page0, num_cache_blocks, num_kv_heads,
                  kv_head, scale_log2, logit_cap, window, d, d_ok, n, MASKED: tl.constexpr, HAS_CAP: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr):
    """One block of keys [k0, k0 + BLOCK_N) folded into the online softmax. MASKED: apply each
    row's position (and window); else every row sees every key of the block."""
    key = k0 + n
    key_in = key < end
    block = tl.load(kv_indices + page0 + key // PAGE, mask=key_in, other=0).to(tl.int64)
    block_ok = (block >= 0) & (block < num_cache_blocks)
    first_bad = tl.minimum(first_bad, tl.min(tl.where(key_in & ~block_ok, key, NO_KEY), axis=0))
    key_ok = key_in & block_ok
    kv_off = ((block * PAGE + key % PAGE) * num_kv_heads + kv_head) * HEAD_DIM
    k = tl.load(K + kv_off[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if HAS_CAP:  # cap * tanh(logit / cap), logit = s * scale
        t = s * (scale_log2 / LOG2E) / logit_cap
        s = logit_cap * (1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0)) * LOG2E
    else:
        s = s * scale_log2
    if MASKED:
        visible = (key[None, :] <= pos[:, None]) & key_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (key[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(V + kv_off[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i, first_bad


# Sizes that change from call to call are not specialised on (Triton would compile a variant for
# each value class: == 1, multiple of 16, other).
@triton.jit(do_not_specialize=["num_rows", "num_seqs", "num_kv_indices", "num_cache_blocks", "window", "num_splits"])
def _paged_attention_kernel(
    Q, K, V, Out, Lse, PartO, PartML,
    q_pos, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, tile_indptr,
    num_rows, num_seqs, num_kv_indices, num_cache_blocks, num_q_heads, num_kv_heads,
    scale_log2, logit_cap, window, num_splits,
    G: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, STEPS: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    # The tile's sequence b and its place among b's tiles.
    b = _sequence_of(tile_indptr, tile, num_seqs, STEPS)
    first_tile = tl.load(tile_indptr + b).to(tl.int64)
    last_tile = tl.load(tile_indptr + b + 1).to(tl.int64)
    if tile < last_tile:
        row_begin = tl.load(qo_indptr + b).to(tl.int64)
        row_end = tl.load(qo_indptr + b + 1).to(tl.int64)
        page0 = tl.load(kv_indptr + b).to(tl.int64)
        num_pages = tl.load(kv_indptr + b + 1).to(tl.int64) - page0
        last = tl.load(kv_last_page_len + b).to(tl.int64)
        seq_ok = (page0 >= 0) & (num_pages >= 1) & (page0 + num_pages <= num_kv_indices) & (last >= 1) & (last <= PAGE)
        kv_len = (num_pages - 1) * PAGE + last

        # Packed rows: m = local row * G + head within the group.
        m = tl.arange(0, BLOCK_M)
        local = m // G
        row = row_begin + (tile - first_tile) * ROWS + local
        head = kv_head * G + m % G
        in_tile = (local < ROWS) & (row < row_end) & (row >= 0) & (row < num_rows)
        # A row belongs to b only if b is also the sequence its index finds (qo_indptr consistent).
        owner = _sequence_of(qo_indptr, row, num_seqs, STEPS)
        in_tile = in_tile & (owner == b)
        pos = tl.load(q_pos + row, mask=in_tile, other=-1).to(tl.int64)
        ok = in_tile & seq_ok & (pos >= 0) & (pos < kv_len) & (pos < NO_KEY)
        pos = tl.where(ok, pos, -1).to(tl.int32)  # checked in int64 first: a bad value cannot wrap

        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_off = (row * num_q_heads + head) * HEAD_DIM
        q = tl.load(Q + q_off[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)

        # The tile's key range, then this program's split of it.
        hi = tl.max(pos, axis=0)  # inclusive; -1 when no row is valid
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(tl.min(tl.where(ok, pos, NO_KEY), axis=0) - window + 1, 0)
        per = tl.cdiv(tl.cdiv(hi - lo + 1, num_splits), BLOCK_N) * BLOCK_N
        start = lo + split * per
        end = tl.minimum(hi + 1, start + per)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        first_bad = tl.full([], NO_KEY, tl.int32)
        n = tl.arange(0, BLOCK_N)
        # Whole blocks every row of the tile sees (keys <= the smallest position) need no mask.
        full_end = start
        if not HAS_WINDOW:
            full_end = start + (tl.maximum(tl.minimum(end, tl.min(tl.where(ok, pos, NO_KEY), axis=0) + 1) - start, 0)
                                // BLOCK_N) * BLOCK_N
        for k0 in range(start, full_end, BLOCK_N):
            acc, m_i, l_i, first_bad = _attend_block(
                q, acc, m_i, l_i, first_bad, k0, end, pos, K, V, kv_indices, page0, num_cache_blocks, num_kv_heads,
                kv_head, scale_log2, logit_cap, window, d, d_ok, n, False, HAS_CAP, HAS_WINDOW, HEAD_DIM, PAGE,
                PRECISION)
        for k0 in range(full_end, end, BLOCK_N):
            acc, m_i, l_i, first_bad = _attend_block(
                q, acc, m_i, l_i, first_bad, k0, end, pos, K, V, kv_indices, page0, num_cache_blocks, num_kv_heads,
                kv_head, scale_log2, logit_cap, window, d, d_ok, n, True, HAS_CAP, HAS_WINDOW, HEAD_DIM, PAGE,
                PRECISION)
        # A row at or after a page outside the cache is inconsistent: NaN (that page was never read).
        bad = ~ok | (pos >= first_bad)

        nan = float("nan")
        o_off = (row * num_q_heads + head)
        if SPLIT:
            slot = split * num_rows * num_q_heads + o_off
            tl.store(PartO + slot[:, None] * HEAD_DIM + d[None, :], acc, mask=in_tile[:, None] & d_ok[None, :])
            tl.store(PartML + 2 * slot, tl.where(bad, nan, m_i), mask=in_tile)
            tl.store(PartML + 2 * slot + 1, l_i, mask=in_tile)
        else:
            fail = bad | (l_i == 0.0)
            out = tl.where(fail[:, None], nan, acc / tl.where(fail, 1.0, l_i)[:, None])
            tl.store(Out + o_off[:, None] * HEAD_DIM + d[None, :], out.to(Out.dtype.element_ty),
                     mask=in_tile[:, None] & d_ok[None, :])
            lse = tl.where(fail, nan, (m_i + tl.log2(tl.where(fail, 1.0, l_i))) * LN2)
            tl.store(Lse + o_off, lse, mask=in_tile)


@triton.jit(do_not_specialize=["num_slots", "num_splits"])
def _combine_kernel(Out, Lse, PartO, PartML, num_slots, num_splits,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merges the splits of one (row, head) slot through their (max, sum) pairs."""
    slot = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    ml = PartML + 2 * (s * num_slots + slot)
    m = tl.load(ml, mask=s_ok, other=float("-inf"))
    l = tl.load(ml + 1, mask=s_ok, other=0.0)
    bad = tl.sum((m != m).to(tl.int32), axis=0) > 0
    m_max = tl.max(tl.where(m != m, float("-inf"), m), axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_ok & (m == m), tl.exp2(m - m_safe), 0.0)
    total = tl.sum(l * w, axis=0)
    fail = bad | (total == 0.0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    o = tl.load(PartO + (s[:, None] * num_slots + slot) * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / tl.where(fail, 1.0, total)
    o = tl.where(fail, float("nan"), o)
    tl.store(Out + slot * HEAD_DIM + d, o.to(Out.dtype.element_ty), mask=d_ok)
    tl.store(Lse + slot, tl.where(fail, float("nan"), (m_max + tl.log2(tl.where(fail, 1.0, total))) * LN2))


def _nan_filled(shape, **kwargs) -> torch.Tensor:
    return torch.full(shape, float("nan"), **kwargs)


_uninitialised = torch.empty  # tests swap in a poisoning allocator: every element must be written


CONFIG_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "splits")


def _checked_config(config: dict | None) -> dict:
    config = dict(config or {})
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown Triton launch settings {unknown}; known: {list(CONFIG_KEYS)}")
    for key, value in config.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config[{key!r}] must be an int >= 1, got {value!r}")
        if key in ("block_m", "block_n") and (value < 16 or value & (value - 1)):
            raise ValueError(f"config[{key!r}] must be a power of two >= 16, got {value}")
    return config


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def tile_shape(group: int, max_rows_per_seq: int | None) -> tuple[int, int]:
    """(BLOCK_M, rows per tile) for ``group`` query heads per KV head. Few rows per sequence
    (decode) get the smallest tile the tensor cores take (16); prompts get 64 or 128."""
    if group > 128:
        raise ValueError(f"the Triton path packs at most 128 query heads per KV head, got {group}")
    want = group * (max_rows_per_seq if max_rows_per_seq is not None else 1 << 30)
    block_m = max(16, min(128, _pow2(want)))
    block_m = max(block_m, _pow2(group))
    return block_m, block_m // group


def num_splits(programs: int, max_keys: int, num_sms: int, per_sm: int = 4) -> int:
    """Splits of the key range so the grid fills the device (>= ``per_sm`` programs per
    multiprocessor) while each split keeps >= 512 keys."""
    want = -(-per_sm * num_sms // max(1, programs))
    most = max(1, -(-max_keys // _MIN_KEYS_PER_SPLIT))
    return int(max(1, min(want, most, 256)))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, so the split path is exercised


def paged_attention(q, meta, key_cache, value_cache, *, scale: float, window: int, logit_cap: float,
                    max_rows_per_seq: int | None = None, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_attention`` (same contract, same argument checks) through the Triton kernels.
    ``max_rows_per_seq``: the most rows one sequence has, when the host knows it (sizes the
    tiles). ``config`` overrides the launch choices (``CONFIG_KEYS``, each a positive int; block
    sizes powers of two >= 16): for benchmarks."""
    config = _checked_config(config)
    if max_rows_per_seq is not None and (isinstance(max_rows_per_seq, bool) or not isinstance(max_rows_per_seq, int)
                                         or max_rows_per_seq < 0):
        raise ValueError(f"max_rows_per_seq must be an int >= 0 or None, got {max_rows_per_seq!r}")
    torch.ops.samcache.sparse_attention_check(q, meta.q_pos, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                              meta.kv_last_page_len, key_cache, value_cache, float(scale),
                                              float(logit_cap), int(meta.max_kv_len))
    return _launch(q, meta, key_cache, value_cache, scale=scale, window=window, logit_cap=logit_cap,
                   max_rows_per_seq=max_rows_per_seq, config=config)


def _launch(q, meta, key_cache, value_cache, *, scale: float, window: int, logit_cap: float,
            max_rows_per_seq: int | None, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels behind :func:`paged_attention`'s checks. Metadata values are never read on the
    host here: the kernel's own guards handle inconsistent device metadata (its tests call this
    with such metadata on the CPU, where the checks would read and refuse it)."""
    num_rows, num_q_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads, _ = key_cache.shape
    # Metadata built on the host was checked there, so every row lies in some tile and is written;
    # device metadata may leave rows uncovered, which must read NaN (two more launches).
    covered = meta.host is not None
    fill = _uninitialised if covered else _nan_filled
    out = fill(q.shape, dtype=q.dtype, device=q.device)
    lse = fill((num_rows, num_q_heads), dtype=torch.float32, device=q.device)
    if num_rows == 0 or num_q_heads == 0 or head_dim == 0:
        return out, lse
    group = num_q_heads // num_kv_heads
    block_m, rows = tile_shape(group, max_rows_per_seq)
    if "block_m" in config:
        block_m = max(int(config["block_m"]), _pow2(group))
        rows = block_m // group
    num_seqs = meta.num_seqs
    tiles = meta.derived(("triton_tiles", rows), lambda: _tile_indptr(meta.qo_indptr, rows))
    if meta.host is not None:  # the exact number of tiles
        grid_tiles = int(meta.derived(("triton_tile_count", rows), lambda: int(
            ((meta.host.qo_indptr[1:] - meta.host.qo_indptr[:-1] + rows - 1) // rows).sum())))
    else:  # a bound: the device metadata is not read back
        grid_tiles = -(-num_rows // rows) + num_seqs
    if grid_tiles == 0:
        return out, lse
    max_keys = min(window, meta.max_kv_len) if window > 0 else meta.max_kv_len
    big = block_m >= 64
    # Big tiles differ in work (rows at later positions see more keys): more programs balance them.
    splits = int(config.get("splits", num_splits(grid_tiles * num_kv_heads, max_keys, _sm_count(q.device),
                                                 per_sm=4 if big else 2)))
    block_d = max(16, _pow2(head_dim))
    # Shared memory per pipeline stage: a K and a V block of block_n x block_d. Measured on an
    # H200: decode tiles stream best with 2 stages (85% of a plain read vs 60% with 4).
    block_n = int(config.get("block_n", 64 if block_d <= 128 else 32))
    stages = int(config.get("num_stages", (3 if big else 2) if block_d <= 128 else 2))
    warps = int(config.get("num_warps", 8 if big else 4))
    part_o = part_ml = out  # unused placeholders when not split
    if splits > 1:
        part_o = torch.empty((splits, num_rows, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
        part_ml = fill((splits, num_rows, num_q_heads, 2), dtype=torch.float32, device=q.device)
    steps = max(1, math.ceil(math.log2(num_seqs + 1)))
    _paged_attention_kernel[(grid_tiles, num_kv_heads, splits)](
        q.contiguous(), key_cache, value_cache, out, lse, part_o, part_ml,
        meta.q_pos, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, tiles,
        num_rows, num_seqs, meta.kv_indices.numel(), num_blocks, num_q_heads, num_kv_heads,
        float(scale) * _LOG2E, float(logit_cap), int(window), splits,
        G=group, ROWS=rows, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page,
        STEPS=steps, HAS_CAP=logit_cap > 0, HAS_WINDOW=window > 0, SPLIT=splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        _combine_kernel[(num_rows * num_q_heads,)](
            out, lse, part_o, part_ml, num_rows * num_q_heads, splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, _pow2(splits)), num_warps=4,
        )
    return out, lse


def _tile_indptr(qo_indptr: torch.Tensor, rows: int) -> torch.Tensor:
    """Cumulative tile counts per sequence (int64, device), from the device ``qo_indptr``; a
    sequence whose row range is inconsistent (decreasing) gets no tile."""
    qo = qo_indptr.to(torch.int64)
    counts = (qo[1:] - qo[:-1]).clamp_min(0)
    tiles = (counts + rows - 1) // rows
    return torch.cat([tiles.new_zeros(1), tiles.cumsum(0)])


__all__ = ["CONFIG_KEYS", "num_splits", "paged_attention", "tile_shape"]
