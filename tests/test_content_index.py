"""ContentIndex: behaviour, a stateful property test against a Python model, bad input, threads."""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import samcache
from samcache import CacheFull, ContentIndex, ContentKey, Namespace, NotFound, Tier

NS = Namespace("model")


def key(i):
    return NS.key(samcache.hash_bytes(str(i).encode()))


def test_put_get_peek_and_eviction_returns_payloads():
    index = ContentIndex(100)
    assert index.put(key(1), handle=10, size_bytes=40) == (True, [])
    assert index.put(key(1), handle=11, size_bytes=40).inserted is False  # present: unchanged
    assert index.get(key(1)).handle == 10 and index.get(key(2)) is None
    index.put(key(2), 20, 40, tier=Tier.HOST)
    index.get(key(1))  # key(2) becomes least recently used
    res = index.put(key(3), 30, 40)
    assert [(e.key, e.entry.handle) for e in res.evicted] == [(key(2), 20)]
    assert key(2) not in index and key(1) in index and len(index) == 2
    e = index.peek(key(1))
    assert (e.handle, e.size_bytes, e.tier, e.pins, e.priority) == (10, 40, Tier.DEVICE, 0, 0)
    assert index.stats()["hits"] == 2 and index.stats()["misses"] == 1


def test_namespaces_never_share_entries():
    content = samcache.hash_bytes(b"screenshot")
    a, b, c = Namespace("m1"), Namespace("m1", tenant="t"), Namespace("m2")
    index = ContentIndex(1 << 20)
    index.put(a.key(content), 1, 10)
    assert index.get(b.key(content)) is None and index.get(c.key(content)) is None
    assert index.get(a.key(content)).handle == 1


def test_pins_protect_and_cache_full_changes_nothing():
    index = ContentIndex(100)
    index.put(key(1), 1, 60)
    index.put(key(2), 2, 30)
    with index.pinned(key(1)) as entry:
        assert entry.pins == 1
        with pytest.raises(CacheFull, match="cannot fit"):
            index.put(key(3), 3, 50)
        assert len(index) == 2 and index.used_bytes == 90
        assert [e.key for e in index.evict_until(0)] == [key(2)]
        assert key(1) in index
    assert index.peek(key(1)).pins == 0
    assert [e.key for e in index.evict_until(0)] == [key(1)]
    index.check_invariants()


def test_priority_then_recency_order():
    index = ContentIndex(1000)
    for i in range(5):
        index.put(key(i), i, 10, priority=i % 2)  # priorities 0,1,0,1,0
    index.get(key(0))  # most recent of the priority-0 group
    index.set_priority(key(3), -1)
    order = [e.entry.handle for e in index.evict_until(0)]
    assert order == [3, 2, 4, 0, 1]


def test_get_many_and_tiers():
    index = ContentIndex(1000)
    for i in range(4):
        index.put(key(i), i * 7, 1)
    handles = index.get_many([key(0), key(9), key(3)])
    assert handles.dtype == np.int64 and handles.tolist() == [0, -1, 21]
    index.set_tier(key(3), Tier.DISK)
    assert index.peek(key(3)).tier == Tier.DISK
    assert index.get_many([]).tolist() == []


def test_bad_input():
    index = ContentIndex(100)
    index.put(key(1), 1, 10)
    raw = samcache.hash_bytes(b"x")
    cases = [
        (lambda: ContentIndex(-1), ValueError),
        (lambda: ContentIndex(1.5), TypeError),
        (lambda: index.get(raw), TypeError),  # a bare content hash has no namespace
        (lambda: index.get(raw.digest), TypeError),
        (lambda: index.put(raw, 1, 1), TypeError),
        (lambda: index.put(key(2), -1, 1), ValueError),
        (lambda: index.put(key(2), 1, -1), ValueError),
        (lambda: index.put(key(2), 1, 0), ValueError),  # zero bytes could never be evicted
        (lambda: index.put(key(2), 1, 1, priority=2**31), ValueError),
        (lambda: index.put(key(2), 1, 1, tier=1), TypeError),
        (lambda: index.put(key(2), 1, 101), CacheFull),
        (lambda: index.remove(key(9)), NotFound),
        (lambda: index.pin(key(9)), NotFound),
        (lambda: index.unpin(key(1)), ValueError),  # not pinned
        (lambda: index.set_priority(key(9), 1), NotFound),
        (lambda: index.set_tier(key(1), "disk"), TypeError),
        (lambda: index.evict_until(-1), ValueError),
        (lambda: index.get_many([key(1), raw]), TypeError),
        (lambda: ContentKey(b"short"), TypeError),
    ]
    for call, exc in cases:
        with pytest.raises(exc):
            call()
        index.check_invariants()
    index.pin(key(1))
    with pytest.raises(ValueError, match="pinned"):
        index.remove(key(1))
    assert len(index) == 1 and index.used_bytes == 10


class IndexMachine(RuleBasedStateMachine):
    """Random put/get/pin/unpin/remove/priority/evict against a Python model of the order:
    unpinned entries leave lowest priority first, then least recent use."""

    CAPACITY = 200

    def __init__(self):
        super().__init__()
        self.index = ContentIndex(self.CAPACITY)
        self.model = {}  # i -> dict(size, pins, priority, last_use)
        self.clock = 0

    def _tick(self):
        self.clock += 1
        return self.clock

    def _check_evicted(self, evicted):
        for e in evicted:
            i = e.entry.handle
            m = self.model.pop(i)
            assert m["pins"] == 0, "a pinned entry was evicted"
            order = (m["priority"], m["last_use"])
            for other in self.model.values():
                if other["pins"] == 0:
                    assert order <= (other["priority"], other["last_use"]), "evicted out of order"

    @rule(i=st.integers(0, 15), size=st.integers(1, 120), priority=st.integers(-2, 2))
    def put(self, i, size, priority):
        pinned = sum(m["size"] for m in self.model.values() if m["pins"])
        try:
            res = self.index.put(key(i), i, size, priority=priority)
        except CacheFull:
            assert i not in self.model and pinned + size > self.CAPACITY
            return
        if i in self.model:
            assert not res.inserted and not res.evicted
            return
        self._check_evicted(res.evicted)
        self.model[i] = dict(size=size, pins=0, priority=priority, last_use=self._tick())

    @rule(i=st.integers(0, 15))
    def get(self, i):
        e = self.index.get(key(i))
        assert (e is not None) == (i in self.model)
        if e is not None:
            self.model[i]["last_use"] = self._tick()

    @rule(i=st.integers(0, 15))
    def pin(self, i):
        if i in self.model:
            self.index.pin(key(i))
            self.model[i]["pins"] += 1

    @rule(i=st.integers(0, 15))
    def unpin(self, i):
        if i in self.model and self.model[i]["pins"]:
            self.index.unpin(key(i))
            self.model[i]["pins"] -= 1

    @rule(i=st.integers(0, 15))
    def remove(self, i):
        if i in self.model and not self.model[i]["pins"]:
            assert self.index.remove(key(i)).handle == i
            del self.model[i]

    @rule(i=st.integers(0, 15), priority=st.integers(-2, 2))
    def set_priority(self, i, priority):
        if i in self.model:
            self.index.set_priority(key(i), priority)
            self.model[i]["priority"] = priority

    @rule(target_bytes=st.integers(0, 200))
    def evict_until(self, target_bytes):
        self._check_evicted(self.index.evict_until(target_bytes))
        used = sum(m["size"] for m in self.model.values())
        unpinned = [m for m in self.model.values() if m["pins"] == 0]
        assert used <= target_bytes or not unpinned

    @invariant()
    def consistent(self):
        self.index.check_invariants()
        s = self.index.stats()
        assert s["entries"] == len(self.model)
        assert s["used_bytes"] == sum(m["size"] for m in self.model.values()) <= self.CAPACITY
        assert s["pinned_bytes"] == sum(m["size"] for m in self.model.values() if m["pins"])


TestIndexMachine = IndexMachine.TestCase


def test_threads_stress_keeps_invariants(run_threads):
    index = ContentIndex(1 << 14)

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(4000):
            k = key(int(rng.integers(300)))
            op = rng.integers(6)
            try:
                if op < 2:
                    index.put(k, 1, 1 + int(rng.integers(512)), priority=int(rng.integers(3)))
                elif op == 2:
                    index.get(k)
                elif op == 3:
                    with index.pinned(k):
                        index.get(k)
                elif op == 4:
                    index.evict_until(1 << 13)
                else:
                    index.check_invariants()
            except NotFound:
                pass

    run_threads(worker)
    index.check_invariants()
    assert index.stats()["pinned_bytes"] == 0


def test_many_stale_heap_nodes_keep_every_entry_evictable():
    """Recency updates and pin cycles leave stale heap nodes; rebuilding them must keep every
    unpinned entry reachable (a regression: entries used after their node was pushed got lost)."""
    index = ContentIndex(100)
    for i in range(3):
        index.put(key(i), i, 30)
    index.get(key(0))
    index.get(key(1))
    for _ in range(1100):
        with index.pinned(key(2)):
            pass
    index.check_invariants()
    assert index.stats()["eviction_heap_nodes"] <= 2 * 3 + 1024 + 1
    assert sorted(e.entry.handle for e in index.evict_until(0)) == [0, 1, 2]
    assert index.used_bytes == 0


def test_huge_sizes_do_not_overflow():
    index = ContentIndex(100)
    index.put(key(1), 1, 10)
    index.pin(key(1))
    with pytest.raises(CacheFull):
        index.put(key(2), 2, 2**63 - 1)
    index.unpin(key(1))
    with pytest.raises(CacheFull):
        index.put(key(2), 2, 2**63 - 1)
    assert index.used_bytes == 10 and len(index) == 1
    index.check_invariants()
