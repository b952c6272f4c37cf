"""A byte-bounded store of per-image tensors (ViT outputs).

The ContentIndex decides what stays (namespaced keys, byte bound, priority + LRU eviction); this
class keeps the payloads it points at and drops them when the index evicts them. Every entry
records what it was made from (a ``check`` value such as the patch grid) and a lookup that finds a
different record is a miss, never a wrong hit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from samcache._checks import check_int
from samcache.cache.content_index import ContentIndex
from samcache.errors import InvariantViolation
from samcache.hashing import ContentKey


def tensor_bytes(payload: Any) -> int:
    """Bytes held by the tensors of a (nested) payload."""
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, dict):
        return sum(tensor_bytes(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(tensor_bytes(v) for v in payload)
    if hasattr(payload, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(payload, f)) for f in payload.__dataclass_fields__)
    return 0


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    inserts: int = 0
    evictions: int = 0
    rejected: int = 0  # payloads larger than the whole store


class TensorStore:
    """``put(key, payload, check)`` / ``get(key, check)`` over a ContentIndex of ``capacity_bytes``.

    A payload's size is its tensors' bytes unless ``put`` is told otherwise (a payload that only
    points at memory held elsewhere). ``on_evict(payload)`` runs for every payload the store lets
    go of (evicted to make room, by ``evict_until`` or by ``clear``), so an owner can release what
    the payload holds; ``spill(key, payload, check)`` likewise, for an owner that keeps it elsewhere
    (a tier below).
    """

    def __init__(self, name: str, capacity_bytes: int, *, on_evict: Callable[[Any], None] | None = None,
                 spill: Callable[[ContentKey, Any, Any], None] | None = None) -> None:
        check_int("capacity_bytes", capacity_bytes, 1)
        self.name = name
        self.index = ContentIndex(capacity_bytes)
        self._payloads: dict[int, tuple[Any, Any]] = {}
        self._handles = itertools.count()
        self._on_evict = on_evict
        self._spill = spill
        self.stats = StoreStats()

    def get(self, key: ContentKey, check: Any = None) -> Any | None:
        entry = self.index.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        payload, stored_check = self._payloads[entry.handle]
        if stored_check != check:  # same key, different making: never hand it out
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return payload

    def __contains__(self, key: ContentKey) -> bool:
        return key in self.index

    def put(self, key: ContentKey, payload: Any, check: Any = None, *, size_bytes: int | None = None) -> bool:
        """Insert (evicting least-recently-used entries). False if present or too large to keep."""
        size = max(1, tensor_bytes(payload)) if size_bytes is None else check_int("size_bytes", size_bytes, 1)
        if size > self.index.capacity_bytes:
            self.stats.rejected += 1
            return False
        handle = next(self._handles)
        result = self.index.put(key, handle=handle, size_bytes=size)
        self._release(result.evicted)
        if result.inserted:
            self._payloads[handle] = (payload, check)
            self.stats.inserts += 1
        return result.inserted

    def evict_until(self, target_bytes: int) -> int:
        """Evict least-recently-used entries until at most ``target_bytes`` are held (pinned ones
        stay); the number evicted."""
        return self._release(self.index.evict_until(target_bytes))

    def clear(self) -> None:
        self.evict_until(0)

    def payloads(self) -> Iterator[Any]:
        return (payload for payload, _ in self._payloads.values())

    def _release(self, evicted) -> int:
        count = 0
        for item in evicted:
            kept = self._payloads.pop(item.entry.handle, None)
            if kept is None:
                continue
            count += 1
            self.stats.evictions += 1
            if self._on_evict is not None:
                self._on_evict(kept[0])
            if self._spill is not None:
                self._spill(item.key, *kept)
        return count

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    def __len__(self) -> int:
        return len(self.index)

    def check_invariants(self) -> None:
        self.index.check_invariants()
        if len(self.index) != len(self._payloads):
            raise InvariantViolation(f"{self.name}: {len(self.index)} index entries but {len(self._payloads)} payloads")


__all__ = ["StoreStats", "TensorStore", "tensor_bytes"]
