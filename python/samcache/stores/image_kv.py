"""Image KV held once, in the pool's own blocks.

When a turn computes an image's KV, that KV already sits in the turn's pool blocks. The store
keeps it there: a *holder* sequence shares the blocks that cover the image's tokens
(``BlockPool.share_blocks``: refcount + 1, nothing copied), so the KV outlives the turn without a
second copy, and no pool eviction can take it while it is held. What is kept, and what goes
when the byte bound is reached, is the ContentIndex's decision (namespaced keys, priority, LRU);
an evicted entry frees its holder and the blocks return to the pool (or stay as prefix-cache
blocks if they are cached there too). Reuse reads the KV from those blocks
(:meth:`ImageKVStore.slots`) and writes it, re-rotated, into the new sequence.

Bytes held per image token: the image's blocks, including the text tokens sharing its first and
last block, over its tokens (``bytes_per_token``); with 16-token blocks a 1,196-token screenshot
holds 1.03x one copy of its KV.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from samcache.block_pool import BlockPool
from samcache.content_index import ContentIndex
from samcache.errors import InvariantViolation
from samcache.hashing import ContentKey
from samcache.stores.tensor_store import StoreStats


@dataclass(frozen=True)
class HeldImage:
    """One image's KV in the pool: holder sequence ``seq`` whose token ``offset`` is the image's
    first token; ``length`` tokens whose keys are rotated to positions from ``position`` on."""

    seq: int
    offset: int
    length: int
    position: int
    check: Any


class ImageKVStore:
    """``put`` keeps an image's KV from a live sequence's blocks; ``get`` finds it by content key.

    ``capacity_bytes`` bounds the blocks held (counted whole, ``block_bytes`` each, for every
    layer's K and V). ``check`` values record what an entry was made from; a lookup with another
    record is a miss, never a wrong hit.
    """

    def __init__(self, pool: BlockPool, capacity_bytes: int, block_bytes: int) -> None:
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a BlockPool, got {type(pool).__name__}")
        for name, value in (("capacity_bytes", capacity_bytes), ("block_bytes", block_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.pool = pool
        self.block_bytes = block_bytes
        self.index = ContentIndex(capacity_bytes)
        self._held: dict[int, HeldImage] = {}
        self._handles = itertools.count()
        self.stats = StoreStats()

    # ---- look-ups -------------------------------------------------------------------------------
    def get(self, key: ContentKey, check: Any = None) -> HeldImage | None:
        entry = self.index.get(key)
        held = self._held.get(entry.handle) if entry is not None else None
        if held is None or held.check != check:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return held

    def __contains__(self, key: ContentKey) -> bool:
        return key in self.index

    def slots(self, held: HeldImage, first: int, count: int) -> np.ndarray:
        """KV slot ids (int64) of the image's tokens ``[first, first + count)``."""
        if first < 0 or count < 0 or first + count > held.length:
            raise ValueError(f"tokens [{first}, {first + count}) are outside the image's {held.length}")
        bs = self.pool.block_size
        index = np.arange(held.offset + first, held.offset + first + count, dtype=np.int64)
        return self.pool.block_table(held.seq).astype(np.int64)[index // bs] * bs + index % bs

    # ---- inserts and evictions --------------------------------------------------------------------
    def put(self, key: ContentKey, seq: int, start: int, length: int, position: int, check: Any = None) -> bool:
        """Hold the KV of tokens ``[start, start + length)`` of live sequence ``seq`` (already written)
        under ``key``. False if the key is present or the image alone exceeds the capacity."""
        if key in self.index:
            return False
        bs = self.pool.block_size
        first, last = start // bs, (start + length - 1) // bs
        size = (last - first + 1) * self.block_bytes
        if size > self.index.capacity_bytes:
            self.stats.rejected += 1
            return False
        holder = self.pool.share_blocks(seq, first, last - first + 1)
        handle = next(self._handles)
        try:
            result = self.index.put(key, handle=handle, size_bytes=size)
        except BaseException:
            self.pool.free_sequence(holder)
            raise
        self._release(result.evicted)
        self._held[handle] = HeldImage(holder, start - first * bs, length, position, check)
        self.stats.inserts += 1
        return True

    def evict_for_blocks(self, blocks: int) -> None:
        """Release held images, least recently used first, until the pool can hand out ``blocks``
        blocks or nothing is held any more."""
        while self.pool.num_free_blocks() < blocks and len(self.index):
            evicted = self.index.evict_until(max(0, self.index.used_bytes - 1))
            if not evicted:  # only pinned entries are left
                return
            self._release(evicted)

    def clear(self) -> None:
        self._release(self.index.evict_until(0))

    def _release(self, evicted) -> None:
        for item in evicted:
            held = self._held.pop(item.entry.handle, None)
            if held is not None:
                self.pool.free_sequence(held.seq)
                self.stats.evictions += 1

    # ---- accounting ---------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    @property
    def held_tokens(self) -> int:
        return sum(h.length for h in self._held.values())

    def bytes_per_token(self) -> float:
        """Bytes held per cached image token (0.0 when empty)."""
        tokens = self.held_tokens
        return self.used_bytes / tokens if tokens else 0.0

    def __len__(self) -> int:
        return len(self.index)

    def check_invariants(self) -> None:
        self.index.check_invariants()
        if len(self.index) != len(self._held):
            raise InvariantViolation(f"image KV: {len(self.index)} index entries but {len(self._held)} holders")
        for held in self._held.values():
            if self.pool.num_tokens(held.seq) < held.offset + held.length:
                raise InvariantViolation(f"image KV holder {held.seq} is shorter than its image")


__all__ = ["HeldImage", "ImageKVStore"]
