"""Exceptions of samcache. The native ones are raised by ``samcache._C`` and re-exported here.

- ``OutOfBlocks`` (RuntimeError): the block pool has no block left after evicting every
  unreferenced cached block.
- ``CacheFull`` (RuntimeError): the content index cannot make room (pinned entries fill it).
- ``NotFound`` (KeyError): an unknown or freed sequence, or a key not in the index.
- ``InvariantViolation`` (AssertionError): ``check_invariants()`` found contradicting internal
  state. This is a bug in samcache, never a consequence of bad input.

Bad arguments raise ``ValueError``/``TypeError``; out-of-range block ids raise ``IndexError``.
"""

from samcache._C import CacheFull, InvariantViolation, NotFound, OutOfBlocks

__all__ = ["CacheFull", "InvariantViolation", "NotFound", "OutOfBlocks"]
