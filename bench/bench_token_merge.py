"""Benchmark of token_merge against the same merge composed from torch ops (index_add_).

The baseline, measured in the same run: weighted rows index_add_-ed into an [N, D] float32
buffer, the weights likewise, anchors found with nonzero, then divided and cast. Merge plans
keep 50%, 25% and one anchor of N visual tokens. On CUDA the table adds GB/s (hidden read +
merged written) and the ratio to a large device-to-device copy.
Usage: python bench/bench_token_merge.py [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import platform

import torch

import samcache  # noqa: F401  (loads the ops)
from samcache.ops import token_merge

from timing import best_seconds, copy_bandwidth  # bench/timing.py


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
    print("| N x D | dtype | kept | samcache ms | torch ms | speed-up | GB/s | of copy |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for n, d in shapes:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            hidden = torch.randn(n, d, device=dev).to(dtype)
            for keep, label in ((0.5, "50%"), (0.25, "25%"), (0.0, "1 anchor")):
                target, weight = merge_plan(n, keep, dev)
                m = int((target == torch.arange(n, device=dev)).sum())
                t_ours = best_seconds(lambda: token_merge(hidden, target, weight), dev, reps)
                t_torch = best_seconds(lambda: torch_token_merge(hidden, target, weight), dev, reps)
                moved = (n + m) * d * hidden.element_size() + n * 12
                gbs = moved / t_ours / 1e9
                print(f"| {n} x {d} | {str(dtype)[6:]} | {label} | {t_ours * 1e3:.3f} | {t_torch * 1e3:.3f} | "
                      f"{t_torch / t_ours:.2f}x | {gbs:.1f} | {gbs / ceiling:.0%} |")


if __name__ == "__main__":
    main()
