"""Recompute policy: which reused tokens are recomputed, and how many at each layer."""

from samcache.recompute.budget import (
    LayerBudget,
    SensitivityCurves,
    probe_layer_sensitivity,
    solve_layer_budget,
    uniform_layer_budget,
)
from samcache.recompute.image_order import ImageOrderCheck
from samcache.recompute.selection import (
    RecomputePlan,
    ReusedSpan,
    attention_relevance,
    key_deviation,
    plan_recompute,
    span_positions,
)

__all__ = [
    "ImageOrderCheck",
    "LayerBudget",
    "RecomputePlan",
    "ReusedSpan",
    "attention_relevance",
    "key_deviation",
    "plan_recompute",
    "span_positions",
    "SensitivityCurves",
    "probe_layer_sensitivity",
    "solve_layer_budget",
    "uniform_layer_budget",
]
