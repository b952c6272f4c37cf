"""SGLang HiCache storage (its L3 tier) over samcache's store.

SGLang's hierarchical cache moves KV pages GPU -> host pool -> a storage backend, keyed by page
hash strings (a chained hash of the page's tokens). This backend keeps those pages in one
byte-bounded samcache store per process, the same store samcache's image KV can use, so both
compete under one byte bound and one eviction order instead of two caches that cannot see each
other. Select it with SGLang's own plug point::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "samcache",
        "module_path": "samcache.integrations.sglang.hicache",
        "class_name": "SamcacheHiCacheStorage",
        "capacity_bytes": 8589934592, "tenant": "acme", "interface_v1": 1}'

Keys: each page hash becomes a ``ContentKey`` under a ``Namespace`` of SGLang's model name, the
TP/PP/CP rank and size and the host layout (plus an optional tenant), so one model's or rank's
pages never answer another's. Every page records its dtype and element count (its ``check``): a
page read into a buffer of another geometry is a miss, never a wrong hit.

The process's store is :func:`shared_store`; it is created by whichever user asks first (with
``capacity_bytes``, or :data:`DEFAULT_CAPACITY_BYTES`) and returned to every later caller. Another
user (image KV) puts its entries with its own group and release callback, e.g.
``shared_store().put(key, held, check, size_bytes=n, group=ns.digest, on_evict=free_holder)``;
each user's ``clear`` drops only its group.

Why this module is long: SGLang's HiCache storage interface has two generations (v0 page hashes, v1
zero-copy batches), and both are implemented here against one store so that they cannot drift apart.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from samcache.cache.content_index import Evicted, Tier
from samcache.errors import CacheFull
from samcache.hashing import ContentKey, Namespace, hash_bytes
from samcache.cache.stores.tensor_store import TensorStore, tensor_bytes

DEFAULT_CAPACITY_BYTES = 4 << 30  # 4 GiB of host memory unless extra_config says otherwise
_PAGE_DOMAIN = b"samcache/sglang-hicache/page/v1\0"


# ---- the process's shared store ---------------------------------------------------------------


@dataclass
class _Held:
    """What the shared store keeps for one key: the payload, who owns it, how to let it go."""

    key: ContentKey
    payload: Any
    check: Any
    group: Hashable | None
    on_evict: Callable[[Any], None] | None


class SharedTensorStore(TensorStore):
    """A :class:`TensorStore` several users share: every call holds one lock (SGLang reads and
    writes from its prefetch and backup threads while the scheduler runs), entries can carry their
    own ``on_evict`` (image KV frees pool blocks, HiCache pages free nothing) and a ``group`` tag,
    so one user can count or clear its own entries without touching the others'."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        super().__init__(name, capacity_bytes, on_evict=self._let_go)
        self.lock = threading.RLock()
        self._held: dict[ContentKey, _Held] = {}
        self._groups: dict[Hashable, set[ContentKey]] = {}

    def put(
        self,
        key: ContentKey,
        payload: Any,
        check: Any = None,
        *,
        size_bytes: int | None = None,
        group: Hashable | None = None,
        on_evict: Callable[[Any], None] | None = None,
        tier: Tier | None = None,
    ) -> bool:
        """Insert like :meth:`TensorStore.put` (False if present or larger than the store); ``group`` tags the entry, ``on_evict(payload)``
        runs when it goes, ``tier`` records where its bytes live. Raises CacheFull (changing
        nothing) when pinned entries leave no room."""
        size = max(1, tensor_bytes(payload)) if size_bytes is None else size_bytes
        held = _Held(key, payload, check, group, on_evict)
        with self.lock:
            if not super().put(key, held, check, size_bytes=size):
                return False
            self._held[key] = held
            if group is not None:
                self._groups.setdefault(group, set()).add(key)
            if tier is not None:
                self.index.set_tier(key, tier)
            return True

    def get(self, key: ContentKey, check: Any = None) -> Any | None:
        with self.lock:
            held = super().get(key, check)
            return None if held is None else held.payload

    def holds(self, key: ContentKey, check: Any = None) -> bool:
        """Whether ``get(key, check)`` would hit, without touching recency or hit counts."""
        with self.lock:
            held = self._held.get(key)
            return held is not None and held.check == check

    def discard(self, key: ContentKey) -> bool:
        """Drop ``key`` now (its ``on_evict`` runs). False if absent or pinned."""
        with self.lock:
            if key not in self._held:
                return False
            try:
                entry = self.index.remove(key)
            except ValueError:  # pinned: in use by someone, so it stays
                return False
            return self._release([Evicted(key, entry)]) > 0

    def clear_group(self, group: Hashable) -> int:
        """Drop every entry tagged ``group``; the number dropped."""
        with self.lock:
            return sum(self.discard(key) for key in list(self._groups.get(group, ())))

    def group_size(self, group: Hashable) -> int:
        with self.lock:
            return len(self._groups.get(group, ()))

    def evict_until(self, target_bytes: int) -> int:
        with self.lock:
            return super().evict_until(target_bytes)

    def payloads(self) -> Iterator[Any]:
        with self.lock:
            return iter([held.payload for held in self._held.values()])

    def check_invariants(self) -> None:
        with self.lock:
            super().check_invariants()
            if len(self._held) != len(self):
                raise AssertionError(f"{self.name}: {len(self)} entries but {len(self._held)} held records")
            grouped = sum(len(keys) for keys in self._groups.values())
            tagged = sum(held.group is not None for held in self._held.values())
            if grouped != tagged:
                raise AssertionError(f"{self.name}: {grouped} grouped keys but {tagged} tagged entries")

    def _let_go(self, held: _Held) -> None:
        # Runs (under the lock) for every entry the base store releases: evicted, discarded, cleared.
        self._held.pop(held.key, None)
        if held.group is not None:
            keys = self._groups.get(held.group)
            if keys is not None:
                keys.discard(held.key)
                if not keys:
                    del self._groups[held.group]
        if held.on_evict is not None:
            held.on_evict(held.payload)


_shared: SharedTensorStore | None = None
_shared_guard = threading.Lock()


def shared_store(capacity_bytes: int | None = None) -> SharedTensorStore:
    """The process's one samcache store, shared by SGLang's HiCache pages and samcache's image KV.

    The first call creates it with ``capacity_bytes`` (default :data:`DEFAULT_CAPACITY_BYTES`);
    later calls return the same object. A later call naming a different capacity raises
    ``ValueError``: the bound is fixed once the store exists, and two users disagreeing about
    it is a configuration error to surface, not to resolve silently.
    """
    global _shared
    with _shared_guard:
        if _shared is None:
            _shared = SharedTensorStore(
                "samcache shared store", DEFAULT_CAPACITY_BYTES if capacity_bytes is None else capacity_bytes
            )
        elif capacity_bytes is not None and capacity_bytes != _shared.index.capacity_bytes:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} but the process's shared samcache store already exists "
                f"with {_shared.index.capacity_bytes} bytes; configure one capacity for all its users"
            )
        return _shared


def reset_shared_store() -> None:
    """Empty and forget the process's shared store (tests; a restart of the serving stack)."""
    global _shared
    with _shared_guard:
        if _shared is not None:
            _shared.clear()
        _shared = None


# ---- the SGLang backend -----------------------------------------------------------------------


def _extra_config(config: HiCacheStorageConfig) -> tuple[int | None, str | None]:
    """(capacity_bytes, tenant) from SGLang's extra_config; ValueError naming a bad key."""
    extra = config.extra_config or {}
    if not isinstance(extra, dict):
        raise TypeError(f"hicache storage extra_config must be a JSON object, got {type(extra).__name__}")
    capacity = extra.get("capacity_bytes")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"extra_config['capacity_bytes'] must be an integer >= 1 (bytes), got {capacity!r}")
    tenant = extra.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise ValueError(f"extra_config['tenant'] must be a non-empty string, got {tenant!r}")
    return capacity, tenant


def _page_check(page: torch.Tensor) -> tuple[str, int]:
    """What a stored page was made as: a read into a buffer of another geometry misses."""
    return str(page.dtype), page.numel()


@dataclass
class _Metrics:
    """Pages and GB/s per batch call, drained by SGLang's ``get_stats``."""

    prefetch_pgs: list[int]
    backup_pgs: list[int]
    prefetch_bandwidth: list[float]
    backup_bandwidth: list[float]


class SamcacheHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` whose pages live in :func:`shared_store`.

    Built by SGLang's ``dynamic`` backend factory as ``SamcacheHiCacheStorage(storage_config,
    kwargs)``. ``extra_config`` keys: ``capacity_bytes`` (int, the shared store's bound; it must
    agree with the store if one exists), ``tenant`` (str, a salt kept apart from other tenants),
    and SGLang's own ``interface_v1`` (1: the controller calls ``batch_get_v1``/``batch_set_v1``,
    which read and write the host pool directly; otherwise it stages every page through
    ``batch_get``/``batch_set``). ``kwargs["store"]`` may give a store instead of the shared one.

    Pages are copied in (the host pool reuses its slots) and copied out into the caller's buffer.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise TypeError(f"storage_config must be a HiCacheStorageConfig, got {type(storage_config).__name__}")
        if storage_config.should_split_heads:
            raise ValueError(
                "samcache HiCache storage keeps whole pages: heterogeneous-TP head splitting "
                "(extra_config['tp_lcm_size'] with the page_head layout) is not supported"
            )
        capacity, tenant = _extra_config(storage_config)
        store = (kwargs or {}).get("store")
        if store is not None and not isinstance(store, SharedTensorStore):
            raise TypeError(f"kwargs['store'] must be a SharedTensorStore, got {type(store).__name__}")
        self.store = store if store is not None else shared_store(capacity)
        self.config = storage_config
        self.tenant = tenant
        self.layout = "page_first" if storage_config.is_page_first_layout else "layer_first"
        self.namespace = self._make_namespace()
        self._pool_checks: dict[str, tuple[str, int]] = {}  # per host pool: its pages' check
        self._page_bytes: dict[str, int] = {}
        self._collect = bool(storage_config.enable_storage_metrics)
        self._metrics = _Metrics([], [], [], [])
        self._metrics_lock = threading.Lock()
        self._page_stats = {"hits": 0, "misses": 0, "writes": 0, "rejected": 0}

    # ---- identity -----------------------------------------------------------------------------
    def _make_namespace(self) -> Namespace:
        c = self.config
        # JSON keeps the parts apart whatever the model name holds.
        scope = json.dumps(
            [c.model_name or "", [c.tp_rank, c.tp_size], [c.pp_rank, c.pp_size], [c.attn_cp_rank, c.attn_cp_size],
             [c.dcp_rank, c.dcp_size], self.layout]
        )
        return Namespace(f"sglang-hicache:{scope}", tenant=self.tenant)

    def _key(self, key: str, pool: str = PoolName.KV.value) -> ContentKey:
        if not isinstance(key, str):
            raise TypeError(f"HiCache page keys are strings, got {type(key).__name__}")
        return self.namespace.key(hash_bytes(_PAGE_DOMAIN + str(pool).encode() + b"\0" + key.encode()))

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        # The pool's real layout (page_first_direct, page_head, ...) orders a page's bytes: it
        # joins the namespace, so pages written in one layout are never read into another.
        layout = getattr(mem_pool_host, "layout", None)
        if layout and layout != self.layout:
            self.layout = layout
            self.namespace = self._make_namespace()
        self._pool_checks.pop(PoolName.KV.value, None)
        self._pool_check(PoolName.KV.value)  # learn the page geometry before any transfer

    def _pool(self, name: str):
        if name == PoolName.KV.value and getattr(self, "mem_pool_host", None) is not None:
            return self.mem_pool_host
        pool = getattr(self, "registered_pools", {}).get(name)
        if pool is None:
            raise ValueError(f"no host pool registered for {name!r}: SGLang registers pools before any transfer")
        return pool

    def _pool_check(self, name: str) -> tuple[str, int]:
        check = self._pool_checks.get(name)
        if check is None:
            page = self._pool(name).get_data_page(0, flat=True)
            check = self._pool_checks[name] = _page_check(page)
            self._page_bytes[name] = page.numel() * page.element_size()
        return check

    # ---- one page -----------------------------------------------------------------------------
    def _write(self, key: ContentKey, page: torch.Tensor) -> bool:
        check = _page_check(page)
        with self.store.lock:
            if self.store.holds(key, check):
                return True  # same content under a content key: nothing to rewrite
            self.store.discard(key)  # a record of another geometry would block the new one
            copy = page.detach().to("cpu").clone(memory_format=torch.contiguous_format)
            try:
                ok = self.store.put(key, copy, check, group=self.namespace.digest, tier=Tier.HOST)
            except CacheFull:  # pinned entries leave no room: a failed write, never an error
                ok = False
        self._count("writes" if ok else "rejected")
        return ok

    def _read(self, key: ContentKey, check: tuple[str, int]) -> torch.Tensor | None:
        page = self.store.get(key, check)
        self._count("hits" if page is not None else "misses")
        return page

    def _count(self, name: str) -> None:
        with self._metrics_lock:  # SGLang's prefetch and backup threads both land here
            self._page_stats[name] += 1

    # ---- v0 API: tensors in and out (SGLang's default path for dynamic backends) ------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Copy page ``key`` into ``target_location`` (a flat page buffer; the registered host
        pool's dummy page when omitted) and return it, or None when absent."""
        if target_location is None:
            target_location = self._pool(PoolName.KV.value).get_dummy_flat_data_page()
        if not isinstance(target_location, torch.Tensor):
            raise TypeError(f"target_location must be a tensor, got {type(target_location).__name__}")
        page = self._read(self._key(key), _page_check(target_location))
        if page is None:
            return None
        target_location.copy_(page.reshape(target_location.shape))
        return target_location

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise ValueError(f"batch_get: {len(keys)} keys but {len(targets)} target_locations")
        return self._timed("prefetch", keys, lambda: [self.get(k, t) for k, t in zip(keys, targets)])

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store a copy of page tensor ``value`` under ``key``; False if it cannot be kept."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"set needs the page as a tensor value, got {type(value).__name__}")
        return self._write(self._key(key), value)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError(f"batch_set: {len(keys)} keys but {0 if values is None else len(values)} values")

        def write_all() -> bool:
            # A prefix is only useful whole: stop at the first page that cannot be kept.
            return all(self.set(k, v) for k, v in zip(keys, values))

        return self._timed("backup", keys, write_all)

    def exists(self, key: str) -> bool:
        """Whether ``key`` would be read back: with a host pool registered, in that pool's page
        geometry; before that, in any geometry."""
        ckey = self._key(key)
        if getattr(self, "mem_pool_host", None) is None:
            return ckey in self.store
        return self.store.holds(ckey, self._pool_check(PoolName.KV.value))

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The number of leading ``keys`` present (SGLang loads only a contiguous prefix)."""
        return next((i for i, k in enumerate(keys) if not self.exists(k)), len(keys))

    # ---- v1 API: straight to and from the registered host pool (extra_config interface_v1) ----
    def _page_offsets(self, name: str, keys: list[str], host_indices: torch.Tensor) -> list[int]:
        page_size = getattr(self._pool(name), "page_size", 1) or 1
        if host_indices is None or host_indices.numel() != len(keys) * page_size:
            got = None if host_indices is None else host_indices.numel()
            raise ValueError(
                f"{name}: {len(keys)} pages of {page_size} tokens need {len(keys) * page_size} host indices, got {got}"
            )
        return host_indices[::page_size].tolist()

    def _pool_get(self, name: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        pool, check = self._pool(name), self._pool_check(name)
        results = []
        for key, offset in zip(keys, self._page_offsets(name, keys, host_indices)):
            page = self._read(self._key(key, name), check)
            if page is not None:
                pool.set_from_flat_data_page(offset, page)
            results.append(page is not None)
        return results

    def _pool_set(self, name: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        pool = self._pool(name)
        return [
            self._write(self._key(key, name), pool.get_data_page(offset, flat=True))
            for key, offset in zip(keys, self._page_offsets(name, keys, host_indices))
        ]

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Read pages ``keys`` into the host pool at ``host_indices`` (page_size indices a page)."""
        return self._timed("prefetch", keys, lambda: self._pool_get(PoolName.KV.value, keys, host_indices))

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``."""
        return self._timed("backup", keys, lambda: self._pool_set(PoolName.KV.value, keys, host_indices))

    # ---- v2 API: KV plus side pools (Mamba, SWA, indexer) of hybrid models -------------------
    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {str(t.name): self._pool_get(str(t.name), t.keys or [], t.host_indices) for t in transfers}

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {str(t.name): self._pool_set(str(t.name), t.keys or [], t.host_indices) for t in transfers}

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest KV prefix every side pool can restore too: ``all_pages`` pools need every
        page of it, ``trailing_pages`` pools only the window that ends it."""
        kv_pages = self.batch_exists(keys)
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            name = str(transfer.name)
            check = self._pool_check(name)
            held = [self.store.holds(self._key(k, name), check) for k in keys[:kv_pages]]
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = next((i for i, h in enumerate(held) if not h), kv_pages)
                ok = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                ok, last_miss = set(), -1
                for p, h in enumerate(held, start=1):  # prefix of p pages needs pages p-window..p-1
                    last_miss = last_miss if h else p - 1
                    if last_miss < p - window:
                        ok.add(p)
                boundary = max(ok, default=0)
            else:
                raise ValueError(
                    f"samcache HiCache storage: unsupported hit policy {transfer.hit_policy!r} for pool {name!r}"
                )
            if boundary:
                hits[transfer.name] = boundary
            restorable &= ok
        order = sorted(restorable)
        return PoolTransferResult(order[-1] if order else 0, hits, order)

    # ---- housekeeping -------------------------------------------------------------------------
    def clear(self) -> None:
        """Drop this backend's pages (its namespace's); other users of the store keep theirs."""
        self.store.clear_group(self.namespace.digest)

    def close(self) -> None:
        """Nothing to release: pages stay in the shared store for the next backend to find."""

    def get_stats(self):
        """SGLang's ``StorageMetrics`` (pages and GB/s per batch since the last call), or None
        when SGLang did not ask for storage metrics."""
        if not self._collect:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._metrics_lock:
            m, self._metrics = self._metrics, _Metrics([], [], [], [])
        out = StorageMetrics()
        out.prefetch_pgs.extend(m.prefetch_pgs)
        out.backup_pgs.extend(m.backup_pgs)
        out.prefetch_bandwidth.extend(m.prefetch_bandwidth)
        out.backup_bandwidth.extend(m.backup_bandwidth)
        return out

    def store_stats(self) -> dict[str, int]:
        """samcache's counters: this backend's page hits, misses, writes and rejected writes,
        its pages held now, and the shared store's bytes used and capacity."""
        with self._metrics_lock:
            counts = dict(self._page_stats)
        return {
            **counts,
            "pages": self.store.group_size(self.namespace.digest),
            "used_bytes": self.store.used_bytes,
            "capacity_bytes": self.store.index.capacity_bytes,
        }

    def _timed(self, direction: str, keys: list[str], run: Callable[[], Any]) -> Any:
        if not self._collect:
            return run()
        start = time.perf_counter()
        result = run()
        seconds = max(time.perf_counter() - start, 1e-9)
        with self._metrics_lock:
            getattr(self._metrics, f"{direction}_pgs").append(len(keys))
            page_bytes = self._page_bytes.get(PoolName.KV.value)
            if page_bytes is not None:  # known once the host pool is registered
                getattr(self._metrics, f"{direction}_bandwidth").append(len(keys) * page_bytes / seconds / 1e9)
        return result


__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "SamcacheHiCacheStorage",
    "SharedTensorStore",
    "reset_shared_store",
    "shared_store",
]
