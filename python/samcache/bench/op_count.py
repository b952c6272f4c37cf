"""Counting the torch ops a piece of code dispatches: the CPU's proxy for GPU kernel launches.

Every op that reaches torch's dispatcher is at least one launch on a GPU, so the count per decoder
layer tells, without a GPU, how launch-bound a turn is. Ops that read a tensor back into Python
(``aten::_local_scalar_dense``: ``.item()``, ``.tolist()``, ``int(t)``) or whose output size
depends on data (``nonzero`` and kin) are host synchronisations on a GPU; they are listed apart.
"""

from __future__ import annotations

import collections
import contextlib

from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique",
                     "aten::_unique2", "aten::unique_consecutive", "aten::repeat_interleave"})


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops by name into the current ``phase`` (set it between calls)."""

    def __init__(self, phase: str = "all") -> None:
        super().__init__()
        self.phase = phase
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.phase][func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    def syncing(self, phase: str) -> dict[str, int]:
        """The ops of ``phase`` that read back or size by data, by name."""
        return {k: v for k, v in sorted(self.counts[phase].items()) if k in SYNCING}


@contextlib.contextmanager
def forward_phase(engine, counter: OpCounter, *, after: str):
    """While active, the ops an ``engine``'s forward steps dispatch count under phase
    ``"forward"`` of ``counter``, and what follows a step under ``after``."""
    if not isinstance(counter, OpCounter):
        raise TypeError(f"counter must be an OpCounter, got {type(counter).__name__}")
    if not isinstance(after, str):
        raise TypeError(f"after must be a phase name (str), got {type(after).__name__}")
    forward = engine.executor.forward

    def counted(steps):
        counter.phase = "forward"
        try:
            return forward(steps)
        finally:
            counter.phase = after

    engine.executor.forward = counted
    try:
        yield counter
    finally:
        engine.executor.forward = forward


__all__ = ["OpCounter", "SYNCING", "forward_phase"]
