"""The values of reuse planning: what a prompt holds, what the caches hold, and the plan.

All of them are plain values (numbers, numpy arrays, hashable keys): no model, no KV tensors. A
runner (samcache's own, or an engine integration) executes a :class:`ReusePlan` layer by layer.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from samcache._checks import check_int
from samcache.recompute.method import RepairMethod
from samcache.recompute.selection import RecomputePlan, ReusedSpan
from samcache.recompute.two_track import TwoTrack


@dataclass(frozen=True)
class ImageSlot:
    """Image ``index`` of a prompt: tokens ``[start, start + length)``, content ``key`` (namespaced:
    model + tenant + pixels) and the M-RoPE position of its first token. Every position of an image
    follows from its first one, so moving an image shifts all of them by one delta."""

    index: int
    start: int
    length: int
    key: Hashable
    position: int

    def __post_init__(self) -> None:
        check_int("ImageSlot.index", self.index, 0)
        check_int("ImageSlot.start", self.start, 0)
        check_int("ImageSlot.length", self.length, 1)
        check_int("ImageSlot.position", self.position, 0)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class PromptLayout:
    """A prompt as the planner sees it: its length and its images (in order, not overlapping)."""

    num_tokens: int
    images: tuple[ImageSlot, ...] = ()


@dataclass(frozen=True)
class CachedImage:
    """What the image-KV store holds for a key: ``length`` tokens of KV whose keys are rotated to
    positions starting at ``position``, computed when the image was image ``index`` of its prompt
    (None: computed alone, or not known). ``exact``: re-rotated to any position, this KV is what a
    full prefill computes there (a model with isolated image attention, the record lossless)."""

    length: int
    position: int
    index: int | None = None
    exact: bool = False

    def __post_init__(self) -> None:
        check_int("CachedImage.length", self.length, 1)
        check_int("CachedImage.position", self.position, 0)
        if self.index is not None:
            check_int("CachedImage.index", self.index, 0)
        if not isinstance(self.exact, bool):
            raise TypeError(f"CachedImage.exact must be a bool, got {self.exact!r}")


@dataclass(frozen=True)
class RecomputeBudget:
    """How much of the reused KV to recompute: ``rates[l]`` of the reused tokens at layer ``l``
    (non-increasing with depth, e.g. ``LayerBudget.rates``), in the order of the repair
    ``method`` (:mod:`samcache.recompute.method`; default two-track)."""

    rates: tuple[float, ...]
    method: RepairMethod = field(default_factory=TwoTrack)

    def __post_init__(self) -> None:
        rates = tuple(float(r) for r in self.rates)
        if any(not 0.0 <= r <= 1.0 for r in rates) or any(b > a for a, b in zip(rates, rates[1:])):
            raise ValueError(f"rates must be in [0, 1] and non-increasing with depth, got {list(rates)}")
        if not isinstance(self.method, RepairMethod):
            raise TypeError(f"method must be a RepairMethod (samcache.recompute.repair_method(name)), "
                            f"got {type(self.method).__name__}")
        object.__setattr__(self, "rates", rates)

    @classmethod
    def none(cls, num_layers: int) -> "RecomputeBudget":
        return cls(rates=(0.0,) * num_layers)

    @property
    def wants_scores(self) -> bool:
        """The order reads relevance scores from before the forward."""
        return self.method.scores == "relevance"

    def quota(self, reused_tokens: int) -> list[int]:
        """How many of ``reused_tokens`` each layer recomputes."""
        return self.method.quota(self.rates, reused_tokens)

    def order(self, spans: Sequence[ReusedSpan], quota: Sequence[int], scores: np.ndarray | None = None
              ) -> RecomputePlan:
        """The method's recompute order of ``spans`` with these quotas (scores: relevance of every
        position; read only by methods that want them)."""
        return self.method.order(spans, quota, scores if self.wants_scores else None)


@dataclass(frozen=True)
class SplicedSpan:
    """Prompt tokens ``[start, start + length)`` take image ``image``'s cached KV from its token
    ``offset`` on (the exact prefix may already hold the image's first tokens), keys rotated by
    ``delta`` positions. ``moved``: the KV was computed at another index among the images (or
    alone, or where is not known). ``exact``: the spliced KV is what a full prefill computes here
    (:attr:`CachedImage.exact`)."""

    image: int
    start: int
    length: int
    offset: int
    delta: int
    moved: bool = True
    exact: bool = False

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class ReusePlan:
    """Where every token's KV comes from, and which tokens each layer computes.

    - ``prefix_tokens``: adopted from the exact prefix cache (tokens ``[0, prefix_tokens)``);
    - ``spliced``: known images' KV, re-rotated to their new positions;
    - ``new_rows``: every other token, computed at every layer;
    - ``recompute``: the reused tokens recomputed, ``recompute.quota[l]`` of them at layer ``l``
      (nested sets, shrinking with depth); ``layer_rows[l]`` = new rows + layer ``l``'s recompute set;
    - ``vit_images``: images whose vision-encoder output the computed rows need;
    - ``exact_tokens``: the leading tokens whose KV equals a full prefill's (everything before the
      first spliced token that is not exact, unless every reused token is recomputed at every
      layer). Only these may enter an exact prefix cache.

    A plan is made in two declared phases, both before the forward: :func:`plan_reuse` decides
    everything that needs no KV; a repair order that ranks tokens by relevance leaves
    ``needs_scores`` set, and :meth:`with_scores` (given scores read from the spliced keys) makes
    the plan complete. Executors refuse an incomplete plan. The one decision left to the forward
    is declared too: ``select_layer`` (the deviation method ranks the reused tokens by the keys it
    computes there).
    """

    num_tokens: int
    prefix_tokens: int
    spliced: tuple[SplicedSpan, ...]
    new_rows: np.ndarray
    recompute: RecomputePlan | None
    layer_rows: tuple[np.ndarray, ...]
    vit_images: tuple[int, ...]
    exact_tokens: int
    needs_scores: bool = False  # the order wants relevance scores: call with_scores() before executing
    budget: RecomputeBudget | None = field(default=None, repr=False)
    image_tokens: tuple[tuple[int, int, int], ...] = field(default=(), repr=False)  # (index, start, end)

    @property
    def num_layers(self) -> int:
        return len(self.layer_rows)

    @property
    def image_reused_tokens(self) -> int:
        return sum(s.length for s in self.spliced)

    @property
    def reused_spans(self) -> list[ReusedSpan]:
        """The spliced token ranges, as the recompute policy takes them."""
        return [ReusedSpan(s.start, s.length, s.moved) for s in self.spliced]

    @property
    def select_layer(self) -> int | None:
        """Where the forward picks which reused tokens the later layers recompute (the repair
        method's second phase: layers up to it recompute every reused token); None: ``layer_rows``
        are final."""
        return None if self.recompute is None else self.budget.method.select_layer

    @property
    def rows(self) -> np.ndarray:
        """Every row computed at some layer (the first layer computes the most)."""
        return self.layer_rows[0] if self.layer_rows else self.new_rows

    @property
    def recomputed_tokens(self) -> int:
        """Reused tokens recomputed at the first layer."""
        return int(self.recompute.quota[0]) if self.recompute is not None and self.recompute.quota else 0

    @property
    def recomputed_token_layers(self) -> int:
        """Recomputed (token, layer) pairs over all layers."""
        return int(sum(self.recompute.quota)) if self.recompute is not None else 0

    @property
    def recompute_rates(self) -> list[float]:
        """Per layer, the fraction of the image-reused tokens recomputed there."""
        reused = self.image_reused_tokens
        if self.recompute is None or not reused:
            return [0.0] * self.num_layers
        return [q / reused for q in self.recompute.quota]

    def with_scores(self, scores: np.ndarray) -> "ReusePlan":
        """The same plan with track 2 ordered by ``scores`` (relevance of every prompt position;
        only reused positions are read)."""
        if self.recompute is None:
            return replace(self, needs_scores=False)
        return finish_plan(self, self.budget.order(self.reused_spans, self.recompute.quota, scores), self.num_layers)


def finish_plan(plan: ReusePlan, recompute: RecomputePlan | None, num_layers: int) -> ReusePlan:
    """``plan`` with ``recompute``: per-layer rows and the images their inputs need."""
    if recompute is None:
        layer_rows = tuple(plan.new_rows for _ in range(num_layers))
    else:
        layer_rows = tuple(np.union1d(plan.new_rows, recompute.positions(l)) for l in range(num_layers))
    rows = layer_rows[0]
    vit = tuple(i for i, lo, hi in plan.image_tokens if np.searchsorted(rows, hi) > np.searchsorted(rows, lo))
    # Exact everywhere only when every reused token is recomputed at every layer (the quotas
    # shrink with depth: the last layer's is the smallest).
    all_recomputed = recompute is not None and recompute.quota and recompute.quota[-1] >= plan.image_reused_tokens
    approximate = [s.start for s in plan.spliced if not s.exact]
    exact = plan.num_tokens if not approximate or all_recomputed else approximate[0]
    return replace(plan, recompute=recompute, layer_rows=layer_rows, vit_images=vit, exact_tokens=exact,
                   needs_scores=False)


__all__ = ["CachedImage", "ImageSlot", "PromptLayout", "RecomputeBudget", "ReusePlan", "SplicedSpan"]
