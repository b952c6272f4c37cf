"""Attention-aware LRU (OxyGen): an item that the model keeps attending to is worth keeping even
if it was not the last one touched, and a recently used item nobody attends to is not.

Priority = alpha x activity + (1 - alpha) x recency, both in [0, 1]: ``activity`` is the item's
share of attention mass over recent steps (an exponential moving average kept by
:class:`AttentionActivity` from what the attention kernels already return, or from a cheap
sample of queries); ``recency`` halves every ``half_life`` steps since the last use. The score is
scaled to an int32 priority.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from samcache._checks import check_int
from samcache.policies.base import EvictionPolicy, ItemState, clamp_priority

_SCALE = 1_000_000  # priority units per unit of score


class AttentionAwarePolicy(EvictionPolicy):
    name = "attention"

    def __init__(self, alpha: float = 0.5, half_life: int = 8):
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
        check_int("half_life", half_life, 1)
        self.alpha = float(alpha)
        self.half_life = half_life

    def score(self, item: ItemState, now: int) -> float:
        if not 0.0 <= item.attention <= 1.0:
            raise ValueError(f"attention activity must be in [0, 1], got {item.attention!r} for {item.key!r}")
        recency = 0.5 ** (max(0, now - item.last_use) / self.half_life)
        return self.alpha * item.attention + (1.0 - self.alpha) * recency

    def priority(self, item: ItemState, now: int) -> int:
        return clamp_priority(_SCALE * self.score(item, now))

    def __repr__(self) -> str:
        return f"AttentionAwarePolicy(alpha={self.alpha}, half_life={self.half_life})"


class AttentionActivity:
    """Each item's share of attention mass, as an exponential moving average over steps
    (``decay``: the weight of the past). ``observe(step_masses)`` takes one step's attention mass
    per item (any non-negative numbers: they are normalised to shares); items not observed in a
    step decay toward 0."""

    def __init__(self, decay: float = 0.8):
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be a number in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self._activity: dict[Hashable, float] = {}

    def observe(self, masses: Mapping[Hashable, float]) -> None:
        if any(not m >= 0 for m in masses.values()):
            raise ValueError("attention masses must be non-negative numbers")
        total = sum(masses.values())
        for key in set(self._activity) | set(masses):
            share = masses.get(key, 0.0) / total if total > 0 else 0.0
            self._activity[key] = self.decay * self._activity.get(key, 0.0) + (1.0 - self.decay) * share

    def __getitem__(self, key: Hashable) -> float:
        return self._activity.get(key, 0.0)

    def forget(self, key: Hashable) -> None:
        self._activity.pop(key, None)


__all__ = ["AttentionActivity", "AttentionAwarePolicy"]
