"""The shared tier: KV items in a store that several engine instances (on several machines) use.

:class:`RemoteStore` is the small interface samcache needs from such a store (put / get / exists /
remove of bytes by key, with batch forms). :class:`MooncakeStore` is its backend over Mooncake
Store, the distributed KV-cache store that SGLang HiCache, vLLM and LMCache deployments already
run (``mooncake_master`` plus a transfer engine; TCP here, RDMA in production through the same
API). :class:`RemoteTier` keeps KV items there in the cold encoding (:mod:`samcache.cache.tiers.cold`)
under ``samcache/{namespace}/{content key}/kv``: the namespace (model and tenant) is part of every
key, and the encoded header is checked again on every read, so another model's, another tenant's
or a damaged item is never used (a damaged one is removed).
"""

from __future__ import annotations

import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from samcache.hashing import ContentKey, Namespace
from samcache.cache.tiers.cold import ColdFormatError, ForeignItem, decode, decode_tensors, encode, encode_tensors, read_header
from samcache.cache.tiers.disk import StoredKV


class RemoteStoreError(RuntimeError):
    """The shared store cannot be reached or refused an operation it should accept."""


class RemoteStore(ABC):
    """Bytes by string key in a store shared across processes and machines."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key``; False if the store refused it (full, or the key exists)."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The bytes under ``key``, or None."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def remove(self, key: str) -> bool: ...

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        return [self.put(k, d) for k, d in items]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.exists(k) for k in keys]

    def close(self) -> None:  # noqa: B027 - optional for backends
        """Release the connection (a backend without one does nothing)."""


class MooncakeStore(RemoteStore):
    """A Mooncake Store client. ``master``: the ``mooncake_master`` RPC address (host:port);
    ``metadata_server``: its metadata service (``http://host:port/metadata`` for the master's
    built-in HTTP server, or an etcd address); ``segment_bytes``: the memory this client
    contributes to the distributed pool (what it stores lives there while the client runs);
    ``buffer_bytes``: its local transfer buffer; ``protocol``: ``"tcp"`` or ``"rdma"``."""

    def __init__(self, master: str, metadata_server: str, *, local_hostname: str = "127.0.0.1",
                 segment_bytes: int = 512 << 20, buffer_bytes: int = 128 << 20, protocol: str = "tcp",
                 rdma_devices: str = "") -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RemoteStoreError("MooncakeStore needs the mooncake package (pip install "
                                   "mooncake-transfer-engine-non-cuda; Debian libibverbs1)") from e
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        for name, value in (("master", master), ("metadata_server", metadata_server)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        _check_reachable(master)  # the client retries for ~90 s before giving up: fail fast instead
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata_server, int(segment_bytes), int(buffer_bytes), protocol,
                               rdma_devices, master)
        if rc != 0:
            raise RemoteStoreError(f"cannot connect to Mooncake master {master} (metadata {metadata_server}): "
                                   f"setup returned {rc}")
        self._lock = threading.Lock()
        self.master = master
        # Zero-copy transfers: items move between the store and this registered staging buffer
        # directly (get_into / put_from; over RDMA the NIC writes it, no client-side copy); it grows
        # to the largest batch seen. Without a registration (refused), the copying put/get.
        self._staging: np.ndarray | None = None
        self.zero_copy = True

    def _buffer(self, nbytes: int) -> np.ndarray | None:
        """The registered staging buffer, at least ``nbytes`` (call with the lock held)."""
        if not self.zero_copy:
            return None
        if self._staging is None or self._staging.nbytes < nbytes:
            if self._staging is not None:
                self._store.unregister_buffer(self._staging.ctypes.data)
            size = max(nbytes, 1 << 20, 0 if self._staging is None else 2 * self._staging.nbytes)
            buf = np.empty(size, dtype=np.uint8)
            if self._store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                self._staging, self.zero_copy = None, False
                return None
            self._staging = buf
        return self._staging

    def put(self, key: str, data: bytes) -> bool:
        return self.put_many([(key, data)])[0]

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """One batch: the items are laid out in the staging buffer and sent from there."""
        if not items:
            return []
        keys = [k for k, _ in items]
        with self._lock:
            sizes = [len(d) for _, d in items]
            buf = self._buffer(sum(sizes))
            if buf is None:
                return [self._store.put(k, bytes(d)) == 0 for k, d in items]
            offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            for (_, d), at, n in zip(items, offsets, sizes):
                buf[at:at + n] = np.frombuffer(d, dtype=np.uint8)
            base = buf.ctypes.data
            codes = self._store.batch_put_from(keys, [base + int(at) for at in offsets], sizes)
        return [c == 0 for c in codes]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """One batch: the sizes, then every present item straight into the staging buffer."""
        if not keys:
            return []
        keys = list(keys)
        with self._lock:
            sizes = [int(self._store.get_size(k)) for k in keys]  # < 0: absent
            present = [i for i, n in enumerate(sizes) if n > 0]
            out: list[bytes | None] = [None] * len(keys)
            if not present:
                return out
            buf = self._buffer(sum(sizes[i] for i in present))
            if buf is None:
                for i in present:
                    data = self._store.get(keys[i])
                    out[i] = bytes(data) if data else None
                return out
            offsets, at = [], 0
            for i in present:
                offsets.append(at)
                at += sizes[i]
            base = buf.ctypes.data
            got = self._store.batch_get_into([keys[i] for i in present], [base + o for o in offsets],
                                             [sizes[i] for i in present])
            for i, o, n in zip(present, offsets, got):
                if n == sizes[i]:  # removed meanwhile or cut short: a miss
                    out[i] = buf[o:o + n].tobytes()
        return out

    def exists(self, key: str) -> bool:
        with self._lock:
            return self._store.is_exist(key) == 1

    def remove(self, key: str) -> bool:
        with self._lock:
            return self._store.remove(key) == 0

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [r == 1 for r in self._store.batch_is_exist(list(keys))]

    def close(self) -> None:
        with self._lock:
            if self._staging is not None:
                self._store.unregister_buffer(self._staging.ctypes.data)
                self._staging = None
            self._store.close()


class RedisStore(RemoteStore):
    """A Redis server as the shared store (``url``: ``redis://host:port/db``): one key per item,
    written once (``SET NX``), batches in one round trip (``MGET``, a pipeline of ``EXISTS``).
    The simple second backend (LMCache deployments run it); no zero-copy, and Redis keeps every
    item in its own memory (bound it with ``maxmemory`` and an eviction policy on the server)."""

    def __init__(self, url: str, *, timeout: float = 3.0) -> None:
        try:
            import redis
        except ImportError:
            raise RemoteStoreError("RedisStore needs the redis client: pip install 'samcache[redis]'") from None
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must be redis://host:port/db (or rediss://, unix://), got {url!r}")
        self._errors = redis.RedisError
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            self._client.ping()
        except redis.RedisError as e:
            raise RemoteStoreError(f"cannot reach Redis at {url}: {e}") from None
        self.url = url

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._errors as e:
            raise RemoteStoreError(f"Redis {what} failed: {e}") from None

    def put(self, key: str, data: bytes) -> bool:
        return bool(self._call("SET", self._client.set, key, bytes(data), nx=True))

    def get(self, key: str) -> bytes | None:
        return self._call("GET", self._client.get, key)

    def exists(self, key: str) -> bool:
        return bool(self._call("EXISTS", self._client.exists, key))

    def remove(self, key: str) -> bool:
        return bool(self._call("DEL", self._client.delete, key))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return list(self._call("MGET", self._client.mget, list(keys))) if keys else []

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        return [bool(r) for r in self._call("EXISTS", pipe.execute)]

    def close(self) -> None:
        self._client.close()


def _check_reachable(address: str, timeout: float = 3.0) -> None:
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"master must be host:port, got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise RemoteStoreError(f"cannot reach the Mooncake master at {address}: {e}") from None


class RemoteTier:
    """KV items of many engine instances in one :class:`RemoteStore`, in the cold encoding."""

    def __init__(self, store: RemoteStore, *, qtype: str | None = "fp8_e4m3", per_head: bool = True,
                 block_size: int = 16, retry_after_s: float = 30.0) -> None:
        if not isinstance(store, RemoteStore):
            raise TypeError(f"store must be a RemoteStore, got {type(store).__name__}")
        if not isinstance(retry_after_s, (int, float)) or isinstance(retry_after_s, bool) or retry_after_s < 0:
            raise ValueError(f"retry_after_s must be a number >= 0, got {retry_after_s!r}")
        # After a failure (an error, or a put that timed out) the tier is left alone this long:
        # a store that went away must not cost every request a timeout.
        self.retry_after_s = float(retry_after_s)
        self._down_until = 0.0
        self.store = store
        self.qtype, self.per_head, self.block_size = qtype, per_head, block_size
        self.stats = {"puts": 0, "hits": 0, "misses": 0, "dropped": 0, "refused": 0, "errors": 0, "skipped": 0}

    def _safe(self, what: str, fn, *args, default=None):
        """A store call; if the store fails (an error, or a put refused after a timeout's worth of
        waiting) the failure is counted, warned about once, and the tier is skipped for
        ``retry_after_s``: the caller goes on without it (a miss, or not published)."""
        now = time.monotonic()
        if now < self._down_until:
            self.stats["skipped"] += 1
            return default
        try:
            out = fn(*args)
        except Exception as e:  # noqa: BLE001 - any failure of the store degrades to local tiers
            self._failed(f"{what}: {e}")
            return default
        if what == "put" and not out and time.monotonic() - now > 1.0:  # refused after waiting: unreachable
            self._failed("put timed out")
        return out

    def _failed(self, why: str) -> None:
        self.stats["errors"] += 1
        self._down_until = time.monotonic() + self.retry_after_s
        if self.stats["errors"] == 1:
            warnings.warn(f"samcache: the shared store failed ({why}); going on with the local tiers, retrying "
                          f"after {self.retry_after_s:g} s", RuntimeWarning, stacklevel=4)

    @staticmethod
    def key_of(namespace: Namespace, key: ContentKey, kind: str = "kv") -> str:
        """``samcache/{namespace}/{content key}/{kind}``: the store key of an item."""
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a samcache.Namespace, got {type(namespace).__name__}")
        if not isinstance(key, ContentKey):
            raise TypeError(f"key must be a ContentKey, got {type(key).__name__}")
        return f"samcache/{namespace.digest.hex()}/{key.digest.hex()}/{kind}"

    def put(self, namespace: Namespace, key: ContentKey, kv: torch.Tensor, meta: dict | None = None) -> bool:
        """Publish an item (a no-op if the store already has it)."""
        name = self.key_of(namespace, key)
        there = self._safe("exists", self.store.exists, name)
        if there is None:  # the store failed or is being skipped: not written
            return False
        if there:
            return True
        data = encode(kv, namespace, key, qtype=self.qtype, per_head=self.per_head, block_size=self.block_size,
                      meta=meta).data
        ok = self._safe("put", self.store.put, name, data, default=False)
        self.stats["puts" if ok else "refused"] += 1
        return ok

    def get(self, namespace: Namespace, key: ContentKey) -> StoredKV | None:
        return self._fetch(self.key_of(namespace, key),
                           lambda data: StoredKV(decode(data, namespace, key), read_header(data)["meta"]))

    def _fetch(self, name: str, decode_item):
        """The item under ``name`` decoded, or None: absent, another namespace's (a miss), or
        damaged (removed from the store and counted)."""
        data = self._safe("get", self.store.get, name)
        if data is None:
            self.stats["misses"] += 1
            return None
        try:
            item = decode_item(data)
        except ForeignItem:  # cannot happen with namespaced keys unless someone wrote it there
            self.stats["misses"] += 1
            return None
        except ColdFormatError:
            self._safe("remove", self.store.remove, name)
            self.stats["dropped"] += 1
            return None
        self.stats["hits"] += 1
        return item

    def put_tensors(self, namespace: Namespace, key: ContentKey, kind: str, tensors: list[torch.Tensor],
                    meta: dict | None = None) -> bool:
        """Publish an item of plain tensors (e.g. kind ``"vit"``: an image's ViT output), lossless."""
        name = self.key_of(namespace, key, kind)
        there = self._safe("exists", self.store.exists, name)
        if there is None:  # the store failed or is being skipped: not written
            return False
        if there:
            return True
        ok = self._safe("put", self.store.put, name, encode_tensors(tensors, namespace, key, meta=meta), default=False)
        self.stats["puts" if ok else "refused"] += 1
        return ok

    def get_tensors(self, namespace: Namespace, key: ContentKey, kind: str) -> tuple[list[torch.Tensor], dict] | None:
        return self._fetch(self.key_of(namespace, key, kind), lambda data: decode_tensors(data, namespace, key))

    def __contains__(self, item: tuple[Namespace, ContentKey]) -> bool:
        """Whether the store holds the item (False while the store fails or is being skipped)."""
        return bool(self._safe("exists", self.store.exists, self.key_of(*item), default=False))


__all__ = ["MooncakeStore", "RedisStore", "RemoteStore", "RemoteStoreError", "RemoteTier"]
