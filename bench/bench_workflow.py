"""Multi-agent workflow under memory pressure: TTFT and hit rates per eviction policy.

Several workflows run at once, each a planner -> 3 workers -> reviewer loop over the same
screenshots. Every agent has its own session (a long role prompt, the workflow's screenshots, its
history). Turns interleave across the workflows, so between two turns of one agent every other
agent runs: the access pattern is a cycle, which plain LRU serves worst (the context it evicts is
the one needed soonest). The KV pool is sized below the working set (``--pool-fraction`` of what
the whole trace holds with no pressure, measured first). Each policy runs the same trace on its
own engine over the same checkpoint:

- ``lru``: the pool's and stores' own least-recently-used order (what vLLM and SGLang's radix
  cache do);
- ``workflow``: priority = minus steps until the agent that needs an item runs (KVFlow);
- ``attention``: attention activity (sampled at layer 0) blended with recency (OxyGen).

Round 1 fills the caches (cold for every policy); TTFT and hit rates are over the later rounds.

    python bench/bench_workflow.py --out bench/out/workflow          # tiny random Qwen2.5-VL, CPU
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import tempfile

import numpy as np
import torch

from samcache.engine import SAMcacheEngine, screenshot
from samcache.engine.prompt import user_message
from samcache.random_checkpoints import build_tiny_model
from samcache.policies import Workflow

AGENTS = ("planner", "worker1", "worker2", "worker3", "reviewer")
_WORDS = ("window", "button", "field", "menu", "dialog", "value", "check", "submit", "report", "table", "filter",
          "column", "login", "export", "settings", "profile", "search", "result", "error", "confirm")


def role_prompt(rng: np.random.Generator, workflow: int, agent: str, words: int) -> str:
    body = " ".join(str(rng.choice(_WORDS)) for _ in range(words))
    return f"You are the {agent} of team {workflow}. Your instructions: {body}."


def make_trace(workflows: int, rounds: int, role_words: int, image_size: tuple[int, int], seed: int):
    """(sessions, turns): each agent's opening messages, and the turns in the order they run."""
    rng = np.random.default_rng(seed)
    openings = {}
    for w in range(workflows):
        shots = [screenshot(seed * 100 + 10 * w + i, image_size) for i in range(2)]
        for agent in AGENTS:
            openings[(w, agent)] = [{"role": "system", "content": role_prompt(rng, w, agent, role_words)},
                                    user_message(shots, f"Team {w}: the task starts on these screens.")]
    turns = [(r, w, agent) for r in range(rounds) for agent in AGENTS for w in range(workflows)]
    return openings, turns


def run_policy(model, policy: str, num_blocks: int | None, openings, turns, args) -> dict:
    engine = SAMcacheEngine(model, device="cpu", recompute_budget="uniform", eviction_policy=policy, keep_image_order=False,
                            prefix_reuse=args.prefix_reuse,
                            **({"num_blocks": num_blocks} if num_blocks else {"kv_cache_bytes": 512 << 20}))
    engine.warm_up()
    if policy == "workflow":
        for w in range(args.workflows):
            engine.plan_workflow(Workflow.sequence(f"team{w}", AGENTS))
    history = {k: list(v) for k, v in openings.items()}
    rows, peak = [], 0
    for r, w, agent in turns:
        msgs = history[(w, agent)]
        if len(msgs) > 2:  # after the opening: a short instruction
            msgs.append({"role": "user", "content": f"Round {r + 1}: continue your part of the task."})
        else:
            msgs[-1]["content"][-1]["text"] += f" Round {r + 1}: do your part."
        res = engine.chat(messages=msgs, max_new_tokens=args.new_tokens, ignore_eos=True, agent=f"team{w}/{agent}")
        msgs.append({"role": "assistant", "content": res.text})
        m = res.metrics
        peak = max(peak, engine.pool.num_blocks - engine.pool.stats()["free_blocks"])  # held + cached
        rows.append({"round": r, "workflow": w, "agent": agent, "ttft_s": m.ttft_s, "prompt_tokens": m.prompt_tokens,
                     "prefix_reused_tokens": m.prefix_reused_tokens, "image_reused_tokens": m.image_reused_tokens,
                     "prefilled_tokens": m.prefilled_tokens})
    engine.check_invariants()
    warm = [x for x in rows if x["round"] > 0]
    return {
        "policy": policy, "num_blocks": engine.pool.num_blocks, "peak_blocks": peak,
        "median_ttft_s": statistics.median(x["ttft_s"] for x in warm),
        "mean_ttft_s": statistics.fmean(x["ttft_s"] for x in warm),
        "prefix_hit_rate": sum(x["prefix_reused_tokens"] for x in warm) / sum(x["prompt_tokens"] for x in warm),
        "reused_rate": sum(x["prefix_reused_tokens"] + x["image_reused_tokens"] for x in warm)
        / sum(x["prompt_tokens"] for x in warm),
        "turns": rows,
    }


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["policies"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["policy"] for r in runs]
    ax1.bar(names, [1000 * r["median_ttft_s"] for r in runs], color="#2266aa")
    ax1.set_ylabel("median TTFT (ms), rounds 2+")
    ax1.set_title(f"{results['workflows']} workflows x {len(AGENTS)} agents, pool {results['pool_fraction']:.0%} "
                  "of working set")
    ax2.bar(names, [100 * r["prefix_hit_rate"] for r in runs], color="#88aadd")
    ax2.set_ylabel("prompt tokens adopted from the prefix cache (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Qwen2.5-VL checkpoint (default: a tiny random one built here)")
    ap.add_argument("--out", default="bench/out/workflow")
    ap.add_argument("--workflows", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--role-words", type=int, default=1000, help="words in each agent's role prompt (1000: ~2,100-token contexts)")
    ap.add_argument("--image-size", type=int, nargs=2, default=(336, 504), metavar=("H", "W"))
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--pool-fraction", type=float, default=0.6)
    ap.add_argument("--policies", default="lru,workflow,attention")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix-reuse", default="approximate", choices=["exact", "approximate"],
                    help="approximate: an agent's context after a reused screenshot is cached as its prefix too")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or build_tiny_model("qwen2_5_vl", pathlib.Path(tempfile.mkdtemp()) / "model", seed=args.seed)
    openings, turns = make_trace(args.workflows, args.rounds, args.role_words, tuple(args.image_size), args.seed)
    unbounded = run_policy(model, "lru", None, openings, turns, args)
    working_set = unbounded["peak_blocks"]
    num_blocks = max(1, int(args.pool_fraction * working_set))
    runs = [run_policy(model, p, num_blocks, openings, turns, args) for p in args.policies.split(",")]
    results = {
        "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
        "model": str(args.model or "tiny random Qwen2.5-VL"), "workflows": args.workflows, "rounds": args.rounds,
        "agents": list(AGENTS), "working_set_blocks": working_set, "pool_fraction": args.pool_fraction,
        "unbounded": {k: v for k, v in unbounded.items() if k != "turns"}, "policies": runs,
    }
    lru = next((r for r in runs if r["policy"] == "lru"), None)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "workflow.png")
    print(f"working set {working_set} blocks; pool {num_blocks} blocks ({args.pool_fraction:.0%}); "
          f"unbounded median TTFT {1000 * unbounded['median_ttft_s']:.1f} ms")
    for r in runs:
        ratio = f", {lru['median_ttft_s'] / r['median_ttft_s']:.2f}x lower than lru" if lru else ""
        print(f"{r['policy']:9s} median TTFT {1000 * r['median_ttft_s']:7.1f} ms  mean {1000 * r['mean_ttft_s']:7.1f} ms  "
              f"prefix hit {r['prefix_hit_rate']:.1%}  reused {r['reused_rate']:.1%}{ratio}")
    print(f"wrote {out / 'results.json'} and {out / 'workflow.png'}")


if __name__ == "__main__":
    main()
