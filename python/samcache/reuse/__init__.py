"""Reuse planning: a prompt plus what the caches hold -> which tokens are reused, computed and
recomputed. Pure (no model, no KV): samcache's runner and the engine integrations execute the
same :class:`ReusePlan`."""

from samcache.reuse.plan import CachedImage, ImageSlot, PromptLayout, RecomputeBudget, ReusePlan, SplicedSpan
from samcache.reuse.planner import plan_reuse
from samcache.reuse.request import RequestPlan, ReuseCounters, image_key, plan_request

__all__ = ["CachedImage", "ImageSlot", "PromptLayout", "RecomputeBudget", "RequestPlan", "ReusePlan", "ReuseCounters",
           "SplicedSpan", "image_key", "plan_request", "plan_reuse"]
