"""Two-track recompute selection: nested per-layer sets, track order, relevance scores."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from samcache.recompute import (
    ReusedSpan,
    SensitivityCurves,
    attention_relevance,
    key_deviation,
    plan_recompute,
    solve_layer_budget,
    span_positions,
)


@st.composite
def case(draw):
    spans, pos = [], draw(st.integers(0, 5))
    for _ in range(draw(st.integers(1, 4))):
        length = draw(st.integers(1, 40))
        spans.append(ReusedSpan(pos, length))
        pos += length + draw(st.integers(0, 6))
    total = sum(s.length for s in spans)
    quota = sorted(draw(st.lists(st.integers(0, total), min_size=1, max_size=6)), reverse=True)
    scores = np.array(draw(st.lists(st.floats(-5, 5), min_size=pos, max_size=pos)))
    return spans, quota, scores


@given(case(), st.sampled_from([0.0, 0.1, 0.5]))
def test_sets_are_nested_reused_and_sized_by_quota(c, head_fraction):
    spans, quota, scores = c
    plan = plan_recompute(spans, quota, scores, head_fraction=head_fraction)
    reused = {p for s in spans for p in range(s.start, s.start + s.length)}
    assert sorted(plan.order.tolist()) == sorted(reused)  # a permutation of the reused tokens
    previous = None
    for layer in range(plan.num_layers):
        got = set(plan.positions(layer).tolist())
        assert len(got) == quota[layer] and got <= reused
        if previous is not None:
            assert got <= previous, "a deeper layer recomputes a token the layer above did not"
        previous = got


def test_track1_heads_first_interleaved_then_scores():
    spans = [ReusedSpan(10, 20), ReusedSpan(40, 10)]
    scores = np.zeros(60)
    scores[[25, 45, 12]] = [3.0, 9.0, 1.0]
    plan = plan_recompute(spans, [2, 1], scores, head_fraction=0.1)
    assert plan.positions(0).tolist() == [10, 40]  # first token of every span before any second token
    assert plan.positions(1).tolist() == [10]
    order = plan_recompute(spans, [6], scores, head_fraction=0.1).order.tolist()
    assert order[:3] == [10, 40, 11]  # heads: 2 tokens of span 1, 1 token of span 2
    assert order[3:6] == [45, 25, 12]  # then by descending score


def test_with_the_layer_budget():
    curves = SensitivityCurves(np.array([0.0, 0.05, 0.2]), np.array([[1.0, 0.3, 0.0], [1.0, 0.5, 0.1], [0.5, 0.4, 0.3]]))
    budget = solve_layer_budget(curves, 0.1)
    spans = [ReusedSpan(4, 1196), ReusedSpan(1300, 1196)]
    plan = plan_recompute(spans, budget.tokens_per_layer(2392))
    assert [len(plan.positions(i)) for i in range(3)] == budget.tokens_per_layer(2392)


def test_key_deviation_and_attention_relevance():
    gen = torch.Generator().manual_seed(0)
    cached, fresh = torch.randn(5, 2, 4, generator=gen), torch.randn(5, 2, 4, generator=gen)
    want = torch.stack([torch.stack([(cached[i, h] - fresh[i, h]).norm() for h in range(2)]).mean() for i in range(5)])
    torch.testing.assert_close(key_deviation(cached, fresh), want)
    q, k = torch.randn(3, 4, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    rel = attention_relevance(q, k)
    manual = torch.zeros(6)
    for h in range(4):
        p = torch.softmax(q[:, h] @ k[:, h // 2].T / 8**0.5, dim=-1)
        manual += p.sum(0) / 4
    torch.testing.assert_close(rel, manual)
    assert rel.sum().item() == pytest.approx(3.0, rel=1e-5)  # every query distributes mass 1


def test_bad_input():
    spans = [ReusedSpan(0, 10)]
    with pytest.raises(ValueError):
        ReusedSpan(-1, 3)
    with pytest.raises(ValueError):
        ReusedSpan(0, 0)
    with pytest.raises(ValueError):
        plan_recompute([ReusedSpan(0, 10), ReusedSpan(5, 3)], [1])  # overlap
    with pytest.raises(ValueError):
        plan_recompute(spans, [1, 2])  # increasing with depth
    with pytest.raises(ValueError):
        plan_recompute(spans, [11])
    with pytest.raises(ValueError):
        plan_recompute(spans, [-1])
    with pytest.raises(ValueError):
        plan_recompute(spans, [3], np.zeros(5))  # scores do not cover the span
    with pytest.raises(ValueError):
        plan_recompute(spans, [3], np.full(10, np.nan))
    with pytest.raises(ValueError):
        plan_recompute(spans, [3], head_fraction=2.0)
    with pytest.raises(TypeError):
        plan_recompute([(0, 10)], [3])
    with pytest.raises(ValueError):
        key_deviation(torch.zeros(2, 2, 4), torch.zeros(2, 2, 5))
    with pytest.raises(ValueError):
        attention_relevance(torch.zeros(2, 3, 4), torch.zeros(5, 2, 4))


@given(st.integers(0, 40), st.integers(0, 40), st.sampled_from([0.1, 0.25, 0.5, 0.75, 0.9]))
def test_track2_share_interleaves_while_both_tracks_last(n1, n2, share):
    from samcache.recompute.selection import _interleave

    track1, track2 = np.arange(n1), np.arange(1000, 1000 + n2)
    out = _interleave(track1, track2, share)
    assert sorted(out.tolist()) == sorted(track1.tolist() + track2.tolist())
    is2 = out >= 1000
    assert out[~is2].tolist() == track1.tolist() and out[is2].tolist() == track2.tolist()  # each keeps its order
    for k in range(1, out.size + 1):
        taken2, taken1 = int(is2[:k].sum()), k - int(is2[:k].sum())
        if taken2 < n2 and taken1 < n1:  # both tracks still have tokens: track 2 holds floor(k * share)
            assert taken2 == int(k * share)


def test_plan_recompute_shares_the_order_between_tracks():
    spans = [ReusedSpan(0, 40), ReusedSpan(50, 40)]
    scores = np.zeros(90)
    scores[[30, 31, 80]] = [5.0, 4.0, 3.0]
    plan = plan_recompute(spans, [10], scores, head_fraction=0.1, track2_share=0.5)
    assert plan.order[:2].tolist() == [0, 50]  # the first token of every span comes first
    assert plan.order[2:8].tolist() == [1, 30, 51, 31, 2, 80]  # then heads and relevance, half and half


def test_heads_track_alone_stops_at_the_span_heads():
    spans = [ReusedSpan(10, 40), ReusedSpan(100, 25)]
    scores = np.random.default_rng(3).random(200)
    plan = plan_recompute(spans, [20, 12, 2], scores, head_fraction=0.1, track2_share=0.5, tracks="heads")
    heads = {10 + k for k in range(4)} | {100 + k for k in range(3)}
    assert plan.quota == (7, 7, 2)  # 4 + 3 span heads at most
    assert set(plan.positions(0).tolist()) == heads and set(plan.order[:7].tolist()) == heads
    rest = [p for p in range(10, 50) if p not in heads] + [p for p in range(100, 125) if p not in heads]
    assert plan.order[7:].tolist() == sorted(rest, key=lambda p: -scores[p])  # share ignored: track 2 after
    with pytest.raises(ValueError, match="tracks must be"):
        plan_recompute(spans, [1], tracks="track2")
    assert span_positions(spans).tolist() == list(range(10, 50)) + list(range(100, 125))
    with pytest.raises(TypeError, match="ReusedSpan"):
        span_positions([(10, 40)])
