"""Memory tiers under a device budget smaller than the working set: TTFT, hits per tier, bytes and
the fidelity cost of the cold encodings; and two instances sharing one Mooncake store.

The docs scenario with many pages (``--pages``, default 40) revisited in changing order: the
image-KV store on the device holds ``--device-pages`` pages' KV, far fewer than the trace uses.
Configurations, each its own engine over the same checkpoint and trace:

- ``device-only``: what falls out of the device store is recomputed (today's LRU);
- ``+host``: demoted to host memory (exact) and brought back;
- ``+disk-fp8`` / ``+disk-int8`` / ``+disk-lossless``: demoted straight to local disk in that
  encoding (no host tier), to isolate the encoding's cost and bytes.

A tier hit loads into the turn's sequence in a worker thread, layer by layer; ``load`` is the
worker's time and ``hidden`` the share of it the step did not wait for.

Fidelity is the next-token KL and top-1 agreement against a full prefill, on every
``--fidelity-every``-th turn. Then the shared tier: two engines split the turns (even / odd)
alone, and again over one Mooncake Store (a local ``mooncake_master``): pages one computed, the
other reuses.

    python bench/bench_tiers.py --out bench/out/tiers        # tiny random Qwen2.5-VL, CPU
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import shutil
import statistics
import tempfile

import torch

from samcache.engine import SAMcacheEngine
from samcache.random_checkpoints import build_preset
from samcache.bench.workloads import make_trace


def _engine(model, args, **kw) -> SAMcacheEngine:
    return SAMcacheEngine(model, device="cpu", recompute_budget="uniform", kv_cache_bytes=args.pool_mib << 20,
                          keep_image_order=False,
                          prefix_cache=False, recompute_tracks=args.recompute_tracks, **kw)


def _page_bytes(model, trace, args) -> tuple[int, int]:
    """(pool bytes a page's KV takes, whole blocks; KV values of a page: tokens x layers x K/V x row)."""
    probe = _engine(model, args)
    prompt = probe.build_prompt(trace.turns[0].resolved())
    tokens = max(s.length for s in prompt.images)
    layers, _, _, heads, dim = probe.runner.k_cache.shape
    return (-(-tokens // probe.pool.block_size) + 1) * probe.runner.block_bytes, tokens * layers * 2 * heads * dim


def run_config(name: str, engine: SAMcacheEngine, turns, args) -> dict:
    engine.warm_up()
    rows = []
    for i, turn in enumerate(turns):
        fid = args.fidelity_every > 0 and i % args.fidelity_every == args.fidelity_every - 1
        r = engine.chat(messages=turn.resolved(), max_new_tokens=turn.max_new_tokens, ignore_eos=True, fidelity=fid)
        m = r.metrics
        rows.append({"ttft_s": m.ttft_s, "images": m.images, "hits": m.image_kv_hits, "host": m.image_kv_host_hits,
                     "disk": m.image_kv_disk_hits, "remote": m.image_kv_remote_hits,
                     "load_s": m.tier_load_s, "load_wait_s": m.tier_load_wait_s,
                     "kl": m.fidelity.kl if m.fidelity else None,
                     "top1": m.fidelity.top1_agree if m.fidelity else None})
    engine.check_invariants()
    warm = rows[args.warm_turns:]
    images = sum(x["images"] for x in warm)
    kls = [x["kl"] for x in rows if x["kl"] is not None]
    top1 = [x["top1"] for x in rows if x["top1"] is not None]
    out = {
        "config": name, "turns": len(rows),
        "median_ttft_s": statistics.median(x["ttft_s"] for x in warm),
        "mean_ttft_s": statistics.fmean(x["ttft_s"] for x in warm),
        "hit_rate": sum(x["hits"] for x in warm) / images,
        "hit_rate_by_tier": {t: sum(x[t] for x in warm) / images for t in ("host", "disk", "remote")},
        "kl_median": statistics.median(kls) if kls else None, "kl_max": max(kls) if kls else None,
        "top1_agree": sum(top1) / len(top1) if top1 else None,
        # Worker time loading tier hits layer by layer, and the share the steps did not wait for.
        "load_s": sum(x["load_s"] for x in warm), "load_wait_s": sum(x["load_wait_s"] for x in warm),
    }
    out["load_hidden"] = 1 - out["load_wait_s"] / out["load_s"] if out["load_s"] > 0 else None
    out["ttft_by_turn_s"] = [x["ttft_s"] for x in rows]  # the same trace in every configuration: pairs by turn
    lower = engine.lower_tiers
    if lower is not None and lower.disk is not None:
        out["disk_bytes"] = lower.disk.used_bytes
        out["disk_items"] = len(lower.disk)
        # The same pages' KV uncompressed, to compare the cold encoding against.
        out["fp16_bytes"] = out["disk_items"] * args.page_values * 2
        out["fp32_bytes"] = out["disk_items"] * args.page_values * 4
        out["smaller_than_fp16"] = out["fp16_bytes"] / out["disk_bytes"] if out["disk_bytes"] else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: built from --preset)")
    ap.add_argument("--preset", default="tiny", help="size preset of the random-weight Qwen2.5-VL built when no "
                    "--model is given (samcache.random_checkpoints.PRESETS; 'medium': prefill costs what loading does not)")
    ap.add_argument("--out", default="bench/out/tiers")
    ap.add_argument("--pages", type=int, default=40)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--per-turn", type=int, default=3)
    ap.add_argument("--page-size", type=int, nargs=2, default=(560, 420), metavar=("H", "W"))
    ap.add_argument("--device-pages", type=int, default=8, help="pages of image KV the device store holds")
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--warm-turns", type=int, default=4, help="first turns left out of TTFT and hit rates")
    ap.add_argument("--fidelity-every", type=int, default=4)
    ap.add_argument("--configs", default="device-only,+host,+disk-fp8,+disk-int8,+disk-lossless")
    ap.add_argument("--shared", action=argparse.BooleanOptionalAction, default=True,
                    help="also run two instances alone and over one Mooncake store")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recompute-tracks", default="both", choices=("both", "heads"),
                    help="'both': track 2 scores the spliced keys first, so a tier hit loads in full before the "
                         "forward; 'heads': it loads layer by layer during the forward")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="samcache-tiers-"))
    model = args.model or build_preset("qwen2_5_vl", args.preset, work / "model")
    trace = make_trace("docs", turns=args.turns, pages=args.pages, per_turn=args.per_turn,
                       size=tuple(args.page_size), seed=0)
    page, args.page_values = _page_bytes(model, trace, args)
    device_bytes = args.device_pages * page
    host_bytes = 2 * args.pages * page
    configs = {
        "device-only": {},
        "+host": {"host_kv_cache_bytes": host_bytes},
        "+disk-fp8": {"cold_kv_qtype": "fp8_e4m3"},
        "+disk-int8": {"cold_kv_qtype": "int8"},
        "+disk-lossless": {"cold_kv_qtype": None},
    }
    runs = []
    for name in args.configs.split(","):
        kw = dict(configs[name])
        if name.startswith("+disk"):
            kw["disk_kv_cache_dir"] = work / f"disk-{name}"
        runs.append(run_config(name, _engine(model, args, image_kv_cache_bytes=device_bytes, **kw), trace.turns, args))
        print(json.dumps({k: v for k, v in runs[-1].items()}), flush=True)
    shared = None
    if args.shared:
        shared = run_shared(model, trace, device_bytes, args, work)
    results = {
        "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
        "model": str(args.model or f"random Qwen2.5-VL, preset {args.preset}"), "trace": trace.summary(),
        "device_store_bytes": device_bytes, "page_kv_bytes": page, "configs": runs, "shared": shared,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    base = next((r for r in runs if r["config"] == "device-only"), None)
    if base is not None:
        # Turn by turn against device-only (the same turns): steadier than a ratio of medians when
        # a trace's turns fall in clusters (0, 1, 2 or 3 pages to prefill).
        for r in runs:
            pairs = list(zip(base["ttft_by_turn_s"], r["ttft_by_turn_s"]))[args.warm_turns:]
            r["speedup_by_turn_median"] = statistics.median(b / t for b, t in pairs)
        (out / "results.json").write_text(json.dumps(results, indent=2))
    for r in runs:
        ratio = (f"  {base['median_ttft_s'] / r['median_ttft_s']:.2f}x vs device-only (turn by turn: "
                 f"{r['speedup_by_turn_median']:.2f}x)" if base else "")
        kl = f"  KL median {r['kl_median']:.2e} max {r['kl_max']:.2e} top1 {r['top1_agree']:.0%}" if r["kl_median"] is not None else ""
        disk = (f"  disk {r['disk_bytes'] / 2**20:.2f} MiB for {r['disk_items']} pages "
                f"({r['smaller_than_fp16']:.2f}x smaller than fp16, {r['fp32_bytes'] / 2**20:.1f} MiB in fp32)"
                if r.get("disk_bytes") else "")
        if r["load_hidden"] is not None:
            disk += f"  load {1000 * r['load_s']:.1f} ms, {r['load_hidden']:.0%} hidden"
        print(f"{r['config']:15s} median TTFT {1000 * r['median_ttft_s']:7.1f} ms  hits {r['hit_rate']:.0%} "
              f"{ {k: f'{v:.0%}' for k, v in r['hit_rate_by_tier'].items()} }{ratio}{kl}{disk}")
    if shared:
        for k, v in shared.items():
            print(f"shared: {k}: median TTFT {1000 * v['median_ttft_s']:.1f} ms (mean {1000 * v['mean_ttft_s']:.1f}), "
                  f"hits {v['hit_rate']:.0%}, "
                  f"remote {v['hit_rate_by_tier']['remote']:.0%}, prefilled {v['prefilled_tokens']} tokens, "
                  f"{v['vit_calls']} ViT calls"
                  + (f", {v['vs_single_by_turn_median']:.2f}x single+host turn by turn" if k == "shared" else ""))
    shutil.rmtree(work, ignore_errors=True)


def run_shared(model, trace, device_bytes, args, work) -> dict:
    """Two engines take the turns in turn (even / odd), each alone, then over one Mooncake store
    (lossless there, so the comparison is about reuse only)."""
    from samcache.cache.tiers import MooncakeStore
    from samcache.cache.tiers.mooncake_local import LocalMooncakeMaster

    halves = [trace.turns[0::2], trace.turns[1::2]]
    # The bar's reference: one warm instance serving every turn, keeping what falls out of its
    # device store in host memory (the same reuse a shared store gives two instances).
    single = _engine(model, args, image_kv_cache_bytes=device_bytes, host_kv_cache_bytes=1 << 30)
    out = {"single+host": run_config_interleaved([single, single], halves, args),
           "alone": run_config_interleaved([_engine(model, args, image_kv_cache_bytes=device_bytes) for _ in halves],
                                           halves, args)}
    with LocalMooncakeMaster(work / "mooncake.log") as m:
        stores = [MooncakeStore(m.master, m.metadata, segment_bytes=1 << 30, buffer_bytes=256 << 20) for _ in halves]
        engines = [_engine(model, args, image_kv_cache_bytes=device_bytes, remote_kv_store=s, cold_kv_qtype=None)
                   for s in stores]
        out["shared"] = run_config_interleaved(engines, halves, args)
        for s in stores:
            s.close()
    # Turn by turn, the shared pair against the single warm instance (the same turns, the same reuse).
    out["shared"]["vs_single_by_turn_median"] = statistics.median(
        t / s for s, t in zip(out["single+host"]["ttft_by_turn_s"], out["shared"]["ttft_by_turn_s"]))
    return out


def run_config_interleaved(engines, halves, args) -> dict:
    """Both instances' turns, alternating, as two servers taking an agent's turns would."""
    rows = []
    for e in engines:
        e.warm_up()
    for i in range(max(len(h) for h in halves)):
        for e, h in zip(engines, halves):
            if i < len(h):
                r = e.chat(messages=h[i].resolved(), max_new_tokens=h[i].max_new_tokens, ignore_eos=True)
                m = r.metrics
                rows.append({"turn": i, "ttft_s": m.ttft_s, "images": m.images, "hits": m.image_kv_hits,
                             "host": m.image_kv_host_hits, "disk": m.image_kv_disk_hits,
                             "remote": m.image_kv_remote_hits, "prefilled": m.prefilled_tokens,
                             "vit_calls": m.vit_calls})
    warm = [x for x in rows if x["turn"] >= args.warm_turns // 2]
    images = sum(x["images"] for x in warm)
    return {"median_ttft_s": statistics.median(x["ttft_s"] for x in warm),
            "mean_ttft_s": statistics.fmean(x["ttft_s"] for x in warm),
            "ttft_by_turn_s": [x["ttft_s"] for x in warm],
            "prefilled_tokens": sum(x["prefilled"] for x in warm), "vit_calls": sum(x["vit_calls"] for x in warm),
            "hit_rate": sum(x["hits"] for x in warm) / images,
            "hit_rate_by_tier": {t: sum(x[t] for x in warm) / images for t in ("host", "disk", "remote")}}


if __name__ == "__main__":
    main()
