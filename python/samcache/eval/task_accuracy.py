"""Task accuracy under reuse: a trained model answers held-out multi-turn traces of the visual-QA
task family (:mod:`samcache.tasks.visual_qa`) through samcache's engine in each benchmark mode.

A trace's images move between turns (a sliding window, re-ordering, sub-agents with their own
system prompts), so every turn after the first reuses image KV at new positions. Each turn's
greedy reply is scored against its known answer; beside the accuracy (with a Wilson 95% interval)
every turn's next-token KL and greedy agreement against a full prefill of the same prompt are kept,
now that the model's distributions are not flat.

    samcache eval --model models/visual-qa --scenario gui --traces 20 --recompute 0,0.02,0.05,0.1,0.2,1.0
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


def evaluate_traces(model_path, traces: Sequence[Sequence[Any]], *, modes: Sequence[str] = ("baseline", "prefix", "samcache"),
                    recompute: Sequence[float] = (0.05,), device: str = "cpu", calibrate: bool = True,
                    max_new_tokens: int = 6, fidelity: bool = True, kv_cache_bytes: int = 256 << 20,
                    progress: bool = True) -> dict:
    """Play every trace (a list of :class:`~samcache.tasks.visual_qa.Turn`) on a fresh engine per
    (mode, ratio) run and score each turn's greedy reply. Returns per run: accuracy, its interval,
    accuracy per question type, turns after the first (the ones that can reuse), KL and greedy
    agreement medians."""
    from samcache.benchmark import MODES, mode_engine_kwargs, parse_modes, parse_ratios
    from samcache.engine import SAMcacheEngine
    from samcache.tasks.visual_qa import is_correct

    modes = parse_modes(list(modes))
    recompute = parse_ratios(list(recompute))
    peers = [m for m in modes if MODES[m].peer or MODES[m].new_content_only]
    if peers:
        raise ValueError(f"task accuracy runs samcache's engine modes; {', '.join(peers)} cannot answer the traces")
    if not traces or any(len(t) == 0 for t in traces):
        raise ValueError("traces must be a non-empty list of non-empty traces")
    check_int("max_new_tokens", max_new_tokens, 1)
    shared = SAMcacheEngine(model_path, device=device, kv_cache_bytes=1 << 20)
    runs = [(m, r) for m in modes for r in (recompute if MODES[m].recomputes else [None])]
    curves = shared.calibrate(progress=progress) if calibrate and any(MODES[m].layer_aware for m, _ in runs) else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(runs) * sum(len(t) for t in traces), desc="samcache eval", unit="turn")
    results = []
    for mode, ratio in runs:
        kw = mode_engine_kwargs(mode, ratio, curves,
                                {"device": device, "kv_cache_bytes": kv_cache_bytes, "share_weights_with": shared})
        turns = []
        for trace in traces:
            engine = SAMcacheEngine(model_path, **kw)  # every trace starts cold
            for index, turn in enumerate(trace):
                r = engine.chat(messages=turn.messages, max_new_tokens=max_new_tokens,
                                fidelity=fidelity and mode != "baseline")
                f = r.metrics.fidelity
                turns.append({"turn": index, "question_type": turn.question_type, "answer": turn.answer,
                              "reply": r.text, "correct": bool(is_correct(r.text, turn.answer)),
                              "image_reused_tokens": r.metrics.image_reused_tokens,
                              "kl": None if f is None else f.kl, "greedy_agree": None if f is None else f.greedy_agree})
                if bar is not None:
                    bar.update(1)
        results.append({"mode": mode, "recompute": ratio, **_summary(turns), "turns": turns})
    return {"model": str(model_path), "traces": len(traces), "runs": results}


def _summary(turns: list[dict]) -> dict:
    correct = sum(t["correct"] for t in turns)
    later = [t for t in turns if t["turn"] > 0]
    by_type: dict[str, list[bool]] = {}
    for t in turns:
        by_type.setdefault(t["question_type"], []).append(t["correct"])
    kls = [t["kl"] for t in turns if t["kl"] is not None]
    agree = [t["greedy_agree"] for t in turns if t["greedy_agree"] is not None]
    return {
        "accuracy": correct / len(turns), "interval": wilson_interval(correct, len(turns)), "turns_scored": len(turns),
        "accuracy_after_first_turn": (sum(t["correct"] for t in later) / len(later)) if later else None,
        "accuracy_by_question": {k: sum(v) / len(v) for k, v in sorted(by_type.items())},
        "kl_median": statistics.median(kls) if kls else None,
        "greedy_agree_mean": statistics.fmean(agree) if agree else None,
    }


__all__ = ["evaluate_traces", "wilson_interval"]
