"""Where one engine turn spends its time: a warm samcache reuse turn and a prefix-mode turn of
bench_engine's workload (4 known screenshots re-sent in another order) under torch.profiler.

Prints, per mode: TTFT, the CUDA API calls that launch, copy or synchronise, the operators by
self device time and by self host time, and the host's Python functions by cumulative time
(cProfile, one more turn).

    python bench/profile_engine.py --device cuda --model <checkpoint> --dtype bfloat16
    python bench/profile_engine.py                      # tiny Qwen2.5-VL on the CPU
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import pathlib
import tempfile
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from samcache.engine import SAMcacheEngine, screenshot
from samcache.engine.prompt import user_message
from samcache.random_checkpoints import build_preset


def conversation(system: str, images, question: str):
    return [{"role": "system", "content": system}, user_message(images, question)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: a tiny random Qwen2.5-VL)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-cache-mib", type=int, default=4096)
    p.add_argument("--rows", type=int, default=25, help="operators listed per mode")
    args = p.parse_args()
    model = args.model or build_preset("qwen2_5_vl", "tiny", pathlib.Path(tempfile.mkdtemp()) / "m")
    cuda = args.device == "cuda"
    images = [screenshot(100 + i, (720, 1280)) for i in range(4)]
    warnings.simplefilter("ignore")
    modes = {"samcache": dict(recompute_ratio=0.05, recompute_budget="uniform"),
             "prefix": dict(image_kv_cache=False)}
    for name, kwargs in modes.items():
        engine = SAMcacheEngine(model, device=args.device, dtype=args.dtype, kv_cache_bytes=args.kv_cache_mib << 20,
                                keep_image_order=False,
                                **kwargs)
        engine.chat(messages=conversation("You operate a computer.", images, "Here is the screen."), max_new_tokens=1)

        def turn(r: int, engine=engine):
            shown = images[::-1] if r % 2 == 0 else images[1:] + images[:1]
            return engine.chat(messages=conversation(f"Step {r}: go.", shown, "Next?"), max_new_tokens=1).metrics

        for r in range(3):  # warm: every shape of the timed turn seen
            turn(r)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            metrics = turn(3)
        calls = collections.Counter(ev.name for ev in prof.events())
        api = {k: v for k, v in sorted(calls.items())
               if k.startswith("cuda") and any(s in k for s in ("Launch", "Memcpy", "Synchronize"))}
        print(f"\n== {name}: TTFT {metrics.ttft_s * 1e3:.1f} ms, {metrics.prompt_tokens} prompt tokens, "
              f"{metrics.prefilled_tokens} prefilled, {metrics.recomputed_tokens} recomputed")
        print(f"CUDA API calls: {api}")
        averages = prof.key_averages()
        if cuda:
            print(averages.table(sort_by="self_cuda_time_total", row_limit=args.rows))
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        # The host's Python: where a turn's time goes while the GPU waits for work.
        stats = cProfile.Profile()
        stats.runcall(turn, 4)
        out = io.StringIO()
        pstats.Stats(stats, stream=out).sort_stats("cumulative").print_stats(args.rows)
        print("\n".join(line[:160] for line in out.getvalue().splitlines() if line.strip()))
        del engine
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
