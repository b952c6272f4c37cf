"""Recompute policy: which reused tokens are recomputed (the repair methods), and how many at each layer."""

from samcache.recompute.budget import (
    LayerBudget,
    SensitivityCurves,
    probe_layer_sensitivity,
    solve_layer_budget,
    uniform_layer_budget,
)
from samcache.recompute.boundary import Boundary, BoundaryDeviation
from samcache.recompute.deviation import Deviation
from samcache.recompute.image_order import ImageOrderCheck
from samcache.recompute.isolated import Isolated
from samcache.recompute.method import RepairMethod
from samcache.recompute.methods import parse_methods, registered, repair_method
from samcache.recompute.selection import (
    RecomputePlan,
    ReusedSpan,
    attention_relevance,
    key_deviation,
    plan_recompute,
    span_positions,
)
from samcache.recompute.two_track import TwoTrack

__all__ = [
    "Boundary",
    "BoundaryDeviation",
    "Deviation",
    "Isolated",
    "RepairMethod",
    "TwoTrack",
    "parse_methods",
    "registered",
    "repair_method",
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
