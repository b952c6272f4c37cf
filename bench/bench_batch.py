"""Batched serving: N concurrent GUI-agent sessions served together vs one after another.

Every session is a GUI agent at a steady turn: it has seen 3 screenshots (its own) and now sends
them again with a new one (a sliding window of 4), so its prompt reuses 3 images' KV and
computes the new screenshot and the text. Two engines over the same weights run the same
requests: ``alone`` serves the sessions one after another, ``batched`` serves them in one
``chat_batch`` call (prefills share forward steps, then every decode step carries one row per
session). Both decode ``--new-tokens`` tokens (end tokens ignored).

Reported: decode throughput (tokens/s over all sessions) of each, its ratio, and the ceiling of
that ratio on this machine (``decode_ceiling``: what memory bandwidth allows); prefill throughput
(computed prompt tokens / time to the last first token); and whether every session's tokens are
identical both ways. Each of ``--repeat`` plays uses fresh sessions and alternates which engine
goes first; the medians are printed.

    python bench/bench_batch.py --preset small --threads 1            # 8 sessions, 1280x720
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
import warnings

import torch

from samcache.engine import ChatRequest, SAMcacheEngine, screenshot
from samcache.engine.prompt import user_message
from samcache.random_checkpoints import PRESETS, build_preset


def session_turns(session: int, size: tuple[int, int]) -> tuple[list[dict], list[dict]]:
    """(the earlier turn, the measured turn) of one session: 3 screenshots, then the same 3 and a new one."""
    shots = [screenshot(10_000 * (session + 1) + i, size) for i in range(4)]
    system = f"You are GUI agent {session}. Answer with one action."
    earlier = [{"role": "system", "content": system}, user_message(shots[:3], "Step 2. What is the next action?")]
    now = [{"role": "system", "content": system}, user_message(shots, "Step 3. What is the next action?")]
    return earlier, now


def play(alone, batched, sessions: range, size, n: int, batched_first: bool) -> dict:
    """One measurement: every session's earlier turn on both engines, then the measured turns one
    by one on ``alone`` and together on ``batched`` (in the given order)."""
    turns = [session_turns(s, size) for s in sessions]
    requests = [ChatRequest(messages=now, max_new_tokens=n, ignore_eos=True) for _, now in turns]
    for engine in (alone, batched):
        for earlier, _ in turns:  # its screenshots become known
            engine.chat(messages=earlier, max_new_tokens=1)
    runs = {}
    for name in (["batched", "alone"] if batched_first else ["alone", "batched"]):
        t0 = time.perf_counter()
        runs[name] = batched.chat_batch(requests) if name == "batched" else [alone.chat(**vars(r)) for r in requests]
        runs[name + "_s"] = time.perf_counter() - t0
    one_by_one, together = runs["alone"], runs["batched"]
    computed = [r.metrics.prefilled_tokens + r.metrics.recomputed_tokens for r in one_by_one]
    alone_decode = [(n - 1) / r.metrics.decode_tokens_per_s for r in one_by_one]  # each session's decode time
    batch_decode = statistics.median((n - 1) / r.metrics.decode_tokens_per_s for r in together)
    k = len(requests)
    return {
        "prompt_tokens": [r.metrics.prompt_tokens for r in one_by_one],
        "computed_tokens": computed,
        "identical_outputs": all(a.token_ids == b.token_ids for a, b in zip(one_by_one, together)),
        "decode_tok_s_one_session": statistics.median(r.metrics.decode_tokens_per_s for r in one_by_one),
        "decode_tok_s_alone_total": k * (n - 1) / sum(alone_decode),
        "decode_tok_s_batched": k * (n - 1) / batch_decode,
        "prefill_tok_s_alone": sum(computed) / sum(r.metrics.ttft_s for r in one_by_one),
        "prefill_tok_s_batched": sum(computed) / max(r.metrics.ttft_s for r in together),
        "wall_s_alone": runs["alone_s"], "wall_s_batched": runs["batched_s"],
    }


def decode_ceiling(engine, size, sessions: int, steps: int = 32) -> dict:
    """The most the batched decode ratio can be on this machine, from parts measured here: one
    session's decode step costs T1, of which attention A1 (both timed over ``steps`` steps); a step
    of ``sessions`` sessions costs at least one session's non-attention work N1 = T1 - A1 (assuming
    no growth for more rows) plus reading every session's KV at this machine's stream rate (a
    400 MB ``torch.sum``, same thread count): ceiling = sessions * T1 / (N1 + KV bytes / rate)."""
    import samcache.engine.runner as runner_module

    ex, r = engine.executor, engine.runner
    earlier, now = session_turns(99_999, size)
    engine.chat(messages=earlier, max_new_tokens=1)
    pre, logits = engine.prefill(engine.build_prompt(now))
    attention = [0.0]
    real = runner_module.ops.sparse_attention

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = real(*a, **kw)
        attention[0] += time.perf_counter() - t0
        return out

    token, position = int(logits.argmax()), pre.prompt.next_position
    runner_module.ops.sparse_attention = timed
    try:
        t0 = time.perf_counter()
        for k in range(steps):
            token = int(ex.forward([ex.decode_step(pre.seq, token, position + k, False)])[0].argmax())
        t1 = (time.perf_counter() - t0) / steps
    finally:
        runner_module.ops.sparse_attention = real
        engine.pool.free_sequence(pre.seq)
    a1 = attention[0] / steps
    big = torch.empty(100_000_000).normal_()
    big.sum()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t0)
    rate = big.numel() * 4 / best
    kv_bytes = sessions * (len(pre.prompt) + steps // 2) * r.kv_bytes_per_token
    return {"one_session_step_s": t1, "one_session_attention_s": a1, "stream_gb_s": rate / 1e9,
            "kv_bytes_per_batched_step": kv_bytes,
            "ceiling": sessions * t1 / ((t1 - a1) + kv_bytes / rate)}


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or build_preset("qwen2_5_vl", args.preset, pathlib.Path(tempfile.mkdtemp()) / "model")
    size = tuple(args.image_size)
    common = dict(device="cpu", kv_cache_bytes=args.kv_cache_mib << 20, recompute_budget="uniform",
                  keep_image_order=False)  # random weights: reuse at any index, said explicitly
    alone = SAMcacheEngine(model, **common)
    batched = SAMcacheEngine(model, **common, share_weights_with=alone)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for engine in (alone, batched):
            engine.warm_up()
        # Fresh sessions every play (their screenshots and prompts unseen), the order alternating.
        plays = [play(alone, batched, range(p * args.sessions, (p + 1) * args.sessions), size, args.new_tokens,
                      batched_first=p % 2 == 1) for p in range(args.repeat)]
        ceiling = decode_ceiling(alone, size, args.sessions)
    for p in plays:
        p["decode_ratio"] = p["decode_tok_s_batched"] / p["decode_tok_s_one_session"]
        p["prefill_ratio"] = p["prefill_tok_s_batched"] / p["prefill_tok_s_alone"]
    med = lambda key: statistics.median(p[key] for p in plays)  # noqa: E731
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": f"cpu, {torch.get_num_threads()} threads",
        "model": str(model), "preset": args.preset, "sessions": args.sessions, "new_tokens": args.new_tokens,
        "image_size": list(size), "repeat": args.repeat,
        "prompt_tokens": plays[0]["prompt_tokens"], "computed_tokens": plays[0]["computed_tokens"],
        "identical_outputs": all(p["identical_outputs"] for p in plays),
        "plays": plays,
        "decode_ceiling": ceiling,
    }
    for key in ("decode_tok_s_one_session", "decode_tok_s_alone_total", "decode_tok_s_batched", "prefill_tok_s_alone",
                "prefill_tok_s_batched", "wall_s_alone", "wall_s_batched", "decode_ratio", "prefill_ratio"):
        out[key] = med(key)  # medians over the plays
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: build --preset)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--image-size", type=int, nargs=2, default=(720, 1280), metavar=("H", "W"))
    p.add_argument("--kv-cache-mib", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeat", type=int, default=3, help="plays with fresh sessions; medians reported")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.sessions < 1 or args.new_tokens < 2 or args.repeat < 1:
        p.error("--sessions and --repeat must be >= 1 and --new-tokens >= 2")
    out = run(args)
    ratios = ", ".join(f"{p['decode_ratio']:.2f}" for p in out["plays"])
    print(f"{out['sessions']} GUI sessions ({out['image_size'][1]}x{out['image_size'][0]} screenshots, "
          f"{statistics.median(out['prompt_tokens'])} prompt tokens each), {out['new_tokens']} new tokens, "
          f"{out['device']}, {out['date']}; medians of {out['repeat']} plays (decode ratios {ratios})")
    print(f"decode: one session {out['decode_tok_s_one_session']:.0f} tok/s; {out['sessions']} together "
          f"{out['decode_tok_s_batched']:.0f} tok/s = {out['decode_ratio']:.2f}x one session's")
    c = out["decode_ceiling"]
    print(f"decode ceiling on this machine: {c['ceiling']:.2f}x (one session's step {c['one_session_step_s'] * 1e3:.2f} ms, "
          f"{c['one_session_attention_s'] * 1e3:.2f} ms of it attention; {out['sessions']} sessions' KV "
          f"{c['kv_bytes_per_batched_step'] / 1e6:.0f} MB a step at the stream rate {c['stream_gb_s']:.1f} GB/s)")
    print(f"prefill: one by one {out['prefill_tok_s_alone']:.0f} tok/s; together {out['prefill_tok_s_batched']:.0f} "
          f"tok/s = {out['prefill_ratio']:.2f}x")
    print(f"outputs identical to serving each alone: {out['identical_outputs']}; wall {out['wall_s_alone']:.2f} s "
          f"one by one, {out['wall_s_batched']:.2f} s together")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
