"""Visual-token compression policies: router scores against a float64 reference, stage layers,
anchors (count, confidence, every expert, spread), merge plans against brute force, and the merge
through the token_merge kernel against a float64 weighted mean."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from samcache.compression import (RouterScores, anchor_count, merge_plan, plan_stage, select_anchors, selection_order,
                                  stage_keeps, stage_layers)


def _grid(h, w):
    r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([r.flatten(), c.flatten()], dim=1)


def test_scores_match_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 8, generator=g) * 3
    s = RouterScores.from_logits(logits.to(torch.bfloat16).float())
    p = torch.softmax(logits.to(torch.bfloat16).double(), -1)
    torch.testing.assert_close(s.probs.double(), p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.confidence.double(), p.max(-1).values, rtol=1e-5, atol=1e-6)
    assert torch.equal(s.expert, p.argmax(-1))
    torch.testing.assert_close(s.entropy.double(), -(p * p.log()).sum(-1), rtol=1e-4, atol=1e-5)
    bc = (p.sqrt()[:5] @ p.sqrt()[10:13].T)
    torch.testing.assert_close(s.similarity(range(5), range(10, 13)).double(), bc, rtol=1e-5, atol=1e-6)
    for bad in (torch.zeros(3), torch.zeros(3, 1), torch.tensor([[0.0, float("nan")]])):
        with pytest.raises(ValueError):
            RouterScores.from_logits(bad)


def test_stage_layers_scale_the_seed_stages():
    assert stage_layers(48) == (2, 6, 15)
    # The share of the model left uncompressed before each stage is kept: 3/48, 7/48, 16/48.
    assert stage_layers(12) == (0, 1, 3)
    assert stage_layers(28) == (1, 3, 8)
    assert stage_layers(4) == (0, 1, 2)  # would-be duplicates move on, always before the last layer
    assert stage_layers(3) == (0, 1) and stage_layers(2) == (0,)
    with pytest.raises(ValueError):
        stage_layers(1)


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 12), w=st.integers(1, 12), experts=st.integers(2, 9), keep=st.floats(0.01, 1.0),
       seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([0.0, 0.5, 1.0]))
def test_anchors_and_merge_plans(h, w, experts, keep, seed, spread):
    n = h * w
    g = torch.Generator().manual_seed(seed)
    scores = RouterScores.from_logits(torch.randn(n, experts, generator=g) * 2)
    anchors = select_anchors(scores, _grid(h, w), keep, spread=spread)
    k = anchor_count(n, keep)
    assert anchors.numel() == k == min(n, max(1, math.ceil(keep * n - 1e-9)))
    assert torch.equal(anchors, anchors.unique())  # distinct, ascending
    assert int(scores.confidence.argmax()) in anchors.tolist()  # the most confident token always
    present = scores.expert.unique()
    if k >= present.numel():  # every dominant expert has an anchor
        assert set(scores.expert[anchors].tolist()) == set(present.tolist())
    plan = merge_plan(scores, anchors)
    assert torch.equal(plan.anchors, anchors)
    p = scores.probs.double().sqrt()
    sim = p @ p[anchors].T  # brute force: the most similar anchor, ties to the lower index
    for i in range(n):
        if i in anchors.tolist():
            assert int(plan.target[i]) == i
        else:
            best = sim[i].max()
            assert sim[i, anchors.tolist().index(int(plan.target[i]))] >= best - 1e-6
    assert (plan.weight > 0).all()
    # The merge is the weighted mean of every anchor's members (float64 reference).
    hidden = torch.randn(n, 16, generator=g)
    merged, kept = plan.merge(hidden)
    assert torch.equal(kept, anchors)
    for r, a in enumerate(anchors.tolist()):
        members = (plan.target == a).nonzero().flatten()
        wts = plan.weight[members].double()
        want = (hidden[members].double() * wts[:, None]).sum(0) / wts.sum()
        torch.testing.assert_close(merged[r].double(), want, rtol=1e-5, atol=1e-5)


def test_anchors_spread_over_the_image():
    # Every token equally confident and routed alike: only spreading decides.
    n, (h, w) = 64, (8, 8)
    scores = RouterScores.from_logits(torch.zeros(n, 4))
    clustered = select_anchors(scores, _grid(h, w), 0.125, spread=0.0)
    spread = select_anchors(scores, _grid(h, w), 0.125, spread=1.0)
    assert clustered.tolist() == list(range(8))  # the first row: the order alone
    rows, cols = {int(i) // w for i in spread}, {int(i) % w for i in spread}
    assert len(rows) >= 3 and len(cols) >= 3  # a lattice over the image, not one row
    xy = _grid(h, w)[spread].double()
    d = torch.cdist(xy, xy) + torch.eye(len(spread)) * 1e9
    assert d.min() >= math.sqrt(n / 8) - 1e-9


def test_selection_order_is_a_round_robin_over_experts():
    logits = torch.full((6, 3), -5.0)
    for i, (e, v) in enumerate([(0, 9), (0, 8), (1, 7), (1, 6), (2, 1), (0, 3)]):
        logits[i, e] = v
    assert selection_order(RouterScores.from_logits(logits)).tolist() == [0, 2, 4, 1, 3, 5]


def test_features_decide_the_merge_when_given():
    scores = RouterScores.from_logits(torch.zeros(4, 2))
    features = torch.tensor([[1.0, 0], [0, 1.0], [0.9, 0.1], [0.1, 0.9]])
    plan = merge_plan(scores, torch.tensor([0, 1]), features=features)
    assert plan.target.tolist() == [0, 1, 0, 1]
    plan = plan_stage(scores, _grid(2, 2), 0.5, features=features)
    assert plan.anchors.numel() == 2


def test_bad_inputs_are_refused():
    scores = RouterScores.from_logits(torch.randn(6, 3))
    for keep in (0.0, 1.5, True):
        with pytest.raises(ValueError, match="keep"):
            select_anchors(scores, _grid(2, 3), keep)
    with pytest.raises(ValueError, match="coords"):
        select_anchors(scores, _grid(3, 3), 0.5)
    with pytest.raises(ValueError, match="spread"):
        select_anchors(scores, _grid(2, 3), 0.5, spread=-1)
    for anchors in ([], [0, 0], [6]):
        with pytest.raises(ValueError, match="anchors"):
            merge_plan(scores, torch.tensor(anchors, dtype=torch.int64))
    with pytest.raises(ValueError, match="hidden"):
        merge_plan(scores, torch.tensor([0])).merge(torch.zeros(5, 2))


def test_stage_keeps_multiply_to_the_target():
    for keep, stages in ((0.25, 3), (0.11, 2), (1.0, 1)):
        assert np.prod(stage_keeps(keep, stages)) == pytest.approx(keep)
    with pytest.raises(ValueError):
        stage_keeps(0.0, 2)


def _greedy_anchors(scores, coords, keep, spread):
    """The anchor rule written plainly: experts' firsts, then a greedy pass keeping ``gap`` apart,
    then a fill, all in selection order."""
    n = len(scores)
    k = anchor_count(n, keep)
    order = selection_order(scores)
    if k == n:
        return list(range(n))
    gap = spread * math.sqrt(n / k)
    chosen = list(order[: min(k, int(scores.expert.unique().numel()))])
    xy = coords.double()
    for i in order:
        if len(chosen) == k:
            break
        if i not in chosen and all(float(torch.dist(xy[i], xy[j])) >= gap for j in chosen):
            chosen.append(int(i))
    for i in order:
        if len(chosen) == k:
            break
        if i not in chosen:
            chosen.append(int(i))
    return sorted(int(i) for i in chosen)


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9), experts=st.integers(2, 6), keep=st.floats(0.02, 1.0),
       seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([0.0, 0.3, 0.5, 1.0, 2.0]),
       duplicate=st.booleans())
def test_anchors_equal_the_plain_greedy_rule(h, w, experts, keep, seed, spread, duplicate):
    n = h * w
    g = torch.Generator().manual_seed(seed)
    scores = RouterScores.from_logits(torch.randn(n, experts, generator=g) * 2)
    coords = _grid(h, w)
    if duplicate and n > 1:  # two tokens in one cell (e.g. two frames): the shortcut must not apply
        coords = coords.clone()
        coords[-1] = coords[0]
    assert select_anchors(scores, coords, keep, spread=spread).tolist() == _greedy_anchors(scores, coords, keep, spread)


def _round_robin(scores):
    """Selection order written plainly: experts by their best token, a lap at a time."""
    conf, expert = scores.confidence.double().tolist(), scores.expert.tolist()
    queues: dict[int, list[int]] = {}
    for i in sorted(range(len(conf)), key=lambda i: (-conf[i], i)):
        queues.setdefault(expert[i], []).append(i)
    order, depth = [], 0
    while len(order) < len(conf):
        order += [q[depth] for q in queues.values() if depth < len(q)]
        depth += 1
    return order


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 80), experts=st.integers(2, 9), seed=st.integers(0, 2**31 - 1), ties=st.booleans())
def test_selection_order_equals_the_plain_round_robin(n, experts, seed, ties):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, experts, generator=g) * 2
    if ties:  # equal confidences: the index breaks them
        logits = logits.round()
    scores = RouterScores.from_logits(logits)
    assert selection_order(scores).tolist() == _round_robin(scores)
