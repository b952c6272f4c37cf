"""BlockPool: behaviour, a stateful property test over a simulated KV memory, bad input, threads."""

import numpy as np
import pytest
import xxhash
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import samcache
from samcache import BlockPool, Namespace, NotFound, OutOfBlocks

IMAGE_PAD = 151655


def tables(pool, seqs):
    return {s: pool.block_table(s) for s in seqs}


def test_append_returns_int32_slots_in_table_order():
    pool = BlockPool(8, 4)
    seq = pool.new_sequence()
    res = pool.append_tokens(seq, np.arange(10))
    assert res.slots.dtype == np.int32 and res.copies.dtype == np.int32 and res.copies.shape == (0, 2)
    table = pool.block_table(seq)
    assert table.dtype == np.int32
    np.testing.assert_array_equal(res.slots, [table[i // 4] * 4 + i % 4 for i in range(10)])
    assert pool.num_tokens(seq) == 10 and pool.num_free_blocks() == 5


def test_share_blocks_holds_a_span_of_blocks_and_refuses_bad_ranges():
    pool = BlockPool(8, 4)
    seq = pool.new_sequence()
    pool.append_tokens(seq, list(range(14)))
    table = pool.block_table(seq)
    holder = pool.share_blocks(seq, 1, 2)
    assert pool.block_table(holder).tolist() == table[1:3].tolist() and pool.num_tokens(holder) == 8
    assert [pool.refcount(int(b)) for b in table] == [1, 2, 2, 1]
    appended = pool.append_slots(holder, 1)  # a holder's tail is full: an append takes a new block
    assert appended.copies.size == 0 and int(appended.slots[0]) // 4 not in table.tolist()
    pool.free_sequence(seq)
    assert [pool.refcount(int(b)) for b in table[1:3]] == [1, 1]
    for first, count, exc in ((-1, 1, ValueError), (1, 0, ValueError), (3, 2, ValueError), (0, True, TypeError)):
        with pytest.raises(exc):
            pool.share_blocks(holder, first, count)
    with pytest.raises(NotFound):
        pool.share_blocks(seq, 0, 1)  # freed
    pool.free_sequence(holder)
    pool.check_invariants()
    assert pool.num_free_blocks() == 8


def test_fork_shares_then_copies_on_write():
    pool = BlockPool(8, 4)
    a = pool.new_sequence()
    pool.append_slots(a, 6)
    b = pool.fork(a)
    ta = pool.block_table(a)
    np.testing.assert_array_equal(pool.block_table(b), ta)
    assert [pool.refcount(x) for x in ta] == [2, 2]
    slots, copies = pool.append_slots(b, 3)  # fills b's private copy, then a new block
    tb = pool.block_table(b)
    np.testing.assert_array_equal(copies, [[ta[1], tb[1]]])
    assert tb[0] == ta[0] and tb[1] != ta[1]
    assert list(slots) == [tb[1] * 4 + 2, tb[1] * 4 + 3, tb[2] * 4]
    assert pool.stats()["cow_copies"] == 1


def test_prefix_reuse_after_free_and_namespace_isolation():
    pool = BlockPool(16, 4)
    ns_a, ns_b = Namespace("m", tenant="a"), Namespace("m", tenant="b")
    tokens = np.arange(11)
    s = pool.new_sequence(ns_a)
    pool.append_tokens(s, tokens)
    first_two = pool.block_table(s)[:2]
    pool.free_sequence(s)
    np.testing.assert_array_equal(pool.match_prefix(tokens, namespace=ns_a), first_two)
    assert pool.match_prefix(tokens, namespace=ns_b).size == 0
    assert pool.match_prefix(tokens).size == 0  # default namespace
    assert pool.match_prefix(tokens[:7], namespace=ns_a).size == 1
    t = pool.new_sequence(ns_a)
    assert pool.adopt_prefix(t, tokens) == 8
    np.testing.assert_array_equal(pool.block_table(t), first_two)
    pool.append_tokens(t, tokens[8:])
    assert pool.num_tokens(t) == 11
    pool.check_invariants()


def test_image_extra_keys_separate_equal_placeholders():
    pool = BlockPool(16, 4)
    img1, img2 = samcache.hash_bytes(b"one"), samcache.hash_bytes(b"two")
    tokens = np.array([1, 2] + [IMAGE_PAD] * 8 + [3, 4])
    s = pool.new_sequence()
    pool.append_tokens(s, tokens, extra_keys=[(2, 10, img1)])
    pool.free_sequence(s)
    assert pool.match_prefix(tokens, [(2, 10, img1)]).size == 3
    assert pool.match_prefix(tokens, [(2, 10, img2)]).size == 0
    assert pool.match_prefix(tokens).size == 0
    assert pool.match_prefix(tokens, [(2, 9, img1)]).size == 0  # other span geometry


def test_block_hash_follows_the_documented_chain():
    """hash = xxh3_128(parent || int32 tokens || per overlapping span: key || i64 start-s || i64 end-s)."""
    bs = 4
    pool = BlockPool(8, bs)
    ns = Namespace("model-x", tenant="t")
    img = samcache.hash_bytes(b"image")
    tokens = np.array([7, 8, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, 9], dtype=np.int32)
    span = (2, 7, img)
    seq = pool.new_sequence(ns)
    pool.append_tokens(seq, tokens[:3], [span])  # spans may be given before their tokens arrive
    pool.append_tokens(seq, tokens[3:], [span])  # and again: duplicates count once
    parent = ns.digest
    for i, block in enumerate(pool.block_table(seq)):
        s = i * bs
        buf = parent + tokens[s : s + bs].tobytes()
        if span[0] < s + bs and span[1] > s:
            buf += img.digest + np.array([span[0] - s, span[1] - s], dtype="<i8").tobytes()
        expected = xxhash.xxh3_128_intdigest(buf).to_bytes(16, "little")
        assert pool.block_hash(int(block)) == expected
        parent = expected


def test_out_of_blocks_only_after_eviction_fails():
    pool = BlockPool(4, 2)
    for i in range(4):  # fill the pool with cached, unreferenced blocks
        s = pool.new_sequence()
        pool.append_tokens(s, [i, i])
        pool.free_sequence(s)
    assert pool.stats()["evictable_blocks"] == 4 and pool.num_free_blocks() == 4
    s = pool.new_sequence()
    pool.append_slots(s, 8)  # takes all four by eviction
    assert pool.stats()["evictions"] == 4
    with pytest.raises(OutOfBlocks, match="needs 1 blocks but only 0"):
        pool.append_slots(s, 1)
    assert pool.num_tokens(s) == 8
    pool.check_invariants()


def test_eviction_priority_per_sequence_and_block():
    pool = BlockPool(3, 2)
    seqs = []
    for i in range(3):
        s = pool.new_sequence()
        pool.append_tokens(s, [i, i])
        seqs.append(s)
    blocks = [int(pool.block_table(s)[0]) for s in seqs]
    pool.set_sequence_priority(seqs[0], 10)  # oldest, but protected
    pool.set_block_priority([blocks[2]], -5)  # newest, but evicted first
    for s in seqs:
        pool.free_sequence(s)
    assert pool.evict(1) == 1 and pool.block_hash(blocks[2]) is None
    assert pool.evict(1) == 1 and pool.block_hash(blocks[1]) is None
    assert pool.block_hash(blocks[0]) is not None
    assert pool.evict(5) == 1
    pool.check_invariants()


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, exc",
    [((0, 4), ValueError), ((4, 0), ValueError), ((-1, 4), ValueError), (("4", 4), TypeError),
     ((4.0, 4), TypeError), ((1 << 30, 1 << 10), ValueError)],
)
def test_constructor_rejects(args, exc):
    with pytest.raises(exc):
        BlockPool(*args)


def test_bad_input_raises_clearly_and_changes_nothing():
    pool = BlockPool(4, 4)
    s = pool.new_sequence()
    pool.append_tokens(s, [1, 2])
    before = pool.stats()
    cases = [
        (lambda: pool.new_sequence(namespace="tenant"), TypeError),
        (lambda: pool.fork(999), NotFound),
        (lambda: pool.fork("1"), TypeError),
        (lambda: pool.free_sequence(-5), NotFound),
        (lambda: pool.append_slots(s, -1), ValueError),
        (lambda: pool.append_slots(s, 1.5), TypeError),
        (lambda: pool.append_slots(s, 17), OutOfBlocks),
        (lambda: pool.append_slots(s, 10**15), OutOfBlocks),
        (lambda: pool.append_tokens(s, [1.0, 2.0]), TypeError),
        (lambda: pool.append_tokens(s, [[1, 2]]), ValueError),
        (lambda: pool.append_tokens(s, [2**40]), ValueError),
        (lambda: pool.append_tokens(s, ["a"]), TypeError),
        (lambda: pool.append_tokens(s, [1], extra_keys=[(0, 1)]), TypeError),
        (lambda: pool.append_tokens(s, [1], extra_keys=[(3, 3, b"x" * 16)]), ValueError),
        (lambda: pool.append_tokens(s, [1], extra_keys=[(-1, 3, b"x" * 16)]), ValueError),
        (lambda: pool.append_tokens(s, [1], extra_keys=[(0, 3, b"short")]), TypeError),
        (lambda: pool.append_tokens(s, [1], extra_keys=[(0.5, 3, b"x" * 16)]), TypeError),
        (lambda: pool.match_prefix(np.zeros((2, 2), dtype=np.int32)), ValueError),
        (lambda: pool.match_prefix([1], namespace=b"ns"), TypeError),
        (lambda: pool.adopt_prefix(s, [1, 2, 3, 4]), ValueError),  # not empty
        (lambda: pool.block_table(12345), NotFound),
        (lambda: pool.num_tokens(12345), NotFound),
        (lambda: pool.refcount(-1), IndexError),
        (lambda: pool.refcount(4), IndexError),
        (lambda: pool.block_hash(99), IndexError),
        (lambda: pool.set_block_priority([0, 99], 1), IndexError),
        (lambda: pool.set_block_priority([0], 2**31), ValueError),
        (lambda: pool.set_block_priority([0], "high"), TypeError),
        (lambda: pool.set_sequence_priority(12345, 1), NotFound),
        (lambda: pool.evict(-1), ValueError),
    ]
    for call, exc in cases:
        with pytest.raises(exc):
            call()
        pool.check_invariants()
    after = pool.stats()
    assert after["free_blocks"] == before["free_blocks"] and pool.num_tokens(s) == 2
    pool.free_sequence(s)
    with pytest.raises(NotFound, match="already freed"):
        pool.free_sequence(s)  # double free
    with pytest.raises(NotFound):
        pool.append_slots(s, 1)


def test_torch_and_numpy_token_inputs():
    import torch

    pool = BlockPool(8, 4)
    s = pool.new_sequence()
    pool.append_tokens(s, torch.arange(5))
    pool.append_tokens(s, np.arange(3, dtype=np.uint8))
    with pytest.raises(TypeError):
        pool.append_tokens(s, torch.ones(3))
    assert pool.num_tokens(s) == 8


# ---- stateful property test over a simulated KV memory ---------------------------------------------

NUM_BLOCKS, BLOCK_SIZE = 24, 4
IMAGES = [samcache.hash_bytes(bytes([i])) for i in range(3)]


class PoolMachine(RuleBasedStateMachine):
    """Random new/append/fork/free/match/adopt/priority/evict sequences. The machine keeps what
    each sequence should read back and a simulated KV memory written at the returned slots
    (after performing the returned copies): every sequence must always read exactly its own
    content, whoever shares its blocks and whatever was evicted."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
        self.memory = np.full(NUM_BLOCKS * BLOCK_SIZE, -1, dtype=np.int64)
        self.content = {}  # seq -> list of encoded values (token * 8 + image id + 1)
        self.spans = {}  # seq -> extra keys given so far (absolute positions)
        self.namespaces = [None, Namespace("m", tenant="x")]
        self.ns_of = {}

    def _write(self, seq, res, values):
        for src, dst in res.copies:
            self.memory[dst * BLOCK_SIZE : (dst + 1) * BLOCK_SIZE] = self.memory[src * BLOCK_SIZE : (src + 1) * BLOCK_SIZE]
        blocks = res.slots // BLOCK_SIZE
        for b in set(blocks.tolist()):
            assert self.pool.refcount(b) == 1, "a returned slot lies in a shared block"
        assert set(res.copies[:, 1].tolist()) <= set(self.pool.block_table(seq).tolist())
        self.memory[res.slots] = values
        self.content[seq].extend(values)

    @staticmethod
    def _encode(tokens, image):
        return [t * 8 + (image + 1 if image is not None else 0) for t in tokens]

    @rule(ns=st.integers(0, 1))
    def new(self, ns):
        if len(self.content) >= 8:
            return
        s = self.pool.new_sequence(self.namespaces[ns])
        self.content[s], self.spans[s], self.ns_of[s] = [], [], ns

    @precondition(lambda self: self.content)
    @rule(data=st.data(), n=st.integers(0, 9), image=st.one_of(st.none(), st.integers(0, 2)), known=st.booleans())
    def append(self, data, n, image, known):
        seq = data.draw(st.sampled_from(sorted(self.content)))
        tokens = [IMAGE_PAD] * n if image is not None else data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
        start = len(self.content[seq])
        keys = [(start, start + n, IMAGES[image])] if image is not None and n else []
        try:
            if known:
                res = self.pool.append_tokens(seq, tokens, keys)
            else:
                res = self.pool.append_slots(seq, n)
        except OutOfBlocks:
            assert self.pool.num_free_blocks() < -(-(start + n) // BLOCK_SIZE) - len(self.pool.block_table(seq)) + 1
            return
        self.spans[seq] += keys
        self._write(seq, res, self._encode(tokens, image))

    @precondition(lambda self: self.content and len(self.content) < 8)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(sorted(self.content)))
        child = self.pool.fork(seq)
        self.content[child] = list(self.content[seq])
        self.spans[child] = list(self.spans[seq])
        self.ns_of[child] = self.ns_of[seq]

    @precondition(lambda self: self.content)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.content)))
        self.pool.free_sequence(seq)
        del self.content[seq], self.spans[seq], self.ns_of[seq]

    @precondition(lambda self: self.content and len(self.content) < 8)
    @rule(data=st.data())
    def adopt(self, data):
        """Replay a live sequence's tokens into a new sequence: adopted blocks must hold them."""
        donor = data.draw(st.sampled_from(sorted(self.content)))
        values = self.content[donor]
        tokens = [v // 8 for v in values]
        ns = self.ns_of[donor]
        matched = self.pool.match_prefix(tokens, self.spans[donor], namespace=self.namespaces[ns])
        s = self.pool.new_sequence(self.namespaces[ns])
        self.content[s], self.spans[s], self.ns_of[s] = [], list(self.spans[donor]), ns
        n = self.pool.adopt_prefix(s, tokens, self.spans[donor])
        assert n == len(matched) * BLOCK_SIZE
        self.content[s] = list(values[:n])

    @precondition(lambda self: self.content)
    @rule(data=st.data(), priority=st.integers(-3, 3))
    def priority(self, data, priority):
        self.pool.set_sequence_priority(data.draw(st.sampled_from(sorted(self.content))), priority)

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        self.pool.evict(n)

    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        holders = {}
        for seq, content in self.content.items():
            table = self.pool.block_table(seq)
            assert len(table) == -(-len(content) // BLOCK_SIZE)
            slots = np.array([table[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(len(content))], dtype=np.int64)
            np.testing.assert_array_equal(self.memory[slots], content, err_msg=f"sequence {seq} reads foreign data")
            for b in table.tolist():
                holders[b] = holders.get(b, 0) + 1
        for b in range(NUM_BLOCKS):
            assert self.pool.refcount(b) == holders.get(b, 0)

    def teardown(self):
        for seq in list(self.content):
            self.pool.free_sequence(seq)
        assert self.pool.num_free_blocks() == NUM_BLOCKS
        self.pool.evict(NUM_BLOCKS)
        s = self.pool.stats()
        assert s["free_blocks"] == NUM_BLOCKS and s["cached_blocks"] == 0 and s["live_sequences"] == 0
        self.pool.check_invariants()


TestPoolMachine = PoolMachine.TestCase


# ---- threads -----------------------------------------------------------------------------------------


def test_threads_stress_keeps_invariants(run_threads):
    pool = BlockPool(256, 8)

    def worker(seed):
        rng = np.random.default_rng(seed)
        mine = []
        for _ in range(3000):
            op = rng.integers(6)
            if op == 0 or not mine:
                mine.append(pool.new_sequence())
                continue
            s = mine[rng.integers(len(mine))]
            try:
                if op == 1:
                    mine.append(pool.fork(s))
                elif op == 2:
                    pool.free_sequence(s)
                    mine.remove(s)
                elif op == 3:
                    pool.append_tokens(s, rng.integers(0, 3, rng.integers(0, 20)))
                elif op == 4:
                    t = pool.new_sequence()
                    mine.append(t)
                    pool.adopt_prefix(t, rng.integers(0, 3, 24))
                else:
                    pool.check_invariants()
            except OutOfBlocks:
                for x in mine:
                    pool.free_sequence(x)
                mine.clear()
        for x in mine:
            pool.free_sequence(x)

    run_threads(worker)
    pool.check_invariants()
    assert pool.num_free_blocks() == 256 and pool.stats()["live_sequences"] == 0


def test_priority_churn_keeps_the_eviction_heap_bounded():
    pool = BlockPool(64, 2)
    for i in range(64):
        s = pool.new_sequence()
        pool.append_tokens(s, [i, i])
        pool.free_sequence(s)
    blocks = np.arange(64, dtype=np.int32)
    for i in range(5000):
        pool.set_block_priority(blocks, i % 2)
    assert pool.stats()["eviction_heap_nodes"] <= 2 * 64 + 1024 + 64
    pool.check_invariants()
    assert pool.evict(64) == 64


def test_sequence_ids_stay_positive_and_unique_over_reuse():
    pool = BlockPool(4, 4)
    seen = set()
    for _ in range(1000):
        s = pool.new_sequence()
        assert s > 0 and s not in seen
        seen.add(s)
        pool.free_sequence(s)


def test_prefix_hashes_match_registered_blocks_and_evictions_are_reported():
    pool = BlockPool(num_blocks=6, block_size=4)
    ns = Namespace("m", "t")
    tokens = np.arange(10, dtype=np.int32)
    seq = pool.new_sequence(ns)
    pool.append_tokens(seq, tokens)
    table = pool.block_table(seq)
    held, has = pool.block_hashes(table)
    want = pool.prefix_hashes(tokens, namespace=ns)
    assert want.shape == (2, 16) and has.tolist() == [True, True, False] and (held[:2] == want).all()
    assert not (pool.prefix_hashes(tokens, namespace=Namespace("m", "u")) == want).all(axis=1).any()  # another tenant
    assert pool.prefix_hashes(tokens[:3], namespace=ns).shape == (0, 16)
    pool.free_sequence(seq)  # its two full blocks stay cached, evictable
    ids, hashes = pool.evict_reporting(5)
    assert sorted(ids.tolist()) == sorted(table[:2].tolist())
    assert {bytes(h) for h in hashes} == {bytes(h) for h in want}
    assert pool.evict_reporting(1)[0].size == 0 and pool.match_prefix(tokens, namespace=ns).size == 0
    pool.check_invariants()
