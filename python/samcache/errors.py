"""Exceptions of samcache. The native ones are raised by ``samcache._C`` and re-exported here.

- ``OutOfBlocks`` (RuntimeError): the block pool has no block left after evicting every
  unreferenced cached block.
- ``CacheFull`` (RuntimeError): the content index cannot make room (pinned entries fill it).
- ``NotFound`` (KeyError): an unknown or freed sequence, or a key not in the index.
- ``InvariantViolation`` (AssertionError): ``check_invariants()`` found contradicting internal
  state. This is a bug in samcache, never a consequence of bad input.

The engine's input errors are ``ValueError`` subclasses, so ``except ValueError`` catches them:

- ``UnsupportedModel``: a checkpoint whose architecture the engine does not run.
- ``ImageLoadError``: an image that cannot be read or decoded.
- ``PromptTooLong``: a prompt that does not fit the KV pool or the model's positions.

``RequestCancelled`` (RuntimeError): a request of the online step loop that its caller cancelled
(a closed stream) before it finished; its blocks are freed at the next step.

Bad arguments raise ``ValueError``/``TypeError``; out-of-range block ids raise ``IndexError``.
"""

from samcache._C import CacheFull, InvariantViolation, NotFound, OutOfBlocks


class UnsupportedModel(ValueError):
    """The checkpoint's architecture is not one the engine runs."""


class ImageLoadError(ValueError):
    """An image could not be read, decoded or converted to RGB."""


class PromptTooLong(ValueError):
    """The prompt needs more KV blocks than the pool has, or more positions than the model."""


class RequestCancelled(RuntimeError):
    """The request was cancelled before it finished (its caller went away)."""


__all__ = ["CacheFull", "ImageLoadError", "InvariantViolation", "NotFound", "OutOfBlocks", "PromptTooLong",
           "RequestCancelled", "UnsupportedModel"]
