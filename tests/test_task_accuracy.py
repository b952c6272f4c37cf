"""samcache.bench.task_accuracy on a tiny random checkpoint: every (mode, ratio) run scores every
turn of the traces against its known answer; bad modes, ratios and traces are refused."""

from __future__ import annotations

import pytest

from samcache.bench.task_accuracy import (
    SCENARIO_KINDS,
    calibration_pairs,
    evaluate_traces,
    paired_difference,
    reordered_turns,
    training_defaults,
    wilson_interval,
)
from samcache.tasks import visual_qa


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from samcache.random_checkpoints import build_tiny_model

    return build_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("tiny"), seed=0)


def test_scores_every_turn_of_every_run(model):
    traces = [visual_qa.trace(seed, scenario="gui", turns=3, window=2) for seed in (1, 2)]
    out = evaluate_traces(model, traces, modes=["baseline", "samcache"], recompute=[0.0, 1.0], calibrate=False,
                          max_new_tokens=3, progress=False)
    assert [(r["mode"], r["recompute"]) for r in out["runs"]] == [("baseline", None), ("samcache", 0.0), ("samcache", 1.0)]
    for run in out["runs"]:
        assert run["turns_scored"] == 6 and 0.0 <= run["accuracy"] <= 1.0
        lo, hi = run["interval"]
        assert lo <= run["accuracy"] <= hi
        assert all(t["correct"] == visual_qa.is_correct(t["reply"], t["answer"]) for t in run["turns"])
    samcache_runs = [r for r in out["runs"] if r["mode"] == "samcache"]
    # The window slides: later turns reuse the screenshots they saw before, at new positions.
    assert all(sum(t["image_reused_tokens"] for t in r["turns"] if t["turn"] > 0) > 0 for r in samcache_runs)
    full = next(r for r in samcache_runs if r["recompute"] == 1.0)
    assert all(t["kl"] is not None and t["kl"] < 1e-6 for t in full["turns"])  # recompute 1.0: a full prefill
    for run in out["runs"]:  # a full window of 2 moves the screenshot it keeps one place up
        assert [t["reordered"] for t in run["turns"]] == [False, False, True] * 2
        kept, moved = ([t["correct"] for t in run["turns"] if t["turn"] == k] for k in (1, 2))
        assert run["by_image_order"] == {
            name: {"accuracy": sum(c) / 2, "turns_scored": 2, "description_accuracy": None, "description_parts": 0}
            for name, c in (("kept", kept), ("reordered", moved))}


def test_reordered_turns_follow_each_image_through_the_trace():
    def turns(*ids):
        return [visual_qa.Turn("t", [], "a", (), "colour", 0, i) for i in ids]

    assert reordered_turns(turns((0, 1), (0, 1, 2), (2, 0, 1))) == [False, False, True]
    # Against the last turn that showed the image: 1 was first at turn 1, so second again is a move.
    assert reordered_turns(turns((0, 1), (1,), (0, 1))) == [False, True, True]
    assert reordered_turns(turns((0,), (1,), (0,))) == [False, False, False]
    assert not any(reordered_turns(visual_qa.trace(2, scenario="handoff", turns=4, window=3)))
    assert set(SCENARIO_KINDS) == set(visual_qa.SCENARIOS)


def test_calibration_pairs_are_consecutive_turns_that_reuse_an_image():
    gui = visual_qa.trace(3, scenario="gui", turns=4, window=2)
    pairs = calibration_pairs([gui])
    assert pairs == [(a.messages, b.messages) for a, b in zip(gui, gui[1:])]  # a window of 2 always keeps one
    with pytest.raises(ValueError, match="no turn that shows an earlier turn's image again"):
        calibration_pairs([visual_qa.trace(3, scenario="gui", turns=3, window=1)])


@pytest.mark.parametrize("bad", [dict(modes=["nope"]), dict(recompute=[1.5]), dict(modes=["new-only"]),
                                 dict(traces=[]), dict(max_new_tokens=0), dict(track2_shares=[1.5]),
                                 dict(track2_shares="half"), dict(track2_shares=[])])
def test_refuses_bad_arguments(model, bad):
    kwargs = dict(traces=[visual_qa.trace(1, scenario="gui", turns=1, window=1)], modes=["samcache"], calibrate=False,
                  progress=False)
    kwargs.update(bad)
    with pytest.raises(ValueError):
        evaluate_traces(model, **kwargs)


def test_refuses_a_bad_keep_image_order_before_any_run(model):
    with pytest.raises(TypeError, match="keep_image_order must be True, False or 'auto'"):
        evaluate_traces(model, [visual_qa.trace(1, scenario="gui", turns=1, window=1)], modes=["samcache"],
                        keep_image_order="yes", progress=False)


def test_track2_share_sweep_runs_each_share_of_the_two_track_modes(model, monkeypatch):
    from samcache.engine import SAMcacheEngine
    from samcache.bench.task_accuracy import comparisons

    shares_built = []
    init = SAMcacheEngine.__init__

    def recording(self, *args, **kwargs):
        shares_built.append(kwargs.get("track2_share"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(SAMcacheEngine, "__init__", recording)
    traces = [visual_qa.trace(1, scenario="gui", turns=2, window=2)]
    out = evaluate_traces(model, traces, modes=["baseline", "samcache", "head-only"], recompute=[0.0, 0.5],
                          track2_shares="0.25,1", calibrate=False, max_new_tokens=2, fidelity=False, progress=False)
    # Ratio 0 recomputes nothing, so its share is moot; head-only has no track 2.
    assert [(r["mode"], r["recompute"], r["track2_share"]) for r in out["runs"]] == [
        ("baseline", None, None), ("samcache", 0.0, None), ("samcache", 0.5, 0.25), ("samcache", 0.5, 1.0),
        ("head-only", 0.0, None), ("head-only", 0.5, None)]
    # The shared weights' engine, then one engine per trace and run, each with its run's share.
    assert shares_built[1:] == [None, None, 0.25, 1.0, None, None]
    names = {(c["a"], c["b"]) for c in comparisons(out)}
    assert {("samcache @ 0.5 share 0.25", "head-only @ 0.5"), ("samcache @ 0.5 share 1", "head-only @ 0.5"),
            ("samcache @ 0.5 share 0.25", "baseline"), ("samcache @ 0", "head-only @ 0")} <= names


def test_calibration_covers_the_whole_reply_of_the_calibration_turns_unless_told(model, monkeypatch):
    from samcache.engine import SAMcacheEngine
    from samcache.engine.api import CALIBRATION_CONTINUATION

    class Recorded(Exception):
        pass

    def recording(self, **kwargs):
        raise Recorded(kwargs.get("continuation"))

    monkeypatch.setattr(SAMcacheEngine, "calibrate", recording)
    traces = [visual_qa.trace(1, scenario="gui", turns=2, window=2)]
    calibration = [visual_qa.trace(7, scenario="gui", turns=3, window=2, dense=True)]
    longest = max(t.max_new_tokens for t in calibration[0])
    assert longest > visual_qa.Turn.max_new_tokens  # dense turns leave room for the description
    for given, expected in ((None, longest), (12, 12)):
        with pytest.raises(Recorded) as got:
            evaluate_traces(model, traces, modes=["samcache"], calibration_traces=calibration,
                            calibration_continuation=given, progress=False)
        assert got.value.args[0] == expected
    with pytest.raises(Recorded) as got:  # the synthetic pair: the engine's own default
        evaluate_traces(model, traces, modes=["samcache"], progress=False)
    assert got.value.args[0] == CALIBRATION_CONTINUATION
    with pytest.raises(ValueError, match="calibration_continuation"):
        evaluate_traces(model, traces, modes=["samcache"], calibration_traces=calibration,
                        calibration_continuation=0, progress=False)


def test_keep_image_order_auto_follows_the_curves_in_every_mode_that_reuses_image_kv(model):
    import numpy as np

    from samcache.recompute import ImageOrderCheck, SensitivityCurves

    rates = np.array([0.0, 0.05, 1.0])
    # Curves whose image-order check found reuse at another index damaging below 1.0.
    order = ImageOrderCheck(rates, [[50, 50], [60, 60], [100, 100]], confident=100, pairs=1)
    curves = SensitivityCurves(rates, np.ones((2, 3)), image_order=order)
    traces = [visual_qa.trace(5, scenario="gui", turns=3, window=2)]
    modes = ["baseline", "samcache", "ordered", "uniform-budget"]
    out = evaluate_traces(model, traces, modes=modes, recompute=[0.05, 1.0], sensitivity=curves, max_new_tokens=2,
                          fidelity=False, progress=False)
    runs = {(r["mode"], r["recompute"]): r for r in out["runs"]}
    assert {k: r["keeps_image_order"] for k, r in runs.items()} == {
        ("baseline", None): None, ("samcache", 0.05): True, ("samcache", 1.0): False, ("ordered", 0.05): True,
        ("ordered", 1.0): True, ("uniform-budget", 0.05): True, ("uniform-budget", 1.0): False}
    # Keeping the order, samcache reuses what the ordered mode reuses, and answers the same.
    auto, ordered = runs[("samcache", 0.05)]["turns"], runs[("ordered", 0.05)]["turns"]
    assert [t["image_reused_tokens"] for t in auto] == [t["image_reused_tokens"] for t in ordered]
    assert [t["reply"] for t in auto] == [t["reply"] for t in ordered]
    told = evaluate_traces(model, traces, modes=["samcache"], recompute=[0.05], sensitivity=curves, max_new_tokens=2,
                           fidelity=False, keep_image_order=False, progress=False)["runs"][0]
    assert told["keeps_image_order"] is False
    # The window slides: told to reuse at any index, it reuses more than keeping the order allows.
    assert sum(t["image_reused_tokens"] for t in told["turns"]) > sum(t["image_reused_tokens"] for t in auto)


def test_wilson_interval():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(45, 50)
    assert 0.78 < lo < 0.9 < hi < 0.97
    for bad in [(3, 2), (-1, 2), (1, -1)]:
        with pytest.raises(ValueError):
            wilson_interval(*bad)


def test_cli_eval(model, tmp_path, capsys):
    import json

    from samcache.cli import main

    assert main(["eval", "--model", str(model), "--traces", "1", "--turns", "2", "--window", "2", "--modes",
                 "baseline,samcache,head-only", "--recompute", "0,1", "--no-calibrate", "--quiet", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "samcache @ 0" in printed and "samcache @ 1 vs head-only @ 1" in printed
    out = json.loads((tmp_path / "results.json").read_text())
    assert len(out["runs"]) == 5
    pairs = {(c["a"], c["b"]) for c in out["comparisons"]}
    assert ("samcache @ 0", "baseline") in pairs and ("samcache @ 0", "head-only @ 0") in pairs
    assert (tmp_path / "accuracy.png").stat().st_size > 0
    assert main(["eval", "--model", str(model), "--modes", "bogus", "--quiet"]) == 2
    assert main(["eval", "--model", str(model), "--traces", "1", "--turns", "2", "--window", "2", "--modes", "samcache",
                 "--max-new-tokens", "1", "--no-fidelity", "--no-calibrate", "--keep-image-order", "true", "--quiet",
                 "--out", str(tmp_path / "told")]) == 0
    assert json.loads((tmp_path / "told" / "results.json").read_text())["runs"][0]["keeps_image_order"] is True
    with pytest.raises(SystemExit):
        main(["eval", "--model", str(model), "--keep-image-order", "sometimes"])


def test_cli_eval_saves_its_calibration_and_reuses_it(model, tmp_path, capsys):
    import json

    from samcache.cli import main

    args = ["eval", "--model", str(model), "--traces", "1", "--turns", "2", "--window", "2", "--modes", "samcache",
            "--recompute", "0.5", "--max-new-tokens", "2", "--no-fidelity", "--quiet"]
    assert main([*args, "--calibration-traces", "1", "--out", str(tmp_path / "a")]) == 0
    saved = json.loads((tmp_path / "a" / "sensitivity.json").read_text())
    assert json.loads((tmp_path / "a" / "results.json").read_text())["sensitivity"] == saved
    assert len(saved["loss"]) == 2 and len(saved["loss"][0]) == len(saved["rates"])  # 2 layers x the probe rates
    # Given curves replace the calibration (same curves back, no probing) ...
    assert main([*args, "--sensitivity", str(tmp_path / "a" / "sensitivity.json"), "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "results.json").read_text())["sensitivity"] == saved
    # ... and curves of another model are refused.
    (tmp_path / "other.json").write_text(json.dumps({**saved, "model_id": "another-model"}))
    capsys.readouterr()
    assert main([*args, "--sensitivity", str(tmp_path / "other.json")]) == 2
    assert "calibrated on model another-model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not both"):
        evaluate_traces(model, [visual_qa.trace(1, scenario="gui", turns=2, window=2)], modes=["samcache"],
                        sensitivity=tmp_path / "a" / "sensitivity.json",
                        calibration_traces=[visual_qa.trace(2, scenario="gui", turns=2, window=2)], progress=False)


def test_eval_follows_how_the_model_was_trained(model, tmp_path, capsys):
    import json
    import shutil

    from samcache.cli import main

    trained = tmp_path / "trained"
    shutil.copytree(model, trained)
    (trained / "training.json").write_text(json.dumps({"config": {"size": [84, 84], "dense_eval": True, "kind": "gui"}}))
    assert training_defaults(trained) == {"size": (84, 84), "dense": True, "kind": "gui"}
    assert main(["eval", "--model", str(trained), "--scenario", "reorder", "--quiet"]) == 2
    assert "trained on gui images" in capsys.readouterr().err
    assert training_defaults(model) == {}
    out = tmp_path / "out"
    assert main(["eval", "--model", str(trained), "--traces", "1", "--turns", "2", "--window", "2", "--modes", "baseline",
                 "--max-new-tokens", "2", "--no-calibrate", "--quiet", "--out", str(out)]) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    turns = run["turns"]
    assert all(t["question"].endswith(visual_qa.DENSE_INSTRUCTION) for t in turns)
    # Dense turns are scored part by part too (two tokens describe nothing right).
    assert all(t["described"] is not None and len(t["described"]) >= 1 and not any(t["described"]) for t in turns)
    assert run["description_accuracy"] == 0.0 and run["description_parts"] == sum(len(t["described"]) for t in turns)
    assert main(["eval", "--model", str(trained), "--traces", "1", "--turns", "1", "--modes", "baseline", "--no-dense",
                 "--max-new-tokens", "2", "--no-calibrate", "--quiet", "--out", str(out)]) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert not run["turns"][0]["question"].endswith(visual_qa.DENSE_INSTRUCTION)
    assert run["turns"][0]["described"] is None and run["description_accuracy"] is None


def test_paired_difference_counts_turns_each_run_alone_got_right():
    def run(correct):
        return {"turns": [{"turn": i, "answer": "x", "correct": c} for i, c in enumerate(correct)]}

    a, b = run([1, 1, 1, 0, 1, 1, 0, 1]), run([1, 0, 1, 0, 1, 0, 1, 1])
    d = paired_difference(a, b)
    assert d["difference"] == 1 / 8 and (d["a_only"], d["b_only"], d["turns"]) == (2, 1, 8)
    assert d["described"] is None  # no turn asked for a description
    a["turns"][0]["described"], b["turns"][0]["described"] = [True, True, False], [True, False, False]
    parts = paired_difference(a, b)["described"]
    assert parts["difference"] == 1 / 3 and (parts["a_only"], parts["b_only"], parts["turns"]) == (1, 0, 3)
    lo, hi = d["interval"]
    assert lo < 1 / 8 < hi
    same = paired_difference(a, a)
    assert same["difference"] == 0 and same["interval"] == (0.0, 0.0)
    with pytest.raises(ValueError, match="same turns"):
        paired_difference(a, run([1, 1]))


def test_methods_run_each_recompute_mode_once_per_method_and_count_the_reuse_kept(model, tmp_path):
    from samcache.bench.task_accuracy import comparisons, frontier_points, plot, reuse_kept

    traces = [visual_qa.trace(1, scenario="gui", turns=3, window=2)]
    out = evaluate_traces(model, traces, modes=["baseline", "uniform-budget"], recompute=[0.0, 0.5],
                          methods="boundary,isolated", calibrate=False, max_new_tokens=2, fidelity=False,
                          keep_image_order=False, progress=False)
    assert [(r["mode"], r["method"], r["recompute"]) for r in out["runs"]] == [
        ("baseline", None, None), ("uniform-budget", "boundary", 0.0), ("uniform-budget", "boundary", 0.5),
        ("uniform-budget", "isolated", 0.0), ("uniform-budget", "isolated", 0.5)]
    runs = {(r["method"], r["recompute"]): r for r in out["runs"]}
    layers = runs["boundary", 0.0]["num_layers"]
    assert layers == 2
    free, half = runs["boundary", 0.0], runs["boundary", 0.5]
    assert sum(t["recomputed_token_layers"] for t in free["turns"]) == 0
    assert reuse_kept(free, free) == 1.0
    reused = sum(t["image_reused_tokens"] for t in half["turns"]) * layers
    recomputed = sum(t["recomputed_token_layers"] for t in half["turns"])
    assert 0 < recomputed < reused and reuse_kept(half, free) == pytest.approx(1 - recomputed / reused)
    # Isolated KV costs one more pass over each new image (its frame token too), after the first token.
    first_images = sum(t["isolated_tokens"] for t in runs["isolated", 0.0]["turns"])
    assert first_images > 0 and sum(t["isolated_tokens"] for t in free["turns"]) == 0
    rows = {c["a"]: c for c in comparisons(out) if c["b"] == "baseline"}
    assert set(rows) == {"uniform-budget boundary @ 0", "uniform-budget boundary @ 0.5", "uniform-budget isolated @ 0",
                         "uniform-budget isolated @ 0.5"}
    assert rows["uniform-budget boundary @ 0.5"]["reuse_kept"] == pytest.approx(reuse_kept(half, free))
    # The frontier: one line per method, points by ratio, the same from the runs and from a summary
    # that kept only the comparisons (no per-turn replies).
    points = frontier_points(out)
    assert list(points) == ["uniform-budget boundary", "uniform-budget isolated"]
    assert [p["recompute"] for p in points["uniform-budget boundary"]] == [0.0, 0.5]
    assert points["uniform-budget boundary"][1]["reuse_kept"] == pytest.approx(reuse_kept(half, free))
    assert points["uniform-budget boundary"][1]["difference"] == rows["uniform-budget boundary @ 0.5"]["difference"]
    summary = {"traces": 1, "comparisons": comparisons(out),
               "runs": [{k: v for k, v in r.items() if k != "turns"} for r in out["runs"]]}
    assert frontier_points(summary) == points
    plot(summary, tmp_path / "accuracy.png")
    assert (tmp_path / "accuracy.png").stat().st_size > 0
    with pytest.raises(ValueError, match="unknown recompute method"):
        evaluate_traces(model, traces, modes=["samcache"], methods="blend", calibrate=False, progress=False)


def test_a_method_a_mode_cannot_run_is_refused_before_any_run(model, monkeypatch):
    from samcache.engine import SAMcacheEngine

    built = []
    init = SAMcacheEngine.__init__
    monkeypatch.setattr(SAMcacheEngine, "__init__", lambda self, *a, **k: built.append(k) or init(self, *a, **k))
    traces = [visual_qa.trace(1, scenario="gui", turns=2, window=2)]
    with pytest.raises(ValueError, match="head-only is two-track's track 1 alone: .* not boundary"):
        evaluate_traces(model, traces, modes=["samcache", "head-only"], methods="two-track,boundary", calibrate=False,
                        progress=False)
    with pytest.raises(ValueError, match="recompute_method 'isolated' needs samcache's own forward: mode vllm-samcache"):
        evaluate_traces(model, traces, modes=["baseline", "vllm-samcache"], methods="boundary,isolated",
                        calibrate=False, progress=False, vllm_python="/nonexistent")
    assert built == []  # no engine was built, nothing ran
