"""Held-out accuracy of a trained visual-QA checkpoint with a full prefill (Hugging Face's own
``generate``, or samcache's engine for isolated image attention), on more examples than training's periodic evaluation and with Wilson intervals.

Training scores 48 examples per image count every few hundred steps, the first 48 of the test
stream, and the run is judged by them: an interval of about ±13 points, and examples the run was
picked on. This scores examples further down the same stream (from ``start``), none of which
training ever evaluated.

Beside the accuracy it says where the errors come from: the accuracy of each question type, and
for dense replies the share of description parts given right and how many wrong answers follow a
description that is right in every part (the model saw the images right and failed the lookup).

    python -m samcache.tasks.heldout python/samcache/tasks/checkpoints/visual-qa --examples 200
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

from samcache._checks import check_int

#: The first test example scored: far past the ones training evaluates (its ``eval_examples``).
START = 10_000


def _engine_replies(folder, attention, exs, messages, dense: bool, progress: bool) -> list[str]:
    """Greedy replies of samcache's engine serving ``folder`` with image ``attention`` (a full
    prefill of each question: every cache off), in batches of 16."""
    from samcache.engine import ChatRequest, SAMcacheEngine
    from samcache.tasks.visual_qa import dense_token_budget

    engine = SAMcacheEngine(folder, device="cpu", image_attention=attention, cache_enabled=False)
    replies: list[str] = []
    batches = range(0, len(exs), 16)
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc=f"scoring {len(exs[0].images)} image(s) ({attention.name})", unit="batch")
    for at in batches:
        batch = exs[at:at + 16]
        out = engine.chat_batch([ChatRequest(messages=messages(ex, dense=dense, answer=False),
                                             max_new_tokens=dense_token_budget(len(ex.images)) if dense else 6)
                                 for ex in batch])
        replies.extend(r.text for r in out)
    return replies


def score_checkpoint(path, *, examples: int = 200, images: Sequence[int] = (1, 4), start: int = START,
                     threads: int = 2, progress: bool = True, attention: str | None = None) -> dict:
    """Accuracy of the checkpoint at ``path`` on ``examples`` held-out questions per image count in
    ``images``: the test examples ``start`` to ``start + examples`` of its training seed, of the
    kind, size and reply style (dense or not) its ``training.json`` records. Returns per image
    count: ``accuracy``, ``correct``, ``examples``, the Wilson 95% ``interval``, ``by_question``
    (question type: ``examples``, ``correct``) and for dense replies ``described_parts`` (the share
    of description parts right, :func:`~samcache.tasks.visual_qa.described_parts`) and
    ``wrong_after_exact_description`` (wrong answers whose description was right in every part).

    ``attention``: the image attention to serve the model with (a name; None: what the checkpoint
    declares). Causal attention decodes with Hugging Face's ``generate``; isolated attention with
    samcache's engine (every image computed alone), the path that serves it."""
    import torch

    from samcache.engine.loading import load_processor
    from samcache.bench.task_accuracy import training_defaults, wilson_interval
    from samcache.random_checkpoints import model_class
    from samcache.tasks import visual_qa
    from samcache.profile.image_attention import ImageAttention, declared
    from samcache.tasks.training import evaluate

    check_int("examples", examples, 1)
    check_int("start", start, 0)
    check_int("threads", threads, 1)
    images = list(images)
    if not images:
        raise ValueError("images must name at least one image count")
    for n in images:
        check_int("images", n, 1)
    folder = pathlib.Path(path)
    record = folder / "training.json"
    if not record.is_file():
        raise ValueError(f"{folder} has no training.json: not a checkpoint trained by samcache.tasks.training")
    config = json.loads(record.read_text()).get("config", {})
    trained = training_defaults(folder)
    torch.set_num_threads(threads)
    served = declared(folder) if attention is None else ImageAttention.parse(attention)
    if not served.isolated:
        model = model_class("qwen2_5_vl").from_pretrained(folder, dtype=torch.float32)
        processor = load_processor(folder)
    out = {"checkpoint": str(folder), "start": start, "seed": int(config.get("seed", 0)),
           "image_attention": served.name}
    dense = trained.get("dense", False)
    for n in images:
        exs = [visual_qa.make_example(visual_qa.split_seed("test", i, out["seed"]), num_images=n,
                                      kind=trained.get("kind", "gui"), size=trained.get("size", visual_qa.DEFAULT_SIZE))
               for i in range(start, start + examples)]
        if served.isolated:
            got = {"replies": _engine_replies(folder, served, exs, visual_qa.messages, dense, progress)}
        else:
            shown = exs
            if progress:
                from tqdm import tqdm

                shown = tqdm(exs, desc=f"scoring {n} image(s)", unit="question")
            got = evaluate(model, processor, shown, visual_qa.messages, dense=dense, replies=True)
        right = [visual_qa.is_correct(reply, ex.answer) for ex, reply in zip(exs, got["replies"])]
        correct = sum(right)
        result = {"accuracy": correct / len(exs), "correct": correct, "examples": len(exs),
                  "interval": list(wilson_interval(correct, len(exs))), "by_question": {}}
        for ex, ok in zip(exs, right):
            tally = result["by_question"].setdefault(ex.question_type, {"examples": 0, "correct": 0})
            tally["examples"] += 1
            tally["correct"] += ok
        if dense:
            parts = [visual_qa.described_parts(reply, ex.specs) for ex, reply in zip(exs, got["replies"])]
            result["described_parts"] = sum(map(sum, parts)) / max(1, sum(map(len, parts)))
            result["wrong_after_exact_description"] = sum(not ok and all(p) for ok, p in zip(right, parts))
        out[f"{n}_image"] = result
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a folder written by samcache.tasks.training (or a shipped checkpoint)")
    parser.add_argument("--examples", type=int, default=200, help="questions per image count")
    parser.add_argument("--images", type=int, nargs="+", default=[1, 4], help="image counts to score")
    parser.add_argument("--start", type=int, default=START, help="first test example")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attention", default=None, metavar="NAME",
                        help="serve the model with this image attention (causal, isolated, ...; default: what the "
                             "checkpoint declares)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    try:
        result = score_checkpoint(args.checkpoint, examples=args.examples, images=args.images, start=args.start,
                                  threads=args.threads, attention=args.attention)
    except (ValueError, OSError) as e:
        print(f"samcache.tasks.heldout: {e}", file=sys.stderr)
        return 2
    for n in args.images:
        r = result[f"{n}_image"]
        lo, hi = r["interval"]
        print(f"{n} image(s): {r['accuracy']:.1%} ({r['correct']}/{r['examples']}) [{lo:.1%}, {hi:.1%}]")
        print("  by question: " + ", ".join(f"{q} {t['correct']}/{t['examples']}" for q, t in sorted(r["by_question"].items())))
        if "described_parts" in r:
            print(f"  description parts right: {r['described_parts']:.1%}; wrong answers after an exact "
                  f"description: {r['wrong_after_exact_description']} of {r['examples'] - r['correct']}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
