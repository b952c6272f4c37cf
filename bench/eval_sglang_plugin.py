"""The SGLang plugin on the trained checkpoint: its replies against samcache's own engine's.

SGLang's engine needs sgl-kernel, which has no CPU build on PyPI, so the SGLang side runs SGLang's
real classes the way its scheduler drives them (the plugin tests' harness,
``tests/sglang_plugin/sglang_harness.py``): its Qwen2.5-VL class with the checkpoint's weights
loaded through its own ``load_weights``, its KV pools, its ``ForwardBatch``, and a prefix hit on
the earlier turns' KV where their padded token ids match (what its radix cache does), in whole
pages of ``--page-size`` tokens (default 16: the engine's KV block, so that both sides take the
same prefix and splice the same spans; a hit can then end inside an image).

Two parts, in two environments:

1. samcache's environment: the held-out traces of ``samcache eval`` (same seeds), each turn's
   prompt as samcache's engine renders it (token ids, the processor's patches and grids), and the
   engine's greedy reply at full prefill (``baseline``) and with image KV reused at any index at the
   plugin's settings (``uniform-budget`` with the plugin's own method object: two-track's second
   track in position order, as the plugin has no relevance scores). Written to
   ``<out>/prompts.pt``; then part 2 is launched in ``.venv-sglang`` (``make sglang-plugin``).
2. ``.venv-sglang``: each turn through SGLang's own path (``stock``, torch_native attention) and
   through the plugin (its model override and attention backend, the image-KV store per trace as
   the engine's, ``keep_image_order=False``): the greedy reply (decoded on SGLang's decode path
   up to the turn's budget or an end token), and the plugin's counters.

For a checkpoint that declares isolated image attention (``visual-qa-isolated``) the plugin
serves it as such (its reuse profile): first-seen images computed alone in side rows, known ones
reused exactly at any index; SGLang's own path computes the images in context, which is not that
model's attention, so only the plugin's agreement means anything there.

Reported (``<out>/results.json``): how often SGLang's own path gives the engine's full-prefill
reply and the plugin gives the engine's reply at the same settings (first token, whole reply),
each side's task accuracy, the image tokens each reused and the (token, layer) pairs each
recomputed.

    python bench/eval_sglang_plugin.py --traces 40 --method two-track --recompute 0.05 --out bench/out/sglang-agreement
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "python" / "samcache" / "tasks" / "checkpoints" / "visual-qa"


def prompts_and_engine_tokens(args, settings) -> dict:
    """Part 1: the prompts of every turn and the engine's reply at both settings (``settings``:
    the plugin's, whose recompute method the engine runs too)."""
    from samcache.bench.benchmark import mode_engine_kwargs
    from samcache.engine.api import SAMcacheEngine
    from samcache.bench.task_accuracy import training_defaults
    from samcache.tasks import visual_qa
    from tqdm import tqdm

    trained = training_defaults(args.model)
    size = trained.get("size", visual_qa.DEFAULT_SIZE)
    traces = [visual_qa.trace(visual_qa.split_seed("test", i, args.seed), scenario=args.scenario, size=size,
                              dense=trained.get("dense", False)) for i in range(args.traces)]
    shared = SAMcacheEngine(args.model, kv_cache_bytes=1 << 20)
    base = {"kv_cache_bytes": 1 << 28, "share_weights_with": shared, "keep_image_order": False}
    method = settings.budget(shared.runner.num_layers).method
    runs = {"baseline": mode_engine_kwargs("baseline", None, None, base),
            "reuse": {**mode_engine_kwargs("uniform-budget", args.recompute, None, base), "recompute_method": method}}
    processor = shared.processor.image_processor
    turns = []
    bar = tqdm(total=len(runs) * sum(len(t) for t in traces), desc="engine", unit="turn")
    for t, trace in enumerate(traces):
        engines = {name: SAMcacheEngine(args.model, **kw) for name, kw in runs.items()}  # each trace starts cold
        for i, turn in enumerate(trace):
            prompt = shared.build_prompt(turn.messages)
            images = []
            for span in prompt.images:
                inputs = processor(images=[span.image.pixels], return_tensors="pt", input_data_format="channels_last")
                images.append({"start": span.start, "length": span.length, "pixel_values": inputs["pixel_values"],
                               "grid": inputs["image_grid_thw"][0].tolist()})
            record = {"trace": t, "turn": i, "token_ids": prompt.token_ids.tolist(), "positions": prompt.positions,
                      "images": images, "answer": turn.answer, "max_new_tokens": turn.max_new_tokens}
            for name, engine in engines.items():
                r = engine.chat(messages=turn.messages, max_new_tokens=turn.max_new_tokens)
                record[f"engine_{name}"] = list(r.token_ids)
                record[f"engine_{name}_reused"] = r.metrics.image_reused_tokens
                record[f"engine_{name}_recomputed"] = r.metrics.recomputed_token_layers
                bar.update(1)
            turns.append(record)
    bar.close()
    return {"model": str(args.model), "scenario": args.scenario, "traces": args.traces, "method": args.method,
            "recompute": args.recompute, "num_layers": shared.runner.num_layers, "page_size": args.page_size,
            "eos_token_ids": sorted(shared.eos_token_ids), "turns": turns}


def _load_checkpoint(model_cls, path: pathlib.Path):
    """SGLang's ``model_cls`` with the checkpoint's weights, through the harness's loader."""
    import types

    import sglang_harness as H
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(path)
    state = load_file(str(path / "model.safetensors"))
    return H._build_from_hf(model_cls, config, 0, lambda c, s: types.SimpleNamespace(state_dict=lambda: state))


def sglang_tokens(data: dict, threads: int) -> list[dict]:
    """Part 2 (in .venv-sglang): each turn through SGLang's own path and through the plugin."""
    sys.path.insert(0, str(ROOT / "tests" / "sglang_plugin"))
    import sglang_harness as H
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem
    from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Stock
    from tqdm import tqdm

    from samcache.integrations.settings import ReuseSettings
    from samcache.integrations.sglang.attention import SamcacheAttnBackend
    from samcache.integrations.sglang.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Override
    from samcache.integrations.sglang.reuse import ModelReuse, reset_stats, stats
    from samcache.cache.stores import TensorStore
    import types

    torch.set_num_threads(threads)
    H.setup_sglang()  # on a free rendezvous port: the plugin tests may run beside it
    path = pathlib.Path(data["model"])
    stock, plugin = _load_checkpoint(Stock, path), _load_checkpoint(Override, path)
    # An isolated checkpoint is served as such through its reuse profile (the harness's server names
    # no model folder): first-seen images computed alone, known ones exact at any index.
    from samcache.profile.image_attention import declared
    from samcache.profile.reuse_profile import PROFILE_FILE

    isolated = declared(path).isolated
    settings = ReuseSettings(recompute_ratio=data["recompute"], recompute_method=data["method"],
                             keep_image_order=False, profile=str(path / PROFILE_FILE) if isolated else None)
    longest = max(len(t["token_ids"]) + t["max_new_tokens"] for t in data["turns"])
    eos = set(data["eos_token_ids"])
    page = data["page_size"]
    out = []
    by_trace: dict[int, list[dict]] = {}
    for record in data["turns"]:
        by_trace.setdefault(record["trace"], []).append(record)
    bar = tqdm(total=len(data["turns"]), desc="sglang", unit="turn")
    for records in by_trace.values():
        H.reset_mm_embedding_cache(1 << 30)
        plugin._samcache_reuse = ModelReuse(plugin, settings, TensorStore("eval", 1 << 31))  # cold, as the engine
        pools = {"stock": H.Pools.for_model(stock, num_slots=longest * (len(records) + 1), max_reqs=len(records) + 1,
                                            max_context_len=longest + 8, backend_factory=TorchNativeAttnBackend),
                 "plugin": H.Pools.for_model(plugin, num_slots=longest * (len(records) + 1), max_reqs=len(records) + 1,
                                             max_context_len=longest + 8, backend_factory=SamcacheAttnBackend)}
        earlier: dict[str, list] = {"stock": [], "plugin": []}
        for record in records:
            ids, items = record["token_ids"], []
            if not record["images"]:
                raise ValueError(f"trace {record['trace']} turn {record['turn']} has no image: nothing to compare")
            for image in record["images"]:
                item = MultimodalDataItem(modality=Modality.IMAGE,
                                          offsets=[(image["start"], image["start"] + image["length"] - 1)],
                                          feature=image["pixel_values"].to(H.DTYPE))
                item.set("image_grid_thw", torch.tensor([image["grid"]], dtype=torch.int64))
                items.append(item)
            row = {"trace": record["trace"], "turn": record["turn"]}
            for name, model in (("stock", stock), ("plugin", plugin)):
                req = H.Request.create(model, pools[name], ids, items)
                if name == "stock" and not torch.equal(req.mm_inputs.mrope_positions, record["positions"]):
                    raise RuntimeError(f"SGLang's M-RoPE positions differ from the engine's (trace {record['trace']}, "
                                       f"turn {record['turn']}): the prompts are not the same")
                # The radix cache's hit: the longest run of equal padded ids (image tokens carry their
                # content hash) with an earlier turn, short of the last token, in whole pages.
                hit, source = 0, None
                for prev in earlier[name]:
                    n = 0
                    limit = min(len(prev.padded_ids), len(req.padded_ids) - 1)
                    while n < limit and prev.padded_ids[n] == req.padded_ids[n]:
                        n += 1
                    n -= n % page
                    if n > hit:
                        hit, source = n, prev
                if source is not None:
                    pools[name].copy_prefix(source.row, req.row, hit)
                    req.kv_len = hit
                reset_stats()

                def record_request(fb, ids=ids):  # the plugin's batch hook: the prompt's first token (a sink)
                    fb.samcache_reqs = [types.SimpleNamespace(origin_input_ids=list(ids))]
                    return fb

                result = H.run_batch(model, pools[name], [req.extend()], capture_full_hidden=False,
                                     after_init=record_request)
                if name == "plugin":
                    s = stats()
                    row["sglang_plugin_reused"] = s.image_reused_tokens
                    row["sglang_plugin_recomputed"] = s.recomputed_token_layers
                    row["sglang_plugin_isolated"] = s.isolated_images
                    if s.isolated_fallbacks:
                        raise RuntimeError(f"trace {record['trace']} turn {record['turn']}: {s.isolated_fallbacks} "
                                           "image(s) of the isolated model could not be computed alone")
                # Greedy decode as the engine's chat does: up to the turn's budget or an end token.
                reply = [int(result.next_token_logits[0].argmax())]
                while len(reply) < record["max_new_tokens"] and reply[-1] not in eos:
                    result = H.run_batch(model, pools[name], [req.decode(reply[-1])], mode="decode",
                                         capture_full_hidden=False)
                    reply.append(int(result.next_token_logits[0].argmax()))
                row[f"sglang_{name}"] = reply
                row[f"sglang_{name}_prefix"] = hit
                row[f"sglang_{name}_prefix_ends_in_image"] = any(
                    i["start"] < hit < i["start"] + i["length"] for i in record["images"])
                earlier[name].append(req)
            out.append(row)
            bar.update(1)
    bar.close()
    return out


def summarize(data: dict, rows: list[dict]) -> dict:
    """Agreement of SGLang's replies with the engine's: the first token and the whole greedy reply,
    and each side's task accuracy (the replies scored as ``samcache eval`` scores them)."""
    import transformers

    from samcache.tasks.visual_qa import is_correct

    tokenizer = transformers.AutoTokenizer.from_pretrained(data["model"])
    turns = []
    if [(t["trace"], t["turn"]) for t in data["turns"]] != [(r["trace"], r["turn"]) for r in rows]:
        raise RuntimeError("SGLang's results do not cover the engine's turns one for one")
    for t, r in zip(data["turns"], rows):
        turn = {**{k: v for k, v in t.items() if k.startswith("engine_") or k in ("trace", "turn", "answer")}, **r}
        for name in ("engine_baseline", "engine_reuse", "sglang_stock", "sglang_plugin"):
            turn[f"{name}_correct"] = bool(is_correct(tokenizer.decode(turn[name], skip_special_tokens=True),
                                                      t["answer"]))
        turns.append(turn)
    n = len(turns)

    def agreement(a: str, b: str) -> dict:
        return {"first_token": sum(t[a][0] == t[b][0] for t in turns) / n,
                "reply": sum(t[a] == t[b] for t in turns) / n}

    total = lambda k: sum(t[k] for t in turns)  # noqa: E731
    return {
        "model": data["model"], "scenario": data["scenario"], "traces": data["traces"], "turns_compared": n,
        "method": data["method"], "recompute": data["recompute"], "keep_image_order": False,
        "sglang_stock_vs_engine_full_prefill": agreement("sglang_stock", "engine_baseline"),
        "sglang_plugin_vs_engine_reuse": agreement("sglang_plugin", "engine_reuse"),
        "sglang_plugin_vs_engine_full_prefill": agreement("sglang_plugin", "engine_baseline"),
        "engine_reuse_vs_engine_full_prefill": agreement("engine_reuse", "engine_baseline"),
        "accuracy": {name: total(f"{name}_correct") / n
                     for name in ("engine_baseline", "engine_reuse", "sglang_stock", "sglang_plugin")},
        "page_size": data["page_size"],
        "turns_whose_prefix_ends_inside_an_image": total("sglang_plugin_prefix_ends_in_image"),
        "image_reused_tokens": {"engine": total("engine_reuse_reused"), "plugin": total("sglang_plugin_reused")},
        "recomputed_token_layers": {"engine": total("engine_reuse_recomputed"),
                                    "plugin": total("sglang_plugin_recomputed")},
        "images_computed_alone_by_the_plugin": total("sglang_plugin_isolated"),
        "turns": turns,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(CHECKPOINT), help="a checkpoint trained by samcache.tasks.training")
    parser.add_argument("--scenario", default="gui", choices=("gui", "subagent", "handoff"))
    parser.add_argument("--traces", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", default="two-track", help="the repair method (both sides)")
    parser.add_argument("--recompute", type=float, default=0.05)
    parser.add_argument("--page-size", type=int, default=16,
                        help="tokens per KV page of the prefix hit (default: the engine's block size)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sglang-python", default=os.environ.get("SAMCACHE_SGLANG_PYTHON",
                                                                  str(ROOT / ".venv-sglang" / "bin" / "python")),
                        help="the Python of SGLang's environment (default: $SAMCACHE_SGLANG_PYTHON or .venv-sglang)")
    parser.add_argument("--out", default="bench/out/sglang-agreement")
    parser.add_argument("--part", choices=("all", "sglang"), default="all", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    if args.part == "sglang":
        data = torch.load(out / "prompts.pt", weights_only=False)
        (out / "sglang.json").write_text(json.dumps(sglang_tokens(data, args.threads)))
        return
    # Bad settings fail here, before any engine runs.
    from samcache.integrations.settings import ReuseSettings

    try:  # the plugin's own check: a method it cannot run, a ratio out of range
        settings = ReuseSettings(recompute_ratio=args.recompute, recompute_method=args.method, keep_image_order=False)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    for flag, value in (("--traces", args.traces), ("--page-size", args.page_size), ("--threads", args.threads)):
        if value < 1:
            raise SystemExit(f"{flag} must be >= 1, got {value}")
    if not pathlib.Path(args.sglang_python).is_file():
        raise SystemExit(f"no SGLang environment at {args.sglang_python}: run `make sglang-plugin` first")
    torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    data = prompts_and_engine_tokens(args, settings)
    torch.save(data, out / "prompts.pt")
    subprocess.run([args.sglang_python, __file__, "--part", "sglang", "--out", str(out), "--threads", str(args.threads)],
                   check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                       p for p in (str(ROOT / "python"), os.environ.get("PYTHONPATH")) if p)})
    result = summarize(data, json.loads((out / "sglang.json").read_text()))
    result["command"] = "python bench/eval_sglang_plugin.py " + " ".join(sys.argv[1:])
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "turns"}, indent=1))


if __name__ == "__main__":
    main()
