"""Large tool results kept out of the context: a content-hashed, byte-bounded SQLite store and the
compact references that stand in for the results in the prompt (AgentMem's tool-result store).

An agent's tool calls return page dumps, logs and search results many times larger than the
question they answer; sent back every turn they flood the context and the prefix cache. The
store keeps each result once, keyed by tenant and the xxh3-128 of its text, and
:meth:`ToolResultStore.reference` gives the short text the context carries instead::

    [tool result 3f9c0a1b2d4e5f60a1b2c3d4e5f60718: 48,211 chars, 912 lines; starts "HTTP/1.1 200 OK"]

The reference is deterministic (same result, same text), so prompts that carry it still hit the
prefix cache. :meth:`ToolResultStore.expand` turns a reference back into the result.

Storage: one SQLite file in WAL mode (readers do not block the writer; it survives a process
restart), zstd-compressed payloads, at most ``max_bytes`` of payload in total: least recently
used results go first. Tenants are part of the key: a tenant can read only what it stored, even
knowing another tenant's key. No pickle: payloads are UTF-8 text.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from samcache._checks import check_int

_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    payload BLOB NOT NULL,       -- zstd-compressed UTF-8
    stored_bytes INTEGER NOT NULL,
    chars INTEGER NOT NULL,
    lines INTEGER NOT NULL,
    head TEXT NOT NULL,
    last_used INTEGER NOT NULL,  -- a counter, not a clock: eviction order is deterministic
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS results_lru ON results (last_used);
"""
_REFERENCE = re.compile(r"\[tool result ([0-9a-f]{32})[^\]]*\]")
_HEAD_CHARS = 40
_UNSAFE_IN_REFERENCE = str.maketrans({'"': "'", "]": ")", "[": "("})


@dataclass(frozen=True)
class StoredResult:
    """What the store knows about one result (``key``: its xxh3-128 in hex)."""

    key: str
    chars: int
    lines: int
    head: str
    stored_bytes: int


class ToolResultStore:
    """Content-hashed tool results in SQLite, bounded to ``max_bytes`` of compressed payload.

    ``path``: the database file (created 0600 if absent; ``":memory:"`` for a private store).
    ``max_item_bytes``: the largest result accepted, in UTF-8 bytes before compression (default:
    ``max_bytes``); a larger one is refused with a ValueError, never truncated silently.
    Thread-safe (one connection behind a lock)."""

    def __init__(self, path: str | Path, *, max_bytes: int = 256 << 20, max_item_bytes: int | None = None,
                 level: int = 3):
        import zstandard

        check_int("max_bytes", max_bytes, 1)
        if max_item_bytes is not None:
            check_int("max_item_bytes", max_item_bytes, 1)
        self.max_bytes = max_bytes
        self.max_item_bytes = max_item_bytes or max_bytes
        # zstd (de)compressor objects are not thread-safe (shared ones mixed two results' bytes
        # under concurrent puts): one pair per thread.
        self._level = level
        self._codecs = threading.local()
        self._zstd = zstandard
        self._lock = threading.Lock()
        if str(path) != ":memory:":
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                path.touch(mode=0o600)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    # ------------------------------------------------------------------------------- writing

    def put(self, text: str, *, tenant: str = "default") -> StoredResult:
        """Store ``text`` for ``tenant`` (idempotent: the same text is stored once) and evict the
        least recently used results until the payload fits ``max_bytes``."""
        if not isinstance(text, str):
            raise TypeError(f"a tool result must be str, got {type(text).__name__}")
        _check_tenant(tenant)
        raw = text.encode("utf-8")
        if len(raw) > self.max_item_bytes:
            raise ValueError(f"tool result of {len(raw):,} bytes exceeds max_item_bytes={self.max_item_bytes:,}; "
                             "raise the bound or truncate the result before storing it")
        key = content_key(text)
        payload = self._compress(raw)
        if len(payload) > self.max_bytes:
            raise ValueError(f"tool result compresses to {len(payload):,} bytes, more than the store's "
                             f"max_bytes={self.max_bytes:,}")
        item = StoredResult(key, len(text), text.count("\n") + 1, _head(text), len(payload))
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                tick = self._tick()
                self._db.execute(
                    "INSERT INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (tenant, key) DO UPDATE SET last_used = excluded.last_used",
                    (tenant, key, payload, item.stored_bytes, item.chars, item.lines, item.head, tick))
                self._evict_to(self.max_bytes)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return item

    def _codec(self):
        codec = getattr(self._codecs, "pair", None)
        if codec is None:
            codec = self._codecs.pair = (self._zstd.ZstdCompressor(level=self._level), self._zstd.ZstdDecompressor())
        return codec

    def _compress(self, raw: bytes) -> bytes:
        return self._codec()[0].compress(raw)

    def _decompress(self, payload: bytes) -> bytes:
        return self._codec()[1].decompress(payload)

    def _tick(self) -> int:
        return self._db.execute("SELECT COALESCE(MAX(last_used), 0) + 1 FROM results").fetchone()[0]

    def _evict_to(self, bound: int) -> None:
        total = self._db.execute("SELECT COALESCE(SUM(stored_bytes), 0) FROM results").fetchone()[0]
        while total > bound:
            tenant, key, size = self._db.execute(
                "SELECT tenant, key, stored_bytes FROM results ORDER BY last_used LIMIT 1").fetchone()
            self._db.execute("DELETE FROM results WHERE tenant = ? AND key = ?", (tenant, key))
            total -= size

    # ------------------------------------------------------------------------------- reading

    def get(self, key: str, *, tenant: str = "default") -> str:
        """The result stored under ``key`` for ``tenant``; KeyError if it is not there (never
        stored, evicted, or stored by another tenant)."""
        _check_tenant(tenant)
        with self._lock:
            row = self._db.execute("SELECT payload FROM results WHERE tenant = ? AND key = ?", (tenant, key)).fetchone()
            if row is None:
                raise KeyError(f"no tool result {key!r} for tenant {tenant!r} (never stored, or evicted)")
            self._db.execute("UPDATE results SET last_used = ? WHERE tenant = ? AND key = ?", (self._tick(), tenant, key))
        try:
            text = self._decompress(row[0]).decode("utf-8")
        except (self._zstd.ZstdError, UnicodeDecodeError):
            text = None
        if text is None or content_key(text) != key:  # damaged: drop it, never return other content
            with self._lock:
                self._db.execute("DELETE FROM results WHERE tenant = ? AND key = ?", (tenant, key))
            raise KeyError(f"tool result {key!r} for tenant {tenant!r} was damaged in the store and is dropped")
        return text

    def __contains__(self, key: str) -> bool:
        return self.contains(key)

    def contains(self, key: str, *, tenant: str = "default") -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM results WHERE tenant = ? AND key = ?", (tenant, key)).fetchone() is not None

    # ------------------------------------------------------------------------------ references

    def reference(self, text: str, *, tenant: str = "default") -> str:
        """Store ``text`` and return the compact reference that replaces it in a prompt."""
        item = self.put(text, tenant=tenant)
        head = item.head.translate(_UNSAFE_IN_REFERENCE)
        return f'[tool result {item.key}: {item.chars:,} chars, {item.lines:,} lines; starts "{head}"]'

    def expand(self, text: str, *, tenant: str = "default") -> str:
        """``text`` with every reference this store made for ``tenant`` replaced by its result
        (KeyError if one was evicted)."""
        return _REFERENCE.sub(lambda m: self.get(m.group(1), tenant=tenant), text)

    # --------------------------------------------------------------------------------- stats

    def stats(self) -> dict:
        with self._lock:
            n, stored, chars = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(stored_bytes), 0), COALESCE(SUM(chars), 0) FROM results").fetchone()
        return {"results": n, "stored_bytes": stored, "chars": chars, "max_bytes": self.max_bytes}

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def content_key(text: str) -> str:
    """The xxh3-128 of ``text`` (UTF-8) in hex: the store's key and the reference's id (all 128
    bits: a shortened key would make a collision, a wrong result returned, merely unlikely)."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def references_in(text: str) -> list[str]:
    """The keys of the tool-result references in ``text``, in order."""
    return _REFERENCE.findall(text)


def _head(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first[:_HEAD_CHARS]


def _check_tenant(tenant) -> None:
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant must be a non-empty str, got {tenant!r}")


__all__ = ["StoredResult", "ToolResultStore", "content_key", "references_in"]
