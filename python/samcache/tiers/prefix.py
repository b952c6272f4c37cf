"""Prefix-cache blocks below the pool: when the pool evicts a cached block (an exact prefix of
some earlier prompt), its KV is copied here, in host memory, under the block's prefix hash
before the block is handed out again; a later prompt whose next block has that hash gets it back
instead of prefilling it (``samcache.engine.executor``). Exact copies only: the prefix cache
promises what a full prefill computes, so no cold encoding here. The hash chains from the
namespace (model and tenant), so another tenant's prompt never finds a block.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from samcache._checks import check_int


class PrefixTier:
    """Evicted prefix blocks' KV (``[layers, 2, block_size, kv_heads, head_dim]`` each) by prefix
    hash, at most ``capacity_bytes``, least recently used out first."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = check_int("capacity_bytes", capacity_bytes, 1)
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self.stats = {"demoted": 0, "restored": 0, "dropped": 0}

    def put(self, block_hash: bytes, kv: torch.Tensor) -> bool:
        """Keep a block's KV (copied to the CPU); False if it alone exceeds the capacity."""
        if not isinstance(block_hash, bytes) or len(block_hash) != 16:
            raise ValueError("block_hash must be the block's 16-byte prefix hash")
        kv = kv.detach().to("cpu", copy=True)
        size = kv.numel() * kv.element_size()
        if size > self.capacity_bytes:
            return False
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            if old is not None:
                self._used -= old.numel() * old.element_size()
            self._blocks[block_hash] = kv
            self._used += size
            self.stats["demoted"] += 1
            while self._used > self.capacity_bytes:
                _, out = self._blocks.popitem(last=False)
                self._used -= out.numel() * out.element_size()
                self.stats["dropped"] += 1
        return True

    def take(self, block_hash: bytes) -> torch.Tensor | None:
        """A block's KV, taken out (it goes back into the pool); None if not here."""
        with self._lock:
            kv = self._blocks.pop(block_hash, None)
            if kv is not None:
                self._used -= kv.numel() * kv.element_size()
                self.stats["restored"] += 1
            return kv

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used


__all__ = ["PrefixTier"]
