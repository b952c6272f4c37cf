"""``two-track``: span heads, then the tokens the new context relies on most.

Track 1 is the first ``head_fraction`` of every reused span (interleaved across spans, so every
span keeps its first tokens when the quota is small); track 2 the rest, by relevance (the
prompt's last tokens' layer-0 attention, or routing confidence) when ``relevance`` is on, else
in position order. ``track2_share`` of the order goes to track 2 while both last; with
``tracks="heads"`` the quotas stop at the heads (:func:`~samcache.recompute.plan_recompute`).
It does not look at which images moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from samcache._checks import check_fraction
from samcache.recompute.method import RepairMethod
from samcache.recompute.selection import RecomputePlan, ReusedSpan, plan_recompute


@dataclass(frozen=True)
class TwoTrack(RepairMethod):
    name: ClassVar[str] = "two-track"

    head_fraction: float = 0.1
    track2_share: float = 0.5
    tracks: str = "both"
    relevance: bool = True

    def __post_init__(self) -> None:
        check_fraction("head_fraction", self.head_fraction)
        check_fraction("track2_share", self.track2_share)
        if self.tracks not in ("both", "heads"):
            raise ValueError(f"tracks must be 'both' or 'heads', got {self.tracks!r}")
        if not isinstance(self.relevance, bool):
            raise TypeError(f"relevance must be a bool, got {self.relevance!r}")

    @property
    def scores(self) -> str | None:  # type: ignore[override]
        return "relevance" if self.tracks == "both" and self.relevance else None

    def order(self, spans: Sequence[ReusedSpan], quota: Sequence[int], scores: np.ndarray | None = None
              ) -> RecomputePlan:
        return plan_recompute(spans, quota, scores if self.scores else None, head_fraction=self.head_fraction,
                              track2_share=self.track2_share, tracks=self.tracks)


__all__ = ["TwoTrack"]
