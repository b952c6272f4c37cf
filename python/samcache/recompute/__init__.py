"""Recompute policy: which reused tokens are recomputed, and how many at each layer."""

from samcache.recompute.budget import (
    LayerBudget,
    SensitivityCurves,
    probe_layer_sensitivity,
    solve_layer_budget,
    uniform_layer_budget,
)

__all__ = [
    "LayerBudget",
    "SensitivityCurves",
    "probe_layer_sensitivity",
    "solve_layer_budget",
    "uniform_layer_budget",
]
