"""Agent-memory benchmark: branch memory and tool-heavy context, counted (no timings).

1. **Branches.** A planner's long multimodal context (system prompt, earlier turns, 6 screenshots)
   in a held session (``hold_context=True``); the planner replies, forks 8 workers and is
   abandoned; each worker takes one divergent turn. Blocks held by the 8 branches together
   against one branch + the divergent suffixes (the bar: at most 1.15x), and against 8 full
   clones.
2. **Tool-heavy request.** A GUI agent after 8 tool-using steps (long logs, search hits, a file read
   twice, verbose tool descriptions). Prompt tokens (the model's tokenizer, whole rendered prompt,
   images included) before and after the tool-result store + context compressor, per stage; the
   next-token KL and top-1 agreement of the compressed prompt against the full one.

    python bench/bench_agent_memory.py --out bench/out/agent-memory            # tiny random Qwen2.5-VL
    python bench/bench_agent_memory.py --model DIR --out ...                    # another checkpoint

Counts do not depend on the machine; nothing here is timed, so it may run beside other work.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import tempfile

import torch

from samcache.agent import CompressorConfig, ContextCompressor, ToolResultStore
from samcache.agent.scenarios import long_context, render_tools, tool_heavy_request
from samcache.engine import SAMcacheEngine
from samcache.random_checkpoints import build_tiny_model


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def branch_memory(engine: SAMcacheEngine, branches: int, seed: int) -> dict:
    context = long_context(seed)
    planner = engine.new_session(hold_context=True)
    planner.messages = context[:-1]
    last = context[-1]["content"]
    images = [p["image"] for p in last if p["type"] == "image"]
    engine.chat(images=images, prompt=last[-1]["text"], session=planner, max_new_tokens=24, ignore_eos=True)
    root_tokens = planner.branch.num_tokens
    workers = [engine.fork_session(planner, name=f"worker {i}") for i in range(branches)]
    engine.abandon_session(planner)
    for i, w in enumerate(workers):
        engine.chat(prompt=f"Worker {i + 1}: do step {i + 1} of the plan and report what changed on screen.",
                    session=w, max_new_tokens=16, ignore_eos=True)
    m = engine.context_memory()
    bs = engine.pool.block_size
    suffixes = [w.branch.num_tokens - root_tokens for w in workers]
    ideal = blocks_for(root_tokens, bs) + sum(blocks_for(s, bs) for s in suffixes)
    engine.check_invariants()
    result = {
        "branches": branches, "block_size": bs, "context_tokens": root_tokens,
        "images": len(images), "suffix_tokens": suffixes,
        "held_blocks": m.held_blocks, "one_branch_plus_suffixes_blocks": ideal,
        "ratio_to_one_plus_suffixes": m.held_blocks / ideal,
        "full_clone_blocks": m.clone_blocks, "clones_over_held": m.sharing_ratio,
        "held_mib": m.held_blocks * engine.runner.block_bytes / 2**20,
        "per_branch_private_blocks": [b.private_blocks for b in m.branches.values()],
    }
    for w in workers:
        engine.abandon_session(w, reclaim=True)
    return result


def _logits(engine: SAMcacheEngine, messages: list[dict]) -> tuple[int, torch.Tensor]:
    prompt = engine.build_prompt(messages)
    pre, logits = engine.prefill(prompt)
    engine.pool.free_sequence(pre.seq)
    return len(prompt), logits.double()


def tool_heavy(engine: SAMcacheEngine, turns: int, seed: int, workdir: pathlib.Path) -> dict:
    messages, tools = tool_heavy_request(seed, turns=turns)
    tok = engine.tokenizer

    def count(text: str) -> int:
        return len(tok(text).input_ids)

    full_tokens, full = _logits(engine, render_tools(messages, tools))
    with ToolResultStore(workdir / "tool-results.sqlite") as store:
        compressor = ContextCompressor(CompressorConfig(), store=store, count_tokens=count)
        out = compressor.compress(messages, tools)
        again = compressor.compress(out.messages, out.tools)
        cut_tokens, cut = _logits(engine, render_tools(out.messages, out.tools))
        stored = store.stats()
        alone = {}  # each stage by itself on the full request
        for stage in CompressorConfig().stages:
            one = ContextCompressor(CompressorConfig(stages=(stage,)), store=store, count_tokens=count)
            r = one.compress(messages, tools)
            alone[stage] = 1 - len(engine.build_prompt(render_tools(r.messages, r.tools))) / full_tokens
    p, q = torch.softmax(full, -1), torch.log_softmax(cut, -1)
    kl = float((p * (torch.log(p.clamp_min(1e-300)) - q)).sum())
    return {
        "turns": turns, "prompt_tokens_full": full_tokens, "prompt_tokens_compressed": cut_tokens,
        "tokens_cut": 1 - cut_tokens / full_tokens,
        "stages": [{"stage": s.stage, "text_tokens_before": s.tokens_before, "text_tokens_after": s.tokens_after,
                    "parts_changed": s.parts_changed} for s in out.stages],
        "tokens_cut_by_stage_alone": alone,
        "idempotent": again.messages == out.messages and again.tools == out.tools,
        "store": stored,
        "next_token_kl": kl, "top1_agree": bool(full.argmax() == cut.argmax()),
    }


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b, t = results["branches"], results["tool_heavy"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    bars = {"8 clones": b["full_clone_blocks"], "1 + suffixes": b["one_branch_plus_suffixes_blocks"],
            "8 held": b["held_blocks"]}
    ax1.bar(list(bars), list(bars.values()), color=["#bbbbbb", "#88aadd", "#2266aa"])
    ax1.set_ylabel("KV blocks held")
    ax1.set_title(f"{b['branches']} branches of a {b['context_tokens']}-token context")
    stages = t["stages"]
    labels = ["full"] + [s["stage"] for s in stages]
    values = [stages[0]["text_tokens_before"]] + [s["text_tokens_after"] for s in stages]
    ax2.plot(labels, values, marker="o")
    ax2.set_ylabel("text tokens (model tokenizer)")
    ax2.set_title(f"tool-heavy request: prompt {t['tokens_cut']:.0%} shorter")
    ax2.set_ylim(0, max(values) * 1.1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Qwen2.5-VL checkpoint (default: a tiny random one built here)")
    ap.add_argument("--out", default="bench/out/agent-memory")
    ap.add_argument("--branches", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8, help="tool-using steps of the tool-heavy request")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="samcache-agent-memory-"))
    model = args.model or build_tiny_model("qwen2_5_vl", work / "model", seed=args.seed)
    engine = SAMcacheEngine(model, device="cpu", recompute_budget="uniform", kv_cache_bytes=256 << 20,
                            keep_image_order=False)
    results = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__},
        "model": str(args.model or "tiny random Qwen2.5-VL (build_tiny_model, seed %d)" % args.seed),
        "branches": branch_memory(engine, args.branches, args.seed),
        "tool_heavy": tool_heavy(engine, args.turns, args.seed, work),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "agent-memory.png")
    b, t = results["branches"], results["tool_heavy"]
    print(f"branches: {b['branches']} x {b['context_tokens']}-token context ({b['images']} images): held "
          f"{b['held_blocks']} blocks = {b['ratio_to_one_plus_suffixes']:.3f} x (one branch + suffixes, "
          f"{b['one_branch_plus_suffixes_blocks']}); full clones {b['full_clone_blocks']} "
          f"({b['clones_over_held']:.2f} x held)")
    print(f"tool-heavy: prompt {t['prompt_tokens_full']} -> {t['prompt_tokens_compressed']} tokens "
          f"({t['tokens_cut']:.1%} cut); next-token KL {t['next_token_kl']:.3g}, top-1 agree {t['top1_agree']}")
    for s in t["stages"]:
        print(f"  {s['stage']:8s} {s['text_tokens_before']:6d} -> {s['text_tokens_after']:6d} text tokens "
              f"({s['parts_changed']} parts); alone it cuts {t['tokens_cut_by_stage_alone'][s['stage']]:.1%}")
    print(f"wrote {out / 'results.json'} and {out / 'agent-memory.png'}")


if __name__ == "__main__":
    main()
