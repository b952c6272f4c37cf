"""Task accuracy under reuse: a trained model answers held-out multi-turn traces of the visual-QA
task family (:mod:`samcache.tasks.visual_qa`) through samcache's engine in each benchmark mode.

A trace's images move between turns (a sliding window, re-ordering, sub-agents with their own
system prompts), so every turn after the first reuses image KV at new positions. Each turn's
greedy reply is scored against its known answer; beside the accuracy (with a Wilson 95% interval)
every turn's next-token KL and greedy agreement against a full prefill of the same prompt are kept,
now that the model's distributions are not flat.

    samcache eval --model models/visual-qa --scenario gui --traces 20 --recompute 0,0.02,0.05,0.1,0.2,1.0

Why this module is long: one measurement from traces to table: scoring a reply, pairing two runs
turn by turn, the share of the reuse kept and the plot all read the same per-turn records, whose
fields are defined here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from samcache._checks import check_int


def wilson_interval(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default)."""
    check_int("total", total, 0)
    check_int("correct", correct, 0)
    if correct > total:
        raise ValueError(f"correct ({correct}) cannot exceed total ({total})")
    if not z > 0:
        raise ValueError(f"z must be > 0, got {z!r}")
    if total == 0:
        return (0.0, 1.0)
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return (max(0.0, centre - half), min(1.0, centre + half))


def training_defaults(model_path) -> dict:
    """What the model at ``model_path`` was trained on, from its ``training.json`` (written by
    :mod:`samcache.tasks.training`): ``size`` (height, width), ``dense`` and ``kind``; {} without one."""
    import json
    import pathlib

    path = pathlib.Path(model_path) / "training.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text()).get("config", {})
    out = {}
    if "size" in config:
        out["size"] = tuple(config["size"])
    if "dense_eval" in config:
        out["dense"] = bool(config["dense_eval"])
    if "kind" in config:
        out["kind"] = str(config["kind"])
    return out


#: The first index (in the test stream) of the traces that calibrate rather than score.
CALIBRATION_OFFSET = 1_000_000

#: The image kind each trace scenario shows.
SCENARIO_KINDS = {"gui": "gui", "subagent": "gui", "handoff": "gui", "reorder": "docs"}


def check_scenario(scenario: str, trained: dict) -> None:
    """Refuse a scenario whose images the model was not trained on (it would score near chance
    and say nothing about reuse)."""
    kind = trained.get("kind")
    if kind in ("gui", "docs") and SCENARIO_KINDS.get(scenario, kind) != kind:
        raise ValueError(f"the model was trained on {kind} images; scenario {scenario!r} shows "
                         f"{SCENARIO_KINDS[scenario]} images (choose from "
                         f"{', '.join(k for k, v in SCENARIO_KINDS.items() if v == kind)})")


def evaluate_traces(model_path, traces: Sequence[Sequence[Any]], *, modes: Sequence[str] = ("baseline", "prefix", "samcache"),
                    recompute: Sequence[float] = (0.05,), device: str = "cpu", calibrate: bool = True,
                    max_new_tokens: int | None = None, fidelity: bool = True, kv_cache_bytes: int = 256 << 20,
                    calibration_traces: Sequence[Sequence[Any]] | None = None,
                    track2_shares: Sequence[float] | None = None, sensitivity: Any = None,
                    calibration_continuation: int | None = None, keep_image_order: bool | str = "auto",
                    methods: Sequence[str] | None = None, vllm_python: str | None = None,
                    progress: bool = True) -> dict:
    """Play every trace (a list of :class:`~samcache.tasks.visual_qa.Turn`) on a fresh engine per
    (mode, ratio) run and score each turn's greedy reply. Returns per run: accuracy, its interval,
    accuracy per question type, turns after the first (the ones that can reuse), KL and greedy
    agreement medians. ``max_new_tokens``: per turn; None takes each turn's own budget
    (``Turn.max_new_tokens``, room for a description on dense traces). ``calibration_traces``:
    traces (others than the scored ones) whose consecutive turns calibrate the layer-aware budget
    (:func:`calibration_pairs`); None calibrates on the engine's default synthetic pair.
    ``calibration_continuation``: reply tokens the calibration's loss covers; None: the whole
    reply of the calibration turns (their longest ``max_new_tokens``; the reference's reply ends
    earlier where it ends), else the engine's default (256) on the synthetic pair. Why the whole
    reply: on dense traces reuse damages the description of a moved image, dozens of tokens in.
    ``track2_shares``: a sweep of ``track2_share`` (the part of the recompute given to relevance,
    track 2) for the two-track modes at each non-zero ratio; None runs the engine's default.
    ``sensitivity``: curves (or the JSON path ``engine.calibrate(save=...)`` wrote) to use instead of
    calibrating. The curves used come back as ``sensitivity`` (None for a uniform budget).
    ``keep_image_order``: the engines' setting (True, False or "auto", the engine's default) in every
    mode that does not set its own (``ordered`` keeps the order); each run records what its engine
    did (``keeps_image_order``).
    ``methods``: repair methods (:mod:`samcache.recompute.method`) to run each recompute mode with,
    each at every ratio (calibrated on its own where the mode reads curves); None runs the engine's
    default. Every run records its ``method`` and, per turn, what it computed
    (``recomputed_token_layers``, ``prefilled_tokens``, ``isolated_tokens``); :func:`reuse_kept` and
    :func:`comparisons` turn those into the share of the any-index reuse a run kept.
    Modes ``vllm`` and ``vllm-samcache`` serve the same traces through the real vLLM (in its own
    environment, ``vllm_python``; :mod:`samcache.bench.peers.vllm_launcher`), one vLLM process a run
    serving every trace in turn, vanilla or with samcache's plugin at each ratio and (plugin)
    method, ``keep_image_order`` and, for ``"auto"``, the curves calibrated on samcache's engine
    (``sensitivity``): the same settings the engine runs with."""
    from samcache.bench.benchmark import MODES, check_mode_methods, mode_engine_kwargs, parse_modes, parse_ratios
    from samcache.engine import SAMcacheEngine
    from samcache.engine.calibration import CALIBRATION_CONTINUATION
    from samcache.recompute.methods import parse_methods
    from samcache.tasks.visual_qa import DENSE_INSTRUCTION, described_parts, is_correct

    modes = parse_modes(list(modes))
    recompute = parse_ratios(list(recompute))
    method_names = [None] if methods is None else parse_methods(methods)
    check_mode_methods(modes, method_names)
    floors = [m for m in modes if MODES[m].new_content_only]
    if floors:
        raise ValueError(f"task accuracy scores whole turns; {', '.join(floors)} cannot answer the traces")
    if any(MODES[m].peer for m in modes):
        from samcache.bench.peers.vllm_launcher import check_plugin_installed, find_vllm_python

        vllm_python = str(find_vllm_python(vllm_python))  # a clear error now, not after the other runs
        if "vllm-samcache" in modes:
            check_plugin_installed(vllm_python)
    if not traces or any(len(t) == 0 for t in traces):
        raise ValueError("traces must be a non-empty list of non-empty traces")
    if max_new_tokens is not None:
        check_int("max_new_tokens", max_new_tokens, 1)
    if sensitivity is not None and calibration_traces is not None:
        raise ValueError("give sensitivity curves or calibration traces, not both")
    if calibration_continuation is not None:
        check_int("calibration_continuation", calibration_continuation, 1)
    elif calibration_traces is not None:
        calibration_continuation = max(t.max_new_tokens for trace in calibration_traces for t in trace)
    else:
        calibration_continuation = CALIBRATION_CONTINUATION
    # keep_image_order is checked here, by the engine, before any run.
    shared = SAMcacheEngine(model_path, device=device, kv_cache_bytes=1 << 20, sensitivity=sensitivity,
                            keep_image_order=keep_image_order)
    shares = [None] if track2_shares is None else parse_shares(track2_shares)
    runs = [(m, r, s, k) for m in modes for k in (method_names if MODES[m].recomputes else [None])
            for r in (recompute if MODES[m].recomputes else [None])
            for s in (shares if _two_track(m, k) and r else [None])]
    given = shared.sensitivity  # given (and checked against the model), else calibrated below
    base = {"device": device, "kv_cache_bytes": kv_cache_bytes, "share_weights_with": shared,
            "keep_image_order": keep_image_order}
    curves_of: dict = {}  # per method: the curves its runs read
    # The plugin reads the curves as the samcache mode does (layer-aware rates, the order check).
    wants_curves = [k for m, _, _, k in runs if MODES[m].reads_curves or m == "vllm-samcache"]
    for method in dict.fromkeys(wants_curves):
        curves_of[method] = given
        if given is None and calibrate and not shared.image_attention.isolated:  # isolated: nothing to calibrate
            requests = None if calibration_traces is None else calibration_pairs(calibration_traces)
            engine = shared if method is None else SAMcacheEngine(
                model_path, device=device, kv_cache_bytes=1 << 20, share_weights_with=shared, recompute_method=method,
                keep_image_order=keep_image_order)
            curves_of[method] = engine.calibrate(requests=requests, continuation=calibration_continuation,
                                                 progress=progress)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(runs) * sum(len(t) for t in traces), desc="samcache eval", unit="turn")
    results = []
    for mode, ratio, share, method in runs:
        if MODES[mode].peer:
            turns = _vllm_turns(model_path, traces, mode, ratio, method, keep_image_order, curves_of.get(method, given),
                                max_new_tokens, vllm_python, shared)
            if bar is not None:
                bar.update(len(turns))
            results.append({"mode": mode, "recompute": ratio, "track2_share": None, "method": method,
                            "keeps_image_order": None, "num_layers": shared.runner.num_layers, **_summary(turns),
                            "turns": turns})
            continue
        kw = mode_engine_kwargs(mode, ratio, curves_of.get(method, given), base)
        if share is not None:
            kw["track2_share"] = share
        if method is not None:
            kw["recompute_method"] = method
        turns = []
        keeps_order = None
        for trace in traces:
            engine = SAMcacheEngine(model_path, **kw)  # every trace starts cold
            keeps_order = engine.keeps_image_order() if engine.use_image_kv else None
            layers = engine.runner.num_layers
            moved = reordered_turns(trace)
            for index, turn in enumerate(trace):
                r = engine.chat(messages=turn.messages, max_new_tokens=max_new_tokens or turn.max_new_tokens,
                                fidelity=fidelity and mode != "baseline")
                f = r.metrics.fidelity
                turns.append({"turn": index, "question_type": turn.question_type, "question": turn.question,
                              "answer": turn.answer, "reordered": moved[index],
                              "reply": r.text, "correct": bool(is_correct(r.text, turn.answer)),
                              # Only a turn that asked for a description can be scored part by part.
                              "described": (described_parts(r.text, turn.specs)
                                            if DENSE_INSTRUCTION in turn.question else None),
                              "image_reused_tokens": r.metrics.image_reused_tokens,
                              "recomputed_token_layers": r.metrics.recomputed_token_layers,
                              "prefilled_tokens": r.metrics.prefilled_tokens,
                              "isolated_tokens": r.metrics.isolated_tokens,
                              "kl": None if f is None else f.kl, "greedy_agree": None if f is None else f.greedy_agree})
                if bar is not None:
                    bar.update(1)
        results.append({"mode": mode, "recompute": ratio, "track2_share": share, "method": method,
                        "keeps_image_order": keeps_order, "num_layers": layers, **_summary(turns), "turns": turns})
    # The curves travel with the results: they say where the layer-aware budget spent its rates.
    used = {("default" if k is None else k): c.to_dict(shared.model_id) for k, c in curves_of.items() if c is not None}
    if set(used) <= {"default"}:
        used = used.get("default")
    return {"model": str(model_path), "traces": len(traces), "sensitivity": used, "runs": results}


def _vllm_turns(model_path, traces, mode: str, ratio: float | None, method: str | None, keep_image_order,
                curves, max_new_tokens: int | None, vllm_python: str, engine) -> list[dict]:
    """Every turn of ``traces`` answered by the real vLLM (one process serving all of them in
    order, as a server would: the traces share no image, so only exact prefix hits carry over
    from one to the next), vanilla (``vllm``) or with samcache's plugin at ``ratio``
    (``vllm-samcache``), scored as the engine's turns are. ``engine``: samcache's engine of the
    same checkpoint (the model id, the prompts' lengths)."""
    import json
    import tempfile

    from samcache.bench.peers.vllm_launcher import run_trace
    from samcache.tasks.visual_qa import DENSE_INSTRUCTION, described_parts, is_correct

    flat = [(index, turn, moved) for trace in traces
            for index, (turn, moved) in enumerate(zip(trace, reordered_turns(trace)))]
    with tempfile.TemporaryDirectory(prefix="samcache-eval-") as scratch:
        config = None
        if mode == "vllm-samcache":
            config = {"recompute_ratio": ratio, "recompute_method": method or "two-track",
                      "keep_image_order": keep_image_order}
            if curves is not None:
                path = f"{scratch}/sensitivity.json"
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(curves.to_dict(engine.model_id), f)
                config["sensitivity"] = path
        limits = [max_new_tokens or t.max_new_tokens for _, t, _ in flat]
        longest = max(len(engine.build_prompt(t.messages)) + limit for (_, t, _), limit in zip(flat, limits))
        out = run_trace([t.messages for _, t, _ in flat], model_path, python=vllm_python, samcache=config,
                        max_tokens=limits, max_model_len=-(-(longest + 64) // 256) * 256, timeout_s=6 * 3600.0)
    if len(out["turns"]) != len(flat):
        raise RuntimeError(f"vLLM answered {len(out['turns'])} of the {len(flat)} turns")
    turns, before = [], {}
    for (index, turn, moved), record in zip(flat, out["turns"]):
        counters = record.get("samcache") or {}
        delta = {k: counters.get(k, 0) - before.get(k, 0) for k in ("image_reused_tokens", "recomputed_token_layers")}
        before = counters or before
        reply = record["text"]
        turns.append({"turn": index, "question_type": turn.question_type, "question": turn.question,
                      "answer": turn.answer, "reordered": moved, "reply": reply,
                      "correct": bool(is_correct(reply, turn.answer)),
                      "described": described_parts(reply, turn.specs) if DENSE_INSTRUCTION in turn.question else None,
                      "image_reused_tokens": delta["image_reused_tokens"],
                      "recomputed_token_layers": delta["recomputed_token_layers"], "prefilled_tokens": None,
                      "isolated_tokens": 0, "kl": None, "greedy_agree": None})
    return turns


def reuse_kept(run: dict, reference: dict) -> float | None:
    """The share of ``reference``'s reused image KV that ``run`` kept, over the same turns: its
    image tokens reused, times the layers, less the (token, layer) pairs it recomputed, over the
    reference's image tokens reused times the layers (the reference: reuse at any index without
    recompute). None where the reference reused nothing."""
    layers = run.get("num_layers") or 1
    total = sum(t["image_reused_tokens"] for t in reference["turns"]) * (reference.get("num_layers") or 1)
    if not total:
        return None
    kept = sum(t["image_reused_tokens"] * layers - t.get("recomputed_token_layers", 0) for t in run["turns"])
    return kept / total


def parse_shares(shares: str | Sequence[float]) -> list[float]:
    """``track2_share`` values to sweep: numbers in [0, 1], comma-separated."""
    try:
        values = [float(v) for v in shares.split(",") if v.strip()] if isinstance(shares, str) \
            else [float(v) for v in shares]
    except (TypeError, ValueError):
        raise ValueError(f"track2 shares must be numbers separated by commas, got {shares!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise ValueError(f"track2 shares must be in [0, 1], got {shares!r}")
    return list(dict.fromkeys(values))


def _two_track(mode: str, method: str | None = None) -> bool:
    """Whether ``mode`` (with repair ``method``, None: the default) recomputes with both tracks of
    the two-track method, so that its track-2 share matters."""
    from samcache.bench.benchmark import MODES

    return (MODES[mode].recomputes and not MODES[mode].peer and method in (None, "two-track")
            and MODES[mode].engine_kwargs.get("recompute_tracks", "both") == "both")


def calibration_pairs(traces: Sequence[Sequence[Any]]) -> list[tuple[list, list]]:
    """(earlier turn, next turn) message pairs of ``traces`` where the next turn shows an image of
    the earlier one again: the reuse the layer-aware budget is calibrated on."""
    pairs = [(a.messages, b.messages) for trace in traces for a, b in zip(trace, trace[1:])
             if set(a.image_ids) & set(b.image_ids) and a.image_ids]
    if not pairs:
        raise ValueError("the calibration traces have no turn that shows an earlier turn's image again")
    return pairs


def reordered_turns(trace: Sequence[Any]) -> list[bool]:
    """Per turn of ``trace``: whether an image it shows was shown before in the trace at another
    place among the images (``Turn.image_ids``), i.e. its cached KV was computed when it was, say,
    the second image and is now the first. Why it matters: a model that tells images apart by
    their order writes that order into their KV (docs/benchmark.md)."""
    last: dict[int, int] = {}
    out = []
    for turn in trace:
        out.append(any(last.get(image, index) != index for index, image in enumerate(turn.image_ids)))
        last.update({image: index for index, image in enumerate(turn.image_ids)})
    return out


def _summary(turns: list[dict]) -> dict:
    out = _scores(turns)
    # After the first turn, split by whether the turn's images kept their order (what a model
    # that writes an image's order into its KV can reuse as is) or not.
    later = [t for t in turns if t["turn"] > 0]
    out["by_image_order"] = {name: {k: v for k, v in _scores(group).items() if k in _ORDER_KEYS}
                             for name, group in (("kept", [t for t in later if not t.get("reordered")]),
                                                 ("reordered", [t for t in later if t.get("reordered")])) if group}
    return out


_ORDER_KEYS = ("accuracy", "turns_scored", "description_accuracy", "description_parts")


def _scores(turns: list[dict]) -> dict:
    correct = sum(t["correct"] for t in turns)
    later = [t for t in turns if t["turn"] > 0]
    by_type: dict[str, list[bool]] = {}
    for t in turns:
        by_type.setdefault(t["question_type"], []).append(t["correct"])
    parts = [p for t in turns if t.get("described") is not None for p in t["described"]]
    kls = [t["kl"] for t in turns if t["kl"] is not None]
    agree = [t["greedy_agree"] for t in turns if t["greedy_agree"] is not None]
    return {
        "accuracy": correct / len(turns), "interval": wilson_interval(correct, len(turns)), "turns_scored": len(turns),
        "accuracy_after_first_turn": (sum(t["correct"] for t in later) / len(later)) if later else None,
        "accuracy_by_question": {k: sum(v) / len(v) for k, v in sorted(by_type.items())},
        "description_accuracy": (sum(parts) / len(parts)) if parts else None,
        "description_interval": wilson_interval(sum(parts), len(parts)) if parts else None,
        "description_parts": len(parts),
        "kl_median": statistics.median(kls) if kls else None,
        "greedy_agree_mean": statistics.fmean(agree) if agree else None,
    }


def paired_difference(a: dict, b: dict, z: float = 1.96) -> dict:
    """Accuracy of run ``a`` minus run ``b`` over the same turns, with a paired confidence interval
    (normal approximation on the per-turn differences, each -1, 0 or 1): paired, because every
    run answers the same turns, so the turns' difficulty cancels out. ``described``: the same over
    the parts of the descriptions (:func:`samcache.tasks.visual_qa.described_parts`) where the
    turns asked for them, else None."""
    ta, tb = a["turns"], b["turns"]
    if len(ta) != len(tb) or any((x["turn"], x["answer"]) != (y["turn"], y["answer"]) for x, y in zip(ta, tb)):
        raise ValueError("paired_difference needs two runs over the same turns")
    out = _paired([int(x["correct"]) - int(y["correct"]) for x, y in zip(ta, tb)], z)
    # The same, part by part of the descriptions, where both runs' turns asked for them.
    parts = [int(p) - int(q) for x, y in zip(ta, tb) if x.get("described") is not None and y.get("described") is not None
             for p, q in zip(x["described"], y["described"])]
    out["described"] = _paired(parts, z) if parts else None
    return out


def _paired(diffs: list[int], z: float) -> dict:
    n = len(diffs)
    mean = sum(diffs) / n
    sd = statistics.stdev(diffs) if n > 1 else 0.0
    half = z * sd / math.sqrt(n)
    return {"difference": mean, "interval": (mean - half, mean + half), "turns": n,
            "a_only": diffs.count(1), "b_only": diffs.count(-1)}


def run_name(run: dict) -> str:
    """A run's name in comparisons and plots: mode, method, ``@ ratio``, track-2 share."""
    mode = run["mode"] if run.get("method") is None else f"{run['mode']} {run['method']}"
    name = mode if run["recompute"] is None else f"{mode} @ {run['recompute']:g}"
    return name if run.get("track2_share") is None else f"{name} share {run['track2_share']:g}"


def comparisons(out: dict) -> list[dict]:
    """The comparisons the task eval is for, where its runs allow: each recompute run against the
    full prefill (``baseline``), with the share of the any-index reuse it kept (``reuse_kept``:
    against the run that reused the most image tokens), layer-aware (``samcache``) against
    ``uniform-budget`` and two-track (``samcache``) against ``head-only`` at each shared ratio
    (and track-2 share, where swept; and method)."""
    runs = {(r["mode"], r["recompute"], r.get("track2_share"), r.get("method")): r for r in out["runs"]}
    reused = {key: sum(t["image_reused_tokens"] for t in run["turns"]) for key, run in runs.items()}
    reference = runs[max(reused, key=reused.get)] if reused and max(reused.values()) else None
    rows = []
    full = runs.get(("baseline", None, None, None))
    for (mode, ratio, share, method), run in runs.items():
        if full is not None and mode != "baseline":
            kept = None if reference is None else reuse_kept(run, reference)
            rows.append({"a": run_name(run), "b": "baseline", "reuse_kept": kept, **paired_difference(run, full)})
    for other in ("uniform-budget", "head-only"):
        for (mode, ratio, share, method), run in runs.items():
            # head-only has no track 2: every share of samcache is compared with its one run.
            key = (other, ratio, None if other == "head-only" else share, method)
            if mode == "samcache" and key in runs:
                rows.append({"a": run_name(run), "b": run_name(runs[key]), **paired_difference(run, runs[key])})
    return rows


def plot(out: dict, path) -> None:
    """Accuracy (with its Wilson interval; dotted: the share of description parts right) and median
    next-token KL against the recompute ratio, one line per recompute mode, the full prefill and
    prefix reuse as horizontal lines; and the frontier: accuracy against the reuse kept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Panels only for what was measured: KL needs the fidelity pass, the frontier a reference reuse.
    with_kl = any(r.get("kl_median") for r in out["runs"])
    with_frontier = bool(frontier_points(out))
    panels = 1 + with_kl + with_frontier
    fig, grid = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    axes = list(grid[0])
    acc = axes.pop(0)
    kl = axes.pop(0) if with_kl else None
    frontier = axes.pop(0) if with_frontier else None
    for run in out["runs"]:
        if run["recompute"] is None:
            acc.axhline(run["accuracy"], linestyle="--", linewidth=1, label=run["mode"],
                        color="black" if run["mode"] == "baseline" else "grey")
    by_mode: dict[str, list[dict]] = {}
    for run in out["runs"]:
        if run["recompute"] is not None:
            share, method = run.get("track2_share"), run.get("method")
            name = run["mode"] if method is None else f"{run['mode']} {method}"
            by_mode.setdefault(name if share is None else f"{name} share {share:g}", []).append(run)
    for mode, runs in by_mode.items():
        runs = sorted(runs, key=lambda r: r["recompute"])
        x = [r["recompute"] for r in runs]
        y = [r["accuracy"] for r in runs]
        err = [[r["accuracy"] - r["interval"][0] for r in runs], [r["interval"][1] - r["accuracy"] for r in runs]]
        line = acc.errorbar(x, y, yerr=err, marker="o", capsize=3, label=mode)[0]
        described = [(r["recompute"], r["description_accuracy"]) for r in runs if r.get("description_accuracy") is not None]
        if described:
            acc.plot(*zip(*described), linestyle=":", marker=".", color=line.get_color(), label=f"{mode}: described")
        kls = [(r["recompute"], r["kl_median"]) for r in runs if r.get("kl_median")]
        if kls:
            kl.plot(*zip(*kls), marker="o", label=mode)
    acc.set(xscale="symlog", xlabel="recompute ratio", ylabel="task accuracy", ylim=(0, 1.02),
            title=f"accuracy on {out['traces']} held-out traces")
    acc.set_xscale("symlog", linthresh=0.02)
    acc.set_xlim(left=0)  # ratios are >= 0: no negative side of the symlog axis
    if kl is not None:
        kl.set(xlabel="recompute ratio", ylabel="median next-token KL (nats)", title="fidelity against a full prefill")
        kl.set_xscale("symlog", linthresh=0.02)
        kl.set_yscale("log")
        kl.set_xlim(left=0)
    if frontier is not None:
        _plot_frontier(frontier, out)
    for ax in (acc, kl, frontier):
        if ax is None:
            continue
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def frontier_points(out: dict) -> dict[str, list[dict]]:
    """Per recompute mode and method, its runs as points of the accuracy / reuse frontier, by
    ratio: ``recompute``, ``reuse_kept`` and the paired difference against the full prefill
    (``difference``, ``interval``). Taken from ``out["comparisons"]`` (a summary without per-turn
    replies) or computed from the runs."""
    rows = {row["a"]: row for row in (out.get("comparisons") or comparisons(out))
            if row["b"] == "baseline" and row.get("reuse_kept") is not None}
    lines: dict[str, list[dict]] = {}
    for run in out["runs"]:
        row = rows.get(run_name(run))
        if row is None or run["recompute"] is None:
            continue
        name = run["mode"] if run.get("method") is None else f"{run['mode']} {run['method']}"
        if run.get("track2_share") is not None:
            name = f"{name} share {run['track2_share']:g}"
        lines.setdefault(name, []).append({"recompute": run["recompute"], "reuse_kept": row["reuse_kept"],
                                           "difference": row["difference"], "interval": tuple(row["interval"])})
    return {name: sorted(points, key=lambda p: p["recompute"]) for name, points in lines.items()}


def _plot_frontier(ax, out: dict) -> None:
    """Accuracy against the full prefill (points, paired 95% interval) over the share of the
    any-index reuse kept, each point labelled with its recompute ratio; the bar's corner dashed."""
    for name, points in frontier_points(out).items():
        x = [100 * p["reuse_kept"] for p in points]
        y = [100 * p["difference"] for p in points]
        err = [[100 * (p["difference"] - p["interval"][0]) for p in points],
               [100 * (p["interval"][1] - p["difference"]) for p in points]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=name)
        for p, xi, yi in zip(points, x, y):
            ax.annotate(f"{p['recompute']:g}", (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.axhline(-1, color="black", linestyle="--", linewidth=1)
    ax.axvline(80, color="black", linestyle="--", linewidth=1)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set(xlabel="reuse kept (% of the image KV reuse at any index takes)",
           ylabel="accuracy vs full prefill (points)", title="frontier (labels: recompute ratio)")


__all__ = ["CALIBRATION_OFFSET", "SCENARIO_KINDS", "calibration_pairs", "check_scenario", "comparisons",
           "evaluate_traces", "frontier_points", "paired_difference", "parse_shares", "plot", "reordered_turns",
           "reuse_kept", "training_defaults", "wilson_interval"]
