"""The tiers below the device pool for image KV: host memory, local disk, a shared store.

When the device store lets an image's KV go (its byte bound, or a prompt that needs the blocks),
the KV is copied out of the pool and *demoted* here instead of being lost: into host memory as it
is (pinned on CUDA, so the copy back is a plain DMA), and from there, when the host tier is over
its bound, down to the disk tier in the cold encoding (FP8/INT8 + zstd). A lookup that misses the
device store asks :meth:`LowerTiers.fetch`: a host hit is exact; a disk hit is the quantized KV.
The item then goes back up into pool blocks (the caller *promotes* it) and leaves the host tier.
With a shared store (:class:`samcache.cache.tiers.remote.RemoteTier`), what an instance computes is
also *published* there at once (:meth:`LowerTiers.publish`), so other instances find it after
host and disk: what one computed, the others reuse.

Every item carries its metadata (the position its keys are rotated to, and the ``check`` record of
what it was made from: grid, token count, model depth); a fetch whose record differs is a miss,
never a wrong hit. Order within a tier is least recently used on a logical counter.

*Prefetch* (:meth:`LowerTiers.prefetch`) moves items up before they are asked for: a worker
thread reads them from disk or the shared store, decodes them and puts them in the host tier,
while the engine computes other turns. A fetch of an item still on its way waits for that one
item only. ``stats`` says how long the worker spent loading (``prefetch_seconds``: load time taken
off the turns' critical path) and how long turns still waited for it (``prefetch_wait_seconds``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from samcache._checks import check_int
from samcache.hashing import ContentKey, Namespace
from samcache.cache.tiers.disk import DiskTier
from samcache.cache.tiers.remote import RemoteTier


def _normal(check: Any) -> Any:
    """``check`` as it reads back from JSON (tuples become lists), so records compare equal
    whichever tier they come from."""
    return json.loads(json.dumps(check))


@dataclass(frozen=True)
class Fetched:
    """``kv``: [layers, 2, tokens, kv_heads, head_dim] on the CPU; ``position``: the first M-RoPE
    position its keys are rotated to; ``tier``: 'host', 'disk' or 'remote'."""

    kv: torch.Tensor
    position: int
    tier: str


@dataclass
class _HostItem:
    namespace: Namespace
    kv: torch.Tensor
    meta: dict


class LowerTiers:
    """Host memory (``host_bytes``, 0 for none) over an optional :class:`DiskTier` and an
    optional shared :class:`RemoteTier`."""

    #: Keys kept protected for prefetch plans at most (plans never fetched are then forgotten).
    WANTED_LIMIT = 4096

    def __init__(self, host_bytes: int, disk: DiskTier | None = None, remote: RemoteTier | None = None, *,
                 pin_memory: bool = False) -> None:
        self.host_bytes = check_int("host_bytes", host_bytes, 0)
        if disk is not None and not isinstance(disk, DiskTier):
            raise TypeError(f"disk must be a DiskTier, got {type(disk).__name__}")
        if remote is not None and not isinstance(remote, RemoteTier):
            raise TypeError(f"remote must be a RemoteTier, got {type(remote).__name__}")
        if not self.host_bytes and disk is None and remote is None:
            raise ValueError("LowerTiers needs a host tier (host_bytes > 0), a disk tier or a remote tier")
        self.disk = disk
        self.remote = remote
        self.pin_memory = bool(pin_memory)
        self._host: OrderedDict[ContentKey, _HostItem] = OrderedDict()
        self._host_used = 0
        self._lock = threading.Lock()
        self._inflight: dict[ContentKey, Future] = {}
        self._wanted: set[ContentKey] = set()  # keys the last prefetch asked for: not spilled to make room
        self._absent: set[ContentKey] = set()  # lifts of the current plan that found nothing below
        # Which host item spills to disk first: the lowest priority (then least recently used)
        # when the engine's eviction policy sets this (CachePriorities.priority_of), else LRU.
        self.priority_of: Callable[[ContentKey], int] | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._publisher: ThreadPoolExecutor | None = None  # shared-store writes, off the serving thread
        self._publishing: set[Future] = set()
        self.stats = {"demoted": 0, "host_hits": 0, "disk_hits": 0, "remote_hits": 0, "misses": 0, "to_disk": 0,
                      "dropped": 0, "published": 0, "prefetched": 0, "prefetch_seconds": 0.0,
                      "prefetch_wait_seconds": 0.0}

    def demote(self, namespace: Namespace, key: ContentKey, kv: torch.Tensor, position: int, check: Any) -> None:
        """Keep ``kv`` (copied to the CPU) one tier down; what overflows the host tier goes to disk."""
        if not isinstance(key, ContentKey):
            raise TypeError(f"key must be a ContentKey, got {type(key).__name__}")
        meta = {"position": int(position), "check": _normal(check)}
        kv = kv.detach().to("cpu", copy=True)
        with self._lock:
            self.stats["demoted"] += 1
            self._absent.discard(key)  # it is below now
        self._to_host(namespace, key, kv, meta, spill_self=True)

    def _to_host(self, namespace: Namespace, key: ContentKey, kv: torch.Tensor, meta: dict, *,
                 spill_self: bool) -> bool:
        """Put an item in the host tier, spilling others to disk (lowest priority first, then least
        recently used); an item bigger than the host tier goes straight down if ``spill_self`` (a
        demotion), else nowhere (a prefetch: it is on disk already, and its worker thread leaves
        the policy alone: plain LRU). True if the host tier now holds it."""
        if self.pin_memory:
            kv = kv.pin_memory()
        size = kv.numel() * kv.element_size()
        spill: list[tuple[ContentKey, _HostItem]] = []
        held = size <= self.host_bytes
        with self._lock:
            if held and not spill_self:  # a lift only the protected items could make room for: not kept, nothing moved
                kept = sum(i.kv.numel() * i.kv.element_size() for k, i in self._host.items()
                           if k in self._wanted and k != key)
                if size > self.host_bytes - kept:
                    return False
            if not held:
                if spill_self:
                    spill.append((key, _HostItem(namespace, kv, meta)))  # too big for host memory: straight down
            else:
                old = self._host.pop(key, None)
                if old is not None:
                    self._host_used -= old.kv.numel() * old.kv.element_size()
                self._host[key] = _HostItem(namespace, kv, meta)
                self._host_used += size
                rank = self.priority_of if spill_self else None
                while self._host_used > self.host_bytes:
                    # Items a prefetched turn is about to take stay (else it would read them back from
                    # disk); a lift that only they could make room for is not kept.
                    free = [k for k in self._host if k not in self._wanted and (spill_self or k != key)]
                    if not free and not spill_self:
                        free = [key]
                    elif not free:
                        free = list(self._host)
                    if rank is None:
                        k = free[0]  # least recently used first
                    else:  # the order of _host is least recently used first: ties go by it
                        k = min(enumerate(free), key=lambda ik: (rank(ik[1]), ik[0]))[1]
                    item = self._host.pop(k)
                    self._host_used -= item.kv.numel() * item.kv.element_size()
                    if k != key or spill_self:
                        spill.append((k, item))  # a lift that does not fit is simply not kept: it is on disk
                held = key in self._host
        for k, item in spill:  # disk writes outside the lock
            written = self.disk is not None and self.disk.put(item.namespace, k, item.kv, item.meta)
            with self._lock:
                self.stats["to_disk" if written else "dropped"] += 1
        return held

    def prefetch(self, items: Iterable[tuple[Namespace, ContentKey, Any]]) -> list[Future]:
        """Bring ``items`` ((namespace, key, check) each) up into the host tier in a worker thread,
        in the given order (soonest needed first); items already in host memory or on their way are
        skipped. Until fetched, the items asked for (those in host memory already too) are not
        spilled to make room for other lifts or demotions, while others can go. A future's result:
        True (in host memory now), False (found below, not kept: no room) or None (no lower tier
        has it: a fetch waiting for it is a miss at once)."""
        futures = []
        items = list(items)
        if not items:
            return futures
        with self._lock:
            self._absent.clear()  # a new plan: what the last one found missing may be there now
            if len(self._wanted) > self.WANTED_LIMIT:  # plans that were never fetched: forget them
                self._wanted.clear()
            self._wanted |= {key for _, key, _ in items}  # kept in host memory until fetched
        for namespace, key, check in items:
            with self._lock:
                if key in self._host or key in self._inflight:
                    continue
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="samcache-prefetch")
                future = self._worker.submit(self._lift, namespace, key, _normal(check))
                self._inflight[key] = future
            futures.append(future)
        return futures

    def _lift(self, namespace: Namespace, key: ContentKey, want: Any) -> bool | None:
        """True: in host memory now; False: found below but not kept; None: no lower tier has it
        (a fetch waiting for this lift then knows it is a miss without asking again)."""
        start = time.perf_counter()
        try:
            got = self._lower_get(namespace, key, want)
            if got is None:
                with self._lock:  # the fetch for it may come after this lift is done
                    self._absent.add(key)
                return None
            ok = self._to_host(namespace, key, got[0], got[1], spill_self=False)
            with self._lock:
                self.stats["prefetched"] += int(ok)
            return ok
        finally:
            with self._lock:
                self._inflight.pop(key, None)
                self.stats["prefetch_seconds"] += time.perf_counter() - start

    def _lower_get(self, namespace: Namespace, key: ContentKey, want: Any) -> tuple[torch.Tensor, dict, str] | None:
        """The item from disk, else from the shared store, if its record is ``want``."""
        for tier, store in (("disk", self.disk), ("remote", self.remote)):
            if store is None:
                continue
            got = store.get(namespace, key)
            if got is not None and got.meta.get("check") == want and isinstance(got.meta.get("position"), int):
                return got.kv, got.meta, tier
        return None

    def close(self) -> None:
        """Finish the pending publishes, stop the publisher and the prefetch worker (which
        finishes the item it is loading)."""
        self.flush()
        with self._lock:
            worker, self._worker = self._worker, None
            publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.shutdown(wait=True)
        if worker is not None:
            worker.shutdown(wait=True, cancel_futures=True)

    def publish(self, namespace: Namespace, key: ContentKey, kv: torch.Tensor, position: int, check: Any, *,
                wait: bool = False) -> bool:
        """Put a freshly computed item into the shared store (a no-op without one, or if it is
        there already). The KV is copied now; encoding and the store's put run in a publisher
        thread, so the turn decodes meanwhile (:meth:`flush` waits for them). ``wait``: return the
        put's result. False without a shared store."""
        if self.remote is None:
            return False
        cpu = kv.detach().to("cpu", copy=True)  # the blocks may be reused as soon as this returns
        meta = {"position": int(position), "check": _normal(check)}
        return self._submit(lambda: self.remote.put(namespace, key, cpu, meta), wait)

    def publish_tensors(self, namespace: Namespace, key: ContentKey, kind: str, tensors: list[torch.Tensor],
                        meta: dict, *, wait: bool = False) -> bool:
        """As :meth:`publish`, for an item of plain tensors (``kind`` "vit": an image's ViT
        output, lossless), also written from the publisher thread."""
        if self.remote is None:
            return False
        cpu = [t.detach().to("cpu", copy=True) for t in tensors]
        return self._submit(lambda: self.remote.put_tensors(namespace, key, kind, cpu, meta), wait)

    def _submit(self, put: Callable[[], bool], wait: bool) -> bool:
        with self._lock:
            if self._publisher is None:
                self._publisher = ThreadPoolExecutor(1, thread_name_prefix="samcache-publish")
            future = self._publisher.submit(self._publish_now, put)
            self._publishing.add(future)
        future.add_done_callback(self._published)
        return future.result() if wait else True

    def _publish_now(self, put: Callable[[], bool]) -> bool:
        ok = put()  # RemoteTier's puts never raise for the store's faults
        if ok:
            with self._lock:
                self.stats["published"] += 1
        return ok

    def _published(self, future: Future) -> None:
        with self._lock:
            self._publishing.discard(future)

    def flush(self) -> None:
        """Wait until every item sent to :meth:`publish` is in the shared store (or refused)."""
        with self._lock:
            pending = list(self._publishing)
        for future in pending:
            future.exception()  # waits; a failure was counted by the tier, not raised here

    def fetch(self, namespace: Namespace, key: ContentKey, check: Any) -> Fetched | None:
        """The item's KV from the highest tier holding it with the same ``check`` record, taken
        out of the host tier (it goes back up); None if no tier has it."""
        want = _normal(check)
        with self._lock:
            pending = self._inflight.get(key)
            absent = key in self._absent
            self._absent.discard(key)
        if pending is not None:  # on its way up: wait for this item only
            start = time.perf_counter()
            try:
                absent = pending.result() is None
                with self._lock:
                    self._absent.discard(key)
            except Exception:  # noqa: BLE001 - a failed prefetch is a plain lookup below
                pass
            with self._lock:
                self.stats["prefetch_wait_seconds"] += time.perf_counter() - start
        with self._lock:
            item = self._host.get(key)
            self._wanted.discard(key)
            if item is not None and item.namespace.digest == namespace.digest and item.meta["check"] == want:
                del self._host[key]
                self._host_used -= item.kv.numel() * item.kv.element_size()
                self.stats["host_hits"] += 1
                return Fetched(item.kv, item.meta["position"], "host")
        got = None if absent else self._lower_get(namespace, key, want)  # the lift just asked every tier
        with self._lock:
            if got is None:
                self.stats["misses"] += 1
                return None
            self.stats[f"{got[2]}_hits"] += 1
        return Fetched(got[0], got[1]["position"], got[2])

    def in_host(self, key: ContentKey) -> bool:
        """Whether host memory holds ``key`` now."""
        with self._lock:
            return key in self._host

    def holds(self, key: ContentKey) -> bool:
        """Whether host memory or the disk tier holds ``key`` (local tiers only: asking the shared
        store is a network round trip)."""
        with self._lock:
            if key in self._host or key in self._inflight:
                return True
        return self.disk is not None and key in self.disk

    def check_invariants(self) -> None:
        """Raise AssertionError if the host tier's accounting disagrees with what it holds."""
        with self._lock:
            total = sum(i.kv.numel() * i.kv.element_size() for i in self._host.values())
            if total != self._host_used or self._host_used > self.host_bytes:
                raise AssertionError(f"host tier holds {total} bytes, counts {self._host_used}, "
                                     f"bound {self.host_bytes}")

    @property
    def host_used_bytes(self) -> int:
        with self._lock:
            return self._host_used

    def __len__(self) -> int:
        with self._lock:
            return len(self._host)


__all__ = ["Fetched", "LowerTiers"]
