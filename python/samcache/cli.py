"""``samcache`` command line: ``samcache bench`` runs an agent workload benchmark, ``samcache
report`` rebuilds its report from the JSON, ``samcache eval`` scores a trained model's answers on
held-out visual-QA traces in each mode (task accuracy under reuse).

    samcache bench --scenario gui --modes baseline,prefix,samcache [--model DIR] [--turns 20]
    samcache bench --scenario gui --modes samcache --recompute 0,0.02,0.05,0.1,0.2,1.0
    samcache bench --scenario gui --modes prefix,samcache,vllm --preset small --threads 1
    samcache report bench/out/gui/results.json
    samcache eval --model DIR --scenario gui --traces 20 --modes baseline,prefix,samcache --recompute 0,0.05,1.0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import shlex
import shutil
import sys
import tempfile

from samcache._checks import check_int


def _bench(args) -> int:
    from samcache.bench.benchmark import MODES, parse_keeps, parse_modes, parse_ratios
    from samcache.bench.workloads import make_trace

    try:
        modes = parse_modes(args.modes or ("vllm,vllm-samcache" if args.engine == "vllm" else "baseline,prefix,samcache"))
        ratios = parse_ratios(args.recompute if args.recompute is not None else "0.05")
        if args.compression is not None:
            args.compression = parse_keeps(args.compression)
            if args.model is None and args.family not in ("qwen3_vl_moe", "internvl"):  # before building a checkpoint
                raise ValueError(f"--compression needs an MoE model: --family qwen3_vl_moe or internvl, not {args.family}")
        elif any(MODES[m].needs_compression for m in modes):
            raise ValueError(f"mode(s) {', '.join(m for m in modes if MODES[m].needs_compression)} need --compression")
    except ValueError as e:
        print(f"samcache bench: {e}", file=sys.stderr)
        return 2
    if args.recompute is not None and not any(MODES[m].recomputes for m in modes):
        print(f"samcache bench: --recompute applies to the modes that recompute "
              f"({', '.join(m for m in MODES if MODES[m].recomputes)}); none of {', '.join(modes)} does", file=sys.stderr)
        return 2
    for flag, value in (("--repeat", args.repeat), ("--threads", args.threads)):
        if value is not None and value < 1:
            print(f"samcache bench: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    params = {"seed": args.seed, "max_new_tokens": args.max_new_tokens}
    flags = {"turns": args.turns, "window": args.window,
             "size": tuple(args.image_size) if args.image_size is not None else None}
    params.update({k: v for k, v in flags.items() if v is not None})
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"samcache bench: --param needs KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        if key in ("seed", "max_new_tokens") or flags.get(key) is not None:
            flag = {"size": "--image-size"}.get(key, "--" + key.replace("_", "-"))
            print(f"samcache bench: {key} is set by {flag}; not also by --param", file=sys.stderr)
            return 2
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    try:
        trace = make_trace(args.scenario, **params)
    except ValueError as e:
        print(f"samcache bench: {e}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out or f"bench/out/{args.scenario}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-check").write_text("")
        (out / ".write-check").unlink()
    except OSError as e:
        print(f"samcache bench: cannot write to --out {str(out)!r}: {e}", file=sys.stderr)
        return 2
    if args.fidelity_tokens < 1 or (args.kv_cache_mib is not None and args.kv_cache_mib < 1):
        print("samcache bench: --fidelity-tokens and --kv-cache-mib must be >= 1", file=sys.stderr)
        return 2
    from samcache.engine.loading import resolve_device, resolve_dtype

    try:  # before minutes of building a checkpoint for them
        device = resolve_device(args.device)
        run_dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    except ValueError as e:
        print(f"samcache bench: --device/--dtype: {e}", file=sys.stderr)
        return 2
    if args.quiet:  # also the bars of building and loading the checkpoint
        import transformers.utils.logging

        transformers.utils.logging.disable_progress_bar()
    with contextlib.ExitStack() as stack:
        model, note = args.model, "supplied checkpoint"
        if model is None:
            from samcache.random_checkpoints import build_preset

            # Built in the run's dtype (bf16 on CUDA); deleted after the run unless --keep-model.
            where = tempfile.mkdtemp(prefix="samcache-bench-")
            if not args.keep_model:
                stack.callback(shutil.rmtree, where, ignore_errors=True)
            model = build_preset(args.family, args.preset, pathlib.Path(where) / args.family, dtype=run_dtype)
            print(f"built a random-weight {args.family} checkpoint ({args.preset}) in {model}"
                  + ("" if args.keep_model else " (deleted after the run; --keep-model keeps it)"), file=sys.stderr)
            note = f"random weights, built by samcache.random_checkpoints ({args.preset} sizes)"
        elif not pathlib.Path(model).is_dir():
            print(f"samcache bench: --model {model!r} is not a checkpoint directory", file=sys.stderr)
            return 2
        return _run(args, trace, model, note, modes, ratios, out)


def _run(args, trace, model, note, modes, ratios, out) -> int:
    from samcache.bench.benchmark import run_benchmark
    from samcache.bench.report import fidelity_cells, portable, ratio_cell, write_report

    command = "samcache " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if args.command is None else args.command
    try:
        results = run_benchmark(
            trace, model, modes=modes, recompute=ratios, compression=args.compression or (), device=args.device,
            dtype=args.dtype,
            fidelity=not args.no_fidelity, fidelity_tokens=args.fidelity_tokens, calibrate=not args.no_calibrate,
            kv_cache_bytes=args.kv_cache_mib << 20 if args.kv_cache_mib else None, progress=not args.quiet,
            command=command, model_note=note, repeat=args.repeat, threads=args.threads, vllm_python=args.vllm_python,
            peer_log_dir=out, methods=args.methods,
            engine_kwargs={**({"image_attention": args.image_attention} if args.image_attention else {}),
                           **({"keep_image_order": _ORDER_CHOICES[args.keep_image_order]}
                              if args.keep_image_order != "auto" else {})} or None,
        )
    except (ValueError, FileNotFoundError) as e:  # bad model, prompt too long, no peer environment, ...
        print(f"samcache bench: {e}", file=sys.stderr)
        return 2
    results = portable(results)  # committed results name no path of this machine
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    report = write_report(results, out)
    prefix = next((r for r in results["runs"] if r["mode"] == "prefix"), None)
    vllm = next((r for r in results["runs"] if r.get("peer")), None)
    print(f"{'run':<24}{'TTFT p50':>11}{'TTFT mean':>11}{'vs prefix':>15}" + (f"{'vs vllm':>15}" if vllm else "")
          + f"{'computed':>10}{'KL median':>11}{'top-1':>7}{'greedy':>8}")
    for r in results["runs"]:
        s = r["summary"]
        ratio = ratio_cell(prefix["summary"], s, times="x").replace(" ", "") if prefix else "-"
        peer = f"{ratio_cell(vllm['summary'], s, times='x').replace(' ', ''):>15}" if vllm else ""
        kl, top1, greedy = fidelity_cells(s["fidelity"], r["mode"], short=True)
        name = r["name"] + (" (floor)" if r["mode"] == "new-only" else "")
        print(f"{name:<24}{s['ttft_p50_ms']:>8.1f} ms{s['ttft_mean_ms']:>8.1f} ms{ratio:>15}{peer}"
              f"{s['computed_tokens']:>10}{kl:>11}{top1:>7}{greedy:>8}")
    print("(vs: p50 / mean TTFT ratios, above 1 = faster; " + ("fidelity not measured: --no-fidelity)" if args.no_fidelity
          else "fidelity against a full prefill of the same prompt)"))
    print(f"wrote {out / 'results.json'} and {report}")
    return 0


#: ``--keep-image-order`` choices and the engine's values for them.
_ORDER_CHOICES = {"auto": "auto", "true": True, "false": False}


def _adapt(args) -> int:
    from samcache.tasks.adapt import adapt, config_of

    try:
        record = adapt(args.model, args.out, config_of(args), resume=args.resume, progress=not args.quiet)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"samcache adapt: {e}", file=sys.stderr)
        return 2
    last = (record["curve"] or [{}])[-1]
    scores = ", ".join(f"{k} {v:.1%}" for k, v in last.items() if k.startswith(("answers", "description")))
    print(f"wrote {args.out} ({record['seconds'] / 60:.1f} min){': held-out ' + scores if scores else ''}")
    return 0


def _calibrate(args) -> int:
    from samcache.engine import SAMcacheEngine
    from samcache.engine.calibration import CALIBRATION_CONTINUATION

    try:
        engine = SAMcacheEngine(args.model, device=args.device, profile=False)  # a stale profile is replaced
        if not engine.image_attention.isolated:
            requests = None
            if args.scenario is not None:
                from samcache.bench.task_accuracy import CALIBRATION_OFFSET, calibration_pairs, training_defaults
                from samcache.tasks import visual_qa

                check_int("traces", args.traces, 1)
                trained = training_defaults(args.model)
                size = trained.get("size", visual_qa.DEFAULT_SIZE)
                traces = [visual_qa.trace(visual_qa.split_seed("test", CALIBRATION_OFFSET + i, 0), scenario=args.scenario,
                                          size=size, dense=trained.get("dense", False)) for i in range(args.traces)]
                requests = calibration_pairs(traces)
            engine.calibrate(requests=requests, continuation=args.continuation or CALIBRATION_CONTINUATION,
                             progress=not args.quiet)
        path = engine.save_profile(args.out)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"samcache calibrate: {e}", file=sys.stderr)
        return 2
    profile = engine.profile
    print(f"wrote {path}: image attention {profile.image_attention.name}")
    if profile.keep_order:
        kept = ", ".join(f"{r:g}: {'kept' if k else 'any index'}" for r, k in profile.keep_order.items())
        print(f"image order at each recompute ratio: {kept}")
    else:
        print("images are reused at any index, exactly (nothing recomputed)")
    return 0


def _eval(args) -> int:
    from samcache.bench.report import portable
    from samcache.bench.task_accuracy import (
        CALIBRATION_OFFSET,
        check_scenario,
        comparisons,
        evaluate_traces,
        plot,
        training_defaults,
    )
    from samcache.tasks import visual_qa

    try:
        check_int("traces", args.traces, 1)
        check_int("calibration_traces", args.calibration_traces, 0)
        if args.traces > CALIBRATION_OFFSET:
            raise ValueError(f"--traces must be <= {CALIBRATION_OFFSET} (the calibration traces start there)")
        trained = training_defaults(args.model)
        check_scenario(args.scenario, trained)
        size = tuple(args.image_size) if args.image_size else trained.get("size", visual_qa.DEFAULT_SIZE)
        dense = trained.get("dense", False) if args.dense is None else args.dense
        traces = [visual_qa.trace(visual_qa.split_seed("test", i, args.seed), scenario=args.scenario, turns=args.turns,
                                  window=args.window, size=size, dense=dense) for i in range(args.traces)]
        # Calibration traces from the same stream, far past the scored ones.
        calibration = [visual_qa.trace(visual_qa.split_seed("test", CALIBRATION_OFFSET + i, args.seed),
                                       scenario=args.scenario, turns=args.turns, window=args.window, size=size,
                                       dense=dense) for i in range(args.calibration_traces)] or None
        if args.sensitivity is not None:
            calibration = None  # the given curves replace the calibration
        out = evaluate_traces(args.model, traces, modes=args.modes.split(","), recompute=args.recompute.split(","),
                              device=args.device, calibrate=not args.no_calibrate, max_new_tokens=args.max_new_tokens,
                              fidelity=not args.no_fidelity, calibration_traces=calibration,
                              track2_shares=args.track2_share, sensitivity=args.sensitivity,
                              calibration_continuation=args.calibration_continuation,
                              keep_image_order=_ORDER_CHOICES[args.keep_image_order], methods=args.methods,
                              vllm_python=args.vllm_python, progress=not args.quiet)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"samcache eval: {e}", file=sys.stderr)
        return 2
    for run in out["runs"]:
        lo, hi = run["interval"]
        ratio = "" if run.get("method") is None else f" {run['method']}"
        ratio += "" if run["recompute"] is None else f" @ {run['recompute']:g}"
        if run.get("track2_share") is not None:
            ratio += f" share {run['track2_share']:g}"
        kl = "-" if run["kl_median"] is None else f"{run['kl_median']:.2e}"
        described = "" if run["description_accuracy"] is None else \
            "  described {:.3f} [{:.3f}, {:.3f}]".format(run["description_accuracy"], *run["description_interval"])
        order = "  (image order kept)" if run.get("keeps_image_order") else ""
        print(f"{run['mode'] + ratio:<22} accuracy {run['accuracy']:.3f} [{lo:.3f}, {hi:.3f}]  "
              f"after turn 1 {run['accuracy_after_first_turn'] or 0:.3f}  KL median {kl}{described}{order}")
        for order, group in run["by_image_order"].items():
            parts = "" if group["description_accuracy"] is None else f", described {group['description_accuracy']:.3f}"
            print(f"    later turns, images {order}: accuracy {group['accuracy']:.3f} over {group['turns_scored']}{parts}")
    out["comparisons"] = comparisons(out)
    for c in out["comparisons"]:
        lo, hi = c["interval"]
        d = c["described"]
        parts = "" if d is None else (f"; described {100 * d['difference']:+.1f} [{100 * d['interval'][0]:+.1f}, "
                                      f"{100 * d['interval'][1]:+.1f}] over {d['turns']} parts")
        kept = "" if c.get("reuse_kept") is None else f"; reuse kept {100 * c['reuse_kept']:.0f}%"
        print(f"{c['a']} vs {c['b']}: {100 * c['difference']:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}] "
              f"over {c['turns']} turns{parts}{kept}")
    if args.out:
        path = pathlib.Path(args.out)
        path.mkdir(parents=True, exist_ok=True)
        out["command"] = "samcache " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["eval"] else None
        (path / "results.json").write_text(json.dumps(portable(out), indent=2, default=str))
        print(f"wrote {path / 'results.json'}")
        curves = out["sensitivity"]  # reusable: --sensitivity, or SAMcacheEngine(sensitivity=...)
        named = {} if curves is None else ({"sensitivity.json": curves} if "rates" in curves else
                                           {f"sensitivity-{m.replace('+', '-')}.json": c for m, c in curves.items()})
        for name, c in named.items():
            (path / name).write_text(json.dumps(c, indent=1))
            print(f"wrote {path / name}")
        try:
            plot(out, path / "accuracy.png")
            print(f"wrote {path / 'accuracy.png'}")
        except ImportError:
            print("matplotlib is not installed: no plot (pip install 'samcache[bench]')", file=sys.stderr)
    return 0


def _report(args) -> int:
    from samcache.bench.report import write_report

    path = pathlib.Path(args.results)
    if path.is_dir():  # the output folder of a run
        path = path / "results.json"
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
        report = write_report(results, args.out or path.parent)
    except (OSError, json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
        print(f"samcache report: cannot build a report from {path}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {report}")
    return 0


def _serve(args) -> int:
    from samcache.serve.main import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from samcache.bench.benchmark import MODES
    from samcache.bench.task_accuracy import SCENARIO_KINDS
    from samcache.random_checkpoints import PRESETS
    from samcache.bench.workloads import SCENARIOS, scenario_parameters

    from samcache import __version__

    p = argparse.ArgumentParser(prog="samcache", description="samcache: multimodal agent KV reuse")
    p.add_argument("--version", action="version", version=f"samcache {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, title="commands", metavar="{bench,eval,calibrate,adapt,serve,report}")
    b = sub.add_parser("bench", help="run an agent workload benchmark",
                       description=f"Run a scenario through several modes of the engine. Modes: {', '.join(MODES)}.")
    b.add_argument("--scenario", required=True, choices=list(SCENARIOS))
    b.add_argument("--engine", choices=["samcache", "vllm"], default="samcache",
                   help="vllm: vanilla vLLM (prefix caching on) against vLLM with samcache's plugin, fidelity "
                        "against vanilla vLLM (the modes vllm,vllm-samcache, unless --modes says otherwise)")
    b.add_argument("--modes", default=None,
                   help="comma-separated (default baseline,prefix,samcache), from: " + ", ".join(MODES))
    b.add_argument("--model", help="checkpoint directory (default: build a tiny random one of --family)")
    b.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl_moe", "internvl"])
    b.add_argument("--preset", default="tiny", choices=list(PRESETS),
                   help="sizes of the built checkpoint: tiny, or real sizes with random weights (GPU)")
    b.add_argument("--keep-model", action="store_true", help="keep the built checkpoint after the run")
    b.add_argument("--device", default="cpu", help="cpu or cuda")
    b.add_argument("--dtype", default=None,
                   help="float32 / fp32 (CPU default), bfloat16 / bf16 (CUDA default), float16 / fp16")
    b.add_argument("--turns", type=int, help="gui, docs, chat: turns (default 20, 12, 8)")
    b.add_argument("--window", type=int, help="gui: screenshots kept in the prompt (default 4)")
    b.add_argument("--image-size", type=int, nargs=2, metavar=("H", "W"), help="image size (default: real sizes)")
    b.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="any scenario parameter, value as JSON (e.g. --param pages=8 --param branches=4); "
                        "parameters: " + "; ".join(f"{n}: {', '.join(scenario_parameters(n))}" for n in SCENARIOS))
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--recompute", default=None, help="recompute ratio(s), comma-separated: a sweep (default 0.05)")
    b.add_argument("--methods", default=None,
                   help="repair method(s) each recompute mode runs with, comma-separated (default: the engine's)")
    b.add_argument("--compression", default=None, metavar="KEEP",
                   help="visual-token compression keep ratio(s), comma-separated (e.g. 1.0,0.5,0.25,0.11): every "
                        "mode runs once per ratio with compression on (MoE checkpoints: --family qwen3_vl_moe or internvl)")
    b.add_argument("--repeat", type=int, default=1,
                   help="run the trace N times with fresh engines; each turn's TTFT is its median over the N")
    b.add_argument("--max-new-tokens", type=int, default=8)
    b.add_argument("--fidelity-tokens", type=int, default=4)
    b.add_argument("--no-fidelity", action="store_true", help="skip the full-prefill comparison of each turn")
    b.add_argument("--no-calibrate", action="store_true", help="uniform budget instead of calibrating first")
    b.add_argument("--keep-image-order", default="auto", choices=list(_ORDER_CHOICES),
                   help="the engines' (and the plugin's) keep_image_order (default auto: the calibration decides; "
                        "without curves the order is kept); false: reuse at any index, e.g. on random weights")
    b.add_argument("--image-attention", default=None, metavar="NAME",
                   help="serve the model with this image attention (causal, isolated: every image computed alone and "
                        "reused at any index exactly; default: what the checkpoint declares)")
    b.add_argument("--kv-cache-mib", type=int, default=None,
                   help="KV pool per engine, image KV included (default 256 CPU, 2048 CUDA)")
    b.add_argument("--threads", type=int, default=None,
                   help="CPU threads of every mode, the vllm peer's worker included (default: torch's)")
    b.add_argument("--vllm-python", default=None,
                   help="vLLM's Python for the vllm mode (default: $SAMCACHE_VLLM_PYTHON, else .venv-vllm/bin/python; "
                        "`make vllm-env` builds it)")
    b.add_argument("--out", help="output folder (default bench/out/SCENARIO)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--command", help=argparse.SUPPRESS)
    b.set_defaults(func=_bench)
    e = sub.add_parser("eval", help="task accuracy of a trained model on held-out visual-QA traces, per mode",
                       description="Score a model trained on samcache.tasks.visual_qa (samcache.tasks.training) on "
                                   "held-out multi-turn traces whose images move between turns, in each mode.")
    e.add_argument("--model", required=True, help="the trained checkpoint directory")
    e.add_argument("--scenario", default="gui", choices=list(SCENARIO_KINDS))
    e.add_argument("--traces", type=int, default=20)
    e.add_argument("--turns", type=int, default=6)
    e.add_argument("--window", type=int, default=3)
    e.add_argument("--image-size", type=int, nargs=2, default=None, metavar=("H", "W"),
                   help="image size of the traces (default: the model's training size from its training.json, else 112 112)")
    e.add_argument("--dense", action=argparse.BooleanOptionalAction, default=None,
                   help="ask for a description before the answer (default: as the model was trained)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--modes", default="baseline,prefix,samcache", help="comma-separated engine modes")
    e.add_argument("--recompute", default="0.05", help="recompute ratio(s), comma-separated")
    e.add_argument("--device", default="cpu")
    e.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens per turn (default: room for the answer, or for the description when dense)")
    e.add_argument("--no-fidelity", action="store_true", help="skip KL / greedy agreement against a full prefill")
    e.add_argument("--no-calibrate", action="store_true")
    e.add_argument("--track2-share", default=None,
                   help="track-2 share(s) to sweep for the two-track modes at each non-zero ratio, comma-separated "
                        "(default: the engine's 0.5)")
    e.add_argument("--sensitivity", default=None, metavar="FILE",
                   help="layer sensitivity curves to use instead of calibrating (the sensitivity.json an earlier "
                        "eval wrote, or engine.calibrate(save=...))")
    e.add_argument("--calibration-traces", type=int, default=2,
                   help="held-out traces (not scored) whose consecutive turns calibrate the layer-aware budget; "
                        "0: the engine's default synthetic pair")
    e.add_argument("--calibration-continuation", type=int, default=None, metavar="N",
                   help="reply tokens the calibration's loss covers (default: the whole reply of the calibration "
                        "turns; 256 on the synthetic pair)")
    e.add_argument("--methods", default=None,
                   help="repair method(s) to run each recompute mode with, comma-separated: "
                        "two-track, boundary, deviation, boundary+deviation, isolated (default: the engine's)")
    e.add_argument("--vllm-python", default=None,
                   help="vLLM's Python for the modes vllm and vllm-samcache (default: $SAMCACHE_VLLM_PYTHON, "
                        "then .venv-vllm)")
    e.add_argument("--keep-image-order", default="auto", choices=list(_ORDER_CHOICES),
                   help="the engines' keep_image_order in every mode but 'ordered' (default auto: the calibration "
                        "decides whether an image's KV is reused only at its own index)")
    e.add_argument("--out", help="folder for results.json")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=_eval)
    c = sub.add_parser("calibrate", help="write a model's reuse profile (image attention, curves, order decision)",
                       description="Measure how a model's answers react to reused image KV and write its reuse "
                                   "profile (samcache_profile.json in the model's folder, or --out): every engine "
                                   "that loads the model (samcache's, the vLLM and SGLang plugins) reads it. A model "
                                   "whose images attend in isolation needs no measurement: its profile says so.")
    c.add_argument("model", help="checkpoint directory")
    c.add_argument("--out", default=None, help="profile path or folder (default: the model's folder)")
    c.add_argument("--scenario", default=None, choices=list(SCENARIO_KINDS),
                   help="calibrate on held-out visual-QA traces of this scenario (a model trained on "
                        "samcache.tasks.visual_qa); default: synthetic screenshots shown twice")
    c.add_argument("--traces", type=int, default=2, help="with --scenario: calibration traces (default 2)")
    c.add_argument("--continuation", type=int, default=None, metavar="N",
                   help="reply tokens the calibration's loss covers (default: the whole reply)")
    c.add_argument("--device", default="cpu")
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(func=_calibrate)
    a = sub.add_parser("adapt", help="fine-tune a checkpoint to isolated image attention (exact reuse at any index)",
                       description="Fine-tune an existing Qwen2.5-VL-style checkpoint so that each image's tokens "
                                   "attend only to the image (and the prompt's first token): its KV then does not "
                                   "depend on its context, and samcache reuses it anywhere exactly. Writes the "
                                   "checkpoint, its training record (adapt.json) and its reuse profile.")
    from samcache.tasks.adapt import add_arguments

    add_arguments(a)
    a.set_defaults(func=_adapt)
    s = sub.add_parser("serve", help="serve a model over OpenAI's chat-completions API (streaming, metrics)",
                       description="Serve a checkpoint with samcache's engine behind an OpenAI-compatible HTTP API: "
                                   "POST /v1/chat/completions (streaming or not, images as base64 data URLs), "
                                   "GET /v1/models, /health and /metrics (Prometheus). Requests join the running "
                                   "batch at the next step.")
    from samcache.serve.main import add_arguments as serve_arguments

    serve_arguments(s)
    s.set_defaults(func=_serve)
    r = sub.add_parser("report", help="rebuild report.md and the plots from results.json")
    r.add_argument("results", help="a results.json, or the folder of a run that holds one")
    r.add_argument("--out", help="output folder (default: the folder of results.json)")
    r.set_defaults(func=_report)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
