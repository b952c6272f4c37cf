"""Benchmark of quantize_kv_blocks / dequantize_kv_blocks against the same work composed from torch ops.

The baseline, measured in the same run: gather the blocks, amax, divide, clamp, then
.to(float8_e4m3fn) or round().to(int8); and for the way back q.float() * scale written with
index_put_. "ms" columns are wall time per call (best of back-to-back calls, GPU synchronised
around them). On CUDA the table adds the median device time of one call between CUDA events
(bench/timing.py device_seconds: the host's launch overhead not counted), and the GB/s (bytes read
+ written) and ratio to a large device-to-device copy computed from it.
Usage: python bench/bench_kv_quant.py [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import platform

import torch

import samcache  # noqa: F401  (loads the ops)
from samcache.ops import dequantize_kv_blocks, quantize_kv_blocks
from samcache.ops.kv_quant import QMAX, QTYPES

from timing import best_seconds, copy_bandwidth, device_seconds  # bench/timing.py


def torch_quantize(cache, ids, qtype, per_head):
    x = cache[ids].float()
    dims = (1, 3) if per_head else (1, 2, 3)
    scale = x.abs().amax(dim=dims) / QMAX[qtype]
    s = scale[:, None, :, None] if per_head else scale[:, None, None, None]
    v = (x / s).clamp(-QMAX[qtype], QMAX[qtype])
    q = v.to(torch.float8_e4m3fn) if qtype == "fp8_e4m3" else v.round().to(torch.int8)
    return q, scale


def torch_dequantize(q, scales, cache, ids, per_head):
    s = scales[:, None, :, None] if per_head else scales[:, None, None, None]
    cache[ids] = (q.float() * s).to(cache.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = args.device
    reps = 5 if args.quick else 20
    num_blocks, block_size, heads, head_dim = (4096, 16, 8, 128) if dev == "cuda" else (1024, 16, 8, 128)
    n = num_blocks // 2
    ceiling = copy_bandwidth(dev, reps)
    where = torch.cuda.get_device_name() if dev == "cuda" else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"kv_quant on {where}: cache [{num_blocks}, {block_size}, {heads}, {head_dim}], {n} blocks per call; "
          f"copy ceiling {ceiling:.1f} GB/s\n")
    cuda = dev == "cuda"
    head = "| op | dtype | qtype | scales | samcache ms | torch ms | speed-up | GB/s | of copy |"
    rule = "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"
    if cuda:
        head += " samcache device ms | torch device ms | device GB/s | device of copy |"
        rule += " ---: | ---: | ---: | ---: |"
    print(head)
    print(rule)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        cache = torch.randn(num_blocks, block_size, heads, head_dim, device=dev).to(dtype)
        ids = torch.randperm(num_blocks, device="cpu")[:n]
        dev_ids = ids.to(dev)
        block_bytes = block_size * heads * head_dim * cache.element_size()
        for qtype in QTYPES:
            for per_head in (False, True):
                q, s = quantize_kv_blocks(cache, ids, qtype, per_head)
                moved_q = n * block_bytes + q.numel() + s.numel() * 4  # read the blocks, write q and scales
                out = cache.clone()
                rows = [
                    ("quantize", lambda: quantize_kv_blocks(cache, ids, qtype, per_head),
                     lambda: torch_quantize(cache, dev_ids, qtype, per_head)),
                    ("dequantize", lambda: dequantize_kv_blocks(q, s, out, ids),
                     lambda: torch_dequantize(q, s, out, dev_ids, per_head)),
                ]
                for name, ours_fn, torch_fn in rows:
                    ours = best_seconds(ours_fn, dev, reps)
                    base = best_seconds(torch_fn, dev, reps)
                    gbs = moved_q / ours / 1e9
                    line = (f"| {name} | {str(dtype)[6:]} | {qtype} | {'head' if per_head else 'block'} | "
                            f"{ours * 1e3:.3f} | {base * 1e3:.3f} | {base / ours:.2f}x | {gbs:.1f} | {gbs / ceiling:.0%} |")
                    if cuda:
                        d_ours, d_base = device_seconds(ours_fn, 2 * reps), device_seconds(torch_fn, reps)
                        d_gbs = moved_q / d_ours / 1e9
                        line += f" {d_ours * 1e3:.3f} | {d_base * 1e3:.3f} | {d_gbs:.0f} | {d_gbs / ceiling:.0%} |"
                    print(line, flush=True)

if __name__ == "__main__":
    main()
