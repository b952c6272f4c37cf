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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .._checks import check_int


@torch.library.register_fake("samcache::sparse_attention")
def _sparse_attention_fake(q, q_pos, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, key_cache, value_cache,
                           scale, window=-1, logit_cap=0.0, max_kv_len=-1):
    torch._check(q.dim() == 3, lambda: "q must be [num_rows, num_q_heads, head_dim]")
    torch._check(key_cache.dim() == 4, lambda: "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim]")
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each query row of a batch sits and which pages each sequence holds (all int32, on the
    caches' device). Build it once per step (:meth:`build`); every layer reuses it."""

    q_pos: torch.Tensor  # [T] position of each row in its sequence
    qo_indptr: torch.Tensor  # [B+1] rows of sequence b: [qo_indptr[b], qo_indptr[b+1])
    kv_indptr: torch.Tensor  # [B+1] pages of sequence b: kv_indices[kv_indptr[b]: kv_indptr[b+1]]
    kv_indices: torch.Tensor  # [P] cache blocks
    kv_last_page_len: torch.Tensor  # [B] tokens in each sequence's last page
    max_kv_len: int  # the longest sequence

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

        def tensor(values) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32)).to(device)

        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0)  # noqa: E731
        return cls(q_pos=tensor(cat(pos)), qo_indptr=tensor(qo), kv_indptr=tensor(kvp), kv_indices=tensor(cat(pages)),
                   kv_last_page_len=tensor(last), max_kv_len=max((int(n) for n in kv_lens), default=0))

    def select(self, rows: torch.Tensor, rows_per_seq: Sequence[int]) -> "AttentionMetadata":
        """The same batch restricted to ``rows`` (indices into this metadata's rows, each
        sequence's rows in order), ``rows_per_seq`` of them per sequence."""
        counts = np.asarray(rows_per_seq)
        if counts.shape != (self.num_seqs,) or (counts.size and (counts.dtype.kind not in "iu" or counts.min() < 0)):
            raise ValueError(f"rows_per_seq must be {self.num_seqs} ints >= 0 (one per sequence), got {rows_per_seq!r}")
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.numel() != int(counts.sum()):
            raise ValueError(f"rows must be a 1-D tensor of sum(rows_per_seq) = {int(counts.sum())} row indices, got "
                             f"{rows.shape if isinstance(rows, torch.Tensor) else type(rows).__name__}")
        qo = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)).to(self.qo_indptr.device)
        return AttentionMetadata(self.q_pos.index_select(0, rows.to(self.q_pos.device)), qo, self.kv_indptr,
                                 self.kv_indices, self.kv_last_page_len, self.max_kv_len)

    @property
    def num_seqs(self) -> int:
        return int(self.qo_indptr.numel()) - 1


def sparse_attention(
    q: torch.Tensor,
    meta: AttentionMetadata,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    scale: float | None = None,
    window: int = -1,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the batch's query rows against their sequences' paged KV.

    q: ``[num_rows, num_q_heads, head_dim]`` (float32/float16/bfloat16), rows grouped by
        sequence as ``meta.qo_indptr`` says; each row's own K/V must already be in the cache.
        Row i sees keys ``j <= q_pos[i]`` of its sequence (and ``j > q_pos[i] - window`` when
        ``window > 0``).
    key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype;
        ``num_q_heads`` must be a multiple of ``num_kv_heads`` (GQA).
    scale: logit scale, default ``1/sqrt(head_dim)``. logit_cap > 0: ``cap * tanh(logit / cap)``.

    Returns ``(out [num_rows, num_q_heads, head_dim] in q's dtype, lse [num_rows, num_q_heads]
    float32)``, lse being the natural log of the softmax denominator, so partial results over
    disjoint key sets can be merged.
    """
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if not isinstance(meta, AttentionMetadata):
        raise TypeError(f"meta must be an AttentionMetadata (AttentionMetadata.build(...)), got {type(meta).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.samcache.sparse_attention(
        q, meta.q_pos, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, key_cache, value_cache,
        float(scale), int(window), float(logit_cap), int(meta.max_kv_len),
    )


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


__all__ = ["AttentionMetadata", "full_attention", "sparse_attention"]
