"""Content-addressed index: namespaced 128-bit content keys -> payload entries, byte-bounded.

An entry records where a cached payload lives (``handle``: the owner's id for it, e.g. a slot
in a tensor store), its size, tier, pin count, last use and eviction priority. Inserting past
``capacity_bytes`` evicts unpinned entries (lowest priority first, then least recently used)
and returns them, so the owner frees their payloads. Pinned entries are never evicted.

Only ``ContentKey`` objects (from ``Namespace.key``) are accepted as keys, so every entry is
scoped to a model id and tenant. Thread-safe (one lock; the GIL is released in native calls).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from samcache import _C
from samcache.hashing import ContentKey

Tier = _C.Tier  # DEVICE, HOST, DISK
ContentEntry = _C.ContentEntry  # handle, size_bytes, tier, pins, last_use, priority


class Evicted(NamedTuple):
    key: ContentKey
    entry: ContentEntry


class PutResult(NamedTuple):
    """``inserted`` is False when the key was already present (nothing changed).
    ``evicted``: entries removed to make room, whose payloads the caller must free."""

    inserted: bool
    evicted: list[Evicted]


def _key(key: Any) -> bytes:
    if not isinstance(key, ContentKey):
        raise TypeError(
            f"ContentIndex keys must be ContentKey (from Namespace.key(...)), got {type(key).__name__}: "
            "a bare content hash would let models or tenants share entries"
        )
    return key.digest


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


_I64 = (0, 2**63 - 1)
_I32 = (-(2**31), 2**31 - 1)


def _evicted(raw: list) -> list[Evicted]:
    return [Evicted(ContentKey(k), e) for k, e in raw]


class ContentIndex:
    """Byte-bounded content index (see the module docstring)."""

    def __init__(self, capacity_bytes: int) -> None:
        self._index = _C.ContentIndex(_int(capacity_bytes, "capacity_bytes", *_I64))

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._index.stats()["used_bytes"]

    def __len__(self) -> int:
        return self._index.stats()["entries"]

    def __contains__(self, key: ContentKey) -> bool:
        return self._index.peek(_key(key)) is not None

    def get(self, key: ContentKey) -> ContentEntry | None:
        """The entry for ``key`` (refreshing its recency), or None."""
        return self._index.get(_key(key))

    def peek(self, key: ContentKey) -> ContentEntry | None:
        """The entry for ``key`` without touching recency or statistics."""
        return self._index.peek(_key(key))

    def get_many(self, keys: Sequence[ContentKey]) -> np.ndarray:
        """Handles of ``keys`` as an int64 array, -1 where missing (one native call)."""
        return self._index.get_many(b"".join(_key(k) for k in keys))

    def put(
        self, key: ContentKey, handle: int, size_bytes: int, *, tier: Tier = Tier.DEVICE, priority: int = 0
    ) -> PutResult:
        """Insert ``key`` if absent, evicting unpinned entries to make room.
        Raises CacheFull (changing nothing) if pinned entries leave too little room."""
        if not isinstance(tier, Tier):
            raise TypeError(f"tier must be a samcache.Tier, got {type(tier).__name__}")
        inserted, evicted = self._index.put(
            _key(key),
            _int(handle, "handle", *_I64),
            _int(size_bytes, "size_bytes", 1, _I64[1]),
            tier,
            _int(priority, "priority", *_I32),
        )
        return PutResult(inserted, _evicted(evicted))

    def remove(self, key: ContentKey) -> ContentEntry:
        """Remove an unpinned entry and return it. NotFound if absent, ValueError if pinned."""
        return self._index.remove(_key(key))

    def pin(self, key: ContentKey) -> None:
        """Protect ``key`` from eviction (counted: each pin needs an unpin)."""
        self._index.pin(_key(key))

    def unpin(self, key: ContentKey) -> None:
        self._index.unpin(_key(key))

    @contextmanager
    def pinned(self, key: ContentKey) -> Iterator[ContentEntry]:
        """``with index.pinned(key) as entry:`` keeps the entry alive while it is used."""
        self.pin(key)
        try:
            yield self._index.peek(_key(key))
        finally:
            self.unpin(key)

    def set_priority(self, key: ContentKey, priority: int) -> None:
        """Eviction priority: higher is kept longer; LRU among equal priorities."""
        self._index.set_priority(_key(key), _int(priority, "priority", *_I32))

    def set_tier(self, key: ContentKey, tier: Tier) -> None:
        if not isinstance(tier, Tier):
            raise TypeError(f"tier must be a samcache.Tier, got {type(tier).__name__}")
        self._index.set_tier(_key(key), tier)

    def evict_until(self, target_bytes: int) -> list[Evicted]:
        """Evict unpinned entries in eviction order until used bytes <= target_bytes."""
        return _evicted(self._index.evict_until(_int(target_bytes, "target_bytes", *_I64)))

    def stats(self) -> dict[str, int]:
        return self._index.stats()

    def check_invariants(self) -> None:
        self._index.check_invariants()

    def __repr__(self) -> str:
        s = self.stats()
        return f"ContentIndex(entries={s['entries']}, used={s['used_bytes']}/{s['capacity_bytes']} bytes)"
