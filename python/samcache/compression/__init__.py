"""Visual-token compression for MoE VLMs (issue 14): router-logit scores, multi-stage anchors,
weighted merge into anchors. Pure policies; the engine applies them."""

from samcache.compression.anchors import (MIN_WEIGHT, MergePlan, anchor_count, merge_plan, plan_stage, select_anchors,
                                          selection_order, stage_keeps)
from samcache.compression.router_scores import SEED_DEPTH, SEED_STAGES, RouterScores, stage_layers

__all__ = ["MIN_WEIGHT", "SEED_DEPTH", "SEED_STAGES", "MergePlan", "RouterScores", "anchor_count", "merge_plan",
           "plan_stage", "select_anchors", "selection_order", "stage_keeps", "stage_layers"]
