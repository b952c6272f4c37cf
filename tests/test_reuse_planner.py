"""plan_reuse on hand-made prompts: no model, no KV, every decision checked by hand."""

import numpy as np
import pytest

from samcache.reuse import CachedImage, ImageSlot, PromptLayout, RecomputeBudget, plan_reuse
from samcache.recompute import TwoTrack

# A 100-token prompt: text [0, 10), image A [10, 50), text [50, 55), image B [55, 95), text [95, 100).
A = ImageSlot(index=0, start=10, length=40, key="A", position=10)
B = ImageSlot(index=1, start=55, length=40, key="B", position=60)
LAYOUT = PromptLayout(100, (A, B))


def test_nothing_cached_computes_everything_exactly():
    plan = plan_reuse(LAYOUT, num_layers=3)
    assert plan.prefix_tokens == 0 and plan.spliced == () and plan.recompute is None
    assert plan.new_rows.tolist() == list(range(100))
    assert all(r.tolist() == list(range(100)) for r in plan.layer_rows) and plan.num_layers == 3
    assert plan.vit_images == (0, 1) and plan.exact_tokens == 100 and not plan.needs_scores
    assert plan.image_reused_tokens == 0 and plan.recompute_rates == [0.0, 0.0, 0.0]


def test_a_prefix_hit_covers_the_leading_tokens():
    plan = plan_reuse(LAYOUT, prefix_tokens=32, num_layers=2)
    assert plan.prefix_tokens == 32 and plan.new_rows.tolist() == list(range(32, 100))
    assert plan.vit_images == (0, 1)  # A's tokens 32..49 are still computed from its ViT output
    assert plan.exact_tokens == 100


def test_a_known_image_at_a_new_position_is_spliced_with_its_delta():
    plan = plan_reuse(LAYOUT, cached={"B": CachedImage(length=40, position=17)}, num_layers=2)
    (span,) = plan.spliced
    assert (span.image, span.start, span.length, span.offset, span.delta) == (1, 55, 40, 0, 60 - 17)
    assert plan.new_rows.tolist() == list(range(55)) + list(range(95, 100))
    assert plan.vit_images == (0,)  # B is not recomputed: its ViT output is not needed
    assert plan.exact_tokens == 55  # B's KV saw another context: blocks from here on are approximate
    assert plan.image_reused_tokens == 40


def test_an_image_the_prefix_covers_in_part_is_spliced_from_where_the_prefix_ends():
    plan = plan_reuse(LAYOUT, prefix_tokens=48, cached={"A": CachedImage(40, 10)}, num_layers=1)
    (span,) = plan.spliced
    assert (span.start, span.length, span.offset, span.delta) == (48, 2, 38, 0)
    assert 48 not in plan.new_rows and 50 in plan.new_rows


def test_images_inside_the_prefix_and_unknown_images_are_not_spliced():
    plan = plan_reuse(LAYOUT, prefix_tokens=52, cached={"A": CachedImage(40, 10), "C": CachedImage(3, 0)},
                      num_layers=1)
    assert plan.spliced == () and plan.new_rows.tolist() == list(range(52, 100))


def test_the_last_token_is_always_computed():
    layout = PromptLayout(50, (ImageSlot(0, 10, 40, "A", 10),))  # the image ends the prompt
    plan = plan_reuse(layout, cached={"A": CachedImage(40, 3)}, num_layers=1)
    (span,) = plan.spliced
    assert span.start == 10 and span.length == 39 and plan.new_rows.tolist() == list(range(10)) + [49]
    assert plan.vit_images == (0,)  # the image's last token is computed: its ViT output is needed


def test_the_budget_recomputes_nested_sets_shrinking_with_depth():
    budget = RecomputeBudget(rates=(0.5, 0.25, 0.1), method=TwoTrack(head_fraction=0.1, track2_share=0.0, relevance=False))
    plan = plan_reuse(LAYOUT, cached={"A": CachedImage(40, 0), "B": CachedImage(40, 5)}, budget=budget, num_layers=3)
    assert plan.recompute.quota == (40, 20, 8)  # ceil(rate x 80 reused tokens)
    sets = [set(r.tolist()) - set(plan.new_rows.tolist()) for r in plan.layer_rows]
    assert [len(s) for s in sets] == [40, 20, 8] and sets[0] >= sets[1] >= sets[2]
    # track 1 first, interleaved: the first token of each span, then the heads (10%: 4 tokens each)
    assert sets[2] == {10, 11, 12, 13, 55, 56, 57, 58}
    assert plan.recomputed_tokens == 40 and plan.recomputed_token_layers == 68
    assert plan.recompute_rates == [0.5, 0.25, 0.1]
    assert plan.vit_images == (0, 1) and plan.exact_tokens == 10 and not plan.needs_scores


def test_track_two_follows_the_relevance_scores():
    budget = RecomputeBudget(rates=(0.1,), method=TwoTrack(head_fraction=0.05, track2_share=0.5))
    plan = plan_reuse(LAYOUT, cached={"B": CachedImage(40, 60)}, budget=budget, num_layers=1)
    assert plan.needs_scores  # track 2 wants scores; without them it keeps position order
    scores = np.zeros(100)
    scores[[90, 77, 64]] = [3.0, 2.0, 1.0]
    ranked = plan.with_scores(scores)
    assert not ranked.needs_scores
    recomputed = set(ranked.layer_rows[0].tolist()) - set(ranked.new_rows.tolist())
    # 4 tokens: the heads (55, 56) and the two most relevant (90, 77), half and half
    assert recomputed == {55, 56, 90, 77}


def test_heads_only_stops_at_the_span_heads():
    budget = RecomputeBudget(rates=(1.0, 1.0), method=TwoTrack(head_fraction=0.1, tracks="heads"))
    plan = plan_reuse(LAYOUT, cached={"A": CachedImage(40, 0)}, budget=budget, num_layers=2)
    assert plan.recompute.quota == (4, 4) and not plan.needs_scores


def test_recomputing_every_reused_token_at_every_layer_is_exact():
    budget = RecomputeBudget(rates=(1.0, 1.0), method=TwoTrack(relevance=False))
    plan = plan_reuse(LAYOUT, cached={"A": CachedImage(40, 0)}, budget=budget, num_layers=2)
    assert plan.exact_tokens == 100 and all(r.size == 100 for r in plan.layer_rows)
    partial = plan_reuse(LAYOUT, cached={"A": CachedImage(40, 0)},
                         budget=RecomputeBudget(rates=(1.0, 0.9), method=TwoTrack(relevance=False)), num_layers=2)
    assert partial.exact_tokens == 10


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="last token is always computed"):
        plan_reuse(LAYOUT, prefix_tokens=100, num_layers=1)
    with pytest.raises(ValueError, match="without overlapping"):
        plan_reuse(PromptLayout(100, (A, ImageSlot(1, 40, 20, "X", 0))), num_layers=1)
    with pytest.raises(ValueError, match="without overlapping"):
        plan_reuse(PromptLayout(30, (A,)), num_layers=1)
    with pytest.raises(ValueError, match="at least one token"):
        plan_reuse(PromptLayout(0), num_layers=1)
    with pytest.raises(ValueError, match="its cached KV has 39"):
        plan_reuse(LAYOUT, cached={"A": CachedImage(39, 0)}, num_layers=1)
    with pytest.raises(TypeError, match="CachedImage"):
        plan_reuse(LAYOUT, cached={"A": (40, 0)}, num_layers=1)
    with pytest.raises(ValueError, match="2 layer rates, the model has 3"):
        plan_reuse(LAYOUT, budget=RecomputeBudget(rates=(0.1, 0.1)), num_layers=3)
    with pytest.raises(ValueError, match="num_layers"):
        plan_reuse(LAYOUT, num_layers=0)
    with pytest.raises(TypeError, match="PromptLayout"):
        plan_reuse([100], num_layers=1)
    with pytest.raises(ValueError, match="non-increasing"):
        RecomputeBudget(rates=(0.1, 0.2))
    with pytest.raises(ValueError, match="tracks"):
        TwoTrack(tracks="all")
    with pytest.raises(ValueError, match="head_fraction"):
        TwoTrack(head_fraction=2)
    with pytest.raises(ValueError, match="has index 5: images are numbered in prompt order"):
        plan_reuse(PromptLayout(100, (ImageSlot(5, 10, 40, "A", 10),)), num_layers=1)
    with pytest.raises(ValueError, match="ImageSlot.start must be an int"):
        ImageSlot(0, 10.0, 40, "A", 10)
    with pytest.raises(ValueError, match="ImageSlot.length must be an int >= 1"):
        ImageSlot(0, 10, 0, "A", 10)
    with pytest.raises(ValueError, match="CachedImage.position must be an int >= 0"):
        CachedImage(40, -1)


def test_plan_request_looks_up_the_images_past_the_prefix_once_each_and_counts_them():
    from samcache.engine.metrics import TurnMetrics
    from samcache.reuse import ReuseCounters, plan_request

    layout = PromptLayout(100, (ImageSlot(0, 2, 8, "P", 2), ImageSlot(1, 20, 10, "A", 20),
                                ImageSlot(2, 40, 10, "B", 40), ImageSlot(3, 60, 10, "A", 60)))
    asked = []

    def lookup(slot):
        asked.append(slot.key)
        return (CachedImage(10, 0, index=1), f"entry {slot.key}") if slot.key == "A" else None

    request = plan_request(layout, prefix_tokens=12, lookup=lookup, budget=None, num_layers=2)
    assert asked == ["A", "B"]  # P is in the prefix; A shown twice is looked up once
    assert request.hits == {"A": "entry A"} and [s.key for s in request.misses] == ["B"]
    assert request.looked_up == 3 and request.hit_images == 2
    assert [(s.image, s.moved) for s in request.plan.spliced] == [(1, False), (3, True)]
    assert request.recompute_rows(0).size == 0
    counters = ReuseCounters()
    counters.count(request)
    counters.count(request, scheduled_tokens=10)
    assert (counters.prompt_tokens, counters.image_reused_tokens, counters.image_kv_hits, counters.image_kv_misses) == (
        88 + 10, 40, 4, 2)
    # One vocabulary: every reuse counter a turn also has is named as the turn's metrics name it.
    # (The plugins' own: forward steps, rows computed, images stored, side rows of an isolated model;
    # the engine counts its side sequences as isolated_tokens.)
    shared = set(counters.counters()) - {"steps", "computed_tokens", "images_saved", "isolated_images",
                                         "isolated_fallbacks"}
    assert shared <= set(TurnMetrics.__dataclass_fields__)
    off = plan_request(layout, prefix_tokens=12, lookup=None, budget=None, num_layers=2)
    assert off.looked_up == 0 and not off.plan.spliced and not off.misses
    with pytest.raises(TypeError, match=r"lookup must return \(CachedImage, entry\)"):
        plan_request(layout, prefix_tokens=0, lookup=lambda s: ((10, 0), None), budget=None, num_layers=2)
