"""The repair methods on hand-made spans: each must put known tokens first, keep the quotas the
budget gives (or raise them where it says so), and refuse bad settings with a clear error."""

from __future__ import annotations

import re

import numpy as np
import pytest

from samcache.integrations.settings import PLUGIN_METHODS, ReuseSettings
from samcache.recompute import (
    Boundary,
    BoundaryDeviation,
    Deviation,
    Isolated,
    ReusedSpan,
    TwoTrack,
    parse_methods,
    registered,
    repair_method,
)
from samcache.recompute.boundary import front_to_back, heads
from samcache.reuse import CachedImage, ImageSlot, PromptLayout, RecomputeBudget, plan_reuse

# Two moved images (10 and 4 tokens) around one that kept its index (8 tokens).
SPANS = [ReusedSpan(10, 10, moved=True), ReusedSpan(30, 8, moved=False), ReusedSpan(50, 4, moved=True)]


def test_registry_names_every_method_and_refuses_unknown_ones():
    assert set(registered()) == {"two-track", "boundary", "deviation", "boundary+deviation", "isolated"}
    for name, cls in registered().items():
        method = repair_method(name)
        assert isinstance(method, cls) and method.name == name
    own = Boundary()
    assert repair_method(own) is own
    assert parse_methods("boundary, deviation,boundary") == ["boundary", "deviation"]
    with pytest.raises(ValueError, match="unknown recompute method 'cacheblend'; choose from two-track"):
        repair_method("cacheblend")
    with pytest.raises(ValueError, match="unknown recompute method"):
        parse_methods("boundary,nope")
    with pytest.raises(ValueError, match="no recompute method given"):
        parse_methods(" , ")
    with pytest.raises(TypeError, match="RepairMethod"):
        RecomputeBudget(rates=(0.1,), method="boundary")


def test_front_to_back_interleaves_by_fraction_of_each_span():
    a, b = ReusedSpan(0, 4), ReusedSpan(10, 2)
    # fractions: a 0, .25, .5, .75; b 0, .5 -> b's second token comes with a's third
    assert front_to_back([a, b]).tolist() == [0, 10, 1, 2, 11, 3]
    assert heads([a, b, ReusedSpan(20, 3, moved=False)], 0.5).tolist() == [0, 10, 1]
    assert heads([a], 0.0).tolist() == []
    assert heads([a], 0.01).tolist() == [0]  # at least one token of each moved span


def test_boundary_takes_the_moved_images_front_to_back_first():
    plan = Boundary().order(SPANS, quota=[6, 3, 0])
    order = plan.order.tolist()
    moved = [10, 50, 11, 12, 51, 13, 14, 15, 52, 16, 17, 53, 18, 19]  # ties: the earlier span first
    assert order[:14] == moved  # 10 and 4 tokens, every span's head before any span's tail
    assert order[14:] == list(range(30, 38))  # the image that kept its index comes last
    assert plan.positions(0).tolist() == sorted(moved[:6]) and plan.positions(1).tolist() == [10, 11, 50]
    assert plan.positions(2).size == 0
    # Nothing moved: the order is the same walk over every span.
    still = [ReusedSpan(s.start, s.length, moved=False) for s in SPANS]
    assert Boundary().order(still, [3]).positions(0).tolist() == [10, 30, 50]
    assert Isolated().order(SPANS, [6]).order.tolist() == order and Isolated.isolated


def test_deviation_recomputes_every_token_up_to_its_check_layer_then_the_largest_deviations():
    method = Deviation(check_layer=1)
    assert method.select_layer == 1 and method.scores is None
    assert method.quota((0.25, 0.25, 0.25, 0.1), 22) == [22, 22, 6, 3]
    assert method.quota((0.0,) * 4, 22) == [0, 0, 0, 0]  # no recompute, no check
    scores = np.zeros(60)
    scores[[31, 12, 52]] = [3.0, 2.0, 1.0]
    plan = method.order(SPANS, [22, 22, 3], scores)
    assert plan.order[:3].tolist() == [31, 12, 52]  # the image that kept its index too: deviation is blind to "moved"
    assert plan.positions(2).tolist() == [12, 31, 52]
    # Before the forward has deviations: every reused position, in position order.
    assert method.order(SPANS, [22, 22, 3]).order.tolist() == [*range(10, 20), *range(30, 38), *range(50, 54)]
    with pytest.raises(ValueError, match="check_layer 4 needs a model deeper than its 4 layers"):
        Deviation(check_layer=4).quota((0.1,) * 4, 10)
    with pytest.raises(ValueError, match="check_layer must be an int >= 1"):
        Deviation(check_layer=0)
    with pytest.raises(ValueError, match="cover every reused position"):
        method.order(SPANS, [3], np.zeros(40))


def test_boundary_deviation_takes_the_moved_heads_then_the_deviations():
    method = BoundaryDeviation(head_fraction=0.25)
    scores = np.zeros(60)
    scores[[35, 19]] = [5.0, 4.0]
    plan = method.order(SPANS, [22, 22, 6], scores)
    # heads: ceil(0.25 * 10) = 3 of the first image, 1 of the last, front to back
    assert plan.order[:4].tolist() == [10, 50, 11, 12]
    assert plan.order[4:6].tolist() == [35, 19]
    assert np.unique(plan.order).size == 22
    with pytest.raises(ValueError, match="head_fraction"):
        BoundaryDeviation(head_fraction=1.5)


def test_two_track_is_todays_order_and_checks_its_settings():
    plan = TwoTrack(head_fraction=0.1, track2_share=0.0, relevance=False).order(SPANS, [3])
    assert plan.order[:3].tolist() == [10, 30, 50]  # offset 0 of every span, moved or not
    assert TwoTrack().scores == "relevance" and TwoTrack(relevance=False).scores is None
    assert TwoTrack(tracks="heads").scores is None
    for bad, match in ((dict(tracks="all"), "tracks"), (dict(head_fraction=-1), "head_fraction"),
                       (dict(track2_share=2), "track2_share")):
        with pytest.raises(ValueError, match=match):
            TwoTrack(**bad)
    assert TwoTrack().describe() == "two-track(head_fraction=0.1, track2_share=0.5, tracks=both, relevance=True)"


def test_the_planner_marks_an_image_moved_when_its_index_changed_or_is_unknown():
    layout = PromptLayout(100, (ImageSlot(0, 10, 20, "A", 10), ImageSlot(1, 40, 20, "B", 40), ImageSlot(2, 70, 20, "C", 70)))
    cached = {"A": CachedImage(20, 5, index=0), "B": CachedImage(20, 5, index=0), "C": CachedImage(20, 70)}
    plan = plan_reuse(layout, cached=cached, num_layers=2, budget=RecomputeBudget((0.1, 0.1), Boundary()))
    assert [s.moved for s in plan.spliced] == [False, True, True]
    assert [s.moved for s in plan.reused_spans] == [False, True, True]
    # Boundary spends the 6 tokens of its quota on the moved images, B and C.
    assert plan.recompute.positions(0).tolist() == [40, 41, 42, 70, 71, 72]
    with pytest.raises(ValueError, match="CachedImage.index must be an int >= 0"):
        CachedImage(20, 5, index=-1)
    with pytest.raises(TypeError, match="moved must be a bool"):
        ReusedSpan(0, 3, moved=1)


def test_a_deviation_plan_declares_its_second_phase():
    layout = PromptLayout(100, (ImageSlot(0, 10, 20, "A", 10),))
    plan = plan_reuse(layout, cached={"A": CachedImage(20, 30)}, num_layers=4,
                      budget=RecomputeBudget((0.25,) * 4, Deviation()))
    assert plan.select_layer == 1 and not plan.needs_scores
    assert list(plan.recompute.quota) == [20, 20, 5, 5] and plan.recomputed_token_layers == 50
    assert [r.size for r in plan.layer_rows] == [80 + 20, 100, 85, 85]
    two = plan_reuse(layout, cached={"A": CachedImage(20, 30)}, num_layers=4, budget=RecomputeBudget((0.25,) * 4))
    assert two.select_layer is None and two.needs_scores


def test_plugin_settings_take_the_methods_the_plugins_can_run():
    assert PLUGIN_METHODS == ("two-track", "boundary")
    settings = ReuseSettings.from_mapping({"recompute_method": "boundary", "recompute_ratio": 0.2}, source="test")
    budget = settings.budget(3)
    assert isinstance(budget.method, Boundary) and budget.rates == (0.2,) * 3
    two = ReuseSettings.from_mapping({"head_fraction": 0.3}, source="test").budget(2)
    assert two.method == TwoTrack(head_fraction=0.3, relevance=False)
    for name in ("deviation", "boundary+deviation", "isolated"):
        with pytest.raises(ValueError, match=re.escape(f"recompute_method '{name}' needs samcache's own forward")):
            ReuseSettings.from_mapping({"recompute_method": name}, source="test")
    with pytest.raises(ValueError, match="recompute_method 'blend' is not a recompute method"):
        ReuseSettings.from_mapping({"recompute_method": "blend"}, source="test")
    with pytest.raises(ValueError, match="head_fraction shapes recompute_method 'two-track', not 'boundary'"):
        ReuseSettings.from_mapping({"recompute_method": "boundary", "head_fraction": 0.2}, source="test")


def test_plugin_settings_built_directly_are_checked_the_same_way():
    """ReuseSettings built in code (the benches, a custom launcher) refuse a bad method, ratio or
    order setting as from_mapping does: an unknown method would otherwise run as boundary."""
    assert ReuseSettings(recompute_method="boundary").budget(2).method == Boundary()
    with pytest.raises(ValueError, match=re.escape("recompute_method 'deviation' needs samcache's own forward")):
        ReuseSettings(recompute_method="deviation")
    with pytest.raises(ValueError, match="recompute_method 'blend' is not a recompute method"):
        ReuseSettings(recompute_method="blend")
    with pytest.raises(ValueError, match=re.escape("recompute_ratio must be a number in [0, 1], got 1.5")):
        ReuseSettings(recompute_ratio=1.5)
    with pytest.raises(ValueError, match="keep_image_order must be True, False or 'auto', got 'maybe'"):
        ReuseSettings(keep_image_order="maybe")
