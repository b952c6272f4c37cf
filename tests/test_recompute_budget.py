"""Layer-aware recompute budget: the DP solver against brute force, constraints, bad input."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from samcache.recompute import (
    SensitivityCurves,
    probe_layer_sensitivity,
    solve_layer_budget,
    uniform_layer_budget,
)

GRID = [0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]  # multiples of the solver's 0.5% unit: exact


def brute_force(curves, total_rate):
    """Every non-increasing assignment of probed rates to layers; the best within budget."""
    L, R = curves.loss.shape
    best = (np.inf, None)
    for combo in itertools.combinations_with_replacement(range(R - 1, -1, -1), L):  # non-increasing
        rates = curves.rates[list(combo)]
        if rates.mean() <= total_rate + 1e-12:
            loss = curves.loss[np.arange(L), list(combo)].sum()
            if loss < best[0] - 1e-12:
                best = (loss, rates)
    return best


@st.composite
def curves_strategy(draw):
    layers = draw(st.integers(1, 5))
    r = draw(st.integers(1, 5))
    rates = np.array(GRID[:r])
    # loss falls as the rate grows (as a probe measures it), at a random pace per layer
    start = np.array(draw(st.lists(st.floats(0.0, 10.0), min_size=layers, max_size=layers)))
    drops = np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=layers * r, max_size=layers * r))).reshape(layers, r)
    loss = np.maximum(start[:, None] - np.cumsum(drops * start[:, None], axis=1) / r, 0.0)
    return SensitivityCurves(rates=rates, loss=loss)


@given(curves=curves_strategy(), total=st.sampled_from([0.0, 0.02, 0.03, 0.05, 0.1, 0.3, 1.0]))
def test_matches_brute_force_and_respects_constraints(curves, total):
    got = solve_layer_budget(curves, total)
    want_loss, _ = brute_force(curves, total)
    assert got.expected_loss == pytest.approx(want_loss, abs=1e-9)
    assert np.all(np.diff(got.rates) <= 0), "rates must not increase with depth"
    assert got.mean_rate <= total + 1e-12
    assert got.expected_loss == pytest.approx(curves.loss[np.arange(curves.num_layers), [list(curves.rates).index(r) for r in got.rates]].sum())
    assert got.expected_loss <= uniform_layer_budget(curves, total).expected_loss + 1e-9


def test_beats_greedy_where_a_shallow_layer_must_rise_first():
    """Layer 0 gains little from recompute, layer 1 a lot; monotonicity means layer 1 can only
    rise as far as layer 0. A greedy step by gain per unit would never raise layer 0."""
    rates = np.array([0.0, 0.1])
    loss = np.array([[1.0, 0.99], [5.0, 0.0]])
    best = solve_layer_budget(SensitivityCurves(rates, loss), 0.1)
    assert best.rates.tolist() == [0.1, 0.1] and best.expected_loss == pytest.approx(0.99)


def test_real_size_is_fast_and_budgeted():
    rng = np.random.default_rng(0)
    L = 48
    sens = rng.uniform(0.1, 2.0, L) * np.linspace(2.0, 0.5, L)  # early layers matter more
    rates = np.array(GRID)
    loss = sens[:, None] * np.exp(-rates[None, :] * 40)
    best = solve_layer_budget(SensitivityCurves(rates, loss), 0.05)
    assert best.mean_rate <= 0.05 + 1e-12 and np.all(np.diff(best.rates) <= 0)
    assert best.expected_loss < uniform_layer_budget(SensitivityCurves(rates, loss), 0.05).expected_loss
    assert best.tokens_per_layer(1196)[0] >= best.tokens_per_layer(1196)[-1]


def test_unprobed_rates_are_charged_conservatively():
    curves = SensitivityCurves(np.array([0.0, 0.0333]), np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]))
    best = solve_layer_budget(curves, 0.0333)  # 0.0333 costs 7 units of 0.5%, the budget 19.98 -> 19 units
    assert best.mean_rate <= 0.0333 and best.rates.tolist() == [0.0333, 0.0333, 0.0]


def test_probe_builds_curves_with_one_run_per_cell():
    calls = []

    def measure(layer, rate):
        calls.append((layer, rate))
        return (layer + 1) * (1 - rate)

    curves = probe_layer_sensitivity(measure, 3, rates=(0.0, 0.5, 1.0), progress=False)
    assert len(calls) == 9 and curves.loss.shape == (3, 3)
    assert curves.loss[2, 1] == pytest.approx(1.5)


def test_the_end_to_end_check_says_where_uniform_rates_won():
    rates, loss = np.array([0.0, 0.1, 0.5, 1.0]), np.ones((2, 4))
    nan = np.nan
    # Measured at 0.1 (the solved rates won) and at 0.5 (uniform won); 0 and 1 are not measured.
    curves = SensitivityCurves(rates, loss, checked=[[nan, nan], [0.2, 0.3], [0.4, 0.1], [nan, nan]])
    assert [curves.prefers_uniform(r) for r in (0.02, 0.1, 0.25, 0.35, 0.5, 0.9)] == [False, False, False, True, True, True]
    assert not SensitivityCurves(rates, loss).prefers_uniform(0.5)  # no check: the solver decides
    assert not SensitivityCurves(rates, loss, checked=np.full((4, 2), nan)).prefers_uniform(0.5)
    d = curves.to_dict("m")
    assert d["checked"][0] == [None, None] and d["checked"][2] == [0.4, 0.1] and d["model_id"] == "m"
    for rate in (-0.1, 1.5, "0.5", None):
        with pytest.raises(ValueError, match="total_rate"):
            curves.prefers_uniform(rate)
    for bad in (np.ones((3, 2)), np.ones((4, 3)), [[np.inf, 0.0]] * 4):
        with pytest.raises(ValueError, match="checked"):
            SensitivityCurves(rates, loss, checked=bad)


def test_bad_input():
    ok = SensitivityCurves(np.array([0.0, 0.1]), np.ones((2, 2)))
    with pytest.raises(ValueError):
        SensitivityCurves(np.array([0.1, 0.2]), np.ones((2, 2)))  # must start at 0
    with pytest.raises(ValueError):
        SensitivityCurves(np.array([0.0, 0.0]), np.ones((2, 2)))
    with pytest.raises(ValueError):
        SensitivityCurves(np.array([0.0, 1.5]), np.ones((2, 2)))
    with pytest.raises(ValueError):
        SensitivityCurves(np.array([0.0, 0.1]), np.ones((2, 3)))
    with pytest.raises(ValueError):
        SensitivityCurves(np.array([0.0, 0.1]), np.array([[1.0, np.nan]]))
    with pytest.raises(ValueError):
        solve_layer_budget(ok, 1.5)
    with pytest.raises(ValueError):
        solve_layer_budget(ok, -0.1)
    with pytest.raises(TypeError):
        solve_layer_budget("curves", 0.05)
    with pytest.raises(ValueError):
        solve_layer_budget(ok, 0.05, resolution=0)
    with pytest.raises(TypeError):
        probe_layer_sensitivity(None, 2)
    with pytest.raises(ValueError):
        probe_layer_sensitivity(lambda l, r: 0.0, 0)


# ---- the image-order check (keep_image_order="auto") ------------------------------------------------
def test_the_image_order_check_keeps_the_order_only_on_enough_evidence_of_damage():
    from samcache.recompute.image_order import AGREEMENT_BAR, MIN_CONFIDENT_TOKENS, ImageOrderCheck

    rates, nan = np.array([0.0, 0.05, 0.2, 1.0]), np.nan
    n = 200
    # Solved rates measured at 0.05 and 0.2 only; uniform at every rate; 0 and 1 the same run.
    agreed = [[150, 150], [160, 170], [nan, 190], [200, 200]]
    check = ImageOrderCheck(rates, agreed, confident=n, pairs=3)
    assert check.agreement(0.0) == 0.75 and check.agreement(0.05) == 0.8 and check.agreement(0.05, uniform=True) == 0.85
    assert check.agreement(0.15) == 0.8  # the nearest measured solved rate is 0.05 (0.2 was not measured)
    assert check.agreement(0.15, uniform=True) == 0.95 and check.agreement(0.9) == 1.0
    assert [check.keeps_order(r) for r in (0.0, 0.05, 0.2, 1.0)] == [True, True, True, False]
    # At the bar: 1 token in 100 changed is not enough to give up reuse at another index.
    at_bar = ImageOrderCheck(rates, [[AGREEMENT_BAR * n] * 2] * 4, confident=n, pairs=1)
    assert not at_bar.keeps_order(0.05)
    # Too few confident tokens (a model with flat distributions): no evidence, no change.
    few = MIN_CONFIDENT_TOKENS - 1
    assert not ImageOrderCheck(rates, [[0, 0]] * 4, confident=few, pairs=1).keeps_order(0.05)
    assert ImageOrderCheck(rates, [[0, 0]] * 4, confident=few + 1, pairs=1).keeps_order(0.05)
    empty = ImageOrderCheck(rates, np.full((4, 2), nan), confident=0, pairs=1)
    assert empty.agreement(0.05) is None and not empty.keeps_order(0.05)
    # JSON and back, inside the curves too.
    again = ImageOrderCheck.from_dict(check.to_dict())
    assert np.array_equal(again.agreed, check.agreed, equal_nan=True) and (again.confident, again.pairs) == (n, 3)
    curves = SensitivityCurves(rates, np.ones((2, 4)), image_order=check)
    loaded = SensitivityCurves.from_dict(curves.to_dict("m"))
    assert np.array_equal(loaded.image_order.agreed, check.agreed, equal_nan=True)
    assert SensitivityCurves.from_dict(SensitivityCurves(rates, np.ones((2, 4))).to_dict()).image_order is None


@pytest.mark.parametrize("bad,match", [
    (dict(agreed=np.zeros((3, 2))), "agreed must be"),
    (dict(agreed=[[11, 0]] * 4), r"\[0, confident=10\]"),
    (dict(agreed=[[-1, 0]] * 4), r"\[0, confident=10\]"),
    (dict(confident=-1), "confident"),
    (dict(confident=True), "confident"),
    (dict(pairs=1.5), "pairs"),
    (dict(rates=[]), "rates"),
])
def test_the_image_order_check_refuses_bad_input(bad, match):
    from samcache.recompute.image_order import ImageOrderCheck

    kwargs = dict(rates=[0.0, 0.1, 0.5, 1.0], agreed=np.zeros((4, 2)), confident=10, pairs=1)
    kwargs.update(bad)
    with pytest.raises(ValueError, match=match):
        ImageOrderCheck(**kwargs)
    with pytest.raises(ValueError, match="rate must be"):
        ImageOrderCheck([0.0, 1.0], np.zeros((2, 2)), 1, 1).agreement(1.5)


def test_curves_refuse_an_image_order_check_of_other_rates():
    from samcache.recompute.image_order import ImageOrderCheck

    rates = np.array([0.0, 0.5, 1.0])
    with pytest.raises(ValueError, match="other probe rates"):
        SensitivityCurves(rates, np.ones((2, 3)), image_order=ImageOrderCheck([0.0, 1.0], np.zeros((2, 2)), 1, 1))
    with pytest.raises(TypeError, match="ImageOrderCheck"):
        SensitivityCurves(rates, np.ones((2, 3)), image_order={"agreed": []})


def test_confident_agreement_counts_only_where_the_reference_is_confident():
    import torch

    from samcache.recompute.image_order import confident_agreement

    sure = torch.tensor([0.0, 5.0, 0.0])  # top-1 probability ~0.99
    flat = torch.tensor([0.0, 0.1, 0.0])  # ~0.36: not evidence
    other = torch.tensor([5.0, 0.0, 0.0])
    reference = [sure, flat, sure, sure]
    got = [sure, other, other, sure * 0.1]  # agrees, (not counted), disagrees, agrees with little confidence
    assert confident_agreement(reference, got) == (2, 3)
    assert confident_agreement([], []) == (0, 0)
    with pytest.raises(ValueError, match="same tokens"):
        confident_agreement(reference, got[:2])
