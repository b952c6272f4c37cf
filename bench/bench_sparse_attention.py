"""Benchmark of samcache's attention (samcache.ops.sparse_attention), each row against a
baseline measured in the same run.

1. A prefill suffix: the last M rows of an N-token sequence (a GUI turn's new screenshot and
   question at the end of its prompt). CPU: against ATen's fastest CPU path for it (flash
   attention in two pieces, merged by their log-sum-exp) and SDPA with a mask. CUDA: the default
   dispatch (torch's flash attention over the keys gathered from the pages) against torch's flash
   attention on the same rows over contiguous keys, SDPA with a mask, and the other backends.
2. Sparse rows at 2 / 5 / 20% density (recompute rows), against the same computation composed
   from torch ops (gather the paged KV, boolean mask, SDPA), and as a fraction of full causal
   attention over all keys (CUDA: torch's flash attention; bar at 5%: <= 0.15). On CUDA every
   backend is timed, and at 5% a few Triton launch configurations.
3. Decode: one row in each of 8 sequences, one call, against 8 calls of one sequence each, and
   against reading the same KV bytes as one stream (the memory-bandwidth ceiling of decode).

Usage: python bench/bench_sparse_attention.py [--device cuda] [--keys N] [--quick] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

import numpy as np
import torch

from samcache.ops import AttentionMetadata, sparse_attention
from samcache.ops.sparse_attention import BACKEND_CALLS

from timing import best_seconds  # bench/timing.py


def flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """torch's flash attention on contiguous keys (bottom-right causal), the CUDA baseline."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]


def ran(backend_before: dict) -> str:
    """The backend(s) the timed calls took (from sparse_attention's counters)."""
    return "+".join(sorted(k for k, v in BACKEND_CALLS.items() if v > backend_before.get(k, 0))) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--keys", type=int, default=None, help="sequence length (default 5142 CPU, 32768 CUDA)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the measurements here")
    ap.add_argument("--cases", default="suffix,sparse,decode", help="which parts to run (comma-separated)")
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    if not cases <= {"suffix", "sparse", "decode"}:
        ap.error(f"--cases takes suffix, sparse and decode, got {sorted(cases - {'suffix', 'sparse', 'decode'})}")
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    cuda = dev == "cuda"
    n = args.keys or (32768 if cuda else (2048 if args.quick else 5142))
    dtype = torch.bfloat16 if cuda else torch.float32
    hq, hkv, d, bs = (28, 4, 128, 16) if cuda else (4, 2, 64, 16)
    reps = 5 if dev == "cpu" else 20
    inner = 3 if cuda else 1
    results: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                     "keys": n, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": str(dtype)}

    def timed(fn) -> float:
        return best_seconds(fn, dev, reps, inner=inner)

    gen = torch.Generator().manual_seed(0)
    nb = -(-n // bs)
    kc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype).to(dev)
    vc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype).to(dev)
    table = torch.randperm(nb, generator=gen).numpy()
    q_all = torch.randn(n, hq, d, generator=gen).to(dtype).to(dev)
    scale = d**-0.5
    g = hq // hkv
    k_full = kc[torch.from_numpy(table).long()].flatten(0, 1)[:n].contiguous()  # [n, hkv, d]
    v_full = vc[torch.from_numpy(table).long()].flatten(0, 1)[:n].contiguous()
    k_rep = k_full.repeat_interleave(g, dim=1).transpose(0, 1)[None]  # [1, hq, n, d]
    v_rep = v_full.repeat_interleave(g, dim=1).transpose(0, 1)[None]
    threads = torch.get_num_threads() if dev == "cpu" else "-"
    print(f"sparse_attention benchmark: {results['device']}, torch {torch.__version__}, {dtype}, keys={n}, "
          f"q_heads={hq}, kv_heads={hkv}, head_dim={d}, threads={threads}\n")

    def meta_for(rows: np.ndarray) -> AttentionMetadata:
        return AttentionMetadata.build([rows], [table], [n], bs, dev)

    def i32(*values):
        return torch.tensor(values, dtype=torch.int32, device=dev)

    ctx = SimpleNamespace(dev=dev, cuda=cuda, n=n, nb=nb, bs=bs, hq=hq, hkv=hkv, d=d, g=g, dtype=dtype, scale=scale,
                          timed=timed, i32=i32, gen=gen, q_all=q_all, kc=kc, vc=vc, k_full=k_full, v_full=v_full,
                          k_rep=k_rep, v_rep=v_rep, table=table, meta_for=meta_for)
    if "suffix" in cases:
        results["suffix"] = bench_suffix(ctx)
    if "sparse" in cases:
        results.update(bench_sparse(ctx))
    if "decode" in cases:
        results["decode"] = bench_decode(ctx)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def bench_suffix(c) -> dict:
    """1. prefill suffix"""
    dev, cuda, n, hq, d, scale, timed, i32 = c.dev, c.cuda, c.n, c.hq, c.d, c.scale, c.timed, c.i32
    q_all, kc, vc, k_full, v_full, k_rep, v_rep = c.q_all, c.kc, c.vc, c.k_full, c.v_full, c.k_rep, c.v_rep
    meta_for = c.meta_for
    m = min(1446, n // 2)
    rows = np.arange(n - m, n)
    meta = meta_for(rows)
    q = q_all[n - m:].contiguous()
    pairs = m * (n - m) + m * (m + 1) / 2
    flops = 4 * pairs * hq * d
    before = dict(BACKEND_CALLS)
    op = timed(lambda: sparse_attention(q, meta, kc, vc, scale=scale))
    path = ran(before)
    qq = q.transpose(0, 1)[None]
    mask = torch.arange(n, device=dev)[None, :] <= torch.from_numpy(rows).to(dev)[:, None]
    t_sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qq, k_rep, v_rep, attn_mask=mask,
                                                                            scale=scale))
    suffix = {"rows": m, "op_ms": op * 1e3, "op_path": path, "op_tflops": flops / op / 1e12, "sdpa_mask_ms": t_sdpa * 1e3}
    if cuda:
        t_flash = timed(lambda: flash_varlen(q, k_full, v_full, i32(0, m), i32(0, n), m, n, scale))
        suffix["flash_same_rows_ms"] = t_flash * 1e3
        suffix["op_vs_flash"] = op / t_flash
        others = {}
        for backend in ("triton", "native"):
            others[backend] = timed(lambda: sparse_attention(q, meta, kc, vc, scale=scale, backend=backend)) * 1e3
        suffix["backends_ms"] = others
        print("| suffix rows | keys | samcache (path) | TFLOP/s | torch flash, same rows | SDPA + mask | samcache / flash "
              "| bar | triton | native CUDA |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print(f"| {m} | {n} | {op * 1e3:.2f} ms ({path}) | {flops / op / 1e12:.0f} | {t_flash * 1e3:.2f} ms "
              f"| {t_sdpa * 1e3:.2f} ms | {op / t_flash:.2f} | <= 1.2 | {others['triton']:.2f} ms | {others['native']:.2f} ms |")
    else:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

        def two_pieces():
            o1, l1 = flash(qq, k_rep[:, :, : n - m], v_rep[:, :, : n - m], 0.0, False, scale=scale)
            o2, l2 = flash(qq, k_rep[:, :, n - m:], v_rep[:, :, n - m:], 0.0, True, scale=scale)
            lse = torch.logaddexp(l1, l2)
            return o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None]

        t_flash = timed(two_pieces)
        suffix["aten_flash_two_pieces_ms"] = t_flash * 1e3
        print("| suffix rows | keys | samcache op | GFLOP/s | ATen flash, two pieces | SDPA + mask | op vs flash | op vs SDPA |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print(f"| {m} | {n} | {op * 1e3:.1f} ms | {flops / op / 1e9:.0f} | {t_flash * 1e3:.1f} ms | {t_sdpa * 1e3:.1f} ms "
              f"| {t_flash / op:.2f}x faster | {t_sdpa / op:.2f}x faster |")
    return suffix


def bench_sparse(c) -> dict:
    """2. sparse rows"""
    dev, cuda, n, g, scale, timed, i32, gen = c.dev, c.cuda, c.n, c.g, c.scale, c.timed, c.i32, c.gen
    q_all, kc, vc, k_full, v_full, k_rep, v_rep, table = c.q_all, c.kc, c.vc, c.k_full, c.v_full, c.k_rep, c.v_rep, c.table
    meta_for = c.meta_for
    results = {}
    full_sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
        q_all.transpose(0, 1)[None], k_rep, v_rep, is_causal=True, scale=scale))
    full = full_sdpa
    if cuda:
        full = timed(lambda: flash_varlen(q_all, k_full, v_full, i32(0, n), i32(0, n), n, n, scale))
    results["full_causal_ms"] = {"flash" if cuda else "sdpa": full * 1e3, "sdpa": full_sdpa * 1e3}
    paths = {"auto": {}, "native": {"SAMCACHE_SPARSE_ATTENTION_TC": "0"}, "native tensor cores": {
        "SAMCACHE_SPARSE_ATTENTION_TC": "1"}} if cuda else {"cpu": {}}
    print(f"\n| path | density | rows | samcache op | torch composition | op vs composition | op / full causal "
          f"{'flash' if cuda else 'SDPA'} | bar |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    sparse = []
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

        t_comp = timed(composed)
        for label, env in paths.items():
            os.environ.update(env)
            backend = "native" if label.startswith("native") else None
            before = dict(BACKEND_CALLS)
            t_op = timed(lambda: sparse_attention(q, meta, kc, vc, scale=scale, backend=backend))
            how = ran(before)
            bar = "<= 0.15" if cuda and density == 0.05 else "-"
            print(f"| {label} ({how}) | {density:.0%} | {nq} | {t_op * 1e3:.2f} ms | {t_comp * 1e3:.2f} ms | "
                  f"{t_comp / t_op:.2f}x faster | {t_op / full:.3f} | {bar} |")
            sparse.append({"path": label, "ran": how, "density": density, "rows": nq, "op_ms": t_op * 1e3,
                           "composed_ms": t_comp * 1e3, "of_full_causal": t_op / full})
        os.environ.pop("SAMCACHE_SPARSE_ATTENTION_TC", None)
    results["sparse"] = sparse
    print(f"\nfull causal attention over all {n} tokens: {full * 1e3:.2f} ms"
          + (f" (torch flash), SDPA {full_sdpa * 1e3:.2f} ms" if cuda else " (SDPA)"))

    if cuda:  # Triton launch configurations at 5% (the defaults are the first row)
        from samcache.ops import attention_triton

        nq = int(n * 0.05)
        idx = np.sort(torch.randperm(n, generator=gen)[:nq].numpy())
        meta = meta_for(idx)
        q = q_all[torch.from_numpy(idx).to(dev)]
        sweep = []
        print("\n| Triton config at 5% | ms | / full causal flash |")
        print("| --- | ---: | ---: |")
        for config in ({}, {"splits": 1}, {"splits": 2}, {"splits": 4}, {"block_n": 32}, {"block_n": 128, "num_stages": 2},
                       {"num_warps": 4}, {"num_stages": 2}, {"num_stages": 4}, {"block_m": 64}):
            try:
                t = timed(lambda: attention_triton.paged_attention(q, meta, kc, vc, scale=scale, window=-1,
                                                                   logit_cap=0.0, max_rows_per_seq=nq, config=config))
            except Exception as e:  # noqa: BLE001 - a config the compiler refuses is a result too
                print(f"| {config} | failed: {type(e).__name__}: {str(e).splitlines()[0][:80]} | |")
                continue
            sweep.append({"config": config, "ms": t * 1e3})
            print(f"| {config or 'default'} | {t * 1e3:.3f} | {t / full:.3f} |")
        results["triton_sweep_5pct"] = sweep
    return results


def bench_decode(c) -> dict:
    """3. decode, 8 sequences with pages of their own"""
    dev, cuda, n, nb, bs, hq, hkv, d, dtype, scale, timed, gen = (c.dev, c.cuda, c.n, c.nb, c.bs, c.hq, c.hkv, c.d, c.dtype,
                                                                 c.scale, c.timed, c.gen)
    seqs = 8
    kc8 = torch.randn(nb * seqs, bs, hkv, d, generator=gen).to(dtype).to(dev)
    vc8 = torch.randn(nb * seqs, bs, hkv, d, generator=gen).to(dtype).to(dev)
    tables = [np.arange(i * nb, (i + 1) * nb) for i in range(seqs)]
    batch = AttentionMetadata.build([np.array([n - 1])] * seqs, tables, [n] * seqs, bs, dev)
    singles = [AttentionMetadata.build([np.array([n - 1])], [t], [n], bs, dev) for t in tables]
    q8 = torch.randn(seqs, hq, d, generator=gen).to(dtype).to(dev)
    before = dict(BACKEND_CALLS)
    t_batch = timed(lambda: sparse_attention(q8, batch, kc8, vc8, scale=scale))
    how = ran(before)
    t_single = timed(lambda: [sparse_attention(q8[i: i + 1], singles[i], kc8, vc8, scale=scale) for i in range(seqs)])
    kv_bytes = seqs * n * hkv * d * 2 * torch.finfo(dtype).bits // 8
    # The ceiling: reading the same bytes as one stream (their pages are consecutive here).
    used = seqs * nb
    t_read = timed(lambda: (kc8[:used].sum(), vc8[:used].sum()))
    decode = {"path": how, "batched_ms": t_batch * 1e3, "gb_s": kv_bytes / t_batch / 1e9, "single_calls_ms": t_single * 1e3,
              "stream_read_ms": t_read * 1e3, "stream_gb_s": kv_bytes / t_read / 1e9, "of_stream": t_read / t_batch}
    if cuda:
        decode["native_ms"] = timed(lambda: sparse_attention(q8, batch, kc8, vc8, scale=scale, backend="native")) * 1e3
        from samcache.ops import attention_triton

        sweep = []
        for config in ({"splits": 8}, {"splits": 16}, {"splits": 32}, {"splits": 64}, {"block_n": 128, "num_stages": 3},
                       {"block_n": 32}, {"num_warps": 2}, {"num_stages": 2}):
            try:
                t = timed(lambda: attention_triton.paged_attention(q8, batch, kc8, vc8, scale=scale, window=-1,
                                                                   logit_cap=0.0, max_rows_per_seq=1, config=config))
            except Exception as e:  # noqa: BLE001 - a config the compiler refuses is a result too
                sweep.append({"config": config, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"})
                continue
            sweep.append({"config": config, "ms": t * 1e3, "of_stream": t_read / t})
        decode["triton_sweep"] = sweep
        print("decode Triton configs: " + "; ".join(f"{x['config']}: " + (f"{x['ms']:.3f} ms ({x['of_stream']:.0%})"
                                                                          if "ms" in x else x["error"]) for x in sweep))
    print(f"\ndecode, {seqs} sequences x {n} keys: one batched call ({how}) {t_batch * 1e3:.3f} ms "
          f"({kv_bytes / t_batch / 1e9:.0f} GB/s of KV, {t_read / t_batch:.0%} of the stream read; bar >= 70% on CUDA), "
          f"{seqs} calls {t_single * 1e3:.2f} ms ({t_single / t_batch:.2f}x); reading the same KV as one stream "
          f"(torch sum): {t_read * 1e3:.3f} ms ({kv_bytes / t_read / 1e9:.0f} GB/s)"
          + (f"; native CUDA kernel {decode['native_ms']:.3f} ms" if cuda else ""))
    return decode


if __name__ == "__main__":
    main()
