"""The repair methods by name (engine argument, eval flag, plugin setting): the registry, apart
from :class:`~samcache.recompute.method.RepairMethod` so that the methods import their base and
this module imports the methods, never the other way round."""

from __future__ import annotations

from collections.abc import Sequence

from samcache.recompute.boundary import Boundary, BoundaryDeviation
from samcache.recompute.deviation import Deviation
from samcache.recompute.isolated import Isolated
from samcache.recompute.method import RepairMethod
from samcache.recompute.two_track import TwoTrack


def repair_method(method: "str | RepairMethod") -> RepairMethod:
    """A method by name (its default settings), or ``method`` itself; a clear error otherwise."""
    if isinstance(method, RepairMethod):
        return method
    methods = registered()
    if not isinstance(method, str) or method not in methods:
        raise ValueError(f"unknown recompute method {method!r}; choose from {', '.join(methods)}")
    return methods[method]()


def parse_methods(methods: "str | Sequence[str]") -> list[str]:
    """Method names, comma-separated or a sequence, each checked."""
    names = [m.strip() for m in methods.split(",")] if isinstance(methods, str) else list(methods)
    names = [m for m in names if m]
    if not names:
        raise ValueError(f"no recompute method given; choose from {', '.join(registered())}")
    for name in names:
        repair_method(name)
    return list(dict.fromkeys(names))


def registered() -> dict[str, type[RepairMethod]]:
    """Every method by name."""
    return {m.name: m for m in (TwoTrack, Boundary, Deviation, BoundaryDeviation, Isolated)}


__all__ = ["parse_methods", "registered", "repair_method"]
