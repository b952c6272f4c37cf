"""Prefix-cache blocks below the pool: when the pool evicts a cached block (an exact prefix of
some earlier prompt), its KV is copied here, in host memory, under the block's prefix hash
before the block is handed out again; a later prompt whose next block has that hash gets it back
instead of prefilling it (``samcache.engine.executor``). Exact copies only: the prefix cache
promises what a full prefill computes, so no cold encoding here. The hash chains from the
namespace (model and tenant), so another tenant's prompt never finds a block.

With a disk tier (``disk``, lossless tensor items) the blocks host memory cannot keep spill to
files instead of being dropped, and come back from there. With a shared store (``remote``, a
:class:`samcache.cache.tiers.RemoteTier`) every exact block an instance computes is also published there
(write-through, from a publisher thread: :meth:`PrefixTier.publish`), under
``samcache/{namespace}/{prefix hash}/prefix``, and a block no local tier holds is looked up there
last: a prompt prefix one instance prefilled, the others take instead of prefilling it. The hash
chains from the model and tenant, so the store never hands a block to another tenant.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from samcache._checks import check_int
from samcache.hashing import ContentKey, Namespace


class PrefixTier:
    """Evicted prefix blocks' KV (``[layers, 2, block_size, kv_heads, head_dim]`` each) by prefix
    hash, at most ``capacity_bytes``, least recently used out first: to ``disk`` (a
    :class:`samcache.cache.tiers.DiskTier`, items framed under ``namespace``) when given, else dropped."""

    #: Hashes remembered as published (so a prefix is not offered to the store every turn).
    PUBLISHED_MEMORY = 1 << 16

    def __init__(self, capacity_bytes: int, *, disk=None, remote=None, namespace: Namespace | None = None) -> None:
        self.capacity_bytes = check_int("capacity_bytes", capacity_bytes, 1)
        if (disk is not None or remote is not None) and not isinstance(namespace, Namespace):
            raise ValueError("a disk or shared store for prefix blocks needs the namespace its items are framed under")
        self.disk, self.remote, self.namespace = disk, remote, namespace
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._published: OrderedDict[bytes, None] = OrderedDict()
        self._publisher: ThreadPoolExecutor | None = None
        self._publishing: set[Future] = set()
        self.stats = {"demoted": 0, "restored": 0, "dropped": 0, "spilled": 0, "restored_from_disk": 0,
                      "published": 0, "restored_from_remote": 0}

    def put(self, block_hash: bytes, kv: torch.Tensor) -> bool:
        """Keep a block's KV (copied to the CPU); False if it alone exceeds the capacity."""
        if not isinstance(block_hash, bytes) or len(block_hash) != 16:
            raise ValueError("block_hash must be the block's 16-byte prefix hash")
        kv = kv.detach().to("cpu", copy=True)
        size = kv.numel() * kv.element_size()
        if size > self.capacity_bytes:
            return False
        spill = []
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            if old is not None:
                self._used -= old.numel() * old.element_size()
            self._blocks[block_hash] = kv
            self._used += size
            self.stats["demoted"] += 1
            while self._used > self.capacity_bytes:
                spill.append(self._blocks.popitem(last=False))
                self._used -= spill[-1][1].numel() * spill[-1][1].element_size()
        for h, out in spill:  # outside the lock: file writes
            if self.disk is not None and self.disk.put_tensors(self.namespace, ContentKey(h), [out]):
                self.stats["spilled"] += 1
            else:
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
        if self.disk is not None:
            got = self.disk.get_tensors(self.namespace, ContentKey(block_hash))
            if got is not None and len(got[0]) == 1:
                self.disk.remove(ContentKey(block_hash))  # back in the pool; it comes down again when evicted
                self.stats["restored_from_disk"] += 1
                return got[0][0]
        if self.remote is not None:  # shared: another instance may have prefilled it (it stays there)
            got = self.remote.get_tensors(self.namespace, ContentKey(block_hash), "prefix")
            if got is not None and len(got[0]) == 1:
                with self._lock:
                    self.stats["restored_from_remote"] += 1
                return got[0][0]
        return None

    def published(self, block_hash: bytes) -> bool:
        """Whether this block was offered to the shared store already (by :meth:`publish`)."""
        with self._lock:
            return block_hash in self._published

    def publish(self, blocks: list[tuple[bytes, torch.Tensor]]) -> int:
        """Put freshly computed exact blocks ((prefix hash, KV) each) into the shared store, from
        the publisher thread (the KV is copied now); blocks published before are skipped. The
        number sent."""
        if self.remote is None:
            return 0
        todo = []
        with self._lock:
            for h, kv in blocks:
                if h in self._published:
                    continue
                todo.append((h, kv.detach().to("cpu", copy=True)))
            if not todo:
                return 0
            if self._publisher is None:
                self._publisher = ThreadPoolExecutor(1, thread_name_prefix="samcache-prefix-publish")
            future = self._publisher.submit(self._publish_now, todo)
            self._publishing.add(future)
        future.add_done_callback(lambda f: self._publishing.discard(f))
        return len(todo)

    def _publish_now(self, todo: list[tuple[bytes, torch.Tensor]]) -> None:
        for h, kv in todo:  # RemoteTier's puts never raise for the store's faults
            if self.remote.put_tensors(self.namespace, ContentKey(h), "prefix", [kv]):
                with self._lock:  # only a block really in the store is never offered again
                    self.stats["published"] += 1
                    self._published[h] = None
                    if len(self._published) > self.PUBLISHED_MEMORY:
                        self._published.popitem(last=False)

    def flush(self) -> None:
        """Wait until every block sent to :meth:`publish` is in the shared store (or refused)."""
        for future in list(self._publishing):
            future.exception()

    def close(self) -> None:
        self.flush()
        if self._publisher is not None:
            self._publisher.shutdown(wait=True)
            self._publisher = None

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
