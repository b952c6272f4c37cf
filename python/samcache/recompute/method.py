"""Repair methods: which reused tokens to recompute first, chosen by name.

Reused KV is wrong where the token's left context changed since it was computed. A repair method
orders the reused tokens, most in need of recompute first; the layer budget (rates per layer,
non-increasing with depth) says how many of that order each layer recomputes, so every method
works with the layer-aware budget. A method says what its order reads:

- ``scores = None``: the spans alone (positions, which images moved);
- ``scores = "relevance"``: a score per position from before the forward (the prompt's last
  tokens' attention, or routing confidence);
- ``select_layer = l``: the forward itself picks the order at layer ``l`` (key deviation, as
  CacheBlend does); layers ``0..l`` recompute every reused token, the plan declares that and the
  quotas of the layers after it, and the runner fills in which tokens (a declared second phase);

and where image KV comes from (``isolated``: computed without left context when the image is
first seen, so every reuse is a move).

The methods (one module each; :mod:`~samcache.recompute.methods` finds them by name): ``two-track`` (:mod:`~samcache.recompute.two_track`), ``boundary``
and ``boundary+deviation`` (:mod:`~samcache.recompute.boundary`), ``deviation``
(:mod:`~samcache.recompute.deviation`), ``isolated`` (:mod:`~samcache.recompute.isolated`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from samcache.recompute.budget import tokens_per_layer
from samcache.recompute.selection import RecomputePlan, ReusedSpan


class RepairMethod(ABC):
    """A recompute order over reused spans (subclasses are frozen dataclasses of their settings)."""

    name: ClassVar[str]
    isolated: ClassVar[bool] = False  # image KV is stored as computed without left context

    @property
    def scores(self) -> str | None:
        """"relevance" where :meth:`order` reads a score per position from before the forward."""
        return None

    @property
    def select_layer(self) -> int | None:
        """The layer at which the forward picks the order (None: the plan has it)."""
        return None

    @abstractmethod
    def order(self, spans: Sequence[ReusedSpan], quota: Sequence[int], scores: np.ndarray | None = None
              ) -> RecomputePlan:
        """The priority order of the spans' tokens and the quotas each layer recomputes
        (``quota``, from :meth:`quota`, may be capped by the method)."""

    def quota(self, rates: Sequence[float], reused_tokens: int) -> list[int]:
        """How many of ``reused_tokens`` each layer recomputes at per-layer ``rates``."""
        return tokens_per_layer(rates, reused_tokens)

    @property
    def settings(self) -> dict[str, Any]:
        """The method's settings by name (what results record beside its name)."""
        from dataclasses import asdict

        return asdict(self)  # type: ignore[call-overload]

    def describe(self) -> str:
        settings = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        return f"{self.name}({settings})"


__all__ = ["RepairMethod"]
