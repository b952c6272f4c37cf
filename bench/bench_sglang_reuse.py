"""SGLang step that re-sends 4 known 1280x720 screenshots at new positions: SGLang's own path vs
samcache's plugin, both on SGLang's real classes (CPU; run in .venv-sglang).

An agent has seen 4 screenshots; a sub-agent with its own system prompt now sends the same 4 in
another order. SGLang's radix cache cannot match past the new prefix, so its stock path prefills
every token. The same extend step, same checkpoint, same pools, two ways:

- ``stock``: SGLang's Qwen2.5-VL class with its ``torch_native`` attention backend (what SGLang runs
  on CPU); ``stock+samcache-attn``: the same model on samcache's attention backend (no reuse);
- ``samcache``: the plugin's model override + ``--attention-backend samcache``, the images' KV
  spliced at their new positions and ``--recompute`` of it recomputed.

Both read the ViT outputs from SGLang's own embedding cache (warmed by the first turn), so the
times are the decoder's: the "layer time" of the step. Reported: the rows the first decoder layer
computes and the token-layers over all layers (samcache / stock), the step time ratio
(median of ``--reps`` interleaved runs), and the next-token KL against the stock step.

    .venv-sglang/bin/python bench/bench_sglang_reuse.py [--threads 2] [--reps 5] [--out bench/out/sglang]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "sglang_plugin"))
import sglang_harness as H  # noqa: E402  (SGLang's classes on CPU: the plugin tests' harness)

SCREENSHOT_GRID = (1, 52, 92)  # a 1280x720 screenshot: 1288x728 after resizing, 14-pixel patches


def bench_config():
    """A small Qwen2.5-VL (text: 6 layers, hidden 512, GQA 8/2, head_dim 64) with a one-block
    vision tower: the decoder is what is measured."""
    return H.tiny_qwen2_5_vl_config(
        text_config=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12],
                                                                 "rope_theta": 1000000.0}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=1, out_hidden_size=512,
                           fullatt_block_indexes=[0]))


def turns():
    """Turn 1 (stores the screenshots) and the sub-agent's turn (same screenshots, new prefix and order)."""
    text = lambda n, seed: [(seed * 37 + 11 * i) % H.TEXT_VOCAB for i in range(n)]  # noqa: E731
    first = [text(48, 1), SCREENSHOT_GRID, text(6, 2), SCREENSHOT_GRID, text(6, 3), SCREENSHOT_GRID, text(6, 4),
             SCREENSHOT_GRID, text(40, 5)]
    second = [text(96, 6), SCREENSHOT_GRID, text(6, 7), SCREENSHOT_GRID, text(6, 8), SCREENSHOT_GRID, text(6, 9),
              SCREENSHOT_GRID, text(64, 10)]
    return first, second


def _kl(p_logits, q_logits) -> float:
    p = torch.log_softmax(p_logits.double().flatten(), 0)
    q = torch.log_softmax(q_logits.double().flatten(), 0)
    return float((p.exp() * (p - q)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--recompute", type=float, default=0.05, help="recompute ratio of reused image tokens")
    parser.add_argument("--out", default=None, help="folder for results.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from samcache.integrations.settings import ReuseSettings
    from samcache.integrations.sglang.attention import SamcacheAttnBackend
    from samcache.integrations.sglang.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Override
    from samcache.integrations.sglang.reuse import ModelReuse, reset_stats, stats
    from samcache.cache.stores import TensorStore
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    H.setup_sglang()
    H.reset_mm_embedding_cache(1 << 30)
    config = bench_config()
    stock = H.build_qwen2_5_vl(config, seed=0)
    model = H._build_from_hf(Override, config, 0, H.hf_reference_qwen2_5_vl)
    model._samcache_reuse = ModelReuse(model, ReuseSettings(recompute_ratio=args.recompute, keep_image_order=False),
                                       TensorStore("bench", 1 << 31))
    first_parts, second_parts = turns()
    first = H.prompt_with_images(config, first_parts, seed=0)
    second_ids, second_items = H.prompt_with_images(config, second_parts, seed=0)
    for i, item in enumerate(second_items):  # the same 4 screenshots, in reverse order
        item.feature = first[1][len(second_items) - 1 - i].feature.clone()
    second = (second_ids, second_items)

    def step(m, backend, prompt):
        pools = H.Pools.for_model(m, num_slots=16384, max_reqs=4, max_context_len=8192, backend_factory=backend)
        req = H.Request.create(m, pools, *prompt)
        start = time.perf_counter()
        out = H.run_batch(m, pools, [req.extend()], capture_full_hidden=False)
        return time.perf_counter() - start, out

    step(model, SamcacheAttnBackend, first)          # turn 1: stores the screenshots' KV, warms the ViT cache
    step(stock, TorchNativeAttnBackend, second)      # warm-up (first-call costs) for every mode
    step(stock, SamcacheAttnBackend, second)
    reset_stats()
    step(model, SamcacheAttnBackend, second)
    s = stats()
    times = {"stock": [], "stock+samcache-attn": [], "samcache": []}
    outs = {}
    for _ in range(args.reps):
        for name, (m, backend) in {"stock": (stock, TorchNativeAttnBackend),
                                   "stock+samcache-attn": (stock, SamcacheAttnBackend),
                                   "samcache": (model, SamcacheAttnBackend)}.items():
            t, out = step(m, backend, second)
            times[name].append(t)
            outs[name] = out.next_token_logits
    med = {k: statistics.median(v) for k, v in times.items()}
    layers = config.text_config.num_hidden_layers
    scheduled = s.prompt_tokens
    token_layers = (scheduled - s.image_reused_tokens) * layers + s.recomputed_token_layers
    result = dict(
        device="cpu", threads=args.threads, reps=args.reps, recompute_ratio=args.recompute,
        prompt_tokens=len(second_ids), image_tokens=s.image_reused_tokens, image_kv_hits=s.image_kv_hits,
        first_layer_rows=dict(stock=scheduled, samcache=s.computed_tokens, ratio=s.computed_tokens / scheduled),
        token_layers=dict(stock=scheduled * layers, samcache=token_layers, ratio=token_layers / (scheduled * layers)),
        step_seconds=med, step_ratio_vs_stock={k: v / med["stock"] for k, v in med.items()},
        speedup_vs_stock=med["stock"] / med["samcache"],
        next_token_kl_vs_stock=_kl(outs["stock"], outs["samcache"]),
        attn_backend_kl_vs_stock=_kl(outs["stock"], outs["stock+samcache-attn"]),
    )
    print(json.dumps(result, indent=2))
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
