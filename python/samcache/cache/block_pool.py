"""Paged KV block pool with copy-on-write reference counts and prefix caching.

The pool hands out fixed-size blocks of KV slots. Sequences own block tables; ``fork`` shares
every block (no copy), and the first append into a shared partial block returns a
``(src, dst)`` copy the caller performs (``samcache.ops.copy_blocks``). Full blocks appended
with their token ids are content-addressed (hash chained from the parent block, the token ids
and extra keys such as image content hashes), so a later sequence with the same prefix adopts
them instead of recomputing; they stay reusable after their sequence is freed until evicted
(lowest priority first, then least recently freed).

All batch inputs and outputs are int32 numpy arrays. Thread-safe (one lock per pool; the GIL
is released inside native calls).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple, Union

import numpy as np

from samcache import _C
from samcache.hashing import DIGEST_SIZE, ContentHash, ContentKey, Namespace

# An extra key: (start, end, key) over absolute token positions [start, end) of the sequence.
ExtraKey = tuple[int, int, Union[ContentHash, ContentKey, bytes]]

_INT32 = np.iinfo(np.int32)
_ZERO_ROOT = bytes(DIGEST_SIZE)


class AppendResult(NamedTuple):
    """``slots``: int32 [n] slot ids (block * block_size + offset) to write the new tokens' KV to.
    ``copies``: int32 [k, 2] (src, dst) block copies to perform *before* writing (copy-on-write)."""

    slots: np.ndarray
    copies: np.ndarray


def slot_ids(block_table: np.ndarray, positions: Any, block_size: int) -> np.ndarray:
    """Slot ids (int64: block * block_size + offset) of token ``positions`` of a sequence whose
    block table is ``block_table``."""
    positions = np.asarray(positions, dtype=np.int64)
    return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


def as_int32_array(values: Any, name: str) -> np.ndarray:
    """A 1-D C-contiguous int32 array from a list, numpy array or CPU tensor of integers."""
    try:
        import torch

        if isinstance(values, torch.Tensor):
            if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
                raise TypeError(f"{name} must hold integers, got a {values.dtype} tensor")
            values = values.detach().cpu().numpy()
    except ImportError:  # pragma: no cover - torch is always there
        pass
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype != np.int32:
        if arr.min() < _INT32.min or arr.max() > _INT32.max:
            raise ValueError(f"{name} has values outside int32")
        arr = arr.astype(np.int32)
    return np.ascontiguousarray(arr)


def _key_bytes(key: Any) -> bytes:
    if isinstance(key, (ContentHash, ContentKey)):
        return key.digest
    if isinstance(key, bytes) and len(key) == DIGEST_SIZE:
        return key
    raise TypeError(f"an extra key must be a ContentHash, ContentKey or 16 bytes, got {type(key).__name__}")


def _spans(extra_keys: Iterable[ExtraKey] | None) -> tuple[np.ndarray, bytes]:
    if not extra_keys:
        return np.zeros((0, 2), dtype=np.int64), b""
    bounds, keys = [], []
    for item in extra_keys:
        try:
            start, end, key = item
        except (TypeError, ValueError):
            raise TypeError(f"an extra key is (start, end, key), got {item!r:.60}") from None
        if not all(isinstance(x, (int, np.integer)) for x in (start, end)):
            raise TypeError(f"extra key bounds must be ints, got ({start!r}, {end!r})")
        if not 0 <= start < end:
            raise ValueError(f"extra key span [{start}, {end}) needs 0 <= start < end")
        bounds.append((int(start), int(end)))
        keys.append(_key_bytes(key))
    return np.asarray(bounds, dtype=np.int64), b"".join(keys)


def _root(namespace: Namespace | None) -> bytes:
    if namespace is None:
        return _ZERO_ROOT
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a samcache.Namespace, got {type(namespace).__name__}")
    return namespace.digest


def _check_int(value: Any, name: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class BlockPool:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` token slots each.

    >>> pool = BlockPool(num_blocks=64, block_size=16)
    >>> seq = pool.new_sequence()
    >>> slots, copies = pool.append_tokens(seq, tokens)   # write KV to `slots`
    >>> child = pool.fork(seq)                             # shares all blocks
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self._pool = _C.BlockPool(_check_int(num_blocks, "num_blocks", 1), _check_int(block_size, "block_size", 1))

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def block_size(self) -> int:
        return self._pool.block_size

    # ---- sequences ----------------------------------------------------------------------------
    def new_sequence(self, namespace: Namespace | None = None) -> int:
        """A new empty sequence. Its cached blocks are only ever matched within ``namespace``."""
        return self._pool.new_sequence(_root(namespace))

    def fork(self, seq: int) -> int:
        """A new sequence sharing all of ``seq``'s blocks (refcount + 1 each, nothing copied)."""
        return self._pool.fork(_check_int(seq, "seq"))

    def share_blocks(self, seq: int, first: int, count: int) -> int:
        """A new sequence holding blocks ``[first, first + count)`` of ``seq``'s table (refcount + 1
        each, nothing copied): keeps part of a sequence's KV alive after ``seq`` is freed, e.g. one
        image's span. It counts ``count * block_size`` tokens and is not cacheable."""
        return self._pool.share_blocks(_check_int(seq, "seq"), _check_int(first, "first", 0),
                                       _check_int(count, "count", 1))

    def free_sequence(self, seq: int) -> None:
        """Drop ``seq``'s references. Raises NotFound if it is unknown or already freed."""
        self._pool.free_sequence(_check_int(seq, "seq"))

    # ---- appends ------------------------------------------------------------------------------
    def append_slots(self, seq: int, n: int) -> AppendResult:
        """Reserve ``n`` slots whose token contents the pool is not told (not prefix-cached)."""
        return AppendResult(*self._pool.append_slots(_check_int(seq, "seq"), _check_int(n, "n", 0)))

    def append_tokens(self, seq: int, tokens: Any, extra_keys: Iterable[ExtraKey] | None = None) -> AppendResult:
        """Reserve slots for ``tokens`` and register each block they fill in the prefix cache.

        ``extra_keys``: ``(start, end, key)`` spans at absolute positions whose content the token
        ids do not show, e.g. an image's ContentHash over its placeholder tokens.
        """
        bounds, keys = _spans(extra_keys)
        return AppendResult(
            *self._pool.append_tokens(_check_int(seq, "seq"), as_int32_array(tokens, "tokens"), bounds, keys)
        )

    # ---- prefix reuse -------------------------------------------------------------------------
    def match_prefix(
        self, tokens: Any, extra_keys: Iterable[ExtraKey] | None = None, namespace: Namespace | None = None
    ) -> np.ndarray:
        """The cached blocks holding the longest full-block prefix of ``tokens`` (int32 array).
        Read-only; use ``adopt_prefix`` to take them without a race."""
        bounds, keys = _spans(extra_keys)
        return self._pool.match_prefix(_root(namespace), as_int32_array(tokens, "tokens"), bounds, keys)

    def adopt_prefix(self, seq: int, tokens: Any, extra_keys: Iterable[ExtraKey] | None = None) -> int:
        """Match and adopt the cached prefix of ``tokens`` into the empty sequence ``seq``,
        atomically. Returns how many tokens were adopted (a multiple of block_size); append the
        rest with ``append_tokens(seq, tokens[n:], extra_keys)``."""
        bounds, keys = _spans(extra_keys)
        return self._pool.adopt_prefix(_check_int(seq, "seq"), as_int32_array(tokens, "tokens"), bounds, keys)

    # ---- queries ------------------------------------------------------------------------------
    def block_table(self, seq: int) -> np.ndarray:
        return self._pool.block_table(_check_int(seq, "seq"))

    def num_tokens(self, seq: int) -> int:
        return self._pool.num_tokens(_check_int(seq, "seq"))

    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free blocks plus evictable cached ones."""
        return self._pool.num_free_blocks()

    def refcount(self, block: int) -> int:
        return self._pool.refcount(_check_int(block, "block"))

    def block_hash(self, block: int) -> bytes | None:
        """The 16-byte prefix hash of a full, hashed block, else None."""
        return self._pool.block_hash(_check_int(block, "block"))

    def block_hashes(self, blocks: Any) -> tuple[np.ndarray, np.ndarray]:
        """The prefix hashes of many blocks at once: uint8 [n, 16] (zeros where a block has none)
        and bool [n], which blocks have one."""
        hashes, mask = self._pool.block_hashes(as_int32_array(blocks, "blocks"))
        n = len(mask)
        return (np.frombuffer(hashes, dtype=np.uint8).reshape(n, DIGEST_SIZE).copy(),
                np.frombuffer(mask, dtype=np.uint8).astype(bool))

    # ---- eviction -----------------------------------------------------------------------------
    def set_block_priority(self, blocks: Any, priority: int) -> None:
        """Eviction priority of these blocks: higher is kept longer (LRU among equals)."""
        self._pool.set_block_priority(as_int32_array(blocks, "blocks"), _check_priority(priority))

    def set_sequence_priority(self, seq: int, priority: int) -> None:
        """Priority of all of ``seq``'s blocks and of the blocks it allocates from now on."""
        self._pool.set_sequence_priority(_check_int(seq, "seq"), _check_priority(priority))

    def evict(self, n: int) -> int:
        """Evict up to ``n`` unreferenced cached blocks now; returns how many were evicted."""
        return self._pool.evict(_check_int(n, "n", 0))

    def evict_reporting(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``evict(n)``, returning the evicted blocks (int32 [k]) and the prefix hashes they held
        (uint8 [k, 16]): their KV stays in the cache until the blocks are handed out again."""
        ids, hashes = self._pool.evict_reporting(_check_int(n, "n", 0))
        return ids, np.frombuffer(hashes, dtype=np.uint8).reshape(-1, DIGEST_SIZE).copy()

    def prefix_hashes(self, tokens: Any, extra_keys: Iterable[ExtraKey] | None = None,
                      namespace: Namespace | None = None) -> np.ndarray:
        """The prefix hash of every full block of ``tokens`` (uint8 [n // block_size, 16]), as the
        pool would register them; no lookup."""
        bounds, keys = _spans(extra_keys)
        raw = self._pool.prefix_hashes(_root(namespace), as_int32_array(tokens, "tokens"), bounds, keys)
        return np.frombuffer(raw, dtype=np.uint8).reshape(-1, DIGEST_SIZE).copy()

    def stats(self) -> dict[str, int]:
        return self._pool.stats()

    def check_invariants(self) -> None:
        """Raise InvariantViolation if refcounts, free lists, cache and tables disagree."""
        self._pool.check_invariants()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"BlockPool(num_blocks={s['num_blocks']}, block_size={s['block_size']}, "
            f"free={s['free_blocks']}, evictable={s['evictable_blocks']}, sequences={s['live_sequences']})"
        )


def _check_priority(priority: Any) -> int:
    p = _check_int(priority, "priority")
    if not _INT32.min <= p <= _INT32.max:
        raise ValueError(f"priority must fit in int32, got {p}")
    return p


__all__ = ["AppendResult", "BlockPool", "ExtraKey", "as_int32_array"]
