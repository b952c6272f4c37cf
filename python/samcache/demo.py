"""``make demo``: first real answers, then speed.

**Answers.** The two trained visual-QA models that ship with samcache (a tiny Qwen2.5-VL that reads
GUI screenshots, and the same model fine-tuned so that each image attends only to itself) play
one held-out GUI agent trace: each turn shows the last 3 screenshots, so known screenshots come
back at new positions. Per turn it prints the question, the expected answer, samcache's answer
with its defaults and whether the full prefill replies the same, with both TTFTs and the image
tokens samcache reused: few on the first model (a moved screenshot is prefilled again: its KV
says where it was), every known one on the second, with the full prefill's replies.

**Speed.** A scripted GUI agent on a small random-weight Qwen2.5-VL, with and without samcache.
The agent keeps its last 3 screenshots (1280x720, 1,196 image tokens each) in the prompt; every
turn adds a new screenshot and drops the oldest, so the exact prefix breaks every turn while two
of the three images are ones the engine has already seen, now at new positions. Each turn runs
on three engines over one copy of the same weights: samcache (every cache level, 5% recompute
with the layer-aware budget), today's engines (exact prefix caching + a ViT-output cache, as in
vLLM and SGLang) and no cache at all. Per turn it prints where each prompt token's KV came from
in samcache, the ViT calls, the three TTFTs and the fidelity of the samcache turn against a full
prefill. Each TTFT is one sample on a shared machine; ``samcache bench --repeat N`` gives medians.

    python -m samcache.demo [--model DIR] [--turns 6] [--window 3] [--device cpu] [--no-answers]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import warnings


def answers(*, turns: int = 6, window: int = 3, device: str = "cpu", seed: int = 0) -> list[dict]:
    """The two shipped trained models on one held-out GUI trace, each with samcache's defaults
    against a full prefill, turn by turn: the causal one (its images' KV depends on their index,
    so a moved screenshot is prefilled again) and the one fine-tuned to isolated image attention
    (every known screenshot reused wherever it moved, exactly). Returns one row per model and turn."""
    from samcache.engine import SAMcacheEngine
    from samcache.bench.task_accuracy import training_defaults
    from samcache.tasks import visual_qa
    from samcache.tasks.checkpoint import isolated_model, trained_model

    rows = []
    for label, model in (("causal", trained_model()), ("isolated", isolated_model())):
        trained = training_defaults(model)
        size, dense = trained.get("size", visual_qa.DEFAULT_SIZE), trained.get("dense", False)
        trace = visual_qa.trace(visual_qa.split_seed("test", 0, seed), scenario="gui", turns=turns, window=window,
                                size=size, dense=dense)
        full = SAMcacheEngine(model, device=device, cache_enabled=False)
        fast = SAMcacheEngine(model, device=device, share_weights_with=full)
        how = ("images attend in isolation: a known screenshot is reused at any index, exactly" if label == "isolated"
               else "images read in order, no reuse profile: a known screenshot is reused only at its own index")
        print(f"\nthe {label} visual-QA model ({model.name}, {size[0]}x{size[1]} screenshots) on a held-out GUI agent "
              f"trace: {turns} turns, the last {window} screenshots each turn, newest last\n  ({how})")
        for k, turn in enumerate(trace):
            mine = fast.chat(messages=turn.messages, max_new_tokens=turn.max_new_tokens)
            ref = full.chat(messages=turn.messages, max_new_tokens=turn.max_new_tokens)
            row = {"model": label, "turn": k, "question": turn.question.replace(visual_qa.DENSE_INSTRUCTION, "").strip(),
                   "answer": turn.answer, "samcache": visual_qa.parse_answer(mine.text),
                   "full_prefill": visual_qa.parse_answer(ref.text), "same_reply": mine.text == ref.text,
                   "ttft_samcache_ms": mine.metrics.ttft_s * 1e3, "ttft_full_ms": ref.metrics.ttft_s * 1e3,
                   "prefix_reused": mine.metrics.prefix_reused_tokens,
                   "image_reused": mine.metrics.image_reused_tokens, "prefilled": mine.metrics.prefilled_tokens}
            rows.append(row)
            mark = "right" if row["samcache"].lower() == turn.answer.lower() else "wrong"
            print(f"  turn {k}: {row['question']}\n    expected {turn.answer!r}; samcache {row['samcache']!r} ({mark}); "
                  f"{'the full prefill gives the same reply' if row['same_reply'] else 'the full prefill replies otherwise'}"
                  f"\n    TTFT samcache {row['ttft_samcache_ms']:.1f} ms, full prefill {row['ttft_full_ms']:.1f} ms; "
                  f"samcache's KV: {row['prefix_reused']} tokens from the prefix cache, {row['image_reused']} image "
                  f"tokens reused, {row['prefilled']} computed")
        mine_rows = [r for r in rows if r["model"] == label]
        right = sum(r["samcache"].lower() == r["answer"].lower() for r in mine_rows)
        same = sum(r["same_reply"] for r in mine_rows)
        reused = sum(r["image_reused"] for r in mine_rows)
        print(f"  {label}: {right} of {len(mine_rows)} answers right, the full prefill's reply in {same} of "
              f"{len(mine_rows)} turns, {reused} image tokens reused")
        for engine in (fast, full):
            engine.check_invariants()
    print("(docs/benchmark.md: 40 traces per scenario, and what each model's accuracy is)")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="samcache demo: a GUI agent with and without samcache")
    p.add_argument("--model", help="a Qwen2.5-VL / Qwen3-VL-MoE checkpoint directory (default: build a small one)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--recompute", type=float, default=0.05)
    p.add_argument("--no-answers", action="store_true", help="skip the trained model's answers, show speed only")
    args = p.parse_args(argv)

    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()  # weight loading bars: noise in a walkthrough
    if not args.no_answers:
        answers(turns=args.turns, window=args.window, device=args.device)
        print()
    from samcache.engine import SAMcacheEngine, screenshot
    from samcache.engine.prompt import user_message
    from samcache.random_checkpoints import build_preset

    model = args.model
    if model is None:  # the `small` preset: the checkpoint of the comparison with vLLM in docs/benchmark.md
        model = build_preset("qwen2_5_vl", "small", pathlib.Path(tempfile.mkdtemp(prefix="samcache-demo-")) / "small-qwen2.5-vl")
        print(f"built a small random-weight Qwen2.5-VL checkpoint (4 layers, 4.0 M parameters) in {model}")
    fast = SAMcacheEngine(model, device=args.device, recompute_ratio=args.recompute)
    today = SAMcacheEngine(model, device=args.device, image_kv_cache=False, share_weights_with=fast)
    plain = SAMcacheEngine(model, device=args.device, cache_enabled=False, share_weights_with=fast)
    print(f"engine: {fast}")
    print("calibrating the layer-aware recompute budget (per-layer sensitivity probe) ...")
    curves = fast.calibrate(progress=False)
    print(f"  next-token KL with no recompute {curves.loss[0, 0]:.2e}; rates probed {curves.rates.tolist()}")

    header = (f"{'turn':>4} {'images':>12} {'prompt':>7} {'prefilled':>9} {'prefix':>7} {'img-KV':>7} "
              f"{'recomp':>7} {'ViT run/hit':>11} {'TTFT samcache':>14} {'prefix+ViT':>11} {'no cache':>10} "
              f"{'speedup':>8} {'KL':>9}")
    print(f"\nGUI agent, window of the last {args.window} screenshots, {args.turns} turns\n{header}\n{'-' * len(header)}")
    system = "You are a GUI agent. Goal: file the expense report. Answer with one action."
    history: list[str] = []
    vs_today, vs_plain = [], []
    seen: set[int] = set()

    def run_turn(k: int, label: str, msgs: list, window: list[int]) -> tuple[int, float, float, str]:
        """Turn ``k`` on the three engines; (screenshots known before it, speedup vs prefix + ViT,
        speedup vs no cache, samcache's reply)."""
        # The engine that goes first pays for a cold machine (caches, allocator): rotate the order.
        order = [(fast, dict(fidelity=True)), (today, {}), (plain, {})]
        results = {id(e): e.chat(messages=msgs, max_new_tokens=8, **kw) for e, kw in order[k % 3:] + order[:k % 3]}
        mine, ref, base = results[id(fast)], results[id(today)], results[id(plain)]
        m = mine.metrics
        known = sum(i in seen for i in window)
        seen.update(window)
        speedup = ref.metrics.ttft_s / m.ttft_s
        print(f"{label:>4} {f'{known} known+{len(window) - known} new':>12} {m.prompt_tokens:>7} "
              f"{m.prefilled_tokens:>9} {m.prefix_reused_tokens:>7} {m.image_reused_tokens:>7} "
              f"{m.recomputed_tokens:>7} {f'{m.vit_calls}/{m.vit_hits}':>11} {m.ttft_s * 1e3:>11.1f} ms "
              f"{ref.metrics.ttft_s * 1e3:>8.1f} ms {base.metrics.ttft_s * 1e3:>7.1f} ms {speedup:>7.1f}x "
              f"{m.fidelity.kl:>9.2e}")
        return known, speedup, base.metrics.ttft_s / m.ttft_s, mine.text

    for engine in (fast, today, plain):  # first-call costs of a full-size screenshot out of the table
        engine.warm_up(size=(720, 1280))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for turn in range(args.turns):
            window = list(range(max(0, turn - args.window + 1), turn + 1))
            shots = [screenshot(1000 + i) for i in window]
            actions = "; ".join(history[-4:]) or "none yet"
            msgs = [{"role": "system", "content": system},
                    user_message(shots, f"Screenshots {window[0]}..{window[-1]}, newest last. "
                                        f"Actions so far: {actions}. Next action?")]
            known, a, b, text = run_turn(turn, str(turn), msgs, window)
            if known:
                vs_today.append(a)
                vs_plain.append(b)
            history.append(f"step {turn}: {text.strip()[:12]!r}")
        # A sub-agent with its own system prompt over the same screenshots: the prefix breaks at
        # its first token, every screenshot is known.
        sub = [{"role": "system", "content": "You are a verifier sub-agent. Check the last action only."},
               user_message(shots, "Did the last action succeed? Answer yes or no.")]
        _, sub_today, sub_plain, _ = run_turn(args.turns, "sub", sub, window)
    print(f"\nmedian TTFT speedup of samcache on the GUI turns that re-send known screenshots: "
          f"{statistics.median(vs_today):.1f}x vs prefix + ViT caching (today's engines), "
          f"{statistics.median(vs_plain):.1f}x vs no cache")
    print(f"the sub-agent turn (its own system prompt, every screenshot known): {sub_today:.1f}x vs prefix + ViT "
          f"caching, {sub_plain:.1f}x vs no cache")
    print("each GUI turn brings one new screenshot, whose ViT and prefill no cache can skip; against the real vLLM on")
    print("this checkpoint: `make vllm-env && samcache bench --scenario gui --modes prefix,samcache,vllm --preset small`.")
    print("prefilled = computed from scratch (new text, the new screenshot); img-KV = tokens of known screenshots whose")
    print("KV was spliced in at their new positions (RoPE re-rotated); recomp = of those, recomputed at the first layer;")
    print("speedup = prefix+ViT TTFT / samcache TTFT; every TTFT is one sample on a shared machine.")
    print("KL = next-token KL (nats) against a full prefill of the same prompt (random weights: near-uniform outputs).")
    for engine in (fast, today, plain):
        engine.check_invariants()


if __name__ == "__main__":
    main()
