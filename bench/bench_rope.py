"""Benchmark rope_rerotate and rope_rerotate_write against the same work composed from torch ops.

    .venv/bin/python bench/bench_rope.py [--device cuda] [--tokens 4096]

The torch composition: cos/sin from the deltas (float32 angles, per-frequency axis gathered for
M-RoPE), the rotate-half formula in float32, and for the paged write index_copy_ into the cache.
Prints a markdown table; ratio = torch time / samcache time (> 1: samcache faster). On CUDA it
also prints GB/s (key bytes read + written) and the fraction of a measured device copy's GB/s.
"""

from __future__ import annotations

import argparse

import torch

import samcache.ops  # noqa: F401  (registers the ops)

from timing import best_seconds, copy_bandwidth  # bench/timing.py


def frequency_axes(style, section, half):
    """Row of delta per frequency (the same mapping the kernels use; see docs/ops/rope.md)."""
    j = torch.arange(half)
    if style == "mrope":
        return (j >= section[0]).long() + (j >= section[0] + section[1]).long()
    if style == "mrope_interleaved":
        axis = torch.zeros(half, dtype=torch.long)
        axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
        return axis
    return torch.zeros(half, dtype=torch.long)


def torch_rotated(key, delta, inv_freq, style, section):
    """key rotated by delta, composed from torch ops (rotate-half styles)."""
    half = inv_freq.numel()
    rd = 2 * half
    if delta.dim() == 2:
        d = delta[frequency_axes(style, section, half).to(delta.device)].t()  # [N, half]
    else:
        d = delta[:, None]
    freqs = d.float() * inv_freq
    emb = torch.cat([freqs, freqs], -1)[:, None, :]
    x = key[..., :rd].float()
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    out = (x * emb.cos() + rot * emb.sin()).to(key.dtype)
    return out if rd == key.shape[-1] else torch.cat([out, key[..., rd:]], -1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev, n, h, d = args.device, args.tokens, args.heads, args.head_dim
    half = d // 2
    inv_freq = (1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))).to(dev)
    peak = copy_bandwidth(dev) if dev == "cuda" else None
    threads = torch.get_num_threads()
    print(f"device {dev}, {n} tokens x {h} heads x {d} dims, {threads} threads"
          + (f", device copy {peak:.0f} GB/s" if peak else ""))
    print()
    print("| op | style | dtype | deltas | samcache µs | torch µs | ratio |" + (" GB/s | of copy |" if peak else ""))
    print("| --- | --- | --- | --- | ---: | ---: | ---: |" + (" ---: | ---: |" if peak else ""))
    block_size = 16
    num_blocks = n // block_size + 8
    for style, section in (("neox", []), ("mrope", [16, 24, 24]), ("mrope_interleaved", [24, 20, 20])):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for deltas in ("per image", "per token"):
                rows = 3 if style.startswith("mrope") else 1
                if deltas == "per image":  # one image moved as a whole: one delta for all tokens
                    delta = torch.full((rows, n), 1234, dtype=torch.long)
                else:
                    delta = torch.randint(-100_000, 100_000, (rows, n))
                delta = (delta if rows == 3 else delta[0]).to(dev)
                key = torch.randn(n, h, d, device=dev).to(dtype)
                cache = torch.zeros(num_blocks, block_size, h, d, device=dev, dtype=dtype)
                slots = torch.randperm(num_blocks * block_size, device=dev)[:n]
                flat = cache.view(-1, h, d)
                ops = {
                    "rerotate": (
                        lambda: torch.ops.samcache.rope_rerotate(key, delta, inv_freq, style, section),
                        lambda: key.copy_(torch_rotated(key, delta, inv_freq, style, section)),
                    ),
                    "rerotate_write": (
                        lambda: torch.ops.samcache.rope_rerotate_write(key, delta, inv_freq, style, section, cache, slots),
                        lambda: flat.index_copy_(0, slots, torch_rotated(key, delta, inv_freq, style, section)),
                    ),
                }
                for name, (ours, theirs) in ops.items():
                    t_ours, t_torch = best_seconds(ours, dev, 20, warmup=3), best_seconds(theirs, dev, 20, warmup=3)
                    row = (f"| {name} | {style} | {str(dtype).removeprefix('torch.')} | {deltas} | "
                           f"{t_ours * 1e6:.0f} | {t_torch * 1e6:.0f} | {t_torch / t_ours:.2f} |")
                    if peak:
                        gbps = 2 * key.numel() * key.element_size() / t_ours / 1e9
                        row += f" {gbps:.0f} | {gbps / peak:.2f} |"
                    print(row, flush=True)


if __name__ == "__main__":
    main()
