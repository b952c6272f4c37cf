"""The local-disk tier: cold-tier items (:mod:`samcache.cache.tiers.cold`) as files in a cache directory,
byte-bounded, least recently used out first.

One file per item, named by the hex of its namespaced content key (the key already covers the
model and the tenant), written to a temporary name and renamed into place so a reader never sees
half a file. The directory is created 0700 and every file 0600. A file that fails to decode (a bad
checksum, another namespace, truncated, an old format version) is deleted and counted in
``stats()["dropped"]``; the caller recomputes the item. An intact file made for another
namespace (copied or swapped in under this key's name) is a miss with a warning, counted in
``"foreign"``, and stays (it is not this caller's to delete); a file removed behind the tier is a
miss with a warning, counted in ``"lost"``. Recency is a logical counter kept in
memory; at start the files present are taken in modification-time order, so a restarted process
keeps what the last one cached.

Besides KV items, a disk tier holds items of plain tensors, lossless (:meth:`DiskTier.put_tensors`):
ViT outputs the ViT cache lets go, and prefix blocks the host prefix tier spills.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from samcache._checks import check_int
from samcache.hashing import ContentKey, Namespace
from samcache.cache.tiers.cold import (QTYPES, ColdFormatError, ForeignItem, decode, decode_tensors, encode, encode_tensors,
                                 read_header)

SUFFIX = ".samkv"


@dataclass(frozen=True)
class StoredKV:
    """What the disk tier gives back: the KV tensor and the ``meta`` it was stored with."""

    kv: torch.Tensor
    meta: dict


class DiskTier:
    """``put(namespace, key, kv)`` / ``get(namespace, key)`` over files in ``path``, at most
    ``max_bytes`` of them (encoded size). ``qtype`` / ``per_head`` / ``block_size``: how items are
    encoded (``qtype=None``: lossless)."""

    def __init__(self, path: str | os.PathLike, max_bytes: int, *, qtype: str | None = "fp8_e4m3",
                 per_head: bool = True, block_size: int = 16) -> None:
        self.path = Path(path)
        self.max_bytes = check_int("max_bytes", max_bytes, 1)
        if qtype not in (*QTYPES, None):
            raise ValueError(f"qtype must be one of {QTYPES} or None (lossless), got {qtype!r}")
        if not isinstance(per_head, bool):
            raise TypeError(f"per_head must be a bool, got {type(per_head).__name__}")
        check_int("block_size", block_size, 1)
        self.qtype, self.per_head, self.block_size = qtype, per_head, block_size
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recent first
        self._stats = {"puts": 0, "hits": 0, "misses": 0, "dropped": 0, "evictions": 0, "rejected": 0, "failed": 0,
                       "lost": 0, "foreign": 0}
        found = sorted((p for p in self.path.glob("*" + SUFFIX) if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
        for p in found:
            self._files[p.name] = p.stat().st_size
        for tmp in self.path.glob("*.tmp"):  # a crash mid-write leaves these; never read
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._evict_to(self.max_bytes)

    @staticmethod
    def _name(key: ContentKey) -> str:
        if not isinstance(key, ContentKey):
            raise TypeError(f"key must be a ContentKey, got {type(key).__name__}")
        return key.digest.hex() + SUFFIX

    def put(self, namespace: Namespace, key: ContentKey, kv: torch.Tensor, meta: dict | None = None) -> bool:
        """Encode and write ``kv`` (with ``meta``, a small JSON-able dict) under ``key``; False if the
        encoded item alone exceeds ``max_bytes``. An existing file for the key is replaced."""
        enc = encode(kv, namespace, key, qtype=self.qtype, per_head=self.per_head, block_size=self.block_size,
                     meta=meta)
        return self._write(self._name(key), enc.data)

    def put_tensors(self, namespace: Namespace, key: ContentKey, tensors: list[torch.Tensor],
                    meta: dict | None = None) -> bool:
        """Write an item of plain tensors (lossless) under ``key``; as :meth:`put`."""
        return self._write(self._name(key), encode_tensors(tensors, namespace, key, meta=meta))

    def get_tensors(self, namespace: Namespace, key: ContentKey) -> tuple[list[torch.Tensor], dict] | None:
        """An item of :meth:`put_tensors` (tensors, meta), or None as :meth:`get`."""
        return self._read(self._name(key), lambda data: decode_tensors(data, namespace, key))

    def _write(self, name: str, data: bytes) -> bool:
        """Write one encoded item, atomically (a temporary file renamed into place)."""
        if len(data) > self.max_bytes:
            with self._lock:
                self._stats["rejected"] += 1
            return False
        tmp = self.path / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path / name)
        except OSError as e:  # disk full, gone read-only, ...: the item is not kept, nothing half-written stays
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._stats["failed"] += 1
            warnings.warn(f"samcache: disk tier {self.path}: cannot write an item ({e}); it is not kept",
                          RuntimeWarning, stacklevel=2)
            return False
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._files.pop(name, None)
            self._files[name] = len(data)
            self._stats["puts"] += 1
            self._evict_to(self.max_bytes)
        return True

    def get(self, namespace: Namespace, key: ContentKey, *, device: str | torch.device = "cpu") -> StoredKV | None:
        """The item's KV and meta, or None if absent or unusable (an unusable file is deleted)."""
        got = self._read(self._name(key), lambda data: (decode(data, namespace, key, device=device),
                                                        read_header(data)["meta"]))
        return None if got is None else StoredKV(*got)

    def _read(self, name: str, decoder):
        """``decoder(bytes)`` of one file; None if absent, someone else's or unusable (deleted)."""
        try:
            data = (self.path / name).read_bytes()
        except FileNotFoundError:
            with self._lock:  # evicted meanwhile, or written again since: not lost
                lost = name in self._files and not (self.path / name).exists() and self._files.pop(name, None) is not None
                self._stats["lost" if lost else "misses"] += 1
            if lost:  # it was written here and is gone: someone removed it behind the tier
                warnings.warn(f"samcache: disk tier {self.path}: {name} was removed behind the tier; its item "
                              "is recomputed", RuntimeWarning, stacklevel=3)
            return None
        try:
            got = decoder(data)
        except ForeignItem:  # intact, someone else's (copied or swapped in): a miss, the file stays
            with self._lock:
                self._stats["foreign"] += 1
            warnings.warn(f"samcache: disk tier {self.path}: {name} holds an item of another model or tenant; "
                          "not used, its item is recomputed", RuntimeWarning, stacklevel=3)
            return None
        except ColdFormatError:
            self._drop(name)
            return None
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)
            self._stats["hits"] += 1
        return got

    def __contains__(self, key: ContentKey) -> bool:
        with self._lock:
            return self._name(key) in self._files

    def remove(self, key: ContentKey) -> bool:
        name = self._name(key)
        with self._lock:
            present = self._files.pop(name, None) is not None
        (self.path / name).unlink(missing_ok=True)
        return present

    def _drop(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)
        with self._lock:
            self._files.pop(name, None)
            self._stats["dropped"] += 1
        warnings.warn(f"samcache: disk tier {self.path}: {name} is damaged, truncated or of another format "
                      "version; deleted, its item is recomputed", RuntimeWarning, stacklevel=3)

    def _evict_to(self, bound: int) -> None:
        total = sum(self._files.values())
        while total > bound and self._files:
            name, size = self._files.popitem(last=False)
            (self.path / name).unlink(missing_ok=True)
            total -= size
            self._stats["evictions"] += 1

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._files.values())

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._stats, "items": len(self._files), "used_bytes": sum(self._files.values())}

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)


__all__ = ["SUFFIX", "DiskTier", "StoredKV"]
