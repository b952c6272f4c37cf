"""Timing helpers shared by the kernel benchmarks (run them as `python bench/<name>.py`).

best_seconds: the fastest per-call time after warm-up, synchronising the GPU around each timing.
copy_bandwidth: GB/s (bytes read + written) of one large copy on a device, the practical
ceiling the memory-bound kernels are compared with (METHOD.md of the device tool).
"""

from __future__ import annotations

import time

import torch


def best_seconds(fn, device: str, reps: int, *, warmup: int = 2, inner: int = 1) -> float:
    """Fastest of `reps` timings of `inner` back-to-back calls of fn, per call, in seconds."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def copy_bandwidth(device: str, reps: int = 10) -> float:
    """GB/s of x.copy_(y): ~1 GiB on a GPU, 64 MiB on the CPU."""
    n = (1 << 30) // 4 if device == "cuda" else (64 << 20) // 4
    x, y = torch.empty(n, device=device), torch.ones(n, device=device)
    return 2 * n * 4 / best_seconds(lambda: x.copy_(y), device, reps) / 1e9
