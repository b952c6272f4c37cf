"""Branch context tree: an agent's forks over the block pool's copy-on-write sequences.

A planner forks sub-agents over the same screenshots and history, continues one or two of them
and abandons the rest. Each :class:`Branch` is one live pool sequence. ``fork`` shares every block
of its parent by reference (``BlockPool.fork``: refcount + 1, nothing copied), so N branches of a
long context cost the context once plus their own suffixes; the first append into a shared
partial block is the pool's copy-on-write (the caller performs the copies it returns). ``abandon``
drops the branch's references: blocks nobody else holds become evictable at once, lowest priority
first, so a live branch's context is never evicted for a dead one's. ``memory`` accounts blocks
per branch (private, shared, and a fair share that sums to the tree's total).

The tree knows nothing about models: :class:`samcache.engine.SAMcacheEngine` uses it for sessions
created with ``hold_context=True`` (``fork_session`` / ``abandon_session``), and any caller that
writes KV into pool slots can use it directly.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from samcache._checks import check_int
from samcache.cache.block_pool import AppendResult, BlockPool, ExtraKey
from samcache.errors import InvariantViolation
from samcache.hashing import Namespace
from samcache.policies.base import PRIORITY_MIN

#: A branch's states: ``live`` (holds a sequence, or none yet), ``released`` (its hold was given up
#: under memory pressure; what it held may still be cached), ``abandoned`` (closed for good).
STATES = ("live", "released", "abandoned")


@dataclass(frozen=True)
class BranchMemory:
    """Blocks a branch references: ``private`` (no one else holds them), ``shared`` (with other
    branches, cached images or running requests) and ``fair_share`` (each block counted
    1/refcount, so the shares of everyone holding a block sum to one block)."""

    tokens: int
    blocks: int
    private_blocks: int
    shared_blocks: int
    fair_share: float


@dataclass(frozen=True)
class TreeMemory:
    """``held_blocks``: distinct blocks the tree's live branches hold together; ``clone_blocks``:
    what they would hold as full copies (the sum of their block tables); ``branches``: per branch."""

    held_blocks: int
    clone_blocks: int
    branches: dict[int, BranchMemory]

    @property
    def sharing_ratio(self) -> float:
        """clone_blocks / held_blocks (1.0 when nothing is held)."""
        return self.clone_blocks / self.held_blocks if self.held_blocks else 1.0


class Branch:
    """One branch of a :class:`ContextTree`. Created by :meth:`ContextTree.root` or :meth:`fork`."""

    def __init__(self, tree: ContextTree, branch_id: int, seq: int | None, parent: Branch | None,
                 namespace: Namespace | None, name: str | None) -> None:
        self.tree = tree
        self.id = branch_id
        self.seq = seq
        self.parent = parent
        self.children: list[Branch] = []
        self.namespace = namespace
        self.name = name
        self.state = "live"
        self.last_use = tree._tick()

    # ---- continue -----------------------------------------------------------------------------
    def extend(self, tokens: Any, extra_keys: Iterable[ExtraKey] | None = None) -> AppendResult:
        """Continue the branch with ``tokens`` (hashed into the prefix cache): the slots to write
        their KV to and the copy-on-write block copies to perform first."""
        seq = self._sequence()
        self.last_use = self.tree._tick()
        return self.tree.pool.append_tokens(seq, tokens, extra_keys)

    def extend_slots(self, n: int) -> AppendResult:
        """Continue the branch with ``n`` tokens the pool is not told (not prefix-cached)."""
        seq = self._sequence()
        self.last_use = self.tree._tick()
        return self.tree.pool.append_slots(seq, n)

    def hold(self, seq: int) -> None:
        """Hold a reference to live sequence ``seq`` (e.g. the one a turn just ran in) as this
        branch's context, dropping the branch's previous hold; the caller keeps its own reference."""
        self._check_open("hold a sequence")
        check_int("seq", seq, 0)
        new = self.tree.pool.fork(seq)
        old, self.seq = self.seq, new
        if self.state == "released":
            self.state = "live"
        self.last_use = self.tree._tick()
        if old is not None:
            self.tree.pool.free_sequence(old)

    # ---- fork and abandon ---------------------------------------------------------------------
    def fork(self, name: str | None = None) -> Branch:
        """A child branch sharing every block of this one (nothing copied)."""
        self._check_open("fork")
        seq = self.tree.pool.fork(self.seq) if self.seq is not None else None
        child = self.tree._add(seq, self, self.namespace, name)
        self.children.append(child)
        self.last_use = self.tree._tick()
        return child

    def abandon(self, *, reclaim: bool = False) -> int:
        """Close the branch for good. Blocks only it held become evictable at once, before any
        other cached block (lowest priority); ``reclaim=True`` evicts them now. Children stay
        valid (they hold their own references). Returns how many blocks were freed or made
        evictable. Abandoning twice is a no-op."""
        if self.state == "abandoned":
            return 0
        count = self._release(demote=True, reclaim=reclaim)
        self.state = "abandoned"
        self.tree._prune(self)
        return count

    def release(self) -> int:
        """Give up the branch's hold (memory pressure) but keep it open: its blocks stay in the
        prefix cache until evicted, and its next :meth:`hold` or :meth:`extend` goes on from
        there. Returns how many blocks no one else holds any more."""
        if self.state != "live":
            return 0
        count = self._release(demote=False, reclaim=False)
        self.state = "released"
        return count

    # ---- accounting ---------------------------------------------------------------------------
    def block_table(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int32) if self.seq is None else self.tree.pool.block_table(self.seq)

    @property
    def num_tokens(self) -> int:
        return 0 if self.seq is None else self.tree.pool.num_tokens(self.seq)

    def memory(self) -> BranchMemory:
        pool = self.tree.pool
        table = self.block_table()
        refs = np.array([pool.refcount(int(b)) for b in table], dtype=np.int64)
        private = int((refs == 1).sum())
        return BranchMemory(self.num_tokens, len(table), private, len(table) - private,
                            float((1.0 / np.maximum(refs, 1)).sum()))

    # ---- internals ----------------------------------------------------------------------------
    def _sequence(self) -> int:
        self._check_open("continue")
        if self.seq is None:
            self.seq = self.tree.pool.new_sequence(self.namespace)
            self.state = "live"
        return self.seq

    def _check_open(self, action: str) -> None:
        if self.state == "abandoned":
            raise ValueError(f"cannot {action}: branch {self.label} was abandoned")

    def _release(self, *, demote: bool, reclaim: bool) -> int:
        if self.seq is None:
            return 0
        pool = self.tree.pool
        table = [int(b) for b in pool.block_table(self.seq)]
        private = [b for b in table if pool.refcount(b) == 1]
        cached = [b for b in private if pool.block_hash(b) is not None]
        if demote and cached:  # evicted before every other cached block
            pool.set_block_priority(np.asarray(cached, dtype=np.int32), PRIORITY_MIN)
        pool.free_sequence(self.seq)
        self.seq = None
        if reclaim:
            idle = [b for b in cached if pool.refcount(b) == 0 and pool.block_hash(b) is not None]
            if idle:
                pool.evict(len(idle))
        return len(private)

    @property
    def label(self) -> str:
        return f"{self.id}" + (f" ({self.name!r})" if self.name else "")

    def __repr__(self) -> str:
        return f"Branch({self.label}, {self.state}, tokens={self.num_tokens}, children={len(self.children)})"


class ContextTree:
    """Branches of agent contexts over one :class:`BlockPool`.

    >>> tree = ContextTree(pool)
    >>> root = tree.root()
    >>> slots, copies = root.extend(context_tokens)          # write the context's KV
    >>> workers = [root.fork(f"worker {i}") for i in range(8)]
    >>> workers[0].extend(suffix_tokens)                      # copy-on-write at the fork point
    >>> for w in workers[1:]: w.abandon()
    """

    def __init__(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a BlockPool, got {type(pool).__name__}")
        self.pool = pool
        self._ids = itertools.count()
        self._clock = itertools.count()
        self._branches: dict[int, Branch] = {}

    def root(self, namespace: Namespace | None = None, *, name: str | None = None) -> Branch:
        """A new, empty root branch; its blocks are hashed under ``namespace``."""
        if namespace is not None and not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a samcache.Namespace, got {type(namespace).__name__}")
        return self._add(None, None, namespace, name)

    def branches(self, state: str | None = None) -> list[Branch]:
        """Every branch the tree records (abandoned ones only while they have open descendants),
        or those in ``state``."""
        if state is not None and state not in STATES:
            raise ValueError(f"unknown branch state {state!r}; choose from {', '.join(STATES)}")
        return [b for b in self._branches.values() if state is None or b.state == state]

    def live(self) -> list[Branch]:
        return [b for b in self._branches.values() if b.state == "live" and b.seq is not None]

    def memory(self) -> TreeMemory:
        """Blocks held by the live branches: distinct, as full clones, and per branch."""
        live = self.live()
        tables = [b.block_table() for b in live]
        held = len(set(np.concatenate(tables).tolist())) if tables else 0
        return TreeMemory(held, sum(len(t) for t in tables), {b.id: b.memory() for b in live})

    def release_for_blocks(self, blocks: int) -> int:
        """Release least recently used live branches' holds until the pool can hand out ``blocks``
        blocks or nothing is held; how many branches were released."""
        check_int("blocks", blocks, 0)
        released = 0
        for b in sorted(self.live(), key=lambda b: b.last_use):
            if self.pool.num_free_blocks() >= blocks:
                break
            b.release()
            released += 1
        return released

    def check_invariants(self) -> None:
        """Raise InvariantViolation if a branch's record disagrees with the pool."""
        self.pool.check_invariants()
        for b in self._branches.values():
            if b.state == "abandoned" and b.seq is not None:
                raise InvariantViolation(f"abandoned branch {b.label} still holds sequence {b.seq}")
            if b.seq is not None:
                for block in b.block_table():
                    if self.pool.refcount(int(block)) < 1:
                        raise InvariantViolation(f"branch {b.label} holds block {block} with refcount 0")

    # ---- internals ----------------------------------------------------------------------------
    def _add(self, seq: int | None, parent: Branch | None, namespace: Namespace | None, name: str | None) -> Branch:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"a branch name must be a str, got {type(name).__name__}")
        branch = Branch(self, next(self._ids), seq, parent, namespace, name)
        self._branches[branch.id] = branch
        return branch

    def _prune(self, branch: Branch) -> None:
        """Forget abandoned branches without children, walking up: the tree's records stay as
        small as its open branches and their ancestors."""
        node: Branch | None = branch
        while node is not None and node.state == "abandoned" and not node.children:
            self._branches.pop(node.id, None)
            parent = node.parent
            if parent is not None:
                parent.children.remove(node)
            node = parent

    def _tick(self) -> int:
        return next(self._clock)

    def __len__(self) -> int:
        return len(self._branches)

    def __repr__(self) -> str:
        m = self.memory()
        return f"ContextTree(branches={len(self)}, live={len(m.branches)}, held_blocks={m.held_blocks})"


__all__ = ["STATES", "Branch", "BranchMemory", "ContextTree", "TreeMemory"]
