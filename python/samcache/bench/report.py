"""The benchmark report: ``results.json`` -> ``report.md`` with a table and matplotlib plots.

Written for a reader who never saw the code: what was run and on what, one row per mode, the
ratios against today's engines, plots, and the one command that reproduces it.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any

PLOTS = ("ttft_per_turn.png", "tokens_by_mode.png", "fidelity_vs_recompute.png", "compression.png")


def portable(value: Any, roots: tuple[str, ...] | None = None) -> Any:
    """``value`` (results: dicts, lists, strings) with paths of this machine written portably, so
    that results can be committed and read elsewhere: the working folder's prefix dropped, the
    temporary folder as ``$TMPDIR``."""
    if roots is None:
        roots = (os.getcwd(), tempfile.gettempdir())
    if isinstance(value, dict):
        return {k: portable(v, roots) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(portable(v, roots) for v in value)
    if isinstance(value, str):
        work, temp = (r.rstrip("/") + "/" for r in roots)
        # The longer prefix first: a checkout in a temporary folder is the working folder.
        for prefix, short in sorted(((work, ""), (temp, "$TMPDIR/")), key=lambda p: -len(p[0])):
            value = value.replace(prefix, short)
        return value
    return value


def _uncompressed(run: dict[str, Any]) -> bool:
    return run.get("compression_keep") in (None, 1.0)


def compression_rows(runs: list[dict[str, Any]]) -> list[tuple[dict, dict | None]]:
    """Each compressed run with the run of the same mode and recompute ratio without compression
    (or at keep 1.0, which computes the same), if the results hold one."""
    out = []
    for r in runs:
        if r.get("compression_keep") is None:
            continue
        plain = next((p for p in runs if p["mode"] == r["mode"] and p["recompute"] == r["recompute"]
                      and _uncompressed(p) and p is not r), None)
        out.append((r, plain))
    return out


def _plots(results: dict[str, Any], out: pathlib.Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (used as matplotlib.ticker)

    runs = results["runs"]
    made: list[str] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for run in runs:
        floor = run["mode"] == "new-only"  # a bound, not a system: dashed
        ax.plot(range(len(run["turns"])), [1e3 * t["ttft_s"] for t in run["turns"]], marker="o", ms=3,
                ls="--" if floor else "-", label=f"{run['name']} (floor)" if floor else run["name"])
    ax.set(xlabel="turn", ylabel="TTFT (ms)", title=f"TTFT per turn: {results['trace']['scenario']} scenario")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, PLOTS[0])

    fig, ax = plt.subplots(figsize=(9, 4.2))
    names = [r["name"] for r in runs]
    bottom = [0.0] * len(runs)
    parts = (  # recomputed tokens are image-KV-reused tokens that were computed again: count them once
        ("prefilled", lambda s: s["prefilled_tokens"]),
        ("recomputed", lambda s: s["recomputed_tokens"]),
        ("image KV reused", lambda s: s["image_reused_tokens"] - s["recomputed_tokens"]),
        ("prefix reused", lambda s: s["prefix_reused_tokens"]),
    )
    for label, value in parts:
        vals = [value(r["summary"]) for r in runs]
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(ylabel="prompt tokens, all turns", title="Where each prompt token's KV came from")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    save(fig, PLOTS[1])

    swept = {}
    for r in runs:
        if r["recompute"] is not None and r["summary"]["fidelity"]:
            swept.setdefault(r["mode"], []).append((r["recompute"], r["summary"]["fidelity"]["kl_median"],
                                                    r["summary"]["ttft_p50_ms"]))
    if any(len(v) > 1 for v in swept.values()):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
        for mode, pts in swept.items():
            pts.sort()
            a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
            a2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=mode)
        a1.set(xlabel="recompute ratio", ylabel="next-token KL vs full prefill (median)", title="fidelity")
        a2.set(xlabel="recompute ratio", ylabel="TTFT p50 (ms)", title="speed")
        for a in (a1, a2):
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
        save(fig, PLOTS[2])

    pairs = [(r, p) for r, p in compression_rows(runs) if p is not None and r["summary"]["fidelity"]]
    if pairs:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.9))
        for mode in dict.fromkeys(r["mode"] for r, _ in pairs):
            pts = sorted(((r["compression_keep"], p["summary"]["ttft_p50_ms"] / r["summary"]["ttft_p50_ms"],
                           r["summary"]["fidelity"]["kl_median"], r["summary"]["kv_rows_fraction"])
                          for r, p in pairs if r["mode"] == mode), reverse=True)
            a1.plot([p[1] for p in pts], [max(p[2], 1e-12) for p in pts], marker="o", label=mode)
            for keep, speed, kl, _ in pts:
                a1.annotate(f"{keep:g}", (speed, max(kl, 1e-12)), fontsize=7, xytext=(3, 3), textcoords="offset points")
            a2.plot([p[0] for p in pts], [p[3] if p[3] is not None else float("nan") for p in pts], marker="o",
                    label=mode)
        a1.set(xlabel="TTFT p50 speed-up over the same mode uncompressed", ylabel="next-token KL vs uncompressed",
               title="speed vs fidelity (labels: keep ratio)", yscale="log")
        a2.set(xlabel="keep ratio", ylabel="KV rows held / uncompressed", title="KV of the prompts")
        for a in (a1, a2):
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
        save(fig, PLOTS[3])
    return made


def _pct(value, enabled: bool) -> str:
    return "-" if not enabled or value is None else f"{value:.0%}"


def fidelity_cells(f, mode: str, *, short: bool = False) -> tuple[str, str, str]:
    """KL median, top-1 and greedy agreement of a run's summary fidelity, as table cells."""
    if not f:
        missing = {"baseline": "exact", "new-only": "n/a" if short else "n/a (not the same prompt)"}
        return missing.get(mode, "-" if short else "not measured"), "-", "-"
    return f"{f['kl_median']:.2e}", f"{f['top1_agree']:.0%}", f"{f['greedy_agree']:.0%}"


def ratio_cell(ref: dict, s: dict, *, times: str = "×") -> str:
    """TTFT of ``ref`` over that of ``s`` (summaries), of the medians and of the means."""
    return (f"{ref['ttft_p50_ms'] / s['ttft_p50_ms']:.2f}{times} / "
            f"{ref['ttft_mean_ms'] / s['ttft_mean_ms']:.2f}{times}")


def render(results: dict[str, Any], plots: list[str]) -> str:
    meta, trace, runs = results["meta"], results["trace"], results["runs"]
    by_name = {r["name"]: r for r in runs}
    ref = next((r for r in runs if r["mode"] == "prefix" and _uncompressed(r)), None)
    base = next((r for r in runs if r["mode"] == "baseline" and _uncompressed(r)), None)
    lines = [
        f"# samcache benchmark: `{trace['scenario']}` scenario",
        "",
        "## What was run",
        "",
        f"- **Scenario** `{trace['scenario']}` (seed {trace['seed']}), parameters `{json.dumps(trace['params'])}`: "
        f"{trace['turns']} turns, {trace['images_sent']} images sent, {trace['distinct_images']} distinct.",
        f"- **Model** `{meta.get('family', '?')}` with {meta.get('parameters', 0):,} parameters"
        + (f" ({meta['model_note']})" if meta.get("model_note") else "") + f", from `{meta['model_path']}`.",
        f"- **Decode** {meta.get('max_new_tokens', '?')} tokens a turn in every mode (end-of-turn tokens ignored, so "
        f"every mode does the same work); KV pool {meta.get('kv_cache_mib_per_engine', '?')} MiB per samcache engine, "
        "image KV included (held in the pool's own blocks).",
        f"- **Machine** {meta['device']}, torch {meta['torch']}, {meta['dtype']}; {meta['date']}.",
        "- **Modes** (each its own engine with fresh caches, same checkpoint, same prompts"
        + (" except `new-only`" if "new-only" in results["modes"] else "") + "):",
    ]
    lines += [f"  - `{m}`: {d}" for m, d in results["modes"].items()]
    for r in runs:
        if r.get("peer"):
            p = r["peer"]
            same = all(t.get("same_prompt_as_samcache") for t in r["turns"])
            lines.append(f"- **Peer** `{r['name']}`: {p['engine']} in its own environment ({p['python']}), started in "
                         f"{p['startup_s']:.0f} s, worker bound to {meta.get('threads', '?')} thread(s); TTFT = wall time "
                         "of a one-token request (chat template, image processing, encoder, prefill); its prompts had "
                         + ("the same token counts as samcache's on every turn." if same else
                            "**other token counts than samcache's on some turns** (see results.json)."))
    lines += [
        "- **TTFT** is request start to first token: hashing, image processing, ViT, prefill (the benchmark hands "
        "the engine decoded pixels, so file decoding, the same in every mode, is not in it)"
        + (f"; each turn's TTFT is the median of {meta['repeat']} plays of the whole trace, each with fresh engines"
           if meta.get("repeat", 1) > 1 else "; one play of the trace") + ". "
        + ("Fidelity is each turn against a full prefill of the same prompt: next-token KL (nats), top-1 agreement, "
           f"and agreement of {meta['fidelity_tokens']} greedy tokens; it is measured outside the timed path."
           if meta.get("fidelity_tokens") else "Fidelity was not measured in this run (`--no-fidelity`)."),
        "",
        "## Results",
        "",
        "| run | recompute | TTFT p50 | TTFT p95 | TTFT mean | latency p50 | vs prefix (p50 / mean) | vs vllm (p50 / mean) "
        "| vs baseline | computed tokens "
        "| prefix reused | image KV reused | recomputed (layer 0) | ViT calls | prefix hit / ViT skipped / image-KV hit "
        "| peak KV held / live | decode tok/s | KL median | top-1 | greedy |",
        "| --- " * 20 + "|",
    ]
    peer = next((r for r in runs if r.get("peer")), None)
    for r in runs:
        s = r["summary"]
        vs_prefix = ratio_cell(ref["summary"], s) if ref else "-"
        vs_peer = ratio_cell(peer["summary"], s) if peer else "-"
        vs_base = f"{base['summary']['ttft_p50_ms'] / s['ttft_p50_ms']:.2f}×" if base else "-"
        kl, top1, greedy = fidelity_cells(s["fidelity"], r["mode"])
        levels = r["levels"]
        rates = " / ".join([
            _pct(s["prefix_hit_rate"], levels["prefix"]),
            _pct(s["vit_skipped_rate"], levels["vit"]),
            _pct(s["image_kv_hit_rate"], levels["image_kv"]),
        ])
        ratio = f"{r['recompute']:g}" if r["recompute"] is not None else ("0" if r["mode"] == "no-recompute" else "-")
        unknown = "-"  # a peer reports TTFT and prompt-cache hits only
        latency = f"{s['latency_p50_ms']:.1f} ms" if s["latency_p50_ms"] is not None else unknown
        kv = (f"{s['peak_kv_mib']:.1f} / {s['peak_live_kv_mib']:.1f} MiB" if s["peak_kv_mib"] is not None else unknown)
        decode = f"{s['decode_tokens_per_s']:.1f}" if not r.get("peer") else unknown
        lines.append(
            f"| `{r['name']}` | {ratio} | {s['ttft_p50_ms']:.1f} ms | {s['ttft_p95_ms']:.1f} ms "
            f"| {s['ttft_mean_ms']:.1f} ms | {latency} | {vs_prefix} | {vs_peer} | {vs_base} | {s['computed_tokens']:,} "
            f"| {s['prefix_reused_tokens']:,} | {s['image_reused_tokens']:,} | {s['recomputed_tokens']:,} "
            f"| {s['vit_calls'] if s['vit_calls'] is not None else unknown} | {rates} | {kv} "
            f"| {decode} | {kl} | {top1} | {greedy} |"
        )
    floor = next((r for r in runs if r["mode"] == "new-only"), None)
    if floor and ref:
        best = ref["summary"]["ttft_p50_ms"] / floor["summary"]["ttft_p50_ms"]
        lines += ["", f"`new-only` is a floor, not a system: every turn cut down to what no cache can hold (the images "
                  f"seen for the first time and the last message's text), without the context those tokens would "
                  f"attend to. Serving the whole turn costs at least that, so no reuse scheme can be more than "
                  f"{best:.2f}× faster than `prefix` on this trace and machine."]
    compressed = compression_rows(runs)
    if compressed:
        lines += ["", "### Visual-token compression", "",
                  "Each compressed run against the same mode without compression (fidelity: against a full prefill "
                  "without compression). KV rows = (token, layer) pairs the prompts hold, over every token at every "
                  "layer; image KV rows = the same for the images the image-KV store holds.", "",
                  "| run | keep | TTFT p50 | speed-up p50 / mean | KV rows | image KV rows | image KV bytes/token "
                  "| KL median | top-1 | greedy |", "| --- " * 10 + "|"]
        for r, plain in compressed:
            s = r["summary"]
            speed = ratio_cell(plain["summary"], s) if plain else "-"
            kl, top1, greedy = fidelity_cells(s["fidelity"], r["mode"])
            rows = "-" if s.get("kv_rows_fraction") is None else f"{s['kv_rows_fraction']:.2f}"
            image_rows = "-" if s.get("image_kv_rows_fraction") is None else f"{s['image_kv_rows_fraction']:.2f}"
            per_token = "-" if not s.get("image_kv_bytes_per_token") else f"{s['image_kv_bytes_per_token']:,.0f}"
            lines.append(f"| `{r['name']}` | {r['compression_keep']:g} | {s['ttft_p50_ms']:.1f} ms | {speed} | {rows} "
                         f"| {image_rows} | {per_token} | {kl} | {top1} | {greedy} |")
    recomputing = [r for r in runs if r["recompute"] is not None]
    if recomputing:
        lines += ["", "Per-layer recompute rates of the budget: " + "; ".join(
            f"`{r['name']}` {r['budget']} {[round(x, 3) for x in r['layer_rates']]}"
            for r in recomputing)]
    lines += ["", "Computed tokens = prefilled from scratch + recomputed, a token recomputed at k of L layers "
              "counting k/L; recomputed (layer 0) counts the recomputed tokens at the first layer, where the set is "
              "largest. \"vs\" columns are TTFT ratios (higher is faster than that mode): of the medians, and of the "
              "means, which weigh every turn by its time (the median of a trace mixing cheap and expensive turns can "
              "sit on either kind). " + (f"With {trace['turns']} turns, p95 is close to the slowest turn. "
                                         if trace["turns"] < 20 else "") + "Prefix hit = prompt "
              "tokens adopted from the prefix cache; ViT skipped = images not run through the vision tower; image-KV "
              "hit = known-image lookups past the prefix that hit; '-' where the mode has that level off or the peer "
              "does not report it. Peak KV held = pool blocks in use or cached at the end of a turn (image KV is held "
              "in those blocks); live = the KV of the turn's own sequence.", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    lines += ["## Per turn", "", "| turn | " + " | ".join(f"`{n}` TTFT" for n in by_name) + " |",
              "| --- " * (len(by_name) + 1) + "|"]
    for i, t in enumerate(runs[0]["turns"]):
        lines.append(f"| {t['label']} | " + " | ".join(f"{1e3 * r['turns'][i]['ttft_s']:.1f} ms" for r in runs) + " |")
    lines += ["", "## Reproduce", "", "```bash", meta.get("command") or "samcache bench ...", "```",
              "", "`samcache report results.json` rebuilds this report from the JSON next to it.", ""]
    return "\n".join(lines)


def write_report(results: dict[str, Any], out_dir) -> pathlib.Path:
    """Write ``report.md`` and the plots into ``out_dir``; returns the report's path."""
    out = pathlib.Path(out_dir)
    if not isinstance(results, dict):
        raise ValueError("not a samcache benchmark result: the JSON is not an object")
    for key in ("meta", "trace", "runs", "modes"):
        if key not in results:
            raise ValueError(f"not a samcache benchmark result: the key {key!r} is missing")
    if not results["runs"]:
        raise ValueError("the results hold no runs")
    from samcache.bench.benchmark import summarize

    for run in results["runs"]:  # aggregates always follow from the per-turn records
        run["summary"] = summarize(run["turns"])
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(results, out)
    path = out / "report.md"
    path.write_text(render(results, plots), encoding="utf-8")
    return path


__all__ = ["PLOTS", "fidelity_cells", "ratio_cell", "render", "write_report"]
