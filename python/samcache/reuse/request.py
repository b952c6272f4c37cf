"""One request's reuse, written once for every executor (samcache's engine, the vLLM and SGLang
plugins): how an image's KV is keyed, which images past the exact prefix are looked up, the
planner's decision, and the counters of what was reused, recomputed and missed, in one
vocabulary. The executor brings its look-up (its store, its tiers) and splices and computes the
rows its own way; the decisions are the same everywhere.

    request = plan_request(layout, prefix_tokens=p, lookup=find, budget=budget, num_layers=L)
    for span in request.plan.spliced:          # write request.hits[key]'s KV at span's slots
        ...
    rows = request.plan.layer_rows             # what each layer computes
    counters.count(request)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from samcache.hashing import ContentHash, ContentKey, Namespace, at_ordinal
from samcache.reuse.plan import CachedImage, ImageSlot, PromptLayout, RecomputeBudget, ReusePlan
from samcache.reuse.planner import plan_reuse

#: ``lookup(slot)``: what the executor holds for an image, (what the planner needs, its own entry), or None.
Lookup = Callable[[ImageSlot], "tuple[CachedImage, Any] | None"]


def image_key(namespace: Namespace, content: ContentHash, index: int, keep_image_order: bool) -> ContentKey:
    """The key of an image's KV: its namespaced content, and with ``keep_image_order`` its index
    among the prompt's images too (reused only where the image keeps its place)."""
    return namespace.key(at_ordinal(content, index) if keep_image_order else content)


@dataclass(frozen=True)
class RequestPlan:
    """A request's reuse: the plan, the executor's entry of every image it splices (by key), and
    the images past the prefix that were looked up and not found."""

    plan: ReusePlan
    hits: dict[Hashable, Any]
    misses: tuple[ImageSlot, ...]
    looked_up: int  # images past the prefix that were looked up (hits + misses, repeats included)

    @property
    def hit_images(self) -> int:
        return self.looked_up - len(self.misses)

    def recompute_rows(self, layer: int) -> np.ndarray:
        """Spliced positions layer ``layer`` recomputes (sorted; empty without recompute)."""
        if self.plan.recompute is None:
            return np.zeros(0, dtype=np.int64)
        return self.plan.recompute.positions(layer).astype(np.int64)


def plan_request(layout: PromptLayout, *, prefix_tokens: int, lookup: Lookup | None,
                 budget: RecomputeBudget | None, num_layers: int, scores: np.ndarray | None = None) -> RequestPlan:
    """Look up every image of ``layout`` past the first ``prefix_tokens`` (None: image KV is not
    used, nothing is looked up) and plan the request (:func:`~samcache.reuse.plan_reuse`)."""
    cached: dict[Hashable, CachedImage] = {}
    hits: dict[Hashable, Any] = {}
    misses: list[ImageSlot] = []
    looked = 0
    for slot in layout.images if lookup is not None else ():
        if slot.end <= prefix_tokens:
            continue  # the exact prefix holds it
        looked += 1
        if slot.key in cached:
            continue  # shown twice: one look-up
        found = lookup(slot)
        if found is None:
            misses.append(slot)
            continue
        entry, held = found
        if not isinstance(entry, CachedImage):
            raise TypeError(f"lookup must return (CachedImage, entry) or None, got {type(entry).__name__}")
        cached[slot.key], hits[slot.key] = entry, held
    plan = plan_reuse(layout, prefix_tokens=prefix_tokens, cached=cached, budget=budget, num_layers=num_layers,
                      scores=scores)
    return RequestPlan(plan, hits, tuple(misses), looked)


@dataclass
class ReuseCounters:
    """What requests did with images, summed: the same names as a turn's metrics
    (:class:`samcache.engine.metrics.TurnMetrics`), in the engine and in both plugins."""

    steps: int = 0                    # forward passes with reuse or saves (plugins)
    prompt_tokens: int = 0            # prompt tokens the planned requests scheduled past their prefix
    computed_tokens: int = 0          # of those, rows the first layer computed (new + recomputed)
    image_reused_tokens: int = 0      # image tokens whose KV was spliced in at new positions
    recomputed_tokens: int = 0        # spliced tokens recomputed at the first layer
    recomputed_token_layers: int = 0  # recomputed (token, layer) pairs over all layers
    image_kv_hits: int = 0            # images past the prefix found in the store
    image_kv_misses: int = 0          # ... and not found (computed; stored where they are whole)
    images_saved: int = 0             # images the store took
    isolated_images: int = 0          # an isolated model's first-seen images computed alone (plugins: side rows)
    isolated_fallbacks: int = 0       # ... that could not be (computed in context, their request marked approximate)

    def count(self, request: RequestPlan, scheduled_tokens: int | None = None, uncounted: int = 0) -> None:
        """Add one request's plan (``scheduled_tokens``: the tokens it scheduled, default: the
        plan's tokens past the prefix; ``uncounted``: misses that were never candidates, e.g.
        images an engine cannot name)."""
        plan = request.plan
        self.prompt_tokens += plan.num_tokens - plan.prefix_tokens if scheduled_tokens is None else scheduled_tokens
        self.image_reused_tokens += plan.image_reused_tokens
        self.recomputed_tokens += plan.recomputed_tokens
        self.recomputed_token_layers += plan.recomputed_token_layers
        self.image_kv_hits += request.hit_images
        self.image_kv_misses += len(request.misses) - uncounted

    def add(self, other: "ReuseCounters") -> None:
        for name in ReuseCounters.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def counters(self) -> dict[str, int]:
        """The counters alone (a subclass's gauges left out)."""
        values = asdict(self)
        return {name: values[name] for name in ReuseCounters.__dataclass_fields__}


__all__ = ["Lookup", "RequestPlan", "ReuseCounters", "image_key", "plan_request"]
