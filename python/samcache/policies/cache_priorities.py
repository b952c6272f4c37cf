"""The engine's eviction policy at work: what each cached item is to the policy, and its priority
written where eviction happens.

Items: every image the engine has seen (its KV in the image-KV store, its ViT output in the ViT
store, one namespaced content key for both) and every agent's context (the pool blocks of its last
turn: system prompt, history, everything its next turn adopts as a prefix). After each turn the
engine records who used what (:meth:`CachePriorities.record`): the turn's agent, its images, its
blocks, and with the attention-aware policy the attention its last tokens paid to each image.
Before each batch of turns :meth:`CachePriorities.apply` asks the policy for every item's priority
and writes it into the stores' indexes and the pool's blocks, which evict lowest priority first
(least recently used among equals). A block shared by several agents' contexts keeps the highest
of their priorities.

Plain LRU needs none of this (every priority equal): the engine then makes no such object and
its behaviour is exactly the pool's and the stores' own LRU.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from samcache.cache.block_pool import BlockPool
from samcache.policies import AttentionActivity, AttentionAwarePolicy, EvictionPolicy, ItemState, WorkflowAwarePolicy
from samcache.policies.base import PRIORITY_MIN


@dataclass
class _Item:
    last_use: int
    agents: set[str] = field(default_factory=set)
    blocks: np.ndarray | None = None  # a context's blocks that had a prefix hash when recorded
    hashes: np.ndarray | None = None  # [n, 16] those hashes: what the blocks held
    origin: Any = None  # an image's (namespace, check record): what a lower tier finds it by


class CachePriorities:
    """``policy`` applied to ``pool`` (agents' context blocks) and ``stores`` (objects with an
    ``index``, a ContentIndex keyed by namespaced image content, e.g. the ViT store and the
    image-KV store's entries). ``lower``: the tiers below the pool (``holds(key)``); an image they
    hold stays tracked, so prefetch can bring it back up."""

    def __init__(self, policy: EvictionPolicy, pool: BlockPool | None, stores: Iterable[Any], lower: Any = None) -> None:
        if not isinstance(policy, EvictionPolicy):
            raise TypeError(f"policy must be an EvictionPolicy, got {type(policy).__name__}")
        self.policy = policy
        self.pool = pool
        self.stores = list(stores)
        self.lower = lower
        self.activity = AttentionActivity() if isinstance(policy, AttentionAwarePolicy) else None
        self.clock = 0
        self._applied_at = 0  # the clock at the last apply: items recorded since are not forgotten yet
        self.images: dict[Hashable, _Item] = {}
        self.contexts: dict[str, _Item] = {}

    @property
    def samples_attention(self) -> bool:
        return self.activity is not None

    def record(self, agent: str | None, images: Iterable[Hashable] | Mapping[Hashable, Any],
               blocks: np.ndarray | None, attention: dict | None = None, *, advance: bool = True) -> None:
        """One finished turn of ``agent`` (None: a turn outside any agent) that used ``images``
        (keys, or a mapping of keys to their (namespace, check record) for prefetch) and ran in
        ``blocks``; ``attention``: Executor.attention_sample of it. ``advance=False``: another
        part of a turn already recorded (the workflow does not move on again)."""
        self.clock += 1
        now = self.clock
        origins = images if isinstance(images, Mapping) else dict.fromkeys(images)
        for key, origin in origins.items():
            item = self.images.setdefault(key, _Item(now))
            item.last_use = now
            if origin is not None:
                item.origin = origin
            if agent is not None:
                item.agents.add(agent)
        if agent is not None and blocks is not None:
            blocks = np.asarray(blocks, dtype=np.int32)
            hashes, has = self.pool.block_hashes(blocks)
            self.contexts[agent] = _Item(now, {agent}, blocks[has].copy(), hashes[has])
        if self.activity is not None and attention:
            masses = {(("context", agent) if key is None else key): m for key, m in attention.items()
                      if key is not None or agent is not None}
            self.activity.observe(masses)
        if advance and agent is not None and isinstance(self.policy, WorkflowAwarePolicy):
            self.policy.ran(agent)

    def _state(self, key: Hashable, item: _Item) -> ItemState:
        attention = self.activity[key] if self.activity is not None else 0.0
        return ItemState(key, item.last_use, attention=min(1.0, attention), agents=frozenset(item.agents))

    def apply(self) -> None:
        """Write every tracked item's priority into the stores and the pool; forget items that
        every store has evicted and contexts whose blocks were all reused for other content. An
        image recorded since the last apply is kept even if no store holds it yet (a plugin records
        a step's images before it stores them)."""
        now, since = self.clock, self._applied_at
        self._applied_at = now
        for key, item in list(self.images.items()):
            held = [s for s in self.stores if key in s.index]
            if not held and item.last_use <= since and (self.lower is None or not self.lower.holds(key)):
                del self.images[key]
                if self.activity is not None:
                    self.activity.forget(key)
                continue
            priority = self.policy.priority(self._state(key, item), now)
            for store in held:
                store.index.set_priority(key, priority)
        blocks, prios = [], []
        for agent, item in list(self.contexts.items()):
            hashes, has = self.pool.block_hashes(item.blocks)  # one native call per context
            valid = has & (hashes == item.hashes).all(axis=1)
            if not valid.any():
                del self.contexts[agent]
                continue
            blocks.append(item.blocks[valid])
            prios.append(np.full(int(valid.sum()), self.policy.priority(self._state(("context", agent), item), now),
                                 dtype=np.int64))
        if not blocks:
            return
        blocks_all, prios_all = np.concatenate(blocks), np.concatenate(prios)
        # A block in several contexts keeps the highest priority: sort by priority, keep each block's last.
        order = np.argsort(prios_all, kind="stable")
        blocks_all, prios_all = blocks_all[order], prios_all[order]
        _, last = np.unique(blocks_all[::-1], return_index=True)
        keep = len(blocks_all) - 1 - last
        for p in np.unique(prios_all[keep]):
            chosen = keep[prios_all[keep] == p]
            self.pool.set_block_priority(blocks_all[chosen].astype(np.int32), int(p))

    def prefetch(self, horizon: int = 2) -> list[Hashable]:
        """What the agents of the next ``horizon`` workflow steps need, soonest first (images by
        key, contexts as ('context', agent)), not the agent running now: the list a lower tier
        brings up before their turn. Empty for policies that know no workflow."""
        if not isinstance(self.policy, WorkflowAwarePolicy):
            return []
        items = [self._state(key, item) for key, item in self.images.items()]
        items += [self._state(("context", a), item) for a, item in self.contexts.items()]
        return self.policy.prefetch(items, horizon)

    def priority_of(self, key: Hashable) -> int:
        """An image's priority now (the lowest for one the policy does not track): what orders
        demotion in the tiers below the pool."""
        item = self.images.get(key)
        return PRIORITY_MIN if item is None else self.policy.priority(self._state(key, item), self.clock)

    def origin(self, key: Hashable) -> Any:
        """An image's (namespace, check record) as last recorded; None if unknown."""
        item = self.images.get(key)
        return None if item is None else item.origin

    def priorities(self) -> dict[Hashable, int]:
        """Each tracked item's priority now (images by key, contexts as ('context', agent))."""
        now = self.clock
        out = {key: self.policy.priority(self._state(key, item), now) for key, item in self.images.items()}
        out.update({("context", a): self.policy.priority(self._state(("context", a), item), now)
                    for a, item in self.contexts.items()})
        return out


__all__ = ["CachePriorities"]
