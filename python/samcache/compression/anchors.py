"""Which visual tokens a compression stage keeps (anchors) and where the others go (merged into
their most similar anchor by weighted average, never dropped).

Anchors are picked in an order that mixes three wishes: confident tokens first (the router is
sure what they are), every dominant expert represented (diverse content: a round-robin over the
experts, each expert's most confident token first), and spread over the image (a first pass
skips tokens closer than ``spread * sqrt(n / k)`` grid cells to an anchor already chosen, a second
pass fills what is left in the same order). Diversity comes before spread: each dominant
expert's most confident token is an anchor whenever ``k`` allows. Every other token merges into the anchor whose routing
distribution is closest (or, given ``features``, whose features are: cosine similarity), weighted
by its routing confidence; :meth:`MergePlan.merge` runs the fused ``token_merge`` kernel.

Pure: tensors in, a plan out; no model, no runner. Deterministic for the same input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from samcache._checks import check_int
from samcache.compression.router_scores import RouterScores

#: A token's weight in its anchor's average is its routing confidence, never below this.
MIN_WEIGHT = 1e-6


@dataclass(frozen=True)
class MergePlan:
    """One stage over ``n`` tokens: ``target[i] == i`` keeps token ``i`` as an anchor, else token
    ``i`` merges into anchor ``target[i]``; ``weight[i]`` (> 0) is its weight in that average."""

    target: torch.Tensor  # int64 [n]
    weight: torch.Tensor  # float32 [n]

    @property
    def anchors(self) -> torch.Tensor:
        """The kept tokens, ascending."""
        return torch.nonzero(self.target == torch.arange(self.target.numel())).flatten()

    def merge(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` [n, D] merged: (anchors' rows [M, D], their indices [M]) (``token_merge``)."""
        from samcache.ops import token_merge

        if hidden.dim() != 2 or hidden.shape[0] != self.target.numel():
            raise ValueError(f"hidden must be [{self.target.numel()}, D], got {tuple(hidden.shape)}")
        return token_merge(hidden, self.target.to(hidden.device), self.weight.to(hidden.device))


def anchor_count(n: int, keep: float) -> int:
    """Anchors kept of ``n`` tokens at ``keep`` (a fraction in (0, 1]): at least one."""
    check_int("n", n, 1)
    if not isinstance(keep, (int, float)) or isinstance(keep, bool) or not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be a fraction in (0, 1], got {keep!r}")
    return min(n, max(1, math.ceil(keep * n - 1e-9)))


def selection_order(scores: RouterScores) -> np.ndarray:
    """Token indices in the order anchors are considered: a round-robin over dominant experts
    (experts ordered by their most confident token), each expert's tokens by confidence."""
    conf = scores.confidence.double().numpy()
    expert = scores.expert.numpy()
    ranked = np.lexsort((np.arange(conf.size), -conf))  # by confidence, ties by index
    by_rank = expert[ranked]
    # Experts in the order of their best token; each token's depth = its rank within its expert.
    _, first = np.unique(by_rank, return_index=True)
    expert_rank = np.empty(int(by_rank.max()) + 1 if by_rank.size else 0, dtype=np.int64)
    expert_rank[by_rank[np.sort(first)]] = np.arange(first.size)
    depth = np.empty(conf.size, dtype=np.int64)
    for e in np.unique(by_rank):
        where = by_rank == e
        depth[where] = np.arange(int(where.sum()))
    return ranked[np.lexsort((expert_rank[by_rank], depth))].astype(np.int64)


def select_anchors(scores: RouterScores, coords: torch.Tensor, keep: float, *, spread: float = 0.5) -> torch.Tensor:
    """The anchors (ascending indices) of one stage: ``anchor_count(n, keep)`` tokens picked in
    :func:`selection_order`: each dominant expert's first, then a pass keeping them ``spread * sqrt(n / k)`` grid cells apart
    (``coords`` [n, 2]: each token's row and column in its image's token grid; 0 turns spreading
    off)."""
    n = len(scores)
    k = anchor_count(n, keep)
    if not isinstance(coords, torch.Tensor) or tuple(coords.shape) != (n, 2):
        raise ValueError(f"coords must be a [{n}, 2] tensor of grid rows and columns")
    if not isinstance(spread, (int, float)) or isinstance(spread, bool) or spread < 0:
        raise ValueError(f"spread must be a number >= 0, got {spread!r}")
    order = selection_order(scores)
    if k == n:
        return torch.arange(n)
    xy = coords.double().numpy()
    gap = spread * math.sqrt(n / k)
    nearest = np.full(n, np.inf)  # distance from each token to the closest anchor so far
    chosen = np.zeros(n, dtype=bool)
    count = 0
    # Every dominant expert's most confident token first (the round-robin's first lap), as far as k goes.
    firsts = order[: min(k, int(scores.expert.unique().numel()))]
    chosen[firsts] = True
    count = firsts.size
    # Distinct grid cells are at least 1 apart: with a gap of at most 1 every token passes the
    # spreading test, which then picks in plain order (the fill below does the same, faster).
    spreading = gap > 1.0 or np.unique(xy, axis=0).shape[0] < n
    if spreading:
        for i in firsts:
            np.minimum(nearest, np.hypot(*(xy - xy[i]).T), out=nearest)
        for i in order:
            if count == k:
                break
            if not chosen[i] and nearest[i] >= gap:
                chosen[i] = True
                count += 1
                np.minimum(nearest, np.hypot(*(xy - xy[i]).T), out=nearest)
    rest = order[~chosen[order]][: k - count]  # fill what spreading left, in the same order
    chosen[rest] = True
    return torch.from_numpy(np.flatnonzero(chosen))


def merge_plan(scores: RouterScores, anchors: torch.Tensor, *, features: torch.Tensor | None = None) -> MergePlan:
    """Every token that is not an anchor merges into its most similar anchor (routing
    distributions, or cosine similarity of ``features`` [n, d] when given; ties: the lower
    index), weighted by its routing confidence."""
    n = len(scores)
    anchors = torch.as_tensor(anchors, dtype=torch.int64).flatten()
    if anchors.numel() == 0 or anchors.unique().numel() != anchors.numel() or anchors.min() < 0 or anchors.max() >= n:
        raise ValueError(f"anchors must be distinct token indices in [0, {n}), at least one")
    anchors = anchors.sort().values
    if features is not None:
        if tuple(features.shape[:1]) != (n,) or features.dim() != 2:
            raise ValueError(f"features must be [{n}, d], got {tuple(features.shape)}")
        unit = torch.nn.functional.normalize(features.float(), dim=-1)
        sim = unit @ unit[anchors].T
    else:
        sim = scores.similarity(torch.arange(n), anchors)
    target = anchors[sim.argmax(dim=1)]  # argmax returns the first maximum: the lower anchor index
    target[anchors] = anchors
    weight = scores.confidence.float().clamp_min(MIN_WEIGHT)
    return MergePlan(target, weight)


def plan_stage(scores: RouterScores, coords: torch.Tensor, keep: float, *, spread: float = 0.5,
               features: torch.Tensor | None = None) -> MergePlan:
    """Anchors (:func:`select_anchors`) and the merge of the rest (:func:`merge_plan`)."""
    return merge_plan(scores, select_anchors(scores, coords, keep, spread=spread), features=features)


def stage_keeps(keep: float, stages: int) -> tuple[float, ...]:
    """Per-stage fractions (of the tokens left) whose product is ``keep``: equal shares, so every
    stage removes the same fraction of what reaches it."""
    check_int("stages", stages, 1)
    if not isinstance(keep, (int, float)) or isinstance(keep, bool) or not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be a fraction in (0, 1], got {keep!r}")
    return (keep ** (1.0 / stages),) * stages


__all__ = ["MIN_WEIGHT", "MergePlan", "anchor_count", "merge_plan", "plan_stage", "select_anchors",
           "selection_order", "stage_keeps"]
