"""Eviction, demotion and prefetch policies: small classes behind one method (``priority``),
chosen by name. The index and the block pool evict lowest priority first, least recently used
among equals; a policy only sets priorities."""

from __future__ import annotations

from typing import Any

from samcache.policies.attention import AttentionActivity, AttentionAwarePolicy
from samcache.policies.base import EvictionPolicy, ItemState, LRUPolicy, PriorityLRUPolicy
from samcache.policies.workflow import NEVER, Workflow, WorkflowAwarePolicy

#: Policies by name (the engine's and the integrations' ``eviction_policy`` option).
POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, PriorityLRUPolicy, WorkflowAwarePolicy, AttentionAwarePolicy)
}


def make_policy(name: str, **options: Any) -> EvictionPolicy:
    """The policy called ``name`` (a key of POLICIES) built with ``options``."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(POLICIES)}")
    try:
        return POLICIES[name](**options)
    except TypeError as e:
        raise ValueError(f"eviction policy {name!r}: {e}") from None


__all__ = ["NEVER", "POLICIES", "AttentionActivity", "AttentionAwarePolicy", "EvictionPolicy", "ItemState", "LRUPolicy",
           "PriorityLRUPolicy", "Workflow", "WorkflowAwarePolicy", "make_policy"]
