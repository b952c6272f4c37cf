"""Benchmark of block-sparse recompute attention (torch.ops.samcache.sparse_attention).

Two ratios, each measured in the same run:
- vs the same computation composed from torch ops (gather the paged KV, boolean mask, SDPA):
  the op must not be slower;
- vs full causal attention over the same keys with torch SDPA (every token a query): the
  issue's bar is time(sparse at 5% density) <= 1.3 x 0.05 x time(full causal), i.e. the cost
  falls in proportion to the recompute ratio.
Usage: python bench/bench_sparse_attention.py [--device cuda] [--keys N] [--quick]
"""

from __future__ import annotations

import argparse
import os

import torch

from samcache.ops import sparse_attention

from timing import best_seconds  # bench/timing.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--keys", type=int, default=None, help="sequence length (default 8192 CPU, 32768 CUDA)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = args.device
    n = args.keys or (32768 if dev == "cuda" else (2048 if args.quick else 8192))
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    hq, hkv, d, bs = (28, 4, 128, 16) if dev == "cuda" else (8, 2, 64, 16)
    reps = 5 if dev == "cpu" else 20
    gen = torch.Generator().manual_seed(0)
    nb = n // bs
    kc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype).to(dev)
    vc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype).to(dev)
    table = torch.randperm(nb, generator=gen).to(torch.int32).to(dev)
    q_all = torch.randn(n, hq, d, generator=gen).to(dtype).to(dev)
    scale = d**-0.5
    print(f"sparse_attention benchmark: {dev}, {dtype}, keys={n}, q_heads={hq}, kv_heads={hkv}, head_dim={d}\n")
    print("| path | density | queries | samcache op | torch composition | op vs composition | op / full causal SDPA | bar (<= 1.3 x density) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    # On a GPU both CUDA kernels are timed: CUDA cores, and tensor cores (SAMCACHE_SPARSE_ATTENTION_TC=1).
    paths = {"cuda cores": "0", "tensor cores": "1"} if dev == "cuda" else {"cpu": "0"}

    k_full = kc[table.long()].flatten(0, 1)[:n].transpose(0, 1)
    v_full = vc[table.long()].flatten(0, 1)[:n].transpose(0, 1)
    full = best_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(
        q_all.transpose(0, 1), k_full, v_full, is_causal=True, scale=scale, enable_gqa=True), dev, reps)

    for density in (0.02, 0.05, 0.2):
        nq = int(n * density)
        q_index = torch.randperm(n, generator=gen)[:nq].sort().values.to(dev)
        q = q_all[q_index]

        def op():
            return sparse_attention(q, q_index, kc, vc, table, n, scale=scale)

        def composed():
            k = kc[table.long()].flatten(0, 1)[:n].transpose(0, 1)
            v = vc[table.long()].flatten(0, 1)[:n].transpose(0, 1)
            mask = torch.arange(n, device=dev)[None, :] <= q_index[:, None]
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=True)

        t_comp = best_seconds(composed, dev, reps)
        for path, flag in paths.items():
            os.environ["SAMCACHE_SPARSE_ATTENTION_TC"] = flag
            t_op = best_seconds(op, dev, reps)
            print(f"| {path} | {density:.0%} | {nq} | {t_op * 1e3:.2f} ms | {t_comp * 1e3:.2f} ms | "
                  f"{t_comp / t_op:.2f}x faster | {t_op / full:.3f} | {1.3 * density:.3f} |")
    print(f"\nfull causal SDPA over all {n} tokens: {full * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
