"""Eviction and demotion policies: one method, ``priority``, as in SGLang's
``EvictionStrategy.get_priority``.

A policy turns what is known about a cached item (:class:`ItemState`) into an integer priority:
higher is kept longer. The native ContentIndex and BlockPool already evict lowest priority
first and least recently used among equals, so a policy never sorts or evicts anything itself;
it only sets priorities (:meth:`EvictionPolicy.apply`), and plain LRU is the policy that gives
every item the same priority. Policies are small classes chosen by name (:func:`make_policy`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

#: Priorities are int32 in the native index.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class ItemState:
    """What a policy may know about one cached item (image KV, ViT output, prefix blocks).

    ``last_use``: the logical clock tick of its last use (a step counter, not wall time, so runs
    are reproducible); ``priority``: a caller-given priority (priority-LRU); ``attention``: the
    attention mass its tokens received recently (attention-aware); ``agents``: the agents whose
    context holds it (workflow-aware)."""

    key: Hashable
    last_use: int = 0
    size_bytes: int = 0
    priority: int = 0
    attention: float = 0.0
    agents: frozenset[str] = frozenset()


class EvictionPolicy(ABC):
    """Higher priority is kept longer; the index breaks ties by least recent use."""

    name: ClassVar[str]

    @abstractmethod
    def priority(self, item: ItemState, now: int) -> int:
        """The item's priority at logical time ``now`` (an int32)."""

    def eviction_order(self, items: Iterable[ItemState], now: int) -> list[Hashable]:
        """Keys in the order the index would evict them (lowest priority, then least recent use,
        first): what the policy means, for tests and reports."""
        return [i.key for i in sorted(items, key=lambda i: (self.priority(i, now), i.last_use))]

    def apply(self, index: Any, items: Iterable[ItemState], now: int) -> None:
        """Write the items' priorities into ``index`` (a ContentIndex: ``set_priority(key, p)``)."""
        for item in items:
            index.set_priority(item.key, self.priority(item, now))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def clamp_priority(value: float) -> int:
    if math.isnan(value):
        raise ValueError("a priority cannot be NaN")
    return int(max(PRIORITY_MIN, min(PRIORITY_MAX, round(value))))


class LRUPolicy(EvictionPolicy):
    """Least recently used first: every item the same priority, the index's LRU decides."""

    name = "lru"

    def priority(self, item: ItemState, now: int) -> int:
        return 0


class PriorityLRUPolicy(EvictionPolicy):
    """The caller's priority (e.g. pinned-ish system prompts high), LRU among equals."""

    name = "priority-lru"

    def priority(self, item: ItemState, now: int) -> int:
        return clamp_priority(item.priority)


__all__ = ["PRIORITY_MAX", "PRIORITY_MIN", "EvictionPolicy", "ItemState", "LRUPolicy", "PriorityLRUPolicy",
           "clamp_priority"]
