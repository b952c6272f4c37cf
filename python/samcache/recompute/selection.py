"""Two-track recompute selection: which reused tokens each layer recomputes.

Track 1 repairs the head of every reused span: its first tokens (about 10%) saw a different
left context than they have now, and attention sinks concentrate there. Track 2 recomputes the
tokens the new context relies on most, by a relevance score per reused token: the deviation of
their cached keys from freshly computed ones at an early check layer (as CacheBlend does), or
the attention mass the new tokens put on them.

Both tracks feed one priority order over the reused tokens: track 1 first (interleaved across
spans, so every span keeps its first tokens when the quota is small), then track 2 by
descending score. Layer l recomputes the first ``quota[l]`` tokens of that order. Quotas come
from the layer budget (non-increasing with depth), so the recomputed sets are nested
(layer l+1's set is a subset of layer l's), which a recomputed token needs: its hidden state at layer l
comes from layer l-1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ReusedSpan:
    """Tokens [start, start + length) of the new sequence whose KV is reused from cache.
    ``moved``: the KV was computed with other images before it than it has now (the image's
    index among the prompt's images changed, or its KV was computed alone, or where it was
    computed is not known), so it may be wrong in more than its positions."""

    start: int
    length: int
    moved: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.start, int) and isinstance(self.length, int)) or self.start < 0 or self.length < 1:
            raise ValueError(f"a reused span needs int start >= 0 and length >= 1, got {self}")
        if not isinstance(self.moved, bool):
            raise TypeError(f"ReusedSpan.moved must be a bool, got {self.moved!r}")


@dataclass(frozen=True)
class RecomputePlan:
    """``order``: reused-token positions, most important first; ``quota[l]``: how many of them
    layer l recomputes (non-increasing)."""

    order: np.ndarray
    quota: tuple[int, ...]

    def positions(self, layer: int) -> np.ndarray:
        """Sorted positions layer ``layer`` recomputes."""
        return np.sort(self.order[: self.quota[layer]])

    @property
    def num_layers(self) -> int:
        return len(self.quota)


def check_spans(spans: Sequence[ReusedSpan]) -> list[ReusedSpan]:
    """``spans`` as ReusedSpan values in position order, refusing overlaps."""
    spans = list(spans)
    if not all(isinstance(s, ReusedSpan) for s in spans):
        raise TypeError("spans must be ReusedSpan objects")
    ordered = sorted(spans, key=lambda s: s.start)
    for a, b in zip(ordered, ordered[1:]):
        if b.start < a.start + a.length:
            raise ValueError(f"reused spans overlap: {a} and {b}")
    return ordered


def plan_recompute(
    spans: Sequence[ReusedSpan],
    quota: Sequence[int],
    scores: np.ndarray | torch.Tensor | None = None,
    *,
    head_fraction: float = 0.1,
    track2_share: float = 0.0,
    tracks: str = "both",
) -> RecomputePlan:
    """The priority order and per-layer quotas (e.g. ``LayerBudget.tokens_per_layer(n)``).

    ``scores``: relevance of each position of the new sequence (only reused positions are read);
    None keeps track 2 in position order.
    ``track2_share``: after the first token of every span, the fraction of the order given to
    track 2 while both tracks have tokens left (0: all of track 1 first). With a 5% budget and
    10% heads, a share of 0.5 lets both tracks spend the budget.
    ``tracks="heads"``: track 1 alone; the quotas stop at the span heads (the returned
    ``plan.quota`` says how many each layer recomputes) and track 2 only orders what is left.
    """
    if tracks not in ("both", "heads"):
        raise ValueError(f"tracks must be 'both' or 'heads', got {tracks!r}")
    spans = check_spans(spans)
    if not 0.0 <= head_fraction <= 1.0:
        raise ValueError(f"head_fraction must be in [0, 1], got {head_fraction}")
    if not 0.0 <= track2_share <= 1.0:
        raise ValueError(f"track2_share must be in [0, 1], got {track2_share}")
    reused = span_positions(spans)
    quota = check_quota(quota, reused.size)
    # Track 1: the head of each span, interleaved by offset (offset 0 of every span first).
    heads = [(offset, s.start + offset) for s in spans for offset in range(math.ceil(head_fraction * s.length))]
    track1 = np.array([pos for _, pos in sorted(heads)], dtype=np.int64)
    rest = np.setdiff1d(reused, track1, assume_unique=True)
    if scores is not None:
        scores = check_scores(scores, reused)
        rest = rest[np.argsort(-scores[rest], kind="stable")]
    if tracks == "heads":
        quota, track2_share = [min(q, track1.size) for q in quota], 0.0
    boundary = min(len(spans), track1.size) if head_fraction > 0 else 0  # offset 0 of each span
    order = np.concatenate([track1[:boundary], _interleave(track1[boundary:], rest, track2_share)])
    return RecomputePlan(order=order, quota=tuple(quota))


def check_scores(scores: np.ndarray | torch.Tensor, reused: np.ndarray) -> np.ndarray:
    """``scores`` (one per position of the new sequence) as a numpy array, checked to cover every
    ``reused`` position with a finite value."""
    scores = scores.detach().cpu().numpy() if isinstance(scores, torch.Tensor) else np.asarray(scores)
    if scores.ndim != 1 or (reused.size and scores.shape[0] <= reused.max()):
        raise ValueError(f"scores must be 1-D and cover every reused position, got shape {scores.shape}")
    if not np.all(np.isfinite(scores[reused])):
        raise ValueError("scores of reused positions must be finite")
    return scores


def check_quota(quota: Sequence[int], reused: int) -> list[int]:
    """Per-layer quotas as ints: >= 0, non-increasing with depth, at most ``reused``."""
    quota = [int(q) for q in quota]
    if any(q < 0 for q in quota) or any(b > a for a, b in zip(quota, quota[1:])):
        raise ValueError(f"quotas must be >= 0 and non-increasing with depth, got {quota}")
    if quota and quota[0] > reused:
        raise ValueError(f"quota {quota[0]} exceeds the {reused} reused tokens")
    return quota


def span_positions(spans: Sequence[ReusedSpan]) -> np.ndarray:
    """Every position the spans cover, span by span (int64)."""
    if not all(isinstance(s, ReusedSpan) for s in spans):
        raise TypeError("spans must be ReusedSpan objects")
    return np.concatenate([np.arange(s.start, s.start + s.length) for s in spans]) if spans else np.zeros(0, np.int64)


def _interleave(track1: np.ndarray, track2: np.ndarray, share: float) -> np.ndarray:
    """Both tracks merged so that every prefix holds about ``share`` of track 2 (each track keeps
    its own order; when one runs out the other continues)."""
    if share <= 0.0 or not track2.size:
        return np.concatenate([track1, track2])
    if share >= 1.0 or not track1.size:
        return np.concatenate([track2, track1])
    n = track1.size + track2.size
    step = np.arange(n, dtype=np.float64)
    take2 = np.floor((step + 1) * share) > np.floor(step * share)  # track 2's turns while both last
    done = np.flatnonzero((np.cumsum(take2) >= track2.size) | (np.cumsum(~take2) >= track1.size))
    stop = int(done[0]) + 1 if done.size else n  # after this step one track is empty
    from_track2 = np.empty(n, dtype=bool)
    from_track2[:stop] = take2[:stop]
    from_track2[stop:] = take2[:stop].sum() < track2.size  # the rest all come from the track left
    out = np.empty(n, dtype=np.int64)
    out[from_track2] = track2
    out[~from_track2] = track1
    return out


def key_deviation(cached_keys: torch.Tensor, fresh_keys: torch.Tensor) -> torch.Tensor:
    """Per-token L2 distance between cached and freshly computed keys [N, heads, head_dim],
    averaged over heads: how wrong each reused token's KV is in its new context."""
    if cached_keys.shape != fresh_keys.shape or cached_keys.dim() != 3:
        raise ValueError(f"keys must both be [N, heads, head_dim], got {tuple(cached_keys.shape)} and {tuple(fresh_keys.shape)}")
    return (cached_keys.float() - fresh_keys.float()).norm(dim=-1).mean(dim=-1)


def attention_relevance(new_queries: torch.Tensor, keys: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Attention mass the new tokens' queries [Q, heads, d] put on each key [N, kv_heads, d]
    (softmax over all N keys, summed over queries, averaged over heads; GQA by repetition)."""
    if new_queries.dim() != 3 or keys.dim() != 3 or new_queries.shape[-1] != keys.shape[-1]:
        raise ValueError("new_queries must be [Q, heads, d] and keys [N, kv_heads, d]")
    heads, kv_heads = new_queries.shape[1], keys.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a multiple of kv heads {kv_heads}")
    k = keys.float().repeat_interleave(heads // kv_heads, dim=1)
    scale = scale if scale is not None else keys.shape[-1] ** -0.5
    probs = torch.softmax(torch.einsum("qhd,nhd->hqn", new_queries.float(), k) * scale, dim=-1)
    return probs.sum(dim=1).mean(dim=0)
