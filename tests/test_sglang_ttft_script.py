"""bench/sglang_ttft.py, the GPU TTFT script for SGLang, replayed against a local server speaking
the OpenAI streaming protocol (SGLang's server cannot run here): the trace's screenshots arrive as
1280x720 PNGs, the time to the first streamed token is measured, results are written."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import pathlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parents[1]
DELAY = 0.05


def _script():
    spec = importlib.util.spec_from_file_location("sglang_ttft", ROOT / "bench" / "sglang_ttft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def server():
    received = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n')
            self.wfile.flush()
            time.sleep(DELAY)  # prefill
            for word in ("Click", " OK"):
                self.wfile.write(f'data: {json.dumps({"choices": [{"delta": {"content": word}}]})}\n\n'.encode())
            self.wfile.write(b"data: [DONE]\n\n")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", received
    httpd.shutdown()


def test_replays_trace_and_measures_ttft(server, tmp_path):
    url, received = server
    script = _script()
    assert script.main(["--model", "m", "--url", url, "--modes", "sglang-samcache", "--turns", "3",
                        "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    turns = results["modes"]["sglang-samcache"]["turns"]
    assert len(turns) == 3 and all(t["ttft_s"] >= DELAY and t["text"] == "Click OK" for t in turns)
    assert len(received) == 3 and all(r["stream"] and r["model"] == "m" for r in received)
    urls = [p["image_url"]["url"] for m in received[-1]["messages"] if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "image_url"]
    assert urls
    image = Image.open(io.BytesIO(base64.b64decode(urls[0].split(",", 1)[1])))
    assert image.size == (1280, 720)


def test_refuses_bad_arguments(server):
    url, _ = server
    script = _script()
    with pytest.raises(SystemExit):
        script.main(["--model", "m", "--url", url, "--modes", "sglang,sglang-samcache"])
    with pytest.raises(SystemExit):
        script.main(["--model", "m", "--modes", "vllm"])


def test_samcache_mode_launches_with_the_plugin_flags():
    script = _script()
    flags, env = script.MODES["sglang-samcache"]
    assert flags[:4] == ["--attention-backend", "samcache", "--radix-cache-backend", "samcache"] and not env
    assert script.MODES["sglang"] == ([], {"SAMCACHE_SGLANG_PLUGIN": "0"})
