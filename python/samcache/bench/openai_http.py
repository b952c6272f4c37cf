"""Agent traces through an OpenAI-compatible server: the helpers the HTTP benchmarks share
(``bench/bench_serve_http.py``, ``bench/sglang_ttft.py``)."""

from __future__ import annotations

import base64
import io
import pathlib
import subprocess
import time
import urllib.request
from collections.abc import Callable

import numpy as np


def png_data_url(pixels) -> str:
    """An HxWx3 uint8 image as a PNG data URL."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(pixels)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def openai_messages(turn, url_of: Callable | None = None) -> list[dict]:
    """A trace turn (``samcache.bench.workloads.Turn``) as OpenAI chat messages, each image as the
    data URL ``url_of(image_ref)`` gives (default: encoded now)."""
    from samcache.bench.workloads import materialize

    url_of = url_of or (lambda ref: png_data_url(materialize(ref)))
    out = []
    for m in turn.messages:
        if isinstance(m["content"], str):
            out.append({"role": m["role"], "content": m["content"]})
            continue
        out.append({"role": m["role"], "content": [
            {"type": "image_url", "image_url": {"url": url_of(p["image"])}} if p.get("type") == "image"
            else {"type": "text", "text": p["text"]} for p in m["content"]]})
    return out


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float, log: pathlib.Path | None = None) -> None:
    """Wait until ``url``/health answers 200; raise if ``proc`` exits first (with the end of
    ``log``) or after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = ("; its log's end:\n" + log.read_text(errors="replace")[-3000:]) if log is not None else ""
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} was not healthy after {timeout:.0f} s")


__all__ = ["openai_messages", "png_data_url", "wait_healthy"]
