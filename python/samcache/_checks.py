"""Argument checks shared by the Python layer, each raising ``ValueError`` that names the
argument. ``bool`` is never taken for a number (``True`` is an ``int`` to Python)."""

from __future__ import annotations

from typing import Any

SEED_LIMIT = 2**63  # torch generators take seeds below this


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_seed(value: Any, name: str = "seed") -> int:
    """``value`` as a seed a torch generator accepts: an int in [0, 2**63)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"{name} must be an int in [0, 2**63), got {value!r}")
    return value


def check_fraction(name: str, value: Any) -> float:
    """``value`` as a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)
