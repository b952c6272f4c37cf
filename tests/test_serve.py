"""``samcache serve`` with real clients: the ``openai`` package (sync, async, streaming) against a
server started here on a free local port, serving the shipped trained checkpoint. Replies equal the
engine's in-process replies; 16 concurrent clients playing multi-turn gui traces lose nothing; bad
input gets OpenAI-style 4xx errors and the server stays healthy; a client that leaves mid-stream
frees its blocks; a full pool answers 503; SIGTERM lets in-flight requests finish."""

import asyncio
import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # the openai client's HTTP library
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from PIL import Image  # noqa: E402

from samcache.tasks import visual_qa  # noqa: E402
from samcache.tasks.checkpoint import trained_model  # noqa: E402

KEY = "test-key"
NAME = "vqa"
MAX_LEN = 2048


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "samcache", "serve", str(trained_model()), "--port", str(self.port), "--device", "cpu",
             "--served-model-name", NAME, "--api-key", KEY, "--log-level", "warning", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("samcache serve exited:\n" + "".join(self.log))
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("samcache serve did not come up:\n" + "".join(self.log))

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def healthy(self) -> bool:
        return httpx.get(self.url + "/health", timeout=10).status_code == 200

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", str(MAX_LEN), "--max-images-per-request", "6", "--max-image-bytes", "300000",
               "--max-image-pixels", "1000000", "--batch-wait-ms", "5000")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine():
    from samcache.engine import SAMcacheEngine

    return SAMcacheEngine(trained_model(), device="cpu")


def data_url(image) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.asarray(image)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def openai_messages(messages):
    """samcache's messages (images as arrays) as OpenAI's (images as data URLs)."""
    out = []
    for m in messages:
        if isinstance(m["content"], str):
            out.append(dict(m))
            continue
        parts = [{"type": "image_url", "image_url": {"url": data_url(p["image"])}} if p["type"] == "image"
                 else {"type": "text", "text": p["text"]} for p in m["content"]]
        out.append({"role": m["role"], "content": parts})
    return out


def traces(n, turns=3):
    return [visual_qa.trace(visual_qa.split_seed("test", 500 + i, 0), scenario="gui", turns=turns, window=2,
                            size=visual_qa.DEFAULT_SIZE) for i in range(n)]


def in_process(engine, messages, max_tokens):
    return engine.chat(messages=messages, max_new_tokens=max_tokens, temperature=0.0).text


def assert_no_request_holds_blocks(server, timeout=20.0):
    """Every sequence left in the pool is an image record; no request is running."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if m["samcache_running_requests"] == 0 and m["samcache_live_sequences"] == m["samcache_image_kv_records"]:
            return m
        assert time.time() < deadline, f"blocks still held: {m}"
        time.sleep(0.1)


def test_sync_async_and_streamed_replies_equal_the_engine_in_process(server, engine):
    turn = traces(1)[0][1]
    want = in_process(engine, turn.messages, 24)
    client = server.client()
    reply = client.chat.completions.create(model=NAME, messages=openai_messages(turn.messages), max_tokens=24,
                                           temperature=0)
    assert reply.choices[0].message.content == want
    usage = reply.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    again = client.chat.completions.create(model=NAME, messages=openai_messages(turn.messages), max_tokens=24,
                                           temperature=0)
    assert again.choices[0].message.content == want
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the second time its prefix came from the cache
    assert again.usage.model_extra["samcache"]["prefix_reused_tokens"] > 0

    stream = client.chat.completions.create(model=NAME, messages=openai_messages(turn.messages), max_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, finish, streamed_usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            streamed_usage = chunk.usage
    assert "".join(pieces) == want and finish in ("stop", "length")
    assert streamed_usage is not None and streamed_usage.completion_tokens == usage.completion_tokens

    async def async_reply():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        got = await aclient.chat.completions.create(model=NAME, messages=openai_messages(turn.messages),
                                                    max_tokens=24, temperature=0)
        await aclient.close()
        return got.choices[0].message.content

    assert asyncio.run(async_reply()) == want
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]


def test_requests_sent_together_are_prefilled_in_one_step(server):
    """The server announces each chat request as its headers arrive, before its body is read and
    parsed: four whose bodies are still on the way when the first is submitted are prefilled in
    one step with it. Every announcement comes back, so a lone request after them is not held
    (the server waits up to --batch-wait-ms 5000)."""
    trace = traces(4, turns=1)
    bodies = [json.dumps({"model": NAME, "messages": openai_messages(t[0].messages), "max_tokens": 3,
                          "temperature": 0, "ignore_eos": True}).encode() for t in trace]
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    sent_headers = threading.Barrier(len(trace))
    replies = [None] * len(trace)

    def send(i):
        def body():  # the headers and a first piece, then the rest once every request's headers are out
            yield bodies[i][:10]
            sent_headers.wait()
            time.sleep(1.0 + 0.05 * i)  # the server has seen every request's headers; request 0 completes first
            yield bodies[i][10:]

        replies[i] = httpx.post(server.url + "/v1/chat/completions", content=body(), headers=headers, timeout=120)

    before = server.metrics()
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(trace))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    together = server.metrics()
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    assert all(r.json()["usage"]["completion_tokens"] == 3 for r in replies)
    assert together["samcache_steps_total"] - before["samcache_steps_total"] == 3  # one prefill step, two decodes
    assert 0 < together["samcache_batch_wait_seconds_total"] - before["samcache_batch_wait_seconds_total"] < 4
    lone = server.client().chat.completions.create(model=NAME, messages=openai_messages(trace[0][0].messages),
                                                   max_tokens=2, temperature=0)
    assert lone.usage.completion_tokens >= 1
    after = assert_no_request_holds_blocks(server)
    assert after["samcache_batch_wait_seconds_total"] - together["samcache_batch_wait_seconds_total"] < 1


def test_a_request_without_the_key_is_not_announced_and_holds_nobody_back(server):
    """A client without the API key that trickles its body is not announced: a keyed request sent
    meanwhile starts at once instead of waiting for it (--batch-wait-ms 5000)."""
    trickling = threading.Event()

    def body():
        yield b'{"model": "'
        trickling.set()
        time.sleep(2.0)
        yield NAME.encode() + b'", "messages": [{"role": "user", "content": "hi"}]}'

    keyless = []
    intruder = threading.Thread(target=lambda: keyless.append(httpx.post(
        server.url + "/v1/chat/completions", content=body(), headers={"content-type": "application/json"},
        timeout=60)))
    before = server.metrics()
    intruder.start()
    assert trickling.wait(30)
    time.sleep(0.3)  # its headers are at the server
    reply = server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hello"}],
                                                    max_tokens=2, temperature=0)
    waited = server.metrics()["samcache_batch_wait_seconds_total"] - before["samcache_batch_wait_seconds_total"]
    intruder.join(60)
    assert reply.usage.completion_tokens >= 1 and waited < 1.0
    assert keyless[0].status_code == 401
    assert_no_request_holds_blocks(server)


def test_stop_strings_cut_the_reply_where_the_engine_would_have_gone_on(server, engine):
    turn = traces(1)[0][0]
    full = in_process(engine, turn.messages, 40)
    stop = full[5:8]
    assert stop and full.find(stop) >= 0
    reply = server.client().chat.completions.create(model=NAME, messages=openai_messages(turn.messages),
                                                    max_tokens=40, temperature=0, stop=[stop])
    assert reply.choices[0].message.content == full[:full.find(stop)]
    assert reply.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in server.client().chat.completions.create(
        model=NAME, messages=openai_messages(turn.messages), max_tokens=40, temperature=0, stop=stop, stream=True)
        if c.choices]
    assert "".join(pieces) == full[:full.find(stop)]


def test_sixteen_concurrent_clients_playing_gui_traces_get_the_replies_served_alone(server, engine):
    plays = traces(16)
    got: dict[tuple[int, int], str] = {}
    errors = []
    start = assert_no_request_holds_blocks(server)

    def agent(i):
        try:
            client = server.client(timeout=300)
            for t, turn in enumerate(plays[i]):
                stream = (i + t) % 2 == 0
                kw = dict(model=NAME, messages=openai_messages(turn.messages), max_tokens=16, temperature=0)
                if stream:
                    got[i, t] = "".join(c.choices[0].delta.content or "" for c in
                                        client.chat.completions.create(stream=True, **kw) if c.choices)
                else:
                    got[i, t] = client.chat.completions.create(**kw).choices[0].message.content
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert len(got) == 16 * 3
    for (i, t), text in got.items():
        assert text == in_process(engine, plays[i][t].messages, 16), (i, t)
    end = assert_no_request_holds_blocks(server)
    ok = "samcache_requests_total{outcome=\"ok\"}"  # absent until a first request ended well
    assert end[ok] - start.get(ok, 0) == 48
    assert server.healthy()


def bad_requests():
    good = traces(1)[0][0]
    msgs = openai_messages(good.messages)
    image = next(p for m in msgs if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image_url")

    def with_image(url):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is this?"}]}]

    buf = io.BytesIO()
    Image.new("RGB", (2000, 2000)).save(buf, format="PNG")  # small file, 4 M pixels
    huge_pixels = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    noise = "data:image/png;base64," + base64.b64encode(np.random.default_rng(0).bytes(400_000)).decode()
    base = {"model": NAME, "max_tokens": 4}
    return [
        ("malformed JSON", b"{not json", 400),
        ("messages not a list", {**base, "messages": "hello"}, 400),
        ("no messages", {**base, "messages": []}, 400),
        ("temperature of the wrong type", {**base, "messages": msgs, "temperature": "hot"}, 400),
        ("max_tokens 0", {**base, "messages": msgs, "max_tokens": 0}, 400),
        ("n = 2", {**base, "messages": msgs, "n": 2}, 400),
        ("logprobs", {**base, "messages": msgs, "logprobs": True}, 400),
        ("unknown role", {**base, "messages": [{"role": "robot", "content": "hi"}]}, 400),
        ("not an image", {**base, "messages": with_image("data:image/png;base64," + base64.b64encode(b"hello").decode())}, 400),
        ("invalid base64", {**base, "messages": with_image("data:image/png;base64,@@@")}, 400),
        ("oversized image", {**base, "messages": with_image(noise)}, 413),
        ("too many pixels", {**base, "messages": with_image(huge_pixels)}, 413),
        ("an http URL", {**base, "messages": with_image("https://example.com/a.png")}, 400),
        ("a local path", {**base, "messages": with_image("/etc/passwd")}, 400),
        ("too many images", {**base, "messages": [{"role": "user", "content": [image] * 7 + [
            {"type": "text", "text": "seven"}]}]}, 400),
        ("prompt over max-model-len", {**base, "messages": [{"role": "user", "content": "word " * (MAX_LEN + 10)}]}, 400),
        ("max_tokens past max-model-len", {**base, "messages": msgs, "max_tokens": MAX_LEN}, 400),
        ("unknown model", {**base, "model": "gpt-4o", "messages": msgs}, 404),
    ]


def test_bad_input_gets_an_openai_error_and_the_server_stays_healthy(server):
    for what, body, status in bad_requests():
        headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(server.url + "/v1/chat/completions", headers=headers, content=payload, timeout=60)
        assert r.status_code == status, (what, r.status_code, r.text)
        error = r.json()["error"]
        assert error["message"] and error["code"] == status, what
        assert server.healthy(), what
    for headers in ({}, {"authorization": "Bearer wrong"}):
        r = httpx.get(server.url + "/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    # The server still answers.
    reply = server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens <= 3
    assert_no_request_holds_blocks(server)


def cancelled(server) -> float:
    return server.metrics().get('samcache_requests_total{outcome="cancelled"}', 0.0)


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server):
    turn = traces(1)[0][0]
    before = cancelled(server)
    client = server.client()
    # No max_tokens: it would decode up to max_model_len (about 1,900 tokens) with ignore_eos.
    stream = client.chat.completions.create(model=NAME, messages=openai_messages(turn.messages), temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    for seen, _ in enumerate(stream):
        if seen == 3:
            break
    stream.close()
    assert_no_request_holds_blocks(server)
    assert cancelled(server) == before + 1  # ended by the disconnect, not by running to its end
    assert server.healthy()


def test_a_client_that_gives_up_on_a_plain_request_frees_its_blocks(server):
    turn = traces(1)[0][0]
    before = cancelled(server)
    client = server.client(timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model=NAME, messages=openai_messages(turn.messages), temperature=0,
                                       extra_body={"ignore_eos": True})
    assert_no_request_holds_blocks(server)
    assert cancelled(server) == before + 1
    assert server.healthy()


def test_sessions_hold_a_conversation_and_fork_it_for_a_sub_agent(server):
    """extra_body session / fork_of / end_session: replies equal the same requests without a
    session, a later turn reuses the held prefix, a request that does not continue its session is
    refused, and closed sessions leave no block held."""
    client = server.client()
    trace = traces(1)[0]
    ask = lambda messages, **extra: client.chat.completions.create(  # noqa: E731
        model=NAME, messages=messages, max_tokens=12, temperature=0, extra_body=extra or None)
    m1 = openai_messages(trace[0].messages)
    r1 = ask(m1, session="planner").choices[0].message.content
    assert r1 == ask(m1).choices[0].message.content
    m2 = m1 + [{"role": "assistant", "content": r1}, openai_messages(trace[1].messages)[-1]]
    second = ask(m2, session="planner")
    assert second.choices[0].message.content == ask(m2).choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the held history's KV
    m3 = m2 + [{"role": "assistant", "content": second.choices[0].message.content},
               openai_messages(trace[2].messages)[-1]]
    forked = ask(m3, session="worker", fork_of="planner")
    assert forked.choices[0].message.content == ask(m3).choices[0].message.content
    refused = [
        (openai.BadRequestError, "is not what session 'planner' holds",
         lambda: ask(m1 + [{"role": "assistant", "content": r1 + "!"}, m2[-1]], session="planner")),
        (openai.BadRequestError, "holds 5 messages", lambda: ask(m1, session="planner")),
        (openai.NotFoundError, "no open session 'nobody' to fork", lambda: ask(m3, session="w2", fork_of="nobody")),
        (openai.NotFoundError, "no open session 'planner' to fork",  # another tenant's sessions are not found
         lambda: ask(m3, session="w3", fork_of="planner", tenant="other-tenant")),
        (openai.ConflictError, "session 'worker' exists already", lambda: ask(m3, session="worker", fork_of="planner")),
        (openai.BadRequestError, "fork_of names the session to fork", lambda: ask(m3, fork_of="planner")),
    ]
    for error, message, call in refused:
        with pytest.raises(error, match=message):
            call()
        assert server.healthy()
    m4 = m3 + [{"role": "assistant", "content": forked.choices[0].message.content}, m2[-1]]
    ask(m4, session="worker", end_session=True)
    ask(m3, session="planner", end_session=True)
    with pytest.raises(openai.NotFoundError, match="no open session 'planner'"):
        ask(m3, session="again", fork_of="planner")
    assert_no_request_holds_blocks(server)  # the held sessions' blocks are back


def test_a_full_pool_answers_503_and_sigterm_lets_in_flight_requests_finish():
    # A pool of 48 blocks of 16 tokens (98,304 bytes each on the shipped model): while a request of
    # about 400 prompt tokens (25 blocks) runs, another of the same size does not fit beside it
    # (the pool alone would hold it).
    small = Server("--kv-cache-bytes", str(48 * 98304), "--max-model-len", "700")
    try:
        assert small.metrics()["samcache_kv_pool_blocks_total"] == 48
        client = small.client(timeout=300)
        prompt = "word " * 130  # about 400 tokens
        first = iter(client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=280, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))
        next(first)  # admitted: its prompt's blocks are taken
        r = httpx.post(small.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=120,
                       json={"model": NAME, "messages": [{"role": "user", "content": "other " + prompt}],
                             "max_tokens": 8})
        assert r.status_code == 503, r.text
        assert "pool is full" in r.json()["error"]["message"]
        assert small.healthy()
        # SIGTERM while the first stream decodes: it finishes, then the server exits cleanly.
        small.proc.send_signal(signal.SIGTERM)
        rest = list(first)
        finish = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"]
        # uvicorn shuts down gracefully, then lets the signal end the process as it would have.
        assert small.proc.wait(120) in (0, -signal.SIGTERM)
        time.sleep(0.5)
        assert any("samcache serve: stopped after" in line and "nothing in flight" in line for line in small.log), small.log
    finally:
        small.stop()


def test_a_port_in_use_ends_the_server_with_an_error_not_a_hang():
    """uvicorn serves from a thread beside the step loop on the main thread: when it cannot start,
    the loop stops too and the process exits 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "samcache", "serve", str(trained_model()), "--port", str(port),
                               "--device", "cpu", "--log-level", "warning"], capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 1
    assert "address already in use" in done.stderr and "stopped after 0 steps" in done.stdout
