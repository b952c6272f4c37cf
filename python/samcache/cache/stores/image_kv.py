"""Image KV held once, in the pool's own blocks.

When a turn computes an image's KV, that KV already sits in the turn's pool blocks. The store
keeps it there: a *holder* sequence shares the blocks that cover the image's tokens
(``BlockPool.share_blocks``: refcount + 1, nothing copied), so the KV outlives the turn without a
second copy, and no pool eviction can take it while it is held. What is kept, and what goes
when the byte bound is reached, is the ContentIndex's decision (namespaced keys, priority, LRU);
an evicted entry frees its holder and the blocks return to the pool (or stay as prefix-cache
blocks if they are cached there too). Reuse reads the KV from those blocks
(:meth:`ImageKVStore.slots`) and writes it, re-rotated, into the new sequence.

With lower tiers (:class:`samcache.cache.tiers.LowerTiers`), an entry the store lets go is first copied
out of its blocks and demoted (host memory, then disk) instead of lost; a turn that finds it
there loads it straight into its own sequence, layer by layer (``samcache.engine.tier_io.TierLoad``),
and the store holds it again from that sequence's blocks after the turn. A turn pins the images it reuses (:meth:`pin`) so making
room for its own blocks can never evict them between lookup and splice.

Bytes held per image token: the image's blocks, including the text tokens sharing its first and
last block, over its tokens (``bytes_per_token``); with 16-token blocks a 1,196-token screenshot
holds 1.03x one copy of its KV.

A compressed image (visual-token compression) holds different tokens at different layers: every
token before the first stage, fewer after each. It is kept *packed* (:meth:`put_packed`): its
rows of all layers, one after another, copied into as few blocks of its own as they fill, any
layer's storage of a block taking any layer's row (a block holds ``num_layers x block_size`` rows).
At 25% of the tokens kept from early layers on, that is about a third of the blocks of the whole
image. Packed records are not demoted to the tiers below (they are dropped, and recomputed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from samcache._checks import check_int
from samcache.cache.block_pool import BlockPool, slot_ids
from samcache.errors import CacheFull, InvariantViolation
from samcache.hashing import ContentKey, Namespace
from samcache.cache.stores.tensor_store import TensorStore


@dataclass(frozen=True)
class HeldImage:
    """One image's KV in the pool: holder sequence ``seq`` whose token ``offset`` is the image's
    first token; ``length`` tokens whose keys are rotated to positions from ``position`` on."""

    seq: int
    offset: int
    length: int
    position: int
    key: ContentKey | None = None  # what demotion needs: where it belongs and what it was made from
    namespace: Namespace | None = None
    check: Any = None
    kept: tuple[np.ndarray, ...] | None = None  # packed (compressed): per layer, the image's tokens it holds
    merges: tuple = ()  # packed: its stages' merges (layer, token offsets, target offsets, weights)
    index: int | None = None  # the image's index among its prompt's images when computed (None: alone, or unknown)
    exact: bool = False  # a full prefill's KV at any position (isolated image attention, computed here, lossless)
    hidden: Any = None  # isolated in the lower layers only: the image tokens' input to the first layer in context

    @property
    def packed(self) -> bool:
        return self.kept is not None

    def layer_rows(self, num_layers: int) -> int:
        """(token, layer) rows of KV this record holds: ``length * num_layers`` unless packed."""
        return self.length * num_layers if self.kept is None else sum(int(k.size) for k in self.kept)


class ImageKVStore:
    """``put`` keeps an image's KV from a live sequence's blocks; ``get`` finds it by content key.

    ``capacity_bytes`` bounds the blocks held (counted whole, ``block_bytes`` each, for every
    layer's K and V). ``check`` values record what an entry was made from; a lookup with another
    record is a miss, never a wrong hit. The entries are a :class:`TensorStore` of
    :class:`HeldImage` sized by their blocks; evicting one frees its holder.
    """

    def __init__(self, pool: BlockPool, capacity_bytes: int, block_bytes: int, *, lower=None,
                 read_kv: Callable[[np.ndarray], Any] | None = None) -> None:
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a BlockPool, got {type(pool).__name__}")
        if lower is not None and read_kv is None:
            raise ValueError("lower tiers need read_kv (how KV leaves the pool's blocks)")
        self.pool = pool
        self.block_bytes = check_int("block_bytes", block_bytes, 1)
        self.lower = lower
        self._read_kv = read_kv
        self.entries = TensorStore("image KV", capacity_bytes, on_evict=self._let_go)

    # ---- look-ups -------------------------------------------------------------------------------
    def get(self, key: ContentKey, check: Any = None) -> HeldImage | None:
        return self.entries.get(key, check)

    def __contains__(self, key: ContentKey) -> bool:
        return key in self.entries

    def packed_rows(self, held: HeldImage, layer: int) -> np.ndarray:
        """Flat row ids (in the ``[layers * blocks * block_size]`` view of the caches) of a packed
        image's rows of ``layer``, in the order of ``held.kept[layer]``."""
        if not isinstance(held, HeldImage) or not held.packed:
            raise TypeError("packed_rows needs a packed HeldImage (from get)")
        start = sum(int(k.size) for k in held.kept[:layer])
        return self._packed_flat(self.pool.block_table(held.seq), len(held.kept),
                                 np.arange(start, start + held.kept[layer].size))

    def _packed_flat(self, table: np.ndarray, num_layers: int, rows: np.ndarray) -> np.ndarray:
        """Where packed row ``rows[i]`` lives: block ``rows // (layers * bs)`` of ``table``, in the
        storage of layer ``(rows // bs) % layers`` of that block, slot ``rows % bs``."""
        bs = self.pool.block_size
        per_block = num_layers * bs
        block = table[rows // per_block].astype(np.int64)
        part = (rows % per_block) // bs
        return part * (self.pool.num_blocks * bs) + block * bs + rows % bs

    def slots(self, held: HeldImage, first: int, count: int) -> np.ndarray:
        """KV slot ids (int64) of the image's tokens ``[first, first + count)``."""
        if not isinstance(held, HeldImage):
            raise TypeError(f"held must be a HeldImage (from get), got {type(held).__name__}")
        if held.packed:
            raise ValueError("a packed (compressed) image has no per-token slots: read it with packed_rows")
        check_int("first", first, 0)
        check_int("count", count, 0)
        if first + count > held.length:
            raise ValueError(f"tokens [{first}, {first + count}) are outside the image's {held.length}")
        index = np.arange(held.offset + first, held.offset + first + count)
        return slot_ids(self.pool.block_table(held.seq), index, self.pool.block_size)

    # ---- inserts and evictions --------------------------------------------------------------------
    def put(self, key: ContentKey, seq: int, start: int, length: int, position: int, check: Any = None,
            namespace: Namespace | None = None, index: int | None = None, exact: bool = False,
            hidden: Any = None) -> bool:
        """Hold the KV of tokens ``[start, start + length)`` of live sequence ``seq`` (already written)
        under ``key``, computed as image ``index`` of its prompt (None: alone); ``exact``: it is a
        full prefill's KV wherever it is re-rotated to (:attr:`HeldImage.exact`); ``hidden``: the
        tokens' input to the first layer they attend in context (:attr:`HeldImage.hidden`). False if
        the key is present or the image alone exceeds the capacity."""
        if index is not None:
            check_int("index", index, 0)
        check_int("start", start, 0)
        check_int("length", length, 1)
        check_int("position", position, 0)
        if key in self.entries:
            return False
        bs = self.pool.block_size
        first, last = start // bs, (start + length - 1) // bs
        size = (last - first + 1) * self.block_bytes
        if size > self.entries.index.capacity_bytes:
            self.entries.stats.rejected += 1
            return False
        holder = self.pool.share_blocks(seq, first, last - first + 1)
        if hidden is not None:
            size += hidden.numel() * hidden.element_size()
        return self._keep(HeldImage(holder, start - first * bs, length, position, key, namespace, check, index=index,
                                    exact=bool(exact), hidden=hidden), size)

    def put_packed(self, key: ContentKey, kept: tuple[np.ndarray, ...], source_rows: np.ndarray, length: int,
                   position: int, copy_rows: Callable[[np.ndarray, np.ndarray], None], check: Any = None,
                   namespace: Namespace | None = None, merges: tuple = (), index: int | None = None) -> bool:
        """Hold a compressed image: ``kept[l]`` (ascending token offsets within the image) are the
        tokens layer ``l`` holds, ``source_rows`` their flat rows in the caches now (layer by layer,
        in that order); ``copy_rows(src, dst)`` copies flat rows; ``merges``: the stages' merges, for
        recompute. False if the key is present, the record exceeds the capacity or the pool has no
        free blocks for it."""
        check_int("length", length, 1)
        check_int("position", position, 0)
        total = sum(int(k.size) for k in kept)
        if source_rows.shape != (total,):
            raise ValueError(f"source_rows must hold the {total} kept rows, got {source_rows.shape}")
        if key in self.entries:
            return False
        blocks = self.packed_blocks(kept)
        size = blocks * self.block_bytes
        if size <= self.entries.index.capacity_bytes and blocks > self.pool.num_free_blocks():
            self.evict_for_blocks(blocks)  # older images give way, as for a prompt's blocks
        if size > self.entries.index.capacity_bytes or blocks > self.pool.num_free_blocks():
            self.entries.stats.rejected += 1
            return False
        holder = self.pool.new_sequence()
        try:
            self.pool.append_slots(holder, blocks * self.pool.block_size)
            copy_rows(source_rows, self._packed_flat(self.pool.block_table(holder), len(kept), np.arange(total)))
        except BaseException:
            self.pool.free_sequence(holder)
            raise
        return self._keep(HeldImage(holder, 0, length, position, key, namespace, check, tuple(kept), tuple(merges), index),
                          size)

    def packed_blocks(self, kept: tuple[np.ndarray, ...]) -> int:
        """Blocks a packed record of these per-layer kept tokens takes."""
        return -(-sum(int(k.size) for k in kept) // (len(kept) * self.pool.block_size))

    def _keep(self, held: HeldImage, size: int) -> bool:
        """Insert ``held`` (whose holder sequence is live) as an entry of ``size`` bytes; its holder
        is freed unless it was inserted."""
        try:
            inserted = self.entries.put(held.key, held, held.check, size_bytes=size)
        except CacheFull:  # the images a turn pinned fill the store
            inserted = False
        except BaseException:
            self.pool.free_sequence(held.seq)
            raise
        if not inserted:
            self.pool.free_sequence(held.seq)
        return inserted

    def pin(self, key: ContentKey) -> bool:
        """Keep this entry from eviction until :meth:`unpin` (a turn between lookup and splice);
        False if it is not held."""
        if key not in self.entries:
            return False
        self.entries.index.pin(key)
        return True

    def unpin(self, key: ContentKey) -> None:
        if key in self.entries:
            self.entries.index.unpin(key)

    def _let_go(self, held: HeldImage) -> None:
        """An entry leaves the store: demote its KV one tier down (if there is one), free its holder."""
        try:
            if self.lower is not None and held.key is not None and held.namespace is not None and not held.packed:
                kv = self._read_kv(self.slots(held, 0, held.length))
                self.lower.demote(held.namespace, held.key, kv, held.position, held.check)
        finally:
            self.pool.free_sequence(held.seq)

    def evict_for_blocks(self, blocks: int) -> None:
        """Release held images, least recently used first, until the pool can hand out ``blocks``
        blocks or nothing is held any more."""
        while self.pool.num_free_blocks() < blocks and len(self.entries):
            if not self.entries.evict_until(max(0, self.entries.used_bytes - 1)):
                return  # only pinned entries are left

    def clear(self) -> None:
        self.entries.clear()

    # ---- accounting ---------------------------------------------------------------------------------
    @property
    def stats(self):
        return self.entries.stats

    @property
    def used_bytes(self) -> int:
        return self.entries.used_bytes

    @property
    def held_tokens(self) -> int:
        return sum(h.length for h in self.entries.payloads())

    def bytes_per_token(self) -> float:
        """Bytes held per cached image token (0.0 when empty)."""
        tokens = self.held_tokens
        return self.used_bytes / tokens if tokens else 0.0

    def __len__(self) -> int:
        return len(self.entries)

    def check_invariants(self) -> None:
        self.entries.check_invariants()
        for held in self.entries.payloads():
            if held.packed:
                need = sum(int(k.size) for k in held.kept)
                if self.pool.num_tokens(held.seq) * len(held.kept) < need:
                    raise InvariantViolation(f"packed image KV holder {held.seq} is smaller than its rows")
                continue
            if self.pool.num_tokens(held.seq) < held.offset + held.length:
                raise InvariantViolation(f"image KV holder {held.seq} is shorter than its image")


__all__ = ["HeldImage", "ImageKVStore"]
