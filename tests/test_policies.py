"""Eviction policies: priorities from hand-made step graphs (workflow-aware), attention activity
and recency (attention-aware), plain and priority LRU; priorities reach a real ContentIndex and
change what it evicts; bad plans and options are refused clearly."""

from __future__ import annotations

import pytest

from samcache.cache.content_index import ContentIndex
from samcache.hashing import Namespace, hash_bytes
from samcache.policies import (
    NEVER,
    POLICIES,
    AttentionActivity,
    AttentionAwarePolicy,
    ItemState,
    LRUPolicy,
    PriorityLRUPolicy,
    Workflow,
    WorkflowAwarePolicy,
    make_policy,
)


def pipeline() -> Workflow:
    # planner -> three workers (in parallel in the plan, run one at a time) -> reviewer, repeated
    return Workflow("docs", {"planner": [], "w1": ["planner"], "w2": ["planner"], "w3": ["planner"],
                             "reviewer": ["w1", "w2", "w3"]})


def test_workflow_order_and_steps_to_execution():
    wf = pipeline()
    assert wf.order == ["planner", "w1", "w2", "w3", "reviewer"]
    assert [wf.steps_until(a) for a in wf.order] == [0, 1, 2, 3, 4]
    wf.advance()
    wf.advance()  # w2 runs now
    assert wf.current == "w2"
    assert {a: wf.steps_until(a) for a in wf.order} == {"planner": 3, "w1": 4, "w2": 0, "w3": 1, "reviewer": 2}
    assert wf.upcoming(3) == ["w2", "w3", "reviewer"]
    once = Workflow.sequence("once", ["a", "b"], repeat=False)
    once.advance()
    assert once.steps_until("a") == NEVER and once.steps_until("b") == 0 and once.steps_until("zz") == NEVER
    once.advance()
    assert once.current is None and once.upcoming(2) == []


def test_workflow_aware_priorities_keep_the_next_agents_items():
    wf = pipeline()
    wf.advance()  # w1 runs now
    policy = WorkflowAwarePolicy([wf, Workflow.sequence("chat", ["helper"])])
    items = [
        ItemState("shared-screenshot", last_use=1, agents=frozenset({"w3", "reviewer"})),
        ItemState("planner-notes", last_use=9, agents=frozenset({"planner"})),
        ItemState("w1-page", last_use=2, agents=frozenset({"docs/w1"})),
        ItemState("orphan", last_use=10),
        ItemState("helper-ctx", last_use=0, agents=frozenset({"chat/helper"})),
    ]
    prio = {i.key: policy.priority(i, now=10) for i in items}
    assert prio["w1-page"] == 0 and prio["helper-ctx"] == 0  # running now in their workflows
    assert prio["shared-screenshot"] == -2  # w3 is two steps away (reviewer three)
    assert prio["planner-notes"] == -4
    assert prio["orphan"] == min(prio.values())
    # farthest first: the orphan, then the planner's notes (most recently used, but needed last)
    assert policy.eviction_order(items, now=10)[:2] == ["orphan", "planner-notes"]
    assert LRUPolicy().eviction_order(items, now=10)[:2] == ["helper-ctx", "shared-screenshot"]
    # prefetch: what the next two steps need, not what runs now
    assert policy.prefetch(items, horizon=2) == ["shared-screenshot"]
    assert policy.prefetch(items, horizon=3) == ["shared-screenshot"]
    wf.advance()
    wf.advance()  # w3 runs now: the reviewer and the planner come next
    assert policy.prefetch(items, horizon=2) == ["planner-notes"]


def test_attention_aware_mixes_activity_and_recency():
    hot_old = ItemState("hot", last_use=0, attention=0.9)
    cold_new = ItemState("cold", last_use=20, attention=0.0)
    mostly_attention = AttentionAwarePolicy(alpha=0.8, half_life=4)
    assert mostly_attention.eviction_order([hot_old, cold_new], now=20) == ["cold", "hot"]
    pure_recency = AttentionAwarePolicy(alpha=0.0, half_life=4)
    assert pure_recency.eviction_order([hot_old, cold_new], now=20) == ["hot", "cold"]
    assert pure_recency.score(cold_new, 24) == pytest.approx(0.5)  # one half-life
    with pytest.raises(ValueError, match="attention activity"):
        mostly_attention.priority(ItemState("x", attention=1.5), 0)


def test_attention_activity_is_a_moving_share():
    act = AttentionActivity(decay=0.5)
    act.observe({"a": 3.0, "b": 1.0})
    assert act["a"] == pytest.approx(0.375) and act["b"] == pytest.approx(0.125)
    act.observe({"b": 2.0})
    assert act["a"] == pytest.approx(0.1875) and act["b"] == pytest.approx(0.5625) and act["never"] == 0.0
    with pytest.raises(ValueError, match="non-negative"):
        act.observe({"a": -1.0})


def test_priorities_change_what_a_content_index_evicts():
    ns = Namespace("m")
    keys = {name: ns.key(hash_bytes(name.encode())) for name in ("next", "later", "orphan")}
    index = ContentIndex(capacity_bytes=300)
    for h, name in enumerate(["next", "later", "orphan"]):
        index.put(keys[name], handle=h, size_bytes=100)
    index.get(keys["next"])  # LRU alone would now evict "later" first
    wf = Workflow.sequence("w", ["a", "b", "c"])
    items = [ItemState(keys["next"], agents=frozenset({"a"})), ItemState(keys["later"], agents=frozenset({"c"})),
             ItemState(keys["orphan"])]
    WorkflowAwarePolicy([wf]).apply(index, items, now=0)
    evicted = index.evict_until(100)
    assert [e.key for e in evicted] == [keys["orphan"], keys["later"]]  # lowest priority first
    assert keys["next"] in index


def test_policies_by_name_and_bad_plans():
    assert set(POLICIES) == {"lru", "priority-lru", "workflow", "attention"}
    assert isinstance(make_policy("attention", alpha=0.3), AttentionAwarePolicy)
    assert PriorityLRUPolicy().priority(ItemState("k", priority=2**40), 0) == 2**31 - 1
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="attention"):
        make_policy("attention", beta=1)
    with pytest.raises(ValueError, match="alpha"):
        AttentionAwarePolicy(alpha=2)
    with pytest.raises(ValueError, match="cycle"):
        Workflow("loop", {"a": ["b"], "b": ["a"]})
    with pytest.raises(ValueError, match="not declared"):
        Workflow("w", {"a": ["ghost"]})
    with pytest.raises(ValueError, match="distinct"):
        Workflow.sequence("w", ["a", "a"])
    policy = WorkflowAwarePolicy([pipeline()])
    with pytest.raises(ValueError, match="already planned"):
        policy.add(pipeline())
    with pytest.raises(ValueError, match="horizon"):
        policy.prefetch([], horizon=0)


def test_workflow_ran_advances_only_the_workflow_whose_step_it_is():
    a = Workflow.sequence("a", ["plan", "work"])
    b = Workflow.sequence("b", ["plan", "check"])
    policy = WorkflowAwarePolicy([a, b])
    assert policy.ran("b/plan") and b.current == "check" and a.current == "plan"
    assert not policy.ran("b/plan")  # out of order: nothing advances
    assert policy.ran("work") is False and a.current == "plan"  # 'work' is not a's current step
    assert policy.ran("plan") and a.current == "work"  # unique-enough name: the first workflow at that step
    with pytest.raises(TypeError, match="agent"):
        policy.ran(3)
