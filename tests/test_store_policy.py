"""The plugins' store policy: settings name it (checked at start-up), requests name their agent,
and the workflow-aware policy keeps the images of the agents that run next in a plugin's store."""

from __future__ import annotations

import pytest
import torch

from samcache.hashing import Namespace, hash_bytes
from samcache.integrations.settings import ReuseSettings
from samcache.integrations.store_policy import StorePolicy
from samcache.policies import LRUPolicy, Workflow, WorkflowAwarePolicy
from samcache.cache.stores import TensorStore

TEAM = {"eviction_policy": "workflow", "eviction_options": {"workflows": [{"name": "team", "agents": ["a1", "a2", "a3"]}]}}


def test_settings_name_the_policy_and_refuse_bad_ones():
    assert isinstance(ReuseSettings.from_mapping({}, source="x").make_policy(), LRUPolicy)
    policy = ReuseSettings.from_mapping(TEAM, source="x").make_policy()
    assert isinstance(policy, WorkflowAwarePolicy) and policy.workflows["team"].order == ["a1", "a2", "a3"]
    dag = {"eviction_policy": "workflow", "eviction_options": {"workflows": [
        {"name": "d", "after": {"plan": [], "w1": ["plan"], "w2": ["plan"], "review": ["w1", "w2"]}, "repeat": False}]}}
    assert ReuseSettings.from_mapping(dag, source="x").make_policy().workflows["d"].order == ["plan", "w1", "w2", "review"]
    for extra, message in [
        ({"eviction_policy": "lfu"}, "unknown eviction_policy 'lfu'"),
        ({"eviction_policy": "attention"}, "needs the attention samples"),
        ({"eviction_policy": "workflow", "eviction_options": []}, "eviction_options must be an object"),
        ({"eviction_policy": "workflow", "eviction_options": {"workflows": [{"name": "t"}]}}, "a workflow is"),
        ({"eviction_policy": "workflow", "eviction_options": {"workflows": {"name": "t", "agents": ["a"]}}},
         "must be a list of workflows"),
        ({"eviction_policy": "workflow", "eviction_options": {"flows": []}}, "eviction_options"),
        ({"eviction_policy": "workflow", "eviction_options": {"workflows": [{"name": "t", "after": {"a": ["b"]}}]}},
         "waited for but not declared"),
    ]:
        with pytest.raises(ValueError, match=message):
            ReuseSettings.from_mapping(extra, source="x")


def test_workflow_from_spec_checks_its_fields():
    assert Workflow.from_spec({"name": "w", "agents": ["a", "b"], "repeat": False}).order == ["a", "b"]
    for bad in ({"name": "w", "agents": "ab"}, {"name": "", "agents": ["a"]}, {"name": "w", "agents": ["a"], "x": 1},
                {"name": "w", "agents": ["a"], "after": {}}, {"name": "w", "after": {"a": "b"}}, "w"):
        with pytest.raises(ValueError):
            Workflow.from_spec(bad)


def _cycle(settings: ReuseSettings, rounds: int = 4, steps_per_request: int = 1) -> tuple[int, int]:
    """Three agents, one image each, a store with room for two; each request may take several
    forward steps (chunked prefill). Returns (hits, misses)."""
    store = TensorStore("images", 2 * 4096 + 100)
    policy = StorePolicy(settings, store)
    ns = Namespace("m", "t")
    keys = {a: ns.key(hash_bytes(a.encode())) for a in ("a1", "a2", "a3")}
    hits = misses = 0
    request = 0
    for _ in range(rounds):
        for agent in ("a1", "a2", "a3"):
            request += 1
            for _ in range(steps_per_request):  # the plugin observes every step, the workflow moves once
                policy.observe(f"req-{request}", f"team/{agent}", [keys[agent]])
            policy.apply()
            if store.get(keys[agent]) is not None:
                hits += 1
            else:
                misses += 1
                store.put(keys[agent], torch.zeros(1024))  # 4096 bytes
    return hits, misses


def test_workflow_policy_keeps_the_next_agents_images():
    lru = _cycle(ReuseSettings())
    team = ReuseSettings.from_mapping(TEAM, source="x")
    workflow = _cycle(team)
    assert lru == (0, 12)  # a cycle of three through room for two: LRU always misses
    assert workflow[0] >= 4, workflow
    assert _cycle(team, steps_per_request=3) == workflow  # one move per request, however many steps
    assert not StorePolicy(ReuseSettings(), TensorStore("s", 1 << 20)).tracks
