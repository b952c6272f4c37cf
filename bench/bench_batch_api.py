"""Benchmark of samcache's Python batch APIs against the bars of the native-core issue.

Each figure is the best of several runs on one thread, with a baseline measured in the same
run: the same work done one block per call (what an engine without batch APIs would do) and a
plain-Python allocator. Usage: python bench/bench_batch_api.py [--quick]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

import samcache
from samcache import BlockPool, ContentIndex, Namespace


def best_rate(fn, work: float, reps: int = 5) -> float:
    """work / seconds for the fastest of `reps` calls of fn()."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return work / best


def bench_append_free(iters: int, blocks: int = 64, bs: int = 16) -> dict[str, float]:
    pool = BlockPool(4096, bs)
    tokens = np.arange(blocks * bs, dtype=np.int32)

    def batch_slots():
        for _ in range(iters):
            s = pool.new_sequence()
            pool.append_slots(s, blocks * bs)
            pool.free_sequence(s)

    def batch_tokens():  # hashed: every full block enters the prefix cache
        for i in range(iters):
            s = pool.new_sequence()
            pool.append_tokens(s, tokens + i)
            pool.free_sequence(s)

    def per_block_calls():
        for _ in range(iters // 8):
            s = pool.new_sequence()
            for _ in range(blocks):
                pool.append_slots(s, bs)
            pool.free_sequence(s)

    free = list(range(4096))

    def plain_python():  # list-based allocator: the floor of a Python-side block manager
        for _ in range(iters // 8):
            table = [free.pop() for _ in range(blocks)]
            slots = [b * bs + o for b in table for o in range(bs)]
            free.extend(reversed(table))
            del slots

    return {
        "append_slots+free (64-block batches)": best_rate(batch_slots, iters * blocks),
        "append_tokens+free, hashed (64-block batches)": best_rate(batch_tokens, iters * blocks),
        "baseline: one append_slots call per block": best_rate(per_block_calls, iters // 8 * blocks),
        "baseline: plain-Python list allocator": best_rate(plain_python, iters // 8 * blocks),
    }


def bench_fork(n: int) -> float:
    pool = BlockPool(2048, 16)
    parent = pool.new_sequence()
    pool.append_slots(parent, 16 * 1000)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        kids = [pool.fork(parent) for _ in range(n)]
        best = min(best, (time.perf_counter() - t0) / n)
        for k in kids:
            pool.free_sequence(k)
    return best * 1e6


def bench_lookups(n_entries: int, n_queries: int) -> dict[str, float]:
    ns = Namespace("bench")
    keys = [ns.key(samcache.ContentHash(i.to_bytes(16, "little"))) for i in range(n_entries)]
    index = ContentIndex(1 << 50)
    for i, k in enumerate(keys):
        index.put(k, i, 1)
    rng = np.random.default_rng(0)
    queries = [keys[i] for i in rng.integers(0, n_entries, n_queries)]
    return {
        "get_many (one call per 1,024 keys)": best_rate(
            lambda: [index.get_many(queries[i : i + 1024]) for i in range(0, n_queries, 1024)], n_queries, reps=3
        ),
        "baseline: one get() call per key": best_rate(lambda: [index.get(q) for q in queries], n_queries, reps=3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (for make demo)")
    args = ap.parse_args()
    scale = 1 if args.quick else 5
    print(f"samcache batch-API benchmark ({'quick' if args.quick else 'full'}), "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, one thread\n")
    print("| measure | value | bar |")
    print("| --- | ---: | --- |")
    rates = bench_append_free(iters=2000 * scale)
    for name, r in rates.items():
        bar = ">= 2 M blocks/s" if not name.startswith("baseline") else ""
        print(f"| {name} | {r / 1e6:.2f} M blocks/s | {bar} |")
    head = rates["append_slots+free (64-block batches)"]
    print(f"| batch vs one call per block | {head / rates['baseline: one append_slots call per block']:.1f}x | |")
    print(f"| batch vs plain-Python allocator | {head / rates['baseline: plain-Python list allocator']:.1f}x | |")
    print(f"| fork of a 1,000-block sequence (Python call) | {bench_fork(400 * scale):.2f} us | <= 20 us |")
    look = bench_lookups(100_000, 100_000 * scale)
    for name, r in look.items():
        print(f"| index {name}, 100k entries | {r / 1e6:.2f} M keys/s | |")
    print(f"| get_many vs get() per key | {look['get_many (one call per 1,024 keys)'] / look['baseline: one get() call per key']:.1f}x | |")


if __name__ == "__main__":
    main()
