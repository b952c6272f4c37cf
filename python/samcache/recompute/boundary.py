"""``boundary``: the images that moved, their first tokens first (EPIC / LegoLink, VLCache).

A reused image whose KV was computed with other images before it (its index changed, or it was
computed alone) is wrong from its first token on; an image that kept its index is not (only its
positions changed, and re-rotation makes those exact). The order takes the moved images' tokens
first, front to back, interleaved by *fraction* of the image (the field's first 16-32 tokens of a
1,200-token screenshot are its first 1-3%), so every moved image gets its head before any gets
more; then the images that kept their index, the same way. The separators around an image are
text, computed anyway.

``boundary+deviation``: the first ``head_fraction`` of every moved image, then the other reused
tokens by key deviation at ``check_layer`` (:mod:`~samcache.recompute.deviation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from samcache._checks import check_fraction
from samcache.recompute.deviation import Deviation
from samcache.recompute.method import RepairMethod
from samcache.recompute.selection import RecomputePlan, ReusedSpan, check_quota, check_spans, span_positions


def front_to_back(spans: Sequence[ReusedSpan]) -> np.ndarray:
    """The spans' positions interleaved by fraction of their span (offset / length; ties: the
    earlier span first), so every span's head comes before any span's tail."""
    if not spans:
        return np.zeros(0, np.int64)
    positions = span_positions(spans)
    fraction = np.concatenate([np.arange(s.length) / s.length for s in spans])
    which = np.concatenate([np.full(s.length, i) for i, s in enumerate(spans)])
    return positions[np.lexsort((which, fraction))]


def moved_first(spans: Sequence[ReusedSpan]) -> np.ndarray:
    """Moved spans front to back, then the spans that kept their index front to back."""
    spans = check_spans(spans)
    return np.concatenate([front_to_back([s for s in spans if s.moved]),
                           front_to_back([s for s in spans if not s.moved])])


def heads(spans: Sequence[ReusedSpan], fraction: float) -> np.ndarray:
    """The first ``fraction`` of every moved span (at least one token each), front to back."""
    moved = [ReusedSpan(s.start, min(s.length, max(1, int(np.ceil(fraction * s.length - 1e-9)))))
             for s in check_spans(spans) if s.moved]
    return front_to_back(moved) if fraction > 0 else np.zeros(0, np.int64)


@dataclass(frozen=True)
class Boundary(RepairMethod):
    name: ClassVar[str] = "boundary"

    def order(self, spans: Sequence[ReusedSpan], quota: Sequence[int], scores: np.ndarray | None = None
              ) -> RecomputePlan:
        order = moved_first(spans)
        return RecomputePlan(order=order, quota=tuple(check_quota(quota, order.size)))


@dataclass(frozen=True)
class BoundaryDeviation(Deviation):
    name: ClassVar[str] = "boundary+deviation"

    head_fraction: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fraction("head_fraction", self.head_fraction)

    def order(self, spans: Sequence[ReusedSpan], quota: Sequence[int], scores: np.ndarray | None = None
              ) -> RecomputePlan:
        first = heads(spans, self.head_fraction)
        rest = super().order(spans, quota, scores).order
        rest = rest[~np.isin(rest, first)]
        order = np.concatenate([first, rest])
        return RecomputePlan(order=order, quota=tuple(check_quota(quota, order.size)))


__all__ = ["Boundary", "BoundaryDeviation", "front_to_back", "heads", "moved_first"]
