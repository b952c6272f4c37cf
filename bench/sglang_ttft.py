"""TTFT of an agent trace on a real SGLang server, with and without samcache's plugin (GPU).

For each mode the script starts ``python -m sglang.launch_server`` on the model, waits for
``/health``, replays a samcache agent trace (``gui``: a sliding window of 1280x720 screenshots;
``branch``: sub-agents with their own system prompts over the same screenshots) through SGLang's
OpenAI-compatible ``/v1/chat/completions`` with streaming, records each turn's time to first token,
and stops the server. Modes:

- ``sglang``: SGLang as users run it (its radix cache and ViT cache; samcache off:
  ``SAMCACHE_SGLANG_PLUGIN=0``);
- ``sglang-samcache``: ``--attention-backend samcache --radix-cache-backend samcache`` with CUDA
  graphs off (samcache's backend has no CUDA-graph support yet).

The exact command a user with SGLang on a GPU runs::

    pip install samcache            # next to sglang (>=0.5.23,<0.6)
    python bench/sglang_ttft.py --model Qwen/Qwen2.5-VL-7B-Instruct --scenario gui --turns 12 \\
        --out bench/out/sglang-ttft

which starts, one after the other::

    SAMCACHE_SGLANG_PLUGIN=0 python -m sglang.launch_server --model-path MODEL --port 30000
    python -m sglang.launch_server --model-path MODEL --port 30000 \\
        --attention-backend samcache --radix-cache-backend samcache \\
        --cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled

``--url http://host:port --modes NAME`` measures a server already running instead (one mode).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterable

from samcache.bench.openai_http import openai_messages, wait_healthy

SAMCACHE_FLAGS = ["--attention-backend", "samcache", "--radix-cache-backend", "samcache",
                  "--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled"]
MODES = {"sglang": ([], {"SAMCACHE_SGLANG_PLUGIN": "0"}), "sglang-samcache": (SAMCACHE_FLAGS, {})}


def stream_ttft(url: str, model: str, messages: list[dict], max_tokens: int, timeout: float = 600.0) -> tuple[float, str]:
    """Send one streaming chat completion; return (seconds to the first generated token, text)."""
    parsed = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=timeout)
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:500]!r}")
    first, text = None, []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        delta = (json.loads(data).get("choices") or [{}])[0].get("delta", {})
        if delta.get("content"):
            if first is None:
                first = time.perf_counter() - start
            text.append(delta["content"])
    conn.close()
    if first is None:
        raise RuntimeError(f"{url}: the stream ended without a generated token")
    return first, "".join(text)


def replay(url: str, model: str, turns: Iterable, max_tokens: int) -> list[dict]:
    out = []
    for i, turn in enumerate(turns):
        ttft, text = stream_ttft(url, model, openai_messages(turn), max_tokens)
        out.append({"turn": i, "label": turn.label, "ttft_s": ttft, "text": text})
        print(f"  turn {i:2d} {turn.label:>14}: TTFT {ttft * 1000:8.1f} ms", flush=True)
    return out


def summarize(turns: list[dict], skip_first: int) -> dict:
    steady = [t["ttft_s"] for t in turns[skip_first:]] or [t["ttft_s"] for t in turns]
    return {"p50_s": statistics.median(steady), "mean_s": statistics.fmean(steady), "turns": len(steady)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint path or name (as SGLang's --model-path)")
    parser.add_argument("--scenario", default="gui", choices=["gui", "branch", "docs", "chat"])
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--modes", default="sglang,sglang-samcache")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--url", default=None, help="measure a running server (one mode) instead of launching")
    parser.add_argument("--server-args", default="", help="extra arguments for sglang.launch_server")
    parser.add_argument("--startup-timeout", type=float, default=1200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from samcache.bench.workloads import make_trace

    params = {"turns": args.turns} if args.scenario in ("gui", "docs", "chat") else {}
    trace = make_trace(args.scenario, seed=args.seed, **params)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {sorted(MODES)}")
    if args.url and len(modes) != 1:
        parser.error("--url measures one running server: name its one mode with --modes")
    results = {"model": args.model, "scenario": args.scenario, "trace": trace.summary(), "modes": {}}
    for mode in modes:
        flags, env = MODES[mode]
        print(f"{mode}:", flush=True)
        proc = None
        url = args.url
        if url is None:
            url = f"http://127.0.0.1:{args.port}"
            cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model, "--port", str(args.port),
                   *flags, *args.server_args.split()]
            print("  $", " ".join(cmd), flush=True)
            proc = subprocess.Popen(cmd, env={**os.environ, **env})
        try:
            wait_healthy(url, proc, args.startup_timeout)
            turns = replay(url, args.model, trace.turns, args.max_tokens)
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        results["modes"][mode] = {"turns": turns, "steady": summarize(turns, skip_first=1)}
    if "sglang" in results["modes"] and "sglang-samcache" in results["modes"]:
        a, b = results["modes"]["sglang"]["steady"], results["modes"]["sglang-samcache"]["steady"]
        results["speedup"] = {"p50": a["p50_s"] / b["p50_s"], "mean": a["mean_s"] / b["mean_s"]}
        print(f"steady-state TTFT speedup: {results['speedup']['p50']:.2f}x p50, {results['speedup']['mean']:.2f}x mean")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
