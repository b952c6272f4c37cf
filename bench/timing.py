"""Timing helpers shared by the kernel benchmarks (run them as `python bench/<name>.py`).

best_seconds: the fastest per-call wall time after warm-up, synchronising the GPU around each
timing (host overhead included: what a caller waiting for the result sees).
device_seconds: the median GPU time of one call, from CUDA events around it, with the stream kept
busy while the host queues the calls, so the host's launch overhead is not counted.
kernel_seconds: the GPU time of chosen kernels alone (torch.profiler), for ops with several steps.
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


_cycles_per_ms: float | None = None


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles torch.cuda._sleep spins per millisecond (measured once)."""
    global _cycles_per_ms
    if _cycles_per_ms is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-3)
    return _cycles_per_ms


def device_seconds(fn, reps: int = 50, *, warmup: int = 3) -> float:
    """Median GPU time of one call of fn (seconds), between CUDA events recorded on the current
    stream just before and just after it. A torch.cuda._sleep queued first keeps the stream busy
    while the host queues all `reps` calls, so each call's kernels run back to back and the host's
    launch overhead is not counted. A call that itself waits for the GPU (a device -> host round
    trip, a copy from pageable memory) still counts the GPU time spent waiting for the host."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    host = time.perf_counter() - t0  # an upper bound of one call's host time, to size the sleep
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    sleep_ms = min(1000.0, 2.0 + 1.5 * reps * host * 1e3)
    torch.cuda._sleep(int(sleep_ms * _sleep_cycles_per_ms()))
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2] / 1e3


def kernel_seconds(fn, names: tuple[str, ...], calls: int = 5) -> float | None:
    """Per-call GPU time of the kernels whose name contains one of `names`, summed, from the
    profiler's CUDA trace (CUPTI) over `calls` calls; None when the profiler cannot trace CUDA."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        total_us = 0.0
        for e in prof.key_averages():
            if any(n in e.key for n in names):
                total_us += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        return total_us / calls / 1e6 if total_us > 0 else None
    except Exception:  # noqa: BLE001 - a missing CUPTI must not end the benchmark
        return None


def copy_bandwidth(device: str, reps: int = 10) -> float:
    """GB/s of x.copy_(y): ~1 GiB on a GPU, 64 MiB on the CPU."""
    n = (1 << 30) // 4 if device == "cuda" else (64 << 20) // 4
    x, y = torch.empty(n, device=device), torch.ones(n, device=device)
    return 2 * n * 4 / best_seconds(lambda: x.copy_(y), device, reps) / 1e9
