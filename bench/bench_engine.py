"""Engine benchmark: a turn that re-sends known images at new positions, three ways.

The agent has seen 4 screenshots; the next turn shows the same 4 in another order behind a new
system prompt, so the exact prefix breaks right after the first tokens. TTFT of that turn:

- ``full``: no cache at all (every image processed, encoded and prefilled);
- ``prefix``: what vLLM / SGLang do today: exact prefix caching + a ViT-output cache;
- ``samcache``: the images' KV reused at the new positions, ``--recompute`` of it recomputed
  (layer-aware budget from ``engine.calibrate``), fidelity against a full prefill reported.

Each mode has its own engine over the same checkpoint and runs the same prompts; every
repetition uses a new system prompt so no mode gets an exact-prefix hit on the images.

    python bench/bench_engine.py                      # tiny Qwen2.5-VL on CPU (the default)
    python bench/bench_engine.py --family qwen3_vl_moe
    python bench/bench_engine.py --device cuda --preset qwen2.5-vl-7b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import replace

import torch

from samcache.bench.benchmark import MODES
from samcache.engine import SAMcacheEngine, screenshot
from samcache.engine.loading import resolve_device, resolve_dtype
from samcache.engine.metrics import next_token_fidelity
from samcache.engine.prompt import user_message
from samcache.engine.fidelity import reference_prefill
from samcache.hashing import Namespace
from samcache.random_checkpoints import PRESETS, build_preset

def bf16_peak_tflops(n: int = 8192, reps: int = 10) -> float:
    """The measured bf16 matmul rate (TFLOP/s) of this GPU: an n^3 product on random data."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def conversation(system: str, images, question: str):
    return [{"role": "system", "content": system}, user_message(images, question)]


def run(args) -> dict:
    torch.manual_seed(0)
    model = args.model
    if model is None:
        dtype = str(resolve_dtype(args.dtype, resolve_device(args.device))).removeprefix("torch.")
        model = build_preset(args.family, args.preset, pathlib.Path(tempfile.mkdtemp()) / args.family, dtype=dtype)
    h, w = args.image_size
    images = [screenshot(100 + i, (h, w)) for i in range(args.images)]
    # Random weights: reuse at any index, said explicitly (without a profile the engine keeps the order).
    common = dict(device=args.device, dtype=args.dtype, kv_cache_bytes=args.kv_cache_mib << 20, keep_image_order=False)
    modes = {  # the benchmark's modes; "full" is its baseline
        "full": MODES["baseline"].engine_kwargs,
        "prefix": MODES["prefix"].engine_kwargs,
        "samcache": dict(recompute_ratio=args.recompute,
                         **({} if args.calibrate else {"recompute_budget": "uniform"})),
    }
    engines = {name: SAMcacheEngine(model, **common, **kw) for name, kw in modes.items()}
    if args.unfused_layer:  # every engine runs the model's own norm and RoPE modules (an A/B of the kernels)
        for engine in engines.values():
            engine.runner.fused_norms = engine.runner.fused_rope = False
    if args.calibrate:
        engines["samcache"].calibrate(progress=False)
    results = {name: [] for name in modes}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, engine in engines.items():  # the agent's earlier turn: every image seen once
            engine.chat(messages=conversation("You operate a computer.", images, "Here is the screen."),
                        max_new_tokens=1)
        for rep in range(args.warmup + args.reps):
            system = f"Step {rep}: you operate a computer; the screenshots below are the latest, newest last."
            msgs = conversation(system, images[::-1] if rep % 2 == 0 else images[1:] + images[:1],
                                "Which button should be clicked next?")
            for name, engine in engines.items():
                r = engine.chat(messages=msgs, max_new_tokens=args.new_tokens,
                                fidelity=name == "samcache" and rep >= args.warmup, fidelity_tokens=args.fidelity_tokens)
                if rep >= args.warmup:
                    results[name].append(r.metrics)
    sam = engines["samcache"]
    fidelity = [m.fidelity for m in results["samcache"]]
    # Fidelity against recompute: the last turn's prompt at several ratios (same budget policy).
    prompt = sam.build_prompt(msgs)
    ref, ref_logits = reference_prefill(sam.executor, prompt, sam.model_id, Namespace(sam.model_id))
    sam.pool.free_sequence(ref.seq)
    sweep = {}
    for ratio in args.sweep:
        options = replace(sam.request_options(ratio), use_prefix=False, register_prefix=False, store_images=False)
        pre, logits = sam.prefill(prompt, options=options)
        sam.pool.free_sequence(pre.seq)
        sweep[ratio] = next_token_fidelity(ref_logits, logits)[0]
    table = {}
    for name, ms in results.items():
        table[name] = {
            "ttft_ms_median": 1e3 * statistics.median(m.ttft_s for m in ms),
            "ttft_ms_min": 1e3 * min(m.ttft_s for m in ms),
            "prompt_tokens": ms[0].prompt_tokens,
            "prefilled_tokens": ms[0].prefilled_tokens,
            "prefix_reused_tokens": ms[0].prefix_reused_tokens,
            "image_reused_tokens": ms[0].image_reused_tokens,
            "recomputed_tokens": ms[0].recomputed_tokens,
            "vit_calls": ms[0].vit_calls,
        }
    # Prefix mode's arithmetic rate: it prefills every token after the (short) exact prefix, so
    # its TTFT is dense prefill of the language model: GEMMs 2 x weights x rows, attention
    # 4 x heads x head_dim x visible keys per row, every layer (the ViT output is cached).
    runner = engines["prefix"].runner
    weights = sum(p.numel() for layer in runner.layers for p in layer.parameters())
    row = table["prefix"]
    first = row["prompt_tokens"] - row["prefilled_tokens"]
    keys = sum(range(first + 1, row["prompt_tokens"] + 1))
    flops = 2 * weights * row["prefilled_tokens"] + 4 * runner.num_heads * runner.head_dim * runner.num_layers * keys
    row["tflops"] = flops / (row["ttft_ms_median"] / 1e3) / 1e12
    if args.device == "cuda":
        row["of_bf16_peak"] = row["tflops"] / bf16_peak_tflops()
    out = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "date": time.strftime("%Y-%m-%d"),
        "family": sam.family.name,
        "preset": pathlib.Path(args.model).name if args.model else args.preset,
        "dtype": str(sam.dtype),
        "images": f"{args.images} x {w}x{h}",
        "recompute": args.recompute,
        "budget": sam.recompute_budget,
        "recompute_rates": results["samcache"][0].recompute_rates,
        "modes": table,
        "speedup_vs_full": table["full"]["ttft_ms_median"] / table["samcache"]["ttft_ms_median"],
        "speedup_vs_prefix": table["prefix"]["ttft_ms_median"] / table["samcache"]["ttft_ms_median"],
        "kl_by_recompute": sweep,
        "fidelity": {
            "kl_median": statistics.median(f.kl for f in fidelity),
            "top1_agree": sum(f.top1_agree for f in fidelity) / len(fidelity),
            "greedy_agree": statistics.mean(f.greedy_agree for f in fidelity),
            "greedy_tokens": fidelity[0].greedy_tokens,
        },
    }
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: build a random one of --family/--preset)")
    p.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl_moe"])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--image-size", type=int, nargs=2, default=(720, 1280), metavar=("H", "W"))
    p.add_argument("--recompute", type=float, default=0.05)
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false")
    p.add_argument("--sweep", type=float, nargs="*", default=[0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=1)
    p.add_argument("--fidelity-tokens", type=int, default=8)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--unfused-layer", action="store_true",
                   help="the layer loop with the model's own norm and RoPE modules instead of samcache's fused kernels")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = run(args)
    print(f"samcache engine benchmark: {out['family']} ({out['preset']}, {out['dtype']}) on {out['device']}, "
          f"{out['images']} images re-sent at new positions, recompute {out['recompute']:.0%} ({out['budget']}), "
          f"{out['date']}")
    print(f"{'mode':<10}{'TTFT median':>13}{'TTFT min':>11}{'prompt':>8}{'prefilled':>11}{'prefix':>8}"
          f"{'image KV':>10}{'recomp':>8}{'ViT':>5}")
    for name, row in out["modes"].items():
        print(f"{name:<10}{row['ttft_ms_median']:>10.1f} ms{row['ttft_ms_min']:>8.1f} ms{row['prompt_tokens']:>8}"
              f"{row['prefilled_tokens']:>11}{row['prefix_reused_tokens']:>8}{row['image_reused_tokens']:>10}"
              f"{row['recomputed_tokens']:>8}{row['vit_calls']:>5}")
    prefix = out["modes"]["prefix"]
    print(f"prefix mode: {prefix['tflops']:.0f} TFLOP/s"
          + (f" = {prefix['of_bf16_peak']:.0%} of the bf16 matmul peak measured here" if "of_bf16_peak" in prefix else ""))
    f = out["fidelity"]
    print(f"samcache TTFT: {out['speedup_vs_full']:.1f}x lower than full prefill, {out['speedup_vs_prefix']:.1f}x lower "
          f"than prefix+ViT caching; per-layer recompute rates {[round(r, 3) for r in out['recompute_rates']]}")
    print(f"fidelity vs full prefill: next-token KL median {f['kl_median']:.2e} nats, top-1 agreement "
          f"{f['top1_agree']:.0%}, greedy agreement {f['greedy_agree']:.0%} of {f['greedy_tokens']} tokens")
    print("next-token KL by recompute ratio: " + ", ".join(f"{r:g}: {kl:.2e}" for r, kl in out["kl_by_recompute"].items()))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
