"""What samcache costs on a turn it can reuse nothing for, against a full prefill.

Each turn is a first turn: a held-out GUI trace's first prompt (3 screenshots the engine has never
seen) behind a system prompt made unique per turn, so neither an image nor a prefix block is
known. samcache's engine with its defaults (hashing, ViT-output and image-KV stores, the exact
prefix cache, planning, saving the new images' KV for later turns) against the same engine with
every cache off, over one copy of the weights, alternating which goes first. Reported: TTFT
medians and their ratio, per shipped trained model.

    python bench/bench_no_reuse_turn.py --turns 40 --out bench/out/no-reuse-turn.json
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import statistics
import sys
import warnings


def unique_first_turn(turn, i: int):
    """The turn with a system prompt no other turn has (nothing of its prefix can be cached)."""
    turn = copy.copy(turn)
    turn.messages = copy.deepcopy(turn.messages)
    system = turn.messages[0]
    if system["role"] != "system" or not isinstance(system["content"], str):
        raise ValueError("the trace's first message is expected to be a text system prompt")
    system["content"] = f"Session {i}. {system['content']}"
    return turn


def measure(model, turns: int, warmup: int) -> dict:
    from samcache.bench.task_accuracy import training_defaults
    from samcache.engine import SAMcacheEngine
    from samcache.tasks import visual_qa

    trained = training_defaults(model)
    size, dense = trained.get("size", visual_qa.DEFAULT_SIZE), trained.get("dense", False)
    full = SAMcacheEngine(model, device="cpu", cache_enabled=False)
    mine = SAMcacheEngine(model, device="cpu", share_weights_with=full)
    firsts = [unique_first_turn(visual_qa.trace(visual_qa.split_seed("test", i, 0), scenario="gui", turns=1,
                                                window=3, size=size, dense=dense)[0], i)
              for i in range(warmup + turns)]
    ttft: dict[str, list[float]] = {"samcache": [], "full prefill": []}
    same = 0
    for i, turn in enumerate(firsts):
        pair = (("samcache", mine), ("full prefill", full))
        replies = {}
        for name, engine in pair if i % 2 == 0 else pair[::-1]:
            r = engine.chat(messages=turn.messages, max_new_tokens=1)
            if name == "samcache" and (r.metrics.image_reused_tokens or r.metrics.prefix_reused_tokens):
                raise RuntimeError(f"turn {i} reused something: {r.metrics}")
            replies[name] = r.token_ids
            if i >= warmup:
                ttft[name].append(r.metrics.ttft_s * 1e3)
        same += i >= warmup and replies["samcache"] == replies["full prefill"]
    medians = {k: statistics.median(v) for k, v in ttft.items()}
    return {"turns": turns, "ttft_median_ms": medians,
            "ttft_p25_p75_ms": {k: statistics.quantiles(v, n=4)[::2] for k, v in ttft.items()},
            "ratio": medians["samcache"] / medians["full prefill"], "same_first_token": same}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.turns < 2 or args.warmup < 0:
        p.error("--turns must be >= 2 (quartiles are reported) and --warmup >= 0")
    from samcache.tasks.checkpoint import isolated_model, trained_model

    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, model in (("causal", trained_model()), ("isolated", isolated_model())):
            r = results[label] = measure(model, args.turns, args.warmup)
            m = r["ttft_median_ms"]
            print(f"{label}: samcache {m['samcache']:.2f} ms, full prefill {m['full prefill']:.2f} ms "
                  f"(TTFT medians of {args.turns} first turns): {r['ratio']:.3f}x; "
                  f"same first token {r['same_first_token']}/{args.turns}", flush=True)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
