"""Benchmark of quantize_kv_blocks / dequantize_kv_blocks against the same work composed from torch ops.

The baseline, measured in the same run: gather the blocks, amax, divide, clamp, then
.to(float8_e4m3fn) or round().to(int8); and for the way back q.float() * scale written with
index_put_. On CUDA the table adds GB/s (bytes read + written) and the ratio to a large
device-to-device copy. Usage: python bench/bench_kv_quant.py [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import platform

import torch

import samcache  # noqa: F401  (loads the ops)
from samcache.ops import dequantize_kv_blocks, quantize_kv_blocks
from samcache.ops.kv_quant import QMAX, QTYPES

from timing import best_seconds, copy_bandwidth  # bench/timing.py


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
    print("| op | dtype | qtype | scales | samcache ms | torch ms | speed-up | GB/s | of copy |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        cache = torch.randn(num_blocks, block_size, heads, head_dim, device=dev).to(dtype)
        ids = torch.randperm(num_blocks, device="cpu")[:n]
        dev_ids = ids.to(dev)
        block_bytes = block_size * heads * head_dim * cache.element_size()
        for qtype in QTYPES:
            for per_head in (False, True):
                q, s = quantize_kv_blocks(cache, ids, qtype, per_head)
                moved_q = n * block_bytes + q.numel() + s.numel() * 4  # read the blocks, write q and scales
                t_ours = best_seconds(lambda: quantize_kv_blocks(cache, ids, qtype, per_head), dev, reps)
                t_torch = best_seconds(lambda: torch_quantize(cache, dev_ids, qtype, per_head), dev, reps)
                rows = [("quantize", t_ours, t_torch, moved_q)]
                out = cache.clone()
                t_ours = best_seconds(lambda: dequantize_kv_blocks(q, s, out, ids), dev, reps)
                t_torch = best_seconds(lambda: torch_dequantize(q, s, out, dev_ids, per_head), dev, reps)
                rows.append(("dequantize", t_ours, t_torch, moved_q))
                for name, ours, base, moved in rows:
                    gbs = moved / ours / 1e9
                    print(f"| {name} | {str(dtype)[6:]} | {qtype} | {'head' if per_head else 'block'} | "
                          f"{ours * 1e3:.3f} | {base * 1e3:.3f} | {base / ours:.2f}x | {gbs:.1f} | {gbs / ceiling:.0%} |")


if __name__ == "__main__":
    main()
