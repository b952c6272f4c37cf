"""Benchmark of token_merge against the same merge composed from torch ops (index_add_).

The baseline, measured in the same run: weighted rows index_add_-ed into an [N, D] float32
buffer, the weights likewise, anchors found with nonzero, then divided and cast. Merge plans
keep 50%, 25% and one anchor of N visual tokens. "ms" columns are wall time per call (GPU
synchronised around each call). On CUDA the table adds GB/s (hidden read + merged written) and
the ratio to a large device-to-device copy for: the whole op's device time (CUDA events around one
call, bench/timing.py device_seconds; token_merge waits once for the device -> host copy of the
anchor count, so this includes that round trip), and the reduce kernels alone (merge_chunks +
merge_partials, from torch.profiler, on the large shape; "n/a" elsewhere or without CUPTI).
Usage: python bench/bench_token_merge.py [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import platform

import torch

import samcache  # noqa: F401  (loads the ops)
from samcache.ops import token_merge

from timing import best_seconds, copy_bandwidth, device_seconds, kernel_seconds  # bench/timing.py


def torch_token_merge(hidden, target, weight):
    n, d = hidden.shape
    num = torch.zeros(n, d, device=hidden.device).index_add_(0, target, hidden.float() * weight[:, None])
    den = torch.zeros(n, device=hidden.device).index_add_(0, target, weight)
    kept = (target == torch.arange(n, device=hidden.device)).nonzero().squeeze(1)
    return (num[kept] / den[kept, None]).to(hidden.dtype), kept


def merge_plan(n: int, keep: float, device: str):
    """Anchors spread evenly; every other token merges into a random anchor."""
    m = max(1, int(n * keep))
    anchors = torch.randperm(n)[:m].sort().values
    target = anchors[torch.randint(0, m, (n,))]
    target[anchors] = anchors
    return target.to(device), (torch.rand(n) + 0.01).to(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = args.device
    reps = 5 if args.quick else 20
    shapes = [(16384, 3584), (4096, 2048)] if dev == "cuda" else [(4096, 2048), (1196, 3584)]
    ceiling = copy_bandwidth(dev, reps)
    where = torch.cuda.get_device_name() if dev == "cuda" else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"token_merge on {where}; copy ceiling {ceiling:.1f} GB/s\n")
    cuda = dev == "cuda"
    head = "| N x D | dtype | kept | samcache ms | torch ms | speed-up | GB/s | of copy |"
    rule = "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"
    if cuda:
        head += " device ms | torch device ms | device of copy | reduce ms | reduce GB/s | reduce of copy |"
        rule += " ---: | ---: | ---: | ---: | ---: | ---: |"
    print(head)
    print(rule)
    for n, d in shapes:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            hidden = torch.randn(n, d, device=dev).to(dtype)
            for keep, label in ((0.5, "50%"), (0.25, "25%"), (0.0, "1 anchor")):
                target, weight = merge_plan(n, keep, dev)
                m = int((target == torch.arange(n, device=dev)).sum())
                ours_fn = lambda: token_merge(hidden, target, weight)  # noqa: E731
                torch_fn = lambda: torch_token_merge(hidden, target, weight)  # noqa: E731
                t_ours = best_seconds(ours_fn, dev, reps)
                t_torch = best_seconds(torch_fn, dev, reps)
                moved = (n + m) * d * hidden.element_size() + n * 12
                gbs = moved / t_ours / 1e9
                line = (f"| {n} x {d} | {str(dtype)[6:]} | {label} | {t_ours * 1e3:.3f} | {t_torch * 1e3:.3f} | "
                        f"{t_torch / t_ours:.2f}x | {gbs:.1f} | {gbs / ceiling:.0%} |")
                if cuda:
                    d_ours, d_torch = device_seconds(ours_fn, reps), device_seconds(torch_fn, reps)
                    # The profiler only on the large shape (it costs a fraction of a second per row).
                    k = kernel_seconds(ours_fn, ("merge_chunks_kernel", "merge_partials_kernel")) \
                        if (n, d) == shapes[0] else None
                    line += f" {d_ours * 1e3:.3f} | {d_torch * 1e3:.3f} | {moved / d_ours / 1e9 / ceiling:.0%} |"
                    line += " n/a | n/a | n/a |" if k is None else (
                        f" {k * 1e3:.3f} | {moved / k / 1e9:.0f} | {moved / k / 1e9 / ceiling:.0%} |")
                print(line, flush=True)

if __name__ == "__main__":
    main()
