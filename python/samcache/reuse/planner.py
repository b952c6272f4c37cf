"""plan_reuse: a prompt plus what the caches hold -> the reuse plan. A pure function.

No model, no KV tensors: the inputs are the prompt's layout (length, image spans with content keys
and positions), how many leading tokens the exact prefix cache matched, which images the image-KV
store holds (with the positions their keys are rotated to) and the recompute budget. Every
engine that can execute the plan (samcache's runner; the vLLM and SGLang integrations) gets the
same decisions.

Rules (docs/design.md, "The reuse plan"):

1. Tokens ``[0, prefix_tokens)`` come from the exact prefix cache. The last prompt token is always
   computed: its logits are the step's output.
2. Every image past the prefix whose KV is cached is spliced in; its keys move by
   ``delta = new position - cached position``. An image the prefix covers in part is spliced from
   the first token the prefix does not hold.
3. Everything else is new and computed at every layer.
4. A spliced image has *moved* when its KV was computed at another index among the prompt's
   images (or alone, or where is not known): its KV may be wrong in more than its positions. A
   cached image marked *exact* (a model whose images attend in isolation) is what a full prefill
   computes at any index: it keeps the plan's KV exact.
5. Of the spliced tokens, layer ``l`` recomputes ``ceil(rates[l] * reused)`` (the repair method
   may raise the first layers' quotas), in the repair method's order
   (:mod:`samcache.recompute.method`); a method that orders by relevance wants scores
   (``plan.needs_scores``; :meth:`ReusePlan.with_scores` supplies them), one that picks in the
   forward says where (``plan.select_layer``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import replace

import numpy as np

from samcache._checks import check_int
from samcache.reuse.plan import (CachedImage, ImageSlot, PromptLayout, RecomputeBudget, ReusePlan, SplicedSpan,
                                 finish_plan)


def _check_layout(layout: PromptLayout) -> None:
    if not isinstance(layout, PromptLayout):
        raise TypeError(f"layout must be a PromptLayout, got {type(layout).__name__}")
    n = check_int("layout.num_tokens (a prompt needs at least one token)", layout.num_tokens, 1)
    end = 0
    for i, slot in enumerate(layout.images):
        if not isinstance(slot, ImageSlot):
            raise TypeError(f"layout.images must hold ImageSlot values, got {type(slot).__name__}")
        if slot.index != i:
            raise ValueError(f"layout.images[{i}] has index {slot.index}: images are numbered in prompt order")
        if slot.start < end or slot.end > n:
            raise ValueError(f"image {slot.index} spans tokens [{slot.start}, {slot.end}): images must lie inside "
                             f"the {n}-token prompt, in order, without overlapping")
        end = slot.end


def plan_reuse(
    layout: PromptLayout,
    *,
    prefix_tokens: int = 0,
    cached: Mapping[Hashable, CachedImage] | None = None,
    budget: RecomputeBudget | None = None,
    num_layers: int,
    scores: np.ndarray | None = None,
) -> ReusePlan:
    """The reuse plan of ``layout`` (see the module docstring for the rules).

    ``cached`` maps content keys to what the image-KV store holds (look-ups the caller did; keys
    not in it are misses). ``budget`` None (or all-zero rates) recomputes nothing. ``scores``:
    track-2 relevance of every prompt position, if already known.
    """
    _check_layout(layout)
    check_int("num_layers", num_layers, 1)
    n = layout.num_tokens
    if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) or not 0 <= prefix_tokens < n:
        raise ValueError(f"prefix_tokens must be in [0, {n - 1}] (the last token is always computed), "
                         f"got {prefix_tokens!r}")
    if budget is not None:
        if not isinstance(budget, RecomputeBudget):
            raise TypeError(f"budget must be a RecomputeBudget, got {type(budget).__name__}")
        if len(budget.rates) != num_layers:
            raise ValueError(f"budget has {len(budget.rates)} layer rates, the model has {num_layers} layers")
    cached = cached or {}

    is_new = np.zeros(n, dtype=bool)
    is_new[prefix_tokens:] = True
    spliced: list[SplicedSpan] = []
    for slot in layout.images:
        lo, hi = max(slot.start, prefix_tokens), min(slot.end, n - 1)  # the last token is computed
        entry = cached.get(slot.key)
        if lo >= hi or entry is None:
            continue
        if not isinstance(entry, CachedImage):
            raise TypeError(f"cached values must be CachedImage, got {type(entry).__name__}")
        if entry.length != slot.length:
            raise ValueError(f"image {slot.index} has {slot.length} tokens but its cached KV has {entry.length}: "
                             "a store must never return another image's entry")
        spliced.append(SplicedSpan(slot.index, lo, hi - lo, lo - slot.start, slot.position - entry.position,
                                   moved=entry.index != slot.index, exact=entry.exact))
        is_new[lo:hi] = False

    plan = ReusePlan(
        num_tokens=n, prefix_tokens=prefix_tokens, spliced=tuple(spliced), new_rows=np.flatnonzero(is_new),
        recompute=None, layer_rows=(), vit_images=(), exact_tokens=n, budget=budget,
        image_tokens=tuple((s.index, s.start, s.end) for s in layout.images),
    )
    reused = plan.image_reused_tokens
    quota = budget.quota(reused) if budget is not None and reused else []
    if not quota or quota[0] == 0:
        return finish_plan(plan, None, num_layers)
    plan = finish_plan(plan, budget.order(plan.reused_spans, quota, scores), num_layers)
    return replace(plan, needs_scores=True) if budget.wants_scores and scores is None else plan


__all__ = ["plan_reuse"]
