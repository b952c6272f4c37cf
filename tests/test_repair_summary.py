"""bench/repair_summary.py: the committed repair-method summaries, docs/benchmark.md's table rows
printed from them, and a results file merged into a summary."""

import copy
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUMMARIES = ROOT / "docs" / "bench" / "repair-methods"
KEEPS_ORDER, ANY_INDEX = "the calibration keeps the order", "the calibration reuses at any index"


def _script():
    spec = importlib.util.spec_from_file_location("repair_summary", ROOT / "bench" / "repair_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (scenario, summary, how the doc labels the defaults row): the shipped model's, then the 36-token model's
@pytest.mark.parametrize("scenario, name, label", [("subagent", "summary-subagent.json", KEEPS_ORDER),
                                                   ("handoff", "summary-handoff.json", ANY_INDEX),
                                                   ("gui", "summary-gui-168.json", KEEPS_ORDER)])
def test_the_documented_rows_are_the_summarys(scenario, name, label):
    summary = json.loads((SUMMARIES / name).read_text())
    rows = _script().table(scenario, summary)
    doc = (ROOT / "docs" / "benchmark.md").read_text()
    # Every method at every ratio of the issue, then the defaults.
    assert len(rows) == sum(1 for r in summary["runs"] if r["mode"] != "baseline") >= 24
    for row in rows:
        row = row.replace("**defaults** |", f"**defaults** ({label}) |")
        assert row in doc, row


def _turns(correct):
    return [{"turn": i, "answer": "a", "correct": c, "described": [c], "image_reused_tokens": 9,
             "recomputed_token_layers": 0} for i, c in enumerate(correct)]


def _results(runs, traces=2):
    return {"traces": traces, "command": "samcache eval ...", "runs": runs}


def test_merge_adds_new_runs_paired_with_the_same_full_prefill():
    script = _script()
    full = {"mode": "baseline", "method": None, "recompute": None, "accuracy": 0.75, "turns": _turns([1, 1, 1, 0])}
    full["turns"] = [dict(t, image_reused_tokens=0) for t in full["turns"]]
    first = {"mode": "uniform-budget", "method": "two-track", "recompute": 0.0, "accuracy": 0.5,
             "turns": _turns([1, 0, 1, 0])}
    held = {k: v for k, v in full.items() if k != "turns"}
    summary = {"traces": 2, "commands": [], "runs": [held], "comparisons": []}
    assert script.merge(summary, _results([full, first])) == ["uniform-budget two-track @ 0"]
    assert all("turns" not in r for r in summary["runs"]) and summary["commands"] == ["samcache eval ..."]
    assert summary["comparisons"][0]["difference"] == pytest.approx(-0.25)
    second = dict(copy.deepcopy(first), method="boundary")
    before = copy.deepcopy(summary)
    assert script.merge(summary, _results([full, first, second])) == ["uniform-budget boundary @ 0"]  # first: held
    assert summary["runs"][:2] == before["runs"] and len(summary["runs"]) == 3 and len(summary["comparisons"]) == 2

    with pytest.raises(ValueError, match="no full prefill"):
        script.merge(summary, _results([first]))
    with pytest.raises(ValueError, match="not the same traces or model"):
        script.merge(summary, _results([dict(full, accuracy=0.5), first]))
    with pytest.raises(ValueError, match="cover 3 traces"):
        script.merge(summary, _results([full, first], traces=3))
