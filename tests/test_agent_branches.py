"""The branch context tree: forks share blocks by reference, abandoned branches' private blocks
become evictable first, memory is accounted per branch, and random fork/abandon/continue keeps
the pool's invariants (hypothesis). Then the same through the engine's held sessions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from samcache.agent import ContextTree
from samcache.cache.block_pool import BlockPool

BS = 16


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=n, dtype=np.int32)


def blocks_for(n: int) -> int:
    return -(-n // BS)


def test_forks_share_the_context_and_pay_only_for_their_suffixes():
    pool = BlockPool(256, BS)
    tree = ContextTree(pool)
    root = tree.root(name="planner")
    root.extend(tokens(1000, 0))  # 62.5 blocks: the last one partial
    workers = [root.fork(f"worker {i}") for i in range(8)]
    suffix = 40
    for i, w in enumerate(workers):
        res = w.extend(tokens(suffix, 100 + i))
        # The first write into the shared partial block copies it (copy-on-write), once per fork.
        assert res.copies.shape == (1, 2)
    root.abandon()
    m = tree.memory()
    one = blocks_for(1000)
    per_suffix = blocks_for(1000 + suffix) - 1000 // BS  # the copied partial block and the new ones
    assert m.held_blocks == 1000 // BS + 8 * per_suffix
    assert m.clone_blocks == 8 * blocks_for(1000 + suffix)
    assert m.held_blocks <= 1.15 * (one + 8 * blocks_for(suffix))
    # Per branch: the shared context counts once in the fair shares, which sum to what is held.
    assert sum(b.fair_share for b in m.branches.values()) == pytest.approx(m.held_blocks)
    for b in m.branches.values():
        assert b.private_blocks == per_suffix and b.shared_blocks == 1000 // BS
    tree.check_invariants()


def test_abandoned_private_blocks_are_evicted_before_other_cached_blocks():
    pool = BlockPool(40, BS)
    other = pool.new_sequence()
    other_tokens = tokens(10 * BS, 1)
    pool.append_tokens(other, other_tokens)
    pool.free_sequence(other)  # cached, evictable, and older than the branch: plain LRU takes it first
    tree = ContextTree(pool)
    root = tree.root()
    root.extend(tokens(8 * BS, 2))
    keep, drop = root.fork(), root.fork()
    keep.extend(tokens(4 * BS, 3))
    drop.extend(tokens(10 * BS, 4))
    root.abandon()
    free_before = pool.num_free_blocks()
    assert drop.abandon() == 10  # its own 10 blocks; the 8 shared with `keep` stay held
    assert pool.num_free_blocks() == free_before + 10  # evictable at once
    assert drop.abandon() == 0  # twice: a no-op
    # Take every free block and then 10 more: the abandoned branch's, not the older cached ones.
    taker = pool.new_sequence()
    pool.append_slots(taker, pool.stats()["free_blocks"] * BS + 10 * BS)
    assert len(pool.match_prefix(other_tokens)) == 10
    assert len(pool.match_prefix(np.concatenate([tokens(8 * BS, 2), tokens(10 * BS, 4)]))) == 8
    tree.check_invariants()


def test_reclaim_frees_at_once_and_children_outlive_their_parent():
    pool = BlockPool(64, BS)
    tree = ContextTree(pool)
    root = tree.root()
    root.extend(tokens(5 * BS, 0))
    child = root.fork()
    root.extend(tokens(3 * BS, 1))  # root's own blocks
    free = pool.stats()["free_blocks"]
    assert root.abandon(reclaim=True) == 3
    assert pool.stats()["free_blocks"] == free + 3
    assert all(pool.refcount(int(b)) == 1 for b in child.block_table())
    child.extend(tokens(BS, 2))
    assert child.num_tokens == 6 * BS
    with pytest.raises(ValueError, match="abandoned"):
        root.extend(tokens(1, 3))
    with pytest.raises(ValueError, match="abandoned"):
        root.fork()
    assert root in tree.branches("abandoned")  # kept while a descendant is open
    child.abandon()
    assert tree.branches() == []  # both forgotten
    assert pool.stats()["live_sequences"] == 0
    tree.check_invariants()


def test_release_for_blocks_gives_up_least_recently_used_holds_first():
    pool = BlockPool(12, BS)
    tree = ContextTree(pool)
    a, b = tree.root(name="a"), tree.root(name="b")
    a.extend(tokens(5 * BS, 0))
    b.extend(tokens(5 * BS, 1))
    a.extend(tokens(BS, 2))  # a used last
    assert pool.num_free_blocks() == 1
    assert tree.release_for_blocks(3) == 1
    assert b.state == "released" and a.state == "live" and pool.num_free_blocks() == 6
    b.extend(tokens(BS, 3))  # a released branch goes on (a new sequence)
    assert b.state == "live" and b.num_tokens == BS
    res = b.extend_slots(3)  # tokens the pool is not told: slots only, never prefix-cached
    assert len(res.slots) == 3 and b.num_tokens == BS + 3
    tree.check_invariants()


def test_bad_input_is_refused_clearly():
    pool = BlockPool(8, BS)
    with pytest.raises(TypeError, match="BlockPool"):
        ContextTree("pool")
    tree = ContextTree(pool)
    with pytest.raises(TypeError, match="Namespace"):
        tree.root("tenant-a")
    with pytest.raises(TypeError, match="name"):
        tree.root(name=3)
    with pytest.raises(ValueError, match="state"):
        tree.branches("dead")
    with pytest.raises(ValueError, match="blocks"):
        tree.release_for_blocks(-1)


# ---- random fork / abandon / continue ----------------------------------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["fork", "extend", "abandon", "release", "reclaim"]),
                         st.integers(0, 63), st.integers(1, 40)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_random_tree_operations_keep_the_pool_consistent(ops):
    pool = BlockPool(96, BS)
    tree = ContextTree(pool)
    expected: dict[int, int] = {}  # branch id -> tokens it holds
    first = tree.root()
    first.extend(tokens(20, 0))
    expected[first.id] = 20
    nodes = [first]
    for step, (op, pick, n) in enumerate(ops):
        b = nodes[pick % len(nodes)]
        try:
            if op == "fork":
                child = b.fork()
                nodes.append(child)
                expected[child.id] = expected.get(b.id, 0) if b.state == "live" else 0
            elif op == "extend":
                if pool.num_free_blocks() < blocks_for(n) + 1:
                    continue
                was_live = b.state == "live" and b.seq is not None
                b.extend(tokens(n, step + 1))
                expected[b.id] = (expected.get(b.id, 0) if was_live else 0) + n
            elif op == "abandon":
                b.abandon()
            elif op == "reclaim":
                b.abandon(reclaim=True)
            else:
                b.release()
                expected[b.id] = 0
        except ValueError as e:
            assert "abandoned" in str(e) and b.state == "abandoned"
        tree.check_invariants()
        for node in nodes:
            if node.state == "live" and node.seq is not None:
                assert node.num_tokens == expected[node.id]
        m = tree.memory()
        assert m.held_blocks <= m.clone_blocks
        assert sum(x.fair_share for x in m.branches.values()) <= m.held_blocks + 1e-9
    for node in nodes:
        node.abandon()
    assert pool.stats()["live_sequences"] == 0 and pool.num_free_blocks() == pool.num_blocks
    assert tree.branches() == []
    tree.check_invariants()


# ---- the engine's held sessions ----------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    pytest.importorskip("transformers")
    from engine_helpers import make_engine

    return make_engine(tiny_checkpoints["qwen2_5_vl"])


def test_held_sessions_fork_share_blocks_and_abandon(engine):
    from samcache.engine import screenshot

    from engine_helpers import SIZE

    shots = [screenshot(s, SIZE) for s in (1, 2, 3)]
    plain = engine.new_session("You operate a computer.")
    held = engine.new_session("You operate a computer.", hold_context=True)
    a = engine.chat(images=shots, prompt="Describe the screens.", session=plain, max_new_tokens=6, ignore_eos=True)
    b = engine.chat(images=shots, prompt="Describe the screens.", session=held, max_new_tokens=6, ignore_eos=True)
    assert a.token_ids == b.token_ids  # holding changes what is kept, never what is computed
    one = engine.context_memory()
    assert len(one.branches) == 1 and one.held_blocks == held.branch.memory().blocks > 0

    forks = [engine.fork_session(held, name=f"worker {i}") for i in range(4)]
    engine.abandon_session(held)
    for i, f in enumerate(forks):
        r = engine.chat(prompt=f"Worker {i}: click the button number {i}.", session=f, max_new_tokens=4,
                        ignore_eos=True)
        assert r.metrics.prefix_reused_tokens > 0  # the shared context is adopted, not recomputed
    m = engine.context_memory()
    assert len(m.branches) == 4
    assert m.held_blocks < 0.5 * m.clone_blocks  # the context is held once, not four times
    engine.check_invariants()

    with pytest.raises(ValueError, match="abandoned"):
        engine.chat(prompt="again", session=held)
    with pytest.raises(ValueError, match="hold_context"):
        engine.fork_session(plain)
    with pytest.raises(TypeError, match="Session"):
        engine.abandon_session("session")
    with pytest.raises(TypeError, match="hold_context"):
        engine.new_session(hold_context="yes")
    for f in forks:
        engine.abandon_session(f, reclaim=True)
    assert engine.context_memory().held_blocks == 0
    assert engine.pool.stats()["live_sequences"] == len(engine.image_kv_store)
    engine.check_invariants()


def test_held_sessions_give_way_under_memory_pressure(tiny_checkpoints):
    from samcache.engine import screenshot

    from engine_helpers import SIZE, make_engine

    small = make_engine(tiny_checkpoints["qwen2_5_vl"], num_blocks=24, image_kv_cache=False)
    sessions = []
    for i in range(12):  # each holds a few blocks: the 24-block pool cannot hold them all
        s = small.new_session(hold_context=True)
        sessions.append(s)
        small.chat(images=[screenshot(10 + i, SIZE)], prompt=f"Screen {i}.", session=s, max_new_tokens=4,
                   ignore_eos=True)
        small.check_invariants()
    states = [s.branch.state for s in sessions]
    assert states[-1] == "live" and "released" in states[:-1]
    first_live = states.index("live")
    assert set(states[:first_live]) == {"released"}  # least recently used first
    # A released session goes on; its next turn holds again.
    again = next(s for s in sessions if s.branch.state == "released")
    small.chat(prompt="Next.", session=again, max_new_tokens=2, ignore_eos=True)
    assert again.branch.state == "live"
    small.check_invariants()
