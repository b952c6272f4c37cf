"""Benchmark of samcache's attention (torch.ops.samcache.sparse_attention), each row against a
baseline measured in the same run.

1. A prefill suffix: the last M rows of an N-token sequence (a GUI turn's new screenshot and
   question at the end of its prompt), against ATen's fastest CPU path for it (flash attention in
   two pieces, the cached prefix unmasked and the new block causal, merged by their log-sum-exp)
   and against SDPA with an explicit mask.
2. Sparse rows at 2 / 5 / 20% density (recompute rows), against the same computation composed
   from torch ops (gather the paged KV, boolean mask, SDPA), and as a fraction of full causal
   attention (the issue's bar for the kernels: <= 1.3 x density).
3. Decode: one row in each of 8 sequences, one call, against 8 calls of one sequence each, and
   against reading the same KV bytes as one stream (the memory-bandwidth ceiling of decode).

Usage: python bench/bench_sparse_attention.py [--device cuda] [--keys N] [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from samcache.ops import AttentionMetadata, sparse_attention

from timing import best_seconds  # bench/timing.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--keys", type=int, default=None, help="sequence length (default 5142 CPU, 32768 CUDA)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    n = args.keys or (32768 if dev == "cuda" else (2048 if args.quick else 5142))
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    hq, hkv, d, bs = (28, 4, 128, 16) if dev == "cuda" else (4, 2, 64, 16)
    reps = 5 if dev == "cpu" else 20
    gen = torch.Generator().manual_seed(0)
    nb = -(-n // bs)
    kc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype).to(dev)
    vc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype).to(dev)
    table = torch.randperm(nb, generator=gen).numpy()
    q_all = torch.randn(n, hq, d, generator=gen).to(dtype).to(dev)
    scale = d**-0.5
    g = hq // hkv
    k_full = kc[torch.from_numpy(table).long()].flatten(0, 1)[:n]  # [n, hkv, d]
    v_full = vc[torch.from_numpy(table).long()].flatten(0, 1)[:n]
    k_rep = k_full.repeat_interleave(g, dim=1).transpose(0, 1)[None]  # [1, hq, n, d]
    v_rep = v_full.repeat_interleave(g, dim=1).transpose(0, 1)[None]
    threads = torch.get_num_threads() if dev == "cpu" else "-"
    print(f"sparse_attention benchmark: {dev}, {dtype}, keys={n}, q_heads={hq}, kv_heads={hkv}, head_dim={d}, "
          f"threads={threads}\n")

    def meta_for(rows: np.ndarray) -> AttentionMetadata:
        return AttentionMetadata.build([rows], [table], [n], bs, dev)

    # 1. prefill suffix
    m = min(1446, n // 2)
    rows = np.arange(n - m, n)
    meta = meta_for(rows)
    q = q_all[n - m:]
    pairs = m * (n - m) + m * (m + 1) / 2
    flops = 4 * pairs * hq * d
    op = best_seconds(lambda: sparse_attention(q, meta, kc, vc, scale=scale), dev, reps)
    qq = q.transpose(0, 1)[None]
    print("| suffix rows | keys | samcache op | GFLOP/s | ATen flash, two pieces | SDPA + mask | op vs flash | op vs SDPA |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    if dev == "cpu":
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

        def two_pieces():
            o1, l1 = flash(qq, k_rep[:, :, : n - m], v_rep[:, :, : n - m], 0.0, False, scale=scale)
            o2, l2 = flash(qq, k_rep[:, :, n - m:], v_rep[:, :, n - m:], 0.0, True, scale=scale)
            lse = torch.logaddexp(l1, l2)
            return o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None]

        t_flash = best_seconds(two_pieces, dev, reps)
    else:
        t_flash = float("nan")
    mask = torch.arange(n, device=dev)[None, :] <= torch.from_numpy(rows).to(dev)[:, None]
    t_sdpa = best_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(
        qq, k_rep, v_rep, attn_mask=mask, scale=scale), dev, reps)
    print(f"| {m} | {n} | {op * 1e3:.1f} ms | {flops / op / 1e9:.0f} | {t_flash * 1e3:.1f} ms | {t_sdpa * 1e3:.1f} ms "
          f"| {t_flash / op:.2f}x faster | {t_sdpa / op:.2f}x faster |")

    # 2. sparse rows
    print("\n| path | density | rows | samcache op | torch composition | op vs composition | op / full causal SDPA "
          "| bar (<= 1.3 x density) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    paths = {"cuda cores": "0", "tensor cores": "1"} if dev == "cuda" else {"cpu": "0"}
    full = best_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(
        q_all.transpose(0, 1)[None], k_rep, v_rep, is_causal=True, scale=scale), dev, reps)
    for density in (0.02, 0.05, 0.2):
        nq = int(n * density)
        idx = np.sort(torch.randperm(n, generator=gen)[:nq].numpy())
        meta = meta_for(idx)
        q = q_all[torch.from_numpy(idx).to(dev)]
        idx_t = torch.from_numpy(idx).to(dev)

        def composed():
            k = kc[torch.from_numpy(table).long()].flatten(0, 1)[:n].repeat_interleave(g, dim=1).transpose(0, 1)
            v = vc[torch.from_numpy(table).long()].flatten(0, 1)[:n].repeat_interleave(g, dim=1).transpose(0, 1)
            mask = torch.arange(n, device=dev)[None, :] <= idx_t[:, None]
            return torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)

        t_comp = best_seconds(composed, dev, reps)
        for path, flag in paths.items():
            os.environ["SAMCACHE_SPARSE_ATTENTION_TC"] = flag
            t_op = best_seconds(lambda: sparse_attention(q, meta, kc, vc, scale=scale), dev, reps)
            print(f"| {path} | {density:.0%} | {nq} | {t_op * 1e3:.2f} ms | {t_comp * 1e3:.2f} ms | "
                  f"{t_comp / t_op:.2f}x faster | {t_op / full:.3f} | {1.3 * density:.3f} |")
    print(f"\nfull causal SDPA over all {n} tokens: {full * 1e3:.2f} ms")

    # 3. decode, 8 sequences with pages of their own
    seqs = 8
    kc8 = torch.randn(nb * seqs, bs, hkv, d, generator=gen).to(dtype).to(dev)
    vc8 = torch.randn(nb * seqs, bs, hkv, d, generator=gen).to(dtype).to(dev)
    tables = [np.arange(i * nb, (i + 1) * nb) for i in range(seqs)]
    batch = AttentionMetadata.build([np.array([n - 1])] * seqs, tables, [n] * seqs, bs, dev)
    singles = [AttentionMetadata.build([np.array([n - 1])], [t], [n], bs, dev) for t in tables]
    q8 = torch.randn(seqs, hq, d, generator=gen).to(dtype).to(dev)
    t_batch = best_seconds(lambda: sparse_attention(q8, batch, kc8, vc8, scale=scale), dev, reps)
    t_single = best_seconds(lambda: [sparse_attention(q8[i: i + 1], singles[i], kc8, vc8, scale=scale)
                                     for i in range(seqs)], dev, reps)
    kv_bytes = seqs * n * hkv * d * 2 * torch.finfo(dtype).bits // 8
    # The ceiling: reading the same bytes as one stream (their pages are consecutive here).
    used = seqs * nb
    t_read = best_seconds(lambda: (kc8[:used].sum(), vc8[:used].sum()), dev, reps)
    print(f"\ndecode, {seqs} sequences x {n} keys: one batched call {t_batch * 1e3:.2f} ms "
          f"({kv_bytes / t_batch / 1e9:.1f} GB/s of KV), {seqs} calls {t_single * 1e3:.2f} ms "
          f"({t_single / t_batch:.2f}x); reading the same KV as one stream (torch sum): {t_read * 1e3:.2f} ms "
          f"({kv_bytes / t_read / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
