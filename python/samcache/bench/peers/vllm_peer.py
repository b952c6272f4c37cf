"""Serve a samcache benchmark trace with vLLM, in vLLM's own environment.

This file runs under vLLM's Python (``make vllm-env`` builds that environment: vLLM pins
``transformers<5.20``, samcache's tests pin 5.23), so it imports nothing from samcache; the
benchmark (:mod:`samcache.bench.peers.vllm_launcher`) starts it and reads its result file::

    python vllm_peer.py REQUEST.json RESULT.json

REQUEST holds the checkpoint, the engine settings and the turns; images are PNG files, all
decoded before any timing (samcache's modes get decoded arrays too). Each turn is one request
with ``max_tokens=1`` (temperature 0): its wall time is request -> first token (chat template,
image processing, encoder, prefill, sampling), as samcache's TTFT. A turn may ask for a greedy
reply of ``max_tokens`` instead (task accuracy): its wall time is then ``latency_s``, and ``text``
is the reply. RESULT holds, per turn, that
time, the prompt length and how many prompt tokens vLLM's prefix cache supplied.

With ``"samcache": {...}`` in REQUEST the run enables samcache's vLLM plugin (installed in this
environment; vLLM loads it through its plugin entry point) with that ``kv_connector_extra_config``,
and records the plugin's counters after every turn. ``"logprobs": true`` records every turn's
first-token log-probabilities over the whole vocabulary (fidelity against another run).
"""

from __future__ import annotations

import json
import os
import sys
import time


def step_budget(model: str, max_model_len: int) -> dict:
    """vLLM's step budget: a whole prompt in one step; for a checkpoint that declares isolated image
    attention (config.json's ``samcache_image_attention``, read here as samcache reads it), the
    same with and without the plugin, every image whole in one step (the plugin computes a
    first-seen image alone) with room for the largest image."""
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        attention = json.load(f).get("samcache_image_attention") or {}
    if attention.get("mode") != "isolated":
        return {"max_num_batched_tokens": max_model_len}
    return {"max_num_batched_tokens": max(max_model_len, 16384), "disable_chunked_mm_input": True}


def main(request_path: str, result_path: str) -> int:
    from PIL import Image

    import vllm
    from vllm import LLM, SamplingParams

    req = json.loads(open(request_path, encoding="utf-8").read())
    images = {key: Image.open(path).convert("RGB") for key, path in req["images"].items()}
    for im in images.values():
        im.load()

    def messages(turn):
        out = []
        for m in turn["messages"]:
            if isinstance(m["content"], str):
                out.append(m)
                continue
            parts = [{"type": "image_pil", "image_pil": images[p["image"]]} if p["type"] == "image" else p
                     for p in m["content"]]
            out.append({"role": m["role"], "content": parts})
        return out

    extra = {}
    samcache = req.get("samcache")
    metrics_path = os.path.join(os.path.dirname(os.path.abspath(result_path)), "samcache-metrics.json")
    if samcache is not None:
        from vllm.config import KVTransferConfig

        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="SamcacheConnector", kv_role="kv_both",
            kv_connector_extra_config={**samcache, "metrics_path": metrics_path})
    logprobs = bool(req.get("logprobs"))
    if logprobs:
        extra["max_logprobs"] = -1
    start = time.perf_counter()
    llm = LLM(model=req["model"], dtype=req.get("dtype", "float32"), enforce_eager=True, block_size=req["block_size"],
              max_model_len=req["max_model_len"],
              limit_mm_per_prompt={"image": max(1, req["max_images"])}, enable_prefix_caching=True, seed=req["seed"],
              **step_budget(req["model"], req["max_model_len"]), **extra)
    startup = time.perf_counter() - start
    first = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1 if logprobs else None)
    for warm in req.get("warmup", []):  # first-call costs out of the first measured turn
        llm.chat(messages(warm), first, use_tqdm=False)
    turns = []
    for turn in req["turns"]:
        # A reply of max_tokens (greedy): its wall time is then the turn's latency, not its TTFT.
        params = first if turn.get("max_tokens", 1) == 1 else SamplingParams(
            max_tokens=turn["max_tokens"], temperature=0.0, logprobs=-1 if logprobs else None)
        t0 = time.perf_counter()
        out = llm.chat(messages(turn), params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
        record = {"ttft_s" if params is first else "latency_s": elapsed, "prompt_tokens": len(out.prompt_token_ids),
                  "cached_tokens": int(out.num_cached_tokens or 0), "token_ids": list(out.outputs[0].token_ids),
                  "text": out.outputs[0].text}
        if logprobs:
            first_token = out.outputs[0].logprobs[0]
            record["first_logprobs"] = [first_token[i].logprob for i in sorted(first_token)]
        if samcache is not None and os.path.exists(metrics_path):
            with open(metrics_path, encoding="utf-8") as f:
                record["samcache"] = json.load(f)
        turns.append(record)
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump({"vllm_version": vllm.__version__, "startup_s": startup, "turns": turns}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
