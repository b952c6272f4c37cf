"""``deviation``: the reused tokens whose keys deviate most from fresh ones (CacheBlend).

Layer 0's KV of a reused token is exact after re-rotation (it depends on the token and its
position only), so the first layer where a changed left context shows is layer 1: every reused
token is recomputed at layers ``0..check_layer`` (its hidden state into ``check_layer`` is then
fresh), and at ``check_layer`` the forward compares each reused token's fresh key with its cached
one (:func:`~samcache.recompute.key_deviation`, before the fresh one is written). The layers after
it recompute the largest deviations first, as many as their quota. Cost: ``check_layer + 1``
layers of every reused token on top of the budget's quotas; on a deep model (28 layers, 2 of
them) that is the field's few percent, on a shallow one much more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from samcache._checks import check_int
from samcache.recompute.budget import tokens_per_layer
from samcache.recompute.method import RepairMethod
from samcache.recompute.selection import RecomputePlan, ReusedSpan, check_quota, check_scores, check_spans, span_positions


@dataclass(frozen=True)
class Deviation(RepairMethod):
    name: ClassVar[str] = "deviation"

    check_layer: int = 1

    def __post_init__(self) -> None:
        check_int("check_layer", self.check_layer, 1)

    @property
    def select_layer(self) -> int:  # type: ignore[override]
        return self.check_layer

    def quota(self, rates: Sequence[float], reused_tokens: int) -> list[int]:
        """Every reused token at layers ``0..check_layer``, the budget's quotas after (none at all
        where every rate is 0: no recompute, no check)."""
        if self.check_layer >= len(rates):
            raise ValueError(f"check_layer {self.check_layer} needs a model deeper than its {len(rates)} layers")
        quota = tokens_per_layer(rates, reused_tokens)
        if not any(quota):
            return quota
        return [reused_tokens] * (self.check_layer + 1) + quota[self.check_layer + 1:]

    def order(self, spans: Sequence[ReusedSpan], quota: Sequence[int], scores: np.ndarray | None = None
              ) -> RecomputePlan:
        """By descending ``scores`` (the deviations, once the forward has them; before, position
        order: layers up to ``check_layer`` take every token anyway)."""
        reused = span_positions(check_spans(spans))
        order = np.sort(reused)
        if scores is not None:
            scores = check_scores(scores, reused)
            order = order[np.argsort(-scores[order], kind="stable")]
        return RecomputePlan(order=order, quota=tuple(check_quota(quota, order.size)))


__all__ = ["Deviation"]
