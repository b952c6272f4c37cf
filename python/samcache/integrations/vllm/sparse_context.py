"""The step whose rows the attention layers compute right now (set by the model for the length of
its sparse forward; the attention backend reads it). One forward runs at a time per worker."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

_current: tuple[Any, Any] | None = None


@contextmanager
def active(step: Any, worker: Any):
    global _current
    _current = (step, worker)
    try:
        yield
    finally:
        _current = None


def current() -> tuple[Any, Any] | None:
    """(ForwardStep, worker connector) during a sparse forward, else None."""
    return _current
