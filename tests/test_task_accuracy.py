"""samcache.eval.task_accuracy on a tiny random checkpoint: every (mode, ratio) run scores every
turn of the traces against its known answer; bad modes, ratios and traces are refused."""

from __future__ import annotations

import pytest

from samcache.eval.task_accuracy import evaluate_traces, wilson_interval
from samcache.tasks import visual_qa


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from samcache.models import build_tiny_model

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


@pytest.mark.parametrize("bad", [dict(modes=["nope"]), dict(recompute=[1.5]), dict(modes=["vllm"]),
                                 dict(traces=[]), dict(max_new_tokens=0)])
def test_refuses_bad_arguments(model, bad):
    kwargs = dict(traces=[visual_qa.trace(1, scenario="gui", turns=1, window=1)], modes=["samcache"], calibrate=False,
                  progress=False)
    kwargs.update(bad)
    with pytest.raises(ValueError):
        evaluate_traces(model, **kwargs)


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

    assert main(["eval", "--model", str(model), "--traces", "1", "--turns", "2", "--window", "2", "--modes", "samcache",
                 "--recompute", "0,1", "--no-calibrate", "--quiet", "--out", str(tmp_path)]) == 0
    assert "samcache @ 0" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == 2
    assert main(["eval", "--model", str(model), "--modes", "bogus", "--quiet"]) == 2
