"""ToolResultStore: content-hashed results in SQLite that survive a restart, stay within their byte
bound (least recently used out first), refuse oversized results, and never return another
tenant's data; references are deterministic and expand back to the result."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from samcache.agent import ToolResultStore, content_key, references_in


def page(i: int, size: int = 4000) -> str:
    """A result that does not compress away (zstd would shrink repeated text to nothing)."""
    import random

    rng = random.Random(i)
    return f"result {i}\n" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz \n") for _ in range(size))


def test_put_get_and_references(tmp_path):
    store = ToolResultStore(tmp_path / "tools.db")
    text = page(1)
    ref = store.reference(text)
    assert ref == store.reference(text)  # deterministic: the same result, the same reference
    assert ref.startswith(f"[tool result {content_key(text)}: ") and len(ref) < 120
    assert references_in(f"see {ref} and more") == [content_key(text)]
    assert store.expand(f"before {ref} after") == f"before {text} after"
    assert store.get(content_key(text)) == text
    assert store.stats()["results"] == 1  # stored once


def test_file_is_private_and_survives_a_restart(tmp_path):
    path = tmp_path / "sub" / "tools.db"
    text = page(2)
    ToolResultStore(path).put(text, tenant="alice")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # A new process opens the same file and reads the result back.
    code = ("import sys; from samcache.agent import ToolResultStore, content_key; "
            "s = ToolResultStore(sys.argv[1]); t = s.get(content_key(sys.argv[2]), tenant='alice'); "
            "print(len(t), t == sys.argv[2])")
    out = subprocess.run([sys.executable, "-c", code, str(path), text], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(len(text)), "True"]


def test_tenants_never_see_each_other(tmp_path):
    store = ToolResultStore(tmp_path / "tools.db")
    secret = page(3)
    ref = store.reference(secret, tenant="alice")
    key = content_key(secret)
    with pytest.raises(KeyError, match="bob"):
        store.get(key, tenant="bob")
    with pytest.raises(KeyError):
        store.expand(ref, tenant="bob")
    assert not store.contains(key, tenant="bob") and store.contains(key, tenant="alice")
    store.put(secret, tenant="bob")  # bob's own copy is his
    assert store.get(key, tenant="bob") == secret


def test_byte_bound_evicts_least_recently_used(tmp_path):
    one = len(__import__("zstandard").ZstdCompressor(level=3).compress(page(0).encode()))
    store = ToolResultStore(tmp_path / "tools.db", max_bytes=int(one * 3.5))
    keys = [store.put(page(i)).key for i in range(3)]
    store.get(keys[0])  # 0 is now more recent than 1
    store.put(page(3))
    assert store.contains(keys[0]) and not store.contains(keys[1]) and store.contains(keys[2])
    assert store.stats()["stored_bytes"] <= store.max_bytes
    with pytest.raises(KeyError, match="evicted"):
        store.get(keys[1])


def test_oversized_and_bad_input_are_refused(tmp_path):
    store = ToolResultStore(tmp_path / "tools.db", max_item_bytes=1000)
    with pytest.raises(ValueError, match="max_item_bytes"):
        store.put("x" * 1001)
    with pytest.raises(TypeError, match="str"):
        store.put(b"bytes")
    with pytest.raises(ValueError, match="tenant"):
        store.put("ok", tenant="")
    with pytest.raises(ValueError, match="max_bytes"):
        ToolResultStore(tmp_path / "b.db", max_bytes=0)
    tight = ToolResultStore(tmp_path / "c.db", max_bytes=100, max_item_bytes=10_000)
    with pytest.raises(ValueError, match="compresses to"):
        tight.put(page(5, 2000))
    assert store.stats()["results"] == 0  # nothing half-written


def test_concurrent_writers(tmp_path):
    store = ToolResultStore(tmp_path / "tools.db")
    errors = []

    def work(offset):
        try:
            for i in range(20):
                text = page(offset + i, 20_000)
                assert store.get(store.put(text).key) == text
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    # Many threads, large enough results that compressions overlap (shared zstd objects once mixed
    # two results' bytes here).
    threads = [threading.Thread(target=work, args=(k * 100,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and store.stats()["results"] == 120


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.text(min_size=0, max_size=300), min_size=1, max_size=12))
def test_any_text_round_trips_and_the_bound_holds(texts):
    store = ToolResultStore(":memory:", max_bytes=600)
    for t in texts:
        item = store.put(t)
        assert store.get(item.key) == t  # the newest result is always there
        assert store.stats()["stored_bytes"] <= 600


def test_a_damaged_payload_is_dropped_never_returned(tmp_path):
    import sqlite3

    import zstandard

    path = tmp_path / "tools.db"
    store = ToolResultStore(path)
    key = store.put(page(7)).key
    other = zstandard.ZstdCompressor().compress(page(8).encode())
    with sqlite3.connect(path) as db:  # another result's bytes under this key
        db.execute("UPDATE results SET payload = ? WHERE key = ?", (other, key))
    with pytest.raises(KeyError, match="damaged"):
        store.get(key)
    assert not store.contains(key)
