"""sparse_attention: attention of query rows at any positions of many sequences, in one call.

When samcache reuses cached KV, only a few tokens of a prompt are computed: the new ones and the
2-5% selected for recompute. Their queries, at their own positions, attend to the whole paged KV
of their sequence (reused + recomputed + new). Decode steps are the same thing with one row per
sequence. One call serves a whole batch of sequences; the cost falls with the number of query
rows, and key chunks no row can see (beyond its position, outside a sliding window) are never
touched.

The batch is described by FlashInfer-style metadata (:class:`AttentionMetadata`), built once per
step and shared by every layer: ``qo_indptr`` (rows of each sequence), ``q_pos`` (each row's
position), ``kv_indptr`` / ``kv_indices`` (each sequence's pages) and ``kv_last_page_len``.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .._checks import check_int
from . import attention_flash
from .host_arrays import upload


@torch.library.register_fake("samcache::sparse_attention")
def _sparse_attention_fake(q, q_pos, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, key_cache, value_cache,
                           scale, window=-1, logit_cap=0.0, max_kv_len=-1):
    torch._check(q.dim() == 3, lambda: "q must be [num_rows, num_q_heads, head_dim]")
    torch._check(key_cache.dim() == 4, lambda: "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim]")
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.register_fake("samcache::sparse_attention_check")
def _sparse_attention_check_fake(q, q_pos, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, key_cache, value_cache,
                                 scale, logit_cap=0.0, max_kv_len=-1):
    return None


@dataclass(frozen=True)
class HostMetadata:
    """The host's copy of a batch's metadata (int64 numpy), kept by :meth:`AttentionMetadata.build`
    so that GPU dispatch decisions never read device tensors."""

    q_pos: np.ndarray
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    block_size: int

    @property
    def max_rows_per_seq(self) -> int:
        return int(np.diff(self.qo_indptr).max()) if self.qo_indptr.size > 1 else 0


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each query row of a batch sits and which pages each sequence holds (all int32, on the
    caches' device). Build it once per step (:meth:`build`); every layer reuses it, and so do the
    GPU paths' derived tensors (:meth:`derived`)."""

    q_pos: torch.Tensor  # [T] position of each row in its sequence
    qo_indptr: torch.Tensor  # [B+1] rows of sequence b: [qo_indptr[b], qo_indptr[b+1])
    kv_indptr: torch.Tensor  # [B+1] pages of sequence b: kv_indices[kv_indptr[b]: kv_indptr[b+1]]
    kv_indices: torch.Tensor  # [P] cache blocks
    kv_last_page_len: torch.Tensor  # [B] tokens in each sequence's last page
    max_kv_len: int  # the longest sequence
    host: HostMetadata | None = None  # None: built from device tensors directly (nothing known on the host)
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    def derived(self, key, make: Callable[[], object]):
        """A value computed from this metadata once and kept with it (e.g. a kernel's tile table)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    @classmethod
    def build(cls, positions: Sequence[np.ndarray], block_tables: Sequence[np.ndarray], kv_lens: Sequence[int],
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """One sequence per entry: its query rows' positions, its block table (at least
        ``ceil(kv_len / block_size)`` blocks; extra entries are ignored) and its KV length."""
        if not (len(positions) == len(block_tables) == len(kv_lens)):
            raise ValueError(f"positions, block_tables and kv_lens need one entry per sequence, got "
                             f"{len(positions)}, {len(block_tables)} and {len(kv_lens)}")
        check_int("block_size", block_size, 1)
        pages, pos = [], []
        qo, kvp, last = [0], [0], []
        for b, (p, table, n) in enumerate(zip(positions, block_tables, kv_lens)):
            # Checked here, not only by the op: device metadata is not read on the host, and
            # numpy would truncate float positions silently.
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise ValueError(f"sequence {b}: kv_len must be an int >= 0, got {n!r}")
            n = int(n)
            used = -(-n // block_size)
            table, p = np.asarray(table), np.asarray(p)
            if table.ndim != 1 or (table.size and table.dtype.kind not in "iu"):
                raise ValueError(f"sequence {b}: the block table must be a 1-D integer array, got {table.dtype} "
                                 f"{table.shape}")
            if table.size < used:
                raise ValueError(f"sequence {b}: {n} KV tokens need {used} blocks, its block table has {table.size}")
            if used and table[:used].min() < 0:
                raise ValueError(f"sequence {b}: block table entries must be >= 0, got {table[:used].min()}")
            if p.ndim != 1 or (p.size and p.dtype.kind not in "iu"):
                raise ValueError(f"sequence {b}: positions must be a 1-D integer array, got {p.dtype} {p.shape}")
            if p.size and (p.min() < 0 or p.max() >= n):
                raise ValueError(f"sequence {b}: positions must lie in [0, {n}), got {p.min()} .. {p.max()}")
            pages.append(table[:used])
            pos.append(p)
            qo.append(qo[-1] + int(p.size))
            kvp.append(kvp[-1] + used)
            last.append(n - (used - 1) * block_size if used else 0)

        cat = lambda parts: np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)  # noqa: E731
        host = HostMetadata(cat(pos), np.asarray(qo, np.int64), np.asarray(kvp, np.int64), cat(pages), int(block_size))
        q_pos, qo_t, kvp_t, pages_t, last_t = upload([host.q_pos, qo, kvp, host.kv_indices, last], np.int32, device)
        return cls(q_pos=q_pos, qo_indptr=qo_t, kv_indptr=kvp_t, kv_indices=pages_t, kv_last_page_len=last_t,
                   max_kv_len=max((int(n) for n in kv_lens), default=0), host=host)

    def select(self, rows: torch.Tensor, rows_per_seq: Sequence[int], host_rows: np.ndarray | None = None
               ) -> "AttentionMetadata":
        """The same batch restricted to ``rows`` (indices into this metadata's rows, each
        sequence's rows in order), ``rows_per_seq`` of them per sequence. ``host_rows``: the same
        indices on the host, which keeps the host copy (and the GPU's fast paths) for the subset."""
        counts = np.asarray(rows_per_seq)
        if counts.shape != (self.num_seqs,) or (counts.size and (counts.dtype.kind not in "iu" or counts.min() < 0)):
            raise ValueError(f"rows_per_seq must be {self.num_seqs} ints >= 0 (one per sequence), got {rows_per_seq!r}")
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.numel() != int(counts.sum()):
            raise ValueError(f"rows must be a 1-D tensor of sum(rows_per_seq) = {int(counts.sum())} row indices, got "
                             f"{rows.shape if isinstance(rows, torch.Tensor) else type(rows).__name__}")
        qo_host = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        qo = torch.from_numpy(qo_host.astype(np.int32)).to(self.qo_indptr.device)
        host = None
        if self.host is not None and host_rows is not None:
            host_rows = np.asarray(host_rows, dtype=np.int64)
            if host_rows.shape != (rows.numel(),):
                raise ValueError(f"host_rows must be the {rows.numel()} row indices of rows, got shape {host_rows.shape}")
            host = HostMetadata(self.host.q_pos[host_rows], qo_host, self.host.kv_indptr, self.host.kv_indices,
                                self.host.block_size)
        return AttentionMetadata(self.q_pos.index_select(0, rows.to(self.q_pos.device)), qo, self.kv_indptr,
                                 self.kv_indices, self.kv_last_page_len, self.max_kv_len, host)

    @property
    def num_seqs(self) -> int:
        return int(self.qo_indptr.numel()) - 1


BACKENDS = ("auto", "native", "flash", "triton")

# The shortest run "auto" sends to flash attention. Flash first gathers each run's keys out of the
# pages (a read and a write of every key it sees); a run of r rows does ~r x 14 kFLOP per key
# gathered (28 heads x 128 dims), so below ~128 rows the gather costs more than it saves and the
# Triton kernel, which reads the pages in place, goes first (decode rows in particular).
FLASH_MIN_RUN = 128

# How many calls each backend served (in this process): tests assert the path they meant ran,
# benchmarks report it.
BACKEND_CALLS: Counter = Counter()


def _triton_module():
    """samcache.ops.attention_triton, or None where Triton is not installed."""
    try:
        from . import attention_triton
    except ImportError:
        return None
    return attention_triton


def _choose_backend(requested: str, q: torch.Tensor, meta: AttentionMetadata, logit_cap: float) -> str:
    if requested == "native":
        return "native"
    if requested == "flash":
        if not attention_flash.supported(q, logit_cap) or meta.host is None:
            raise ValueError("backend 'flash' needs CUDA fp16/bf16 queries, head_dim a multiple of 8 up to 256, no "
                             "logit cap, and metadata from AttentionMetadata.build (the host knows the runs)")
        if _flash_layout(meta, q.device) is None:
            raise ValueError("backend 'flash' needs each sequence's rows to be one run of consecutive positions")
        return "flash"
    if requested == "triton":
        if _triton_module() is None:
            raise ValueError("backend 'triton' needs the triton package")
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend 'triton' runs on CUDA (or on the CPU under TRITON_INTERPRET=1)")
        return "triton"
    # auto: the CPU keeps samcache's own kernel (faster there than ATen's attention); on a GPU,
    # contiguous runs go to torch's flash attention and scattered rows to the Triton kernel.
    if not q.is_cuda:
        return "native"
    if meta.host is not None and q.shape[0] and attention_flash.supported(q, logit_cap):
        layout = _flash_layout(meta, q.device)
        if layout is not None and layout.min_q >= FLASH_MIN_RUN:
            return "flash"
    return "triton" if _triton_module() is not None else "native"


def _flash_layout(meta: AttentionMetadata, device: torch.device):
    return meta.derived(("flash", str(device)), lambda: attention_flash.plan_layout(meta.host, device))


def sparse_attention(
    q: torch.Tensor,
    meta: AttentionMetadata,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    scale: float | None = None,
    window: int = -1,
    logit_cap: float = 0.0,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the batch's query rows against their sequences' paged KV.

    q: ``[num_rows, num_q_heads, head_dim]`` (float32/float16/bfloat16), rows grouped by
        sequence as ``meta.qo_indptr`` says; each row's own K/V must already be in the cache.
        Row i sees keys ``j <= q_pos[i]`` of its sequence (and ``j > q_pos[i] - window`` when
        ``window > 0``).
    key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype;
        ``num_q_heads`` must be a multiple of ``num_kv_heads`` (GQA).
    scale: logit scale, default ``1/sqrt(head_dim)``. logit_cap > 0: ``cap * tanh(logit / cap)``.
    backend: ``"auto"`` (default; ``SAMCACHE_ATTENTION_BACKEND`` overrides it): samcache's own
        kernel on the CPU; on CUDA torch's flash attention when every sequence's rows are one run
        of at least ``FLASH_MIN_RUN`` consecutive positions (a prefill, a suffix), else the Triton
        kernel (scattered recompute rows, decode). ``"native"``, ``"flash"``, ``"triton"`` force
        one; each call is counted in ``BACKEND_CALLS``.

    Returns ``(out [num_rows, num_q_heads, head_dim] in q's dtype, lse [num_rows, num_q_heads]
    float32)``, lse being the natural log of the softmax denominator, so partial results over
    disjoint key sets can be merged.
    """
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if not isinstance(meta, AttentionMetadata):
        raise TypeError(f"meta must be an AttentionMetadata (AttentionMetadata.build(...)), got {type(meta).__name__}")
    requested = backend or os.environ.get("SAMCACHE_ATTENTION_BACKEND") or "auto"
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    args = (q, meta.q_pos, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, key_cache,
            value_cache)
    chosen = _choose_backend(requested, q, meta, float(logit_cap))
    BACKEND_CALLS[chosen] += 1
    if chosen == "native":
        return torch.ops.samcache.sparse_attention(*args, float(scale), int(window), float(logit_cap),
                                                   int(meta.max_kv_len))
    if chosen == "flash":  # the layout came from the host's checked metadata; the tensors are checked here
        torch.ops.samcache.sparse_attention_check(*args, float(scale), float(logit_cap), int(meta.max_kv_len))
        return attention_flash.run(q, _flash_layout(meta, q.device), key_cache, value_cache, scale=float(scale),
                                   window=int(window))
    rows_bound = meta.host.max_rows_per_seq if meta.host is not None else q.shape[0]  # T bounds any sequence's rows
    return _triton_module().paged_attention(q, meta, key_cache, value_cache, scale=float(scale), window=int(window),
                                            logit_cap=float(logit_cap), max_rows_per_seq=rows_bound)


_FULL_BLOCK = 16


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Non-causal attention of one sequence through the kernel: every row of ``q`` ``[N, Hq, D]``
    sees all ``M`` keys of ``k``, ``v`` ``[M, Hkv, D]`` (e.g. a ViT's full-attention blocks over one
    image's patches). The keys are laid out as a paged cache of 16-token blocks and every query
    row sits at the sequence's last position. Returns ``[N, Hq, D]`` in q's dtype."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a [tokens, heads, head_dim] tensor")
    if k.shape != v.shape or k.shape[-1] != q.shape[-1] or k.shape[0] < 1:
        raise ValueError(f"k and v must be [M >= 1, Hkv, {q.shape[-1]}] alike, got {tuple(k.shape)} and {tuple(v.shape)}")
    m, heads, dim = k.shape
    blocks = -(-m // _FULL_BLOCK)
    caches = []
    for t in (k, v):
        paged = t.new_zeros(blocks * _FULL_BLOCK, heads, dim)
        paged[:m] = t
        caches.append(paged.view(blocks, _FULL_BLOCK, heads, dim))
    meta = AttentionMetadata.build([np.full(q.shape[0], m - 1)], [np.arange(blocks)], [m], _FULL_BLOCK)
    out, _ = sparse_attention(q.contiguous(), meta, *caches, scale=scale)
    return out


__all__ = ["BACKENDS", "BACKEND_CALLS", "AttentionMetadata", "HostMetadata", "full_attention", "sparse_attention"]
