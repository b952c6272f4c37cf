"""The repair-method summaries in docs/bench/repair-methods/: merge `samcache eval` results into a
scenario's summary, print its rows of docs/benchmark.md's repair table, and plot its frontier.

    python bench/repair_summary.py merge docs/bench/repair-methods/summary-handoff.json \
        bench/out/repair-handoff-deviation-b/results.json
    python bench/repair_summary.py table handoff docs/bench/repair-methods/summary-handoff.json
    python bench/repair_summary.py plot docs/bench/repair-methods/summary-handoff.json \
        docs/bench/repair-methods/accuracy-handoff.png

A summary keeps each run's scores without its per-turn replies, and each run's paired comparison
with the full prefill (``baseline``). A merged results file must hold its own full prefill: its runs
are paired with that one, and it must answer exactly as the summary's (the eval is deterministic),
so that every row of the summary is paired with the same full prefill.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

from samcache.bench.task_accuracy import comparisons, plot, run_name

METHOD_ORDER = ("two-track", "boundary", "deviation", "boundary+deviation", "isolated")


def _key(run: dict) -> tuple:
    return run["mode"], run.get("method"), run["recompute"], run.get("track2_share")


def merge(summary: dict, results: dict) -> list[str]:
    """Adds ``results``' runs and their comparisons with the full prefill to ``summary`` (in place);
    returns the names of the runs added. Runs the summary holds already are left as they are."""
    full = [r for r in results["runs"] if r["mode"] == "baseline"]
    held = [r for r in summary["runs"] if r["mode"] == "baseline"]
    if not full:
        raise ValueError("the results hold no full prefill (baseline) run to pair their runs with")
    if held and held[0]["accuracy"] != full[0]["accuracy"]:
        raise ValueError(f"the results' full prefill answers {full[0]['accuracy']:.4f}, the summary's "
                         f"{held[0]['accuracy']:.4f}: not the same traces or model")
    if results.get("traces") != summary.get("traces"):
        raise ValueError(f"the results cover {results.get('traces')} traces, the summary {summary.get('traces')}")
    known = {_key(r) for r in summary["runs"]}
    rows = {row["a"]: row for row in comparisons(results) if row["b"] == "baseline"}
    added = []
    for run in results["runs"]:
        if _key(run) in known or run["mode"] == "baseline":
            continue
        entry = {k: v for k, v in run.items() if k != "turns"}
        summary["runs"].append(entry)
        name = run_name(run)
        summary["comparisons"].append(rows[name])
        added.append(name)
    command = results.get("command")
    if added and command and command not in summary["commands"]:
        summary["commands"].append(command)
    return added


def _signed(value: float, interval) -> str:
    text = f"{100 * value:+.1f} [{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}]"
    return re.sub(r"-0\.0\b", "+0.0", text)


def table(scenario: str, summary: dict) -> list[str]:
    """docs/benchmark.md's repair-table rows of ``scenario``: one per method and ratio, in the
    table's order, then the defaults (mode ``samcache``)."""
    rows = {row["a"]: row for row in summary["comparisons"] if row["b"] == "baseline"}
    runs = [r for r in summary["runs"] if r["mode"] != "baseline" and r["recompute"] is not None]

    def order(run: dict) -> tuple:
        method = run.get("method")
        rank = METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)
        return run["mode"] == "samcache", rank, run["recompute"]

    out = []
    for run in sorted(runs, key=order):
        row = rows[run_name(run)]
        parts = row.get("described") or {}
        answers = _signed(row["difference"], row["interval"])
        described = "" if run.get("description_accuracy") is None else f"{100 * run['description_accuracy']:.1f}%"
        parts_diff = _signed(parts["difference"], parts["interval"]) if parts else ""
        kept = f"{100 * row['reuse_kept']:.0f}%" if row.get("reuse_kept") is not None else ""
        if run["mode"] == "samcache":
            out.append(f"| {scenario} | **defaults** | {run['recompute']:g} | {answers} | {described} | "
                       f"{parts_diff} | {kept} | |")
        else:
            spent = f"{100 * (1 - row['reuse_kept']):.1f}%" if row.get("reuse_kept") is not None else ""
            out.append(f"| {scenario} | {run['method']} | {run['recompute']:g} | {answers} | {described} | "
                       f"{parts_diff} | {kept} | {spent} |")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="add a results.json's runs to a summary")
    m.add_argument("summary", type=pathlib.Path)
    m.add_argument("results", type=pathlib.Path, nargs="+")
    t = sub.add_parser("table", help="print a summary's rows of the repair table")
    t.add_argument("scenario")
    t.add_argument("summary", type=pathlib.Path)
    p = sub.add_parser("plot", help="plot a summary's accuracy and frontier")
    p.add_argument("summary", type=pathlib.Path)
    p.add_argument("png", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.command == "merge":
        summary = json.loads(args.summary.read_text())
        for path in args.results:
            added = merge(summary, json.loads(path.read_text()))
            print(f"{path}: added {', '.join(added) or 'nothing'}")
        args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    elif args.command == "table":
        print("\n".join(table(args.scenario, json.loads(args.summary.read_text()))))
    else:
        plot(json.loads(args.summary.read_text()), args.png)


if __name__ == "__main__":
    main()
