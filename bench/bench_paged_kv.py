"""Benchmark of paged_write / paged_gather / swap_blocks against the same copies composed from torch ops.

    .venv/bin/python bench/bench_paged_kv.py                 # CPU
    .venv/bin/python bench/bench_paged_kv.py --device cuda   # GPU: adds device time, GB/s and the copy ceiling

Each row times both versions in the same run and prints a markdown table. "wall" is the best
per-call time of back-to-back calls with the GPU synchronised around them (host overhead
included); "speed-up" is torch / samcache wall time. On CUDA, "device" is the median GPU time of
one call between CUDA events, with the stream kept busy while the host queues the calls
(bench/timing.py device_seconds), and GB/s (bytes read + written) and "of ceiling" come from it;
the ceiling is a measured large copy of the same kind (device->device `x.copy_(y)` of ~1 GiB, or
device<->pinned host for the tiering swaps), also counted as read + written. swap_blocks rows
also show the path it took and, for comparison, the other path forced (SAMCACHE_SWAP_BLOCKS).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

import samcache  # noqa: F401  (loads the ops)
from samcache.ops import paged_gather, paged_write, swap_blocks

from timing import best_seconds, device_seconds  # bench/timing.py


def copy_ceiling(kind: str, repeat: int) -> float:
    """GB/s (read + written) of a ~1 GiB copy: device->device, device->pinned or pinned->device."""
    n = (1 << 30) // 2
    gpu = torch.empty(n, dtype=torch.float16, device="cuda")
    other = torch.empty_like(gpu) if kind == "d2d" else torch.empty(n, dtype=torch.float16).pin_memory()
    dst, src = {"d2d": (other, gpu), "d2h": (other, gpu), "h2d": (gpu, other)}[kind]
    seconds = best_seconds(lambda: dst.copy_(src, non_blocking=True), "cuda", repeat, warmup=3)
    del gpu, other
    return 2 * (1 << 30) / seconds / 1e9


def cases(device: str, dtype: torch.dtype, quick: bool):
    """(op, case, samcache fn, torch fn, bytes read + written, ceiling kind, swap path) for each row."""
    g = torch.Generator().manual_seed(0)
    heads, dim, block_size = 8, 128, 16
    num_blocks = 512 if quick else 2048
    shape = (num_blocks, block_size, heads, dim)
    key_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    value_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    row_bytes = heads * dim * key_cache.element_size()
    block_bytes = block_size * row_bytes
    flat_k, flat_v = key_cache.view(-1, heads, dim), value_cache.view(-1, heads, dim)

    for label, n in [("decode, 64 tokens", 64), ("prefill, 4096 tokens", 4096)]:
        key = torch.randn(n, heads, dim, generator=g).to(dtype).to(device)
        value = torch.randn(n, heads, dim, generator=g).to(dtype).to(device)
        if n <= 64:  # one token of each of n sequences: scattered slots
            slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
        else:  # a prompt: consecutive slots in shuffled blocks
            blocks = torch.randperm(num_blocks, generator=g)[: n // block_size]
            slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
        slots = slots.to(device)

        def ours(key=key, value=value, slots=slots):
            paged_write(key, value, key_cache, value_cache, slots)

        def composed(key=key, value=value, slots=slots):
            flat_k.index_copy_(0, slots, key)
            flat_v.index_copy_(0, slots, value)

        yield "paged_write", label, ours, composed, 2 * 2 * n * row_bytes, "d2d", None

    for label, n in [("512 tokens", 512), ("8192 tokens", 8192)]:
        table = torch.randperm(num_blocks, generator=g)[: -(-n // block_size)].to(torch.int32)
        table_long = table.long().to(device)

        def ours(table=table, n=n):
            paged_gather(key_cache, value_cache, table, n)

        def composed(table_long=table_long, n=n):
            key_cache[table_long].flatten(0, 1)[:n]
            value_cache[table_long].flatten(0, 1)[:n]

        yield "paged_gather", label + " (CPU table)", ours, composed, 2 * 2 * n * row_bytes, "d2d", None

    host_kinds = [("cpu", "cpu", "d2d")] if device == "cpu" else [
        ("cuda", "cuda", "d2d"), ("cuda", "pinned", "d2h"), ("pinned", "cuda", "h2d")]
    layouts = ["scattered", "runs of 16"] + ([] if device == "cpu" else ["runs of 64"])
    for src_kind, dst_kind, ceiling in host_kinds:
        def make(kind, blocks):
            t = torch.randn((blocks, *shape[1:]), generator=g).to(dtype)
            return t.pin_memory() if kind == "pinned" else t.to(kind)

        src, dst = make(src_kind, num_blocks), make(dst_kind, num_blocks)
        for layout in layouts:
            n = 256
            if layout == "scattered":
                pairs = torch.stack([torch.randperm(num_blocks, generator=g)[:n], torch.randperm(num_blocks, generator=g)[:n]], 1)
            else:
                run = int(layout.split()[-1])
                starts_s = torch.randperm(num_blocks // run, generator=g)[: n // run] * run
                starts_d = torch.randperm(num_blocks // run, generator=g)[: n // run] * run
                pairs = torch.stack([(starts_s[:, None] + torch.arange(run)).flatten(), (starts_d[:, None] + torch.arange(run)).flatten()], 1)
            src_ids, dst_ids = pairs[:, 0].to(src.device), pairs[:, 1].to(dst.device)

            def ours(src=src, dst=dst, pairs=pairs):
                swap_blocks(src, dst, pairs)

            def composed(src=src, dst=dst, src_ids=src_ids, dst_ids=dst_ids):
                dst[dst_ids] = src[src_ids].to(dst.device, non_blocking=True)

            label = f"{src_kind}->{dst_kind}, {n} blocks {layout}"
            if device == "cpu":
                yield "swap_blocks", label, ours, composed, 2 * n * block_bytes, ceiling, None
                continue
            # The path the op picks (kernel unless a host side has runs of >= 1 MiB), then the other one.
            run_bytes = block_bytes * (1 if layout == "scattered" else int(layout.split()[-1]))
            auto = "memcpy" if "cpu" in (src.device.type, dst.device.type) and run_bytes >= 1 << 20 else "kernel"
            other = "memcpy" if auto == "kernel" else "kernel"
            yield "swap_blocks", label, ours, composed, 2 * n * block_bytes, ceiling, f"{auto} (auto)"
            yield "swap_blocks", label, ours, None, 2 * n * block_bytes, ceiling, other


@contextlib.contextmanager
def swap_path(path):
    """SAMCACHE_SWAP_BLOCKS=<path> for a forced row, unset for the op's own choice."""
    old = os.environ.pop("SAMCACHE_SWAP_BLOCKS", None)
    if path is not None and "(auto)" not in path:
        os.environ["SAMCACHE_SWAP_BLOCKS"] = path
    try:
        yield
    finally:
        os.environ.pop("SAMCACHE_SWAP_BLOCKS", None)
        if old is not None:
            os.environ["SAMCACHE_SWAP_BLOCKS"] = old


def wall_seconds(fn, device: str, repeat: int) -> float:
    """CPU: best of `repeat` timings of 3 calls. GPU: enough back-to-back calls per timing for ~2 ms
    (fewer timings for calls over 1 ms), so a 4 µs copy is not timed against a synchronisation."""
    if device == "cpu":
        return best_seconds(fn, device, repeat, warmup=3, inner=3)
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    inner = max(1, min(20, int(2e-3 / max(one, 1e-7))))
    return best_seconds(fn, device, repeat if one < 1e-3 else min(repeat, 5), warmup=2, inner=inner)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="smaller caches, fewer repeats")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    repeat = 5 if args.quick else args.repeat
    cuda = args.device == "cuda"
    ceilings = {k: copy_ceiling(k, repeat) for k in ["d2d", "d2h", "h2d"]} if cuda else {}

    print(f"device {args.device}, {args.dtype}, heads 8, head_dim 128, block_size 16, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    if cuda:
        print("copy ceilings (GB/s, read + written): " + ", ".join(f"{k} {v:.0f}" for k, v in ceilings.items()))
    head = "| op | case | samcache wall µs | torch wall µs | speed-up |"
    rule = "| --- | --- | ---: | ---: | ---: |"
    if cuda:
        head += " samcache device µs | torch device µs | samcache GB/s | of copy ceiling |"
        rule += " ---: | ---: | ---: | ---: |"
    print()
    print(head)
    print(rule)
    torch_times: dict[str, tuple[float, float]] = {}
    for op, label, ours, composed, nbytes, ceiling, path in cases(args.device, dtype, args.quick):
        key = f"{op} {label}"
        if composed is not None:  # the torch version once per case (forced-path rows reuse it)
            t_torch = wall_seconds(composed, args.device, repeat)
            d_torch = device_seconds(composed, 10 if t_torch > 1e-3 else 50) if cuda else 0.0
            torch_times[key] = (t_torch, d_torch)
        t_torch, d_torch = torch_times[key]
        with swap_path(path):
            t_ours = wall_seconds(ours, args.device, repeat)
            d_ours = device_seconds(ours, 10 if t_ours > 1e-3 else 50) if cuda else 0.0
        case = label if path is None else f"{label}, {path}"
        line = f"| {op} | {case} | {t_ours * 1e6:.1f} | {t_torch * 1e6:.1f} | {t_torch / t_ours:.2f}x |"
        if cuda:
            gbs = nbytes / d_ours / 1e9
            line += (f" {d_ours * 1e6:.1f} | {d_torch * 1e6:.1f} | {gbs:.0f} |"
                     f" {gbs / ceilings[ceiling]:.0%} ({ceiling}) |")
        print(line, flush=True)

if __name__ == "__main__":
    main()
