"""Visual-token compression for MoE VLMs: router-logit scores, multi-stage anchors, weighted merge
into anchors (the policies), the engine's settings, and compacted layers (what the runner keeps
per layer once tokens are merged away)."""

from samcache.compression.anchors import (MIN_WEIGHT, MergePlan, anchor_count, merge_plan, plan_stage, select_anchors,
                                          selection_order, stage_keeps)
from samcache.compression.compaction import Compaction
from samcache.compression.router_scores import SEED_DEPTH, SEED_STAGES, RouterScores, stage_layers
from samcache.compression.settings import DEFAULT_KEEP, CompressionSettings

__all__ = ["DEFAULT_KEEP", "MIN_WEIGHT", "SEED_DEPTH", "SEED_STAGES", "Compaction", "CompressionSettings", "MergePlan",
           "RouterScores", "anchor_count", "merge_plan", "plan_stage", "select_anchors", "selection_order",
           "stage_keeps", "stage_layers"]
