"""Eviction policies inside the engine: chosen by name, plain LRU untouched, the workflow-aware
policy keeping the next agents' contexts under memory pressure where LRU loses them, and the
attention-aware policy fed by attention sampled from the turn's own KV."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from samcache.engine import screenshot  # noqa: E402
from samcache.engine.prompt import user_message  # noqa: E402
from samcache.policies import AttentionAwarePolicy, LRUPolicy, Workflow  # noqa: E402

from engine_helpers import SIZE, make_engine  # noqa: E402

AGENTS = ("plan", "work1", "work2", "review")
POOL_BLOCKS = 160  # each context is ~50 blocks of 16 tokens


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return tiny_checkpoints["qwen2_5_vl"]


def _role(agent: str) -> str:
    rng = np.random.default_rng(len(agent) * 7 + ord(agent[-1]))
    return f"You are {agent}. " + " ".join(f"rule{int(x)}" for x in rng.integers(0, 999, size=120))


def _cycle(engine, rounds: int, agent_prefix: str = "team/") -> list:
    """Agents take turns in a fixed cycle, each with its own growing conversation; text only, so
    every reuse is exact. Returns the metrics of every turn after the first round."""
    history = {a: [{"role": "system", "content": _role(a)}] for a in AGENTS}
    out = []
    for r in range(rounds):
        for a in AGENTS:
            history[a].append({"role": "user", "content": f"Round {r}: your move."})
            res = engine.chat(messages=history[a], max_new_tokens=2, ignore_eos=True, agent=agent_prefix + a)
            history[a].append({"role": "assistant", "content": res.text})
            if r:
                out.append((res.metrics, res.token_ids))
    return out


def test_policies_by_name_and_bad_options(model):
    lru = make_engine(model)
    assert isinstance(lru.eviction_policy, LRUPolicy) and lru.priorities is None
    att = make_engine(model, eviction_policy="attention", eviction_options={"alpha": 0.7})
    assert isinstance(att.eviction_policy, AttentionAwarePolicy) and att.eviction_policy.alpha == 0.7
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'.*lru"):
        make_engine(model, eviction_policy="mru")
    with pytest.raises(ValueError, match="alpha"):
        make_engine(model, eviction_policy="attention", eviction_options={"alpha": 2})
    with pytest.raises(ValueError, match="policy object"):
        make_engine(model, eviction_policy=LRUPolicy(), eviction_options={"x": 1})
    with pytest.raises(TypeError, match="eviction_policy"):
        make_engine(model, eviction_policy=3)
    with pytest.raises(ValueError, match="eviction_policy='workflow'"):
        lru.plan_workflow(Workflow.sequence("w", AGENTS))
    with pytest.raises(TypeError, match="agent"):
        lru.chat(prompt="hi", agent=5)


def test_workflow_policy_keeps_the_next_agents_context_where_lru_loses_it(model):
    # A pool that holds about three of the four agents' contexts: a cycle is LRU's worst case.
    runs = {}
    for policy in ("lru", "workflow"):
        engine = make_engine(model, num_blocks=POOL_BLOCKS, eviction_policy=policy)
        if policy == "workflow":
            engine.plan_workflow(Workflow.sequence("team", AGENTS))
        runs[policy] = _cycle(engine, rounds=3)
        engine.check_invariants()
    hits = {p: sum(m.prefix_reused_tokens for m, _ in r) / sum(m.prompt_tokens for m, _ in r) for p, r in runs.items()}
    assert hits["workflow"] > hits["lru"] + 0.3, hits
    # Exact reuse: the same tokens whatever was kept.
    assert [t for _, t in runs["lru"]] == [t for _, t in runs["workflow"]]


def test_attention_policy_samples_attention_from_the_turns_kv(model):
    engine = make_engine(model, eviction_policy="attention")
    shots = [screenshot(s, SIZE) for s in (5, 6)]
    engine.chat(messages=[{"role": "system", "content": "Look."}, user_message(shots, "Which one?")],
                max_new_tokens=2, agent="solo")
    pr = engine.priorities
    keys = list(pr.images)
    assert len(keys) == 2 and "solo" in pr.contexts
    shares = [pr.activity[k] for k in keys] + [pr.activity[("context", "solo")]]
    assert all(s > 0 for s in shares)
    assert sum(shares) == pytest.approx(1 - pr.activity.decay)  # one observation of shares summing to 1
    prios = pr.priorities()
    assert set(prios) == set(keys) | {("context", "solo")}
    pr.apply()
    for k in keys:
        assert engine.image_kv_store.entries.index.peek(k).priority == prios[k]
    engine.check_invariants()


def test_attention_sample_is_the_attention_of_the_last_tokens(model):
    engine = make_engine(model)
    prompt = engine.build_prompt([{"role": "system", "content": "Look."},
                                  user_message([screenshot(7, SIZE)], "Which one?")])
    pre, _ = engine.prefill(prompt)
    try:
        mass = engine.executor.attention_sample(pre, queries=5)
    finally:
        engine.pool.free_sequence(pre.seq)
    # Each query's softmax sums to one, averaged over heads: the masses sum to the query count.
    assert sum(mass.values()) == pytest.approx(5, rel=1e-4)
    assert len(mass) == 2 and all(v > 0 for v in mass.values())


def test_prefetch_plan_names_the_next_agents_items(model):
    engine = make_engine(model, eviction_policy="workflow")
    engine.plan_workflow(Workflow.sequence("team", AGENTS))
    assert engine.prefetch_plan() == []  # nothing seen yet
    shots = {a: screenshot(40 + i, SIZE) for i, a in enumerate(AGENTS)}
    for a in AGENTS:  # one round: each agent with its own screenshot
        engine.chat(messages=[{"role": "system", "content": _role(a)}, user_message([shots[a]], "Go.")],
                    max_new_tokens=1, agent="team/" + a)
    # The workflow is back at 'plan' (runs now: not prefetched); next come work1, then work2.
    plan = engine.prefetch_plan(horizon=2)
    contexts = [k for k in plan if isinstance(k, tuple)]
    assert contexts == [("context", "team/work1"), ("context", "team/work2")]
    images = [k for k in plan if not isinstance(k, tuple)]
    assert len(images) == 2 and plan.index(images[0]) < plan.index(("context", "team/work2"))
    assert make_engine(model).prefetch_plan() == []  # plain LRU plans no prefetch
    with pytest.raises(ValueError, match="horizon"):
        engine.prefetch_plan(horizon=0)
