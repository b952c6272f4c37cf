"""The server's parts without a server: incremental reply text with stop strings, images from
data URLs and allowed folders under limits, request bodies checked."""

import base64
import io

import numpy as np
import pytest

pytest.importorskip("fastapi")

from PIL import Image  # noqa: E402

from samcache.serve.errors import ApiError  # noqa: E402
from samcache.serve.images import load_image  # noqa: E402
from samcache.serve.reply_text import ReplyText  # noqa: E402


class CharTokenizer:
    """One token per character (ids are code points); 0xFFFD stands for half a character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def feed(text, stops, tokenizer=CharTokenizer()):
    reply, pieces = ReplyText(tokenizer, stops), []
    for ch in text:
        stopped = reply.add(ord(ch))
        pieces.append(reply.take())
        if stopped:
            break
    pieces.append(reply.take(final=True))
    return reply, pieces


@pytest.mark.parametrize("text, stops, want", [
    ("hello world", [], "hello world"),
    ("hello world", ["wor"], "hello "),
    ("hello world", ["xyz", "lo w"], "hel"),
    ("abcabd", ["abd"], "abc"),
    ("aaab", ["aab"], "a"),
])
def test_pieces_add_up_to_the_reply_cut_before_the_first_stop(text, stops, want):
    reply, pieces = feed(text, stops)
    assert "".join(pieces) == want == reply.text
    assert reply.stopped == (want != text)


def test_the_start_of_a_stop_string_is_held_back_until_it_cannot_be_one():
    reply = ReplyText(CharTokenizer(), ["STOP"])
    for ch in "go ST":
        reply.add(ord(ch))
    assert reply.take() == "go "  # "ST" may still become "STOP"
    reply.add(ord("A"))
    assert reply.take() == "STA"


def test_a_half_character_is_not_handed_out():
    reply = ReplyText(CharTokenizer())
    reply.add(ord("a"))
    reply.add(0xFFFD)
    assert reply.take() == "a"
    assert reply.take(final=True) == "\ufffd"


def png(size=(8, 8)):
    buf = io.BytesIO()
    Image.fromarray(np.full((*size, 3), 200, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def url(data, mime="image/png"):
    return f"data:{mime};base64," + base64.b64encode(data).decode()


LIMITS = dict(max_bytes=10_000, max_pixels=100 * 100, allowed_dirs=())


def test_data_urls_decode_to_read_only_rgb_arrays():
    im = load_image(url(png()), **LIMITS)
    assert im.shape == (8, 8, 3) and im.dtype == np.uint8 and im.flags.c_contiguous
    assert not im.flags.writeable  # a cached image is shared by every request sending it
    with pytest.raises(ValueError):
        im[0, 0, 0] = 1


def encoded(image, **save) -> bytes:
    b = io.BytesIO()
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(b, format="PNG", **save)
    return b.getvalue()


def test_every_png_kind_decodes_to_pillows_pixels_and_rgb8_takes_libspng(monkeypatch):
    """8-bit RGB PNGs (with or without a transparent colour) go to libspng; grey, palette, RGBA
    and 16-bit ones to Pillow; each gives exactly what Pillow's RGB conversion gives."""
    import samcache.serve.images as images

    pyspng = pytest.importorskip("pyspng")
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (23, 41, 3), dtype=np.uint8)
    kinds = {  # name: (PNG bytes, decoded by libspng)
        "rgb8": (encoded(rgb), True),
        "rgb8 tRNS": (encoded(rgb, transparency=(1, 2, 3)), True),
        "grey": (encoded(rgb[..., 0]), False),
        "rgba": (encoded(np.dstack([rgb, rgb[..., :1]])), False),
        "palette": (encoded(Image.fromarray(rgb).quantize(16)), False),
        "grey16": (encoded(rgb[..., 0].astype(np.uint16) * 257), False),
    }
    calls = []
    monkeypatch.setattr(images, "pyspng", type("Spy", (), {"load": staticmethod(
        lambda data, format: calls.append(format) or pyspng.load(data, format=format))}))
    for name, (data, fast) in kinds.items():
        calls.clear()
        with Image.open(io.BytesIO(data)) as im:
            want = np.asarray(im.convert("RGB"))
        got = load_image(url(data), max_bytes=1 << 20, max_pixels=1 << 20, allowed_dirs=())
        assert got.dtype == np.uint8 and got.shape == want.shape and not got.flags.writeable, name
        assert np.array_equal(got, want), name
        assert calls == (["RGB"] if fast else []), name
    with pytest.raises(ApiError, match="cannot be decoded") as info:  # libspng's error, as Pillow's
        load_image(url(kinds["rgb8"][0][:-30]), max_bytes=1 << 20, max_pixels=1 << 20, allowed_dirs=())
    assert info.value.status == 400
    monkeypatch.setattr(images, "pyspng", None)  # without libspng: Pillow, the same pixels
    assert np.array_equal(load_image(url(kinds["rgb8"][0]), max_bytes=1 << 20, max_pixels=1 << 20, allowed_dirs=()), rgb)


@pytest.mark.parametrize("bad, status, match", [
    (url(b"not an image"), 400, "cannot be decoded"),
    ("data:image/png;base64,@@", 400, "base64"),
    ("data:image/png,rawbytes", 400, "base64"),
    (url(png(), "text/plain"), 400, "not an image"),
    (url(b"x" * 20_000), 413, "larger than"),
    (url(png((200, 200))), 413, "pixels"),
    ("https://example.com/a.png", 400, "does not fetch"),
    ("/etc/hostname", 400, "local image paths are off"),
    ("", 400, "non-empty"),
])
def test_bad_images_are_refused_with_their_status(bad, status, match):
    with pytest.raises(ApiError, match=match) as info:
        load_image(bad, **LIMITS)
    assert info.value.status == status and info.value.body()["error"]["code"] == status


def test_local_files_only_inside_an_allowed_folder(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(png())
    (tmp_path / "b.png").write_bytes(png())
    limits = dict(LIMITS, allowed_dirs=(inside.resolve(),))
    assert load_image(str(inside / "a.png"), **limits).shape == (8, 8, 3)
    assert load_image((inside / "a.png").as_uri(), **limits).shape == (8, 8, 3)
    for outside in (str(tmp_path / "b.png"), str(inside / ".." / "b.png"), str(inside / "missing.png")):
        with pytest.raises(ApiError) as info:
            load_image(outside, **limits)
        assert info.value.status == 400


def test_request_bodies_refuse_what_samcache_does_not_serve():
    from samcache.serve.requests import ChatCompletionRequest, MediaLimits, chat_request

    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True)
    with pytest.raises(ApiError, match="does not support logprobs"):
        chat_request(body, MediaLimits())
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stop="x",
                                 temperature=0, seed=3, tenant="t", agent="flow/a", future_field=1)
    req = chat_request(body, MediaLimits())
    assert (req.max_new_tokens, req.temperature, req.seed, req.tenant, req.agent) == (5, 0.0, 3, "t", "flow/a")
    assert body.stop == ["x"]
    with pytest.raises(ValueError, match="n=1"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], n=2)
    image = {"type": "image_url", "image_url": {"url": url(png())}}
    body = ChatCompletionRequest(model="m", messages=[{"role": "assistant", "content": [image]}])
    with pytest.raises(ApiError, match="user messages only"):
        chat_request(body, MediaLimits())
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [image] * 3}])
    with pytest.raises(ApiError, match="limit of 2 images"):
        chat_request(body, MediaLimits(max_images=2))


def test_a_data_url_seen_before_is_not_decoded_again_and_the_cache_stays_bounded():
    from samcache.serve.images import DecodedImages

    cache = DecodedImages(max_bytes=2 * 8 * 8 * 3)
    a, b, c = url(png()), url(png((8, 8)) + b"\0"), url(png((8, 8)) + b"\0\0")  # three contents, same pixels
    first = load_image(a, **LIMITS, decoded=cache)
    assert load_image(a, **LIMITS, decoded=cache) is first and (cache.hits, cache.misses) == (1, 1)
    load_image(b, **LIMITS, decoded=cache)
    load_image(c, **LIMITS, decoded=cache)  # past two images' bytes: the least recently used goes
    assert cache.used <= cache.max_bytes and len(cache._images) == 2
    assert load_image(a, **LIMITS, decoded=cache) is not first and cache.misses == 4
    with pytest.raises(ApiError, match="cannot be decoded"):  # bad data is never cached
        load_image(url(b"junk"), **LIMITS, decoded=cache)
    with pytest.raises(ApiError, match="cannot be decoded"):
        load_image(url(b"junk"), **LIMITS, decoded=cache)


def test_serve_flags_out_of_range_are_clear_errors(tmp_path):
    import argparse

    from samcache.serve.main import add_arguments, build, startup_line
    from samcache.tasks.checkpoint import trained_model

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    model = str(trained_model())
    for flags, match in ((["--max-model-len", "1"], "max-model-len 1"),
                         (["--max-model-len", "10000000"], "max-model-len 10000000"),
                         (["--allowed-local-media-path", str(tmp_path / "missing")], "not a folder"),
                         (["--max-images-per-request", "0"], "max-images-per-request must be >= 1")):
        with pytest.raises(ValueError, match=match):
            build(parser.parse_args([model, "--device", "cpu", *flags]))
    args = parser.parse_args([model, "--device", "cpu", "--kv-cache-bytes", "8MiB", "--served-model-name", "vqa"])
    engine, app, settings = build(args)
    assert settings.served_model_name == "vqa" and engine.pool.num_blocks * engine.runner.block_bytes <= 8 << 20
    line = startup_line(engine, settings, "127.0.0.1", 8000)
    assert "vqa on cpu" in line and "reuse profile: none" in line and "image order kept" in line


class ByteTokenizer:
    """One token per UTF-8 byte, as byte-fallback tokenizers split rare characters."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_character_split_over_several_byte_tokens_comes_out_whole():
    text = "a中b€ c"
    reply, pieces = ReplyText(ByteTokenizer()), []
    for byte in text.encode():
        reply.add(byte)
        pieces.append(reply.take())
    pieces.append(reply.take(final=True))
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    reply, pieces = ReplyText(ByteTokenizer(), ["€"]), []
    for byte in text.encode():
        if reply.add(byte):
            break
        pieces.append(reply.take())
    pieces.append(reply.take(final=True))
    assert "".join(pieces) == "a中b" and reply.stopped


@pytest.mark.parametrize("bad", [-1, 1.5, True, "256MiB"])
def test_a_decode_cache_of_a_bad_size_is_refused(bad):
    from samcache.serve.images import DecodedImages

    with pytest.raises(ValueError, match="max_bytes"):
        DecodedImages(bad)


# ---- sessions --------------------------------------------------------------------------------------
class _Held:
    def __init__(self, name=None):
        self.messages, self.abandoned, self.name = [], False, name


class _Engine:
    """What ServerSessions asks of the engine: held sessions, forks, abandoning."""

    def __init__(self):
        self.abandoned = []

    def new_session(self, *, tenant=None, hold_context=False):
        assert hold_context
        return _Held()

    def fork_session(self, session, name=None):
        return _Held(name)

    def abandon_session(self, session):
        session.abandoned = True
        self.abandoned.append(session)


def _messages(*texts):
    from samcache.serve.requests import Message

    roles = ["user", "assistant"]
    return [Message(role=roles[i % 2], content=t) for i, t in enumerate(texts)]


def test_message_digests_name_role_text_and_images():
    from samcache.serve.requests import Message
    from samcache.serve.sessions import message_digest

    plain = Message(role="assistant", content="click save")
    parts = Message(role="assistant", content=[{"type": "text", "text": "click "}, {"type": "text", "text": "save"}])
    assert message_digest(plain) == message_digest(parts) == message_digest("click save")  # a reply as sent back
    assert message_digest(Message(role="user", content="click save")) != message_digest(plain)
    a = Message(role="user", content=[{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    b = Message(role="user", content=[{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAB"}}])
    assert message_digest(a) != message_digest(b)


def test_sessions_continue_fork_refuse_and_make_room():
    from samcache.serve.sessions import ServerSessions

    engine = _Engine()
    sessions = ServerSessions(engine, max_sessions=2)
    first = sessions.begin("a", _messages("hi"), tenant=None)
    assert first.new and first.messages_from == 0
    with pytest.raises(ApiError, match="answering another request") as busy:
        sessions.begin("a", _messages("hi", "hello", "next"), tenant=None)
    assert busy.value.status == 409
    sessions.finish(first, _messages("hi"), "hello", end=False)
    turn = sessions.begin("a", _messages("hi", "hello", "next"), tenant=None)
    assert not turn.new and turn.messages_from == 2
    sessions.finish(turn, _messages("hi", "hello", "next"), "done", end=False)
    with pytest.raises(ApiError, match=r"messages\[1\] is not what session 'a' holds") as wrong:
        sessions.begin("a", _messages("hi", "HELLO", "next", "done", "more"), tenant=None)
    assert wrong.value.status == 400
    with pytest.raises(ApiError, match="ends with the user message"):
        sessions.begin("a", _messages("hi", "hello"), tenant=None)
    fork = sessions.begin("b", _messages("hi", "hello", "next", "done", "sub"), tenant=None, fork_of="a")
    assert fork.messages_from == 4 and fork.open.session.name == "b"
    with pytest.raises(ApiError, match="no open session 'a' to fork") as other:
        sessions.begin("c", _messages("hi"), tenant="t2", fork_of="a")  # another tenant's
    assert other.value.status == 404
    # Full (2 open, b busy): a new one closes the least recently used idle one, a.
    sessions.begin("d", _messages("x"), tenant=None)
    assert len(sessions) == 2 and engine.abandoned and engine.abandoned[0].messages == []
    with pytest.raises(ApiError, match="all 2 sessions are answering requests") as full:
        sessions.begin("e", _messages("y"), tenant=None)
    assert full.value.status == 503
    sessions.finish(fork, _messages("hi", "hello", "next", "done", "sub"), None, end=False)  # failed: kept as it was
    sessions.finish(fork, _messages("hi"), "r", end=True)
    assert len(sessions) == 1
    sessions.close_all()
    assert len(sessions) == 0
    with pytest.raises(ValueError, match="max_sessions"):
        ServerSessions(engine, max_sessions=0)
    with pytest.raises(ApiError, match="session must be a non-empty string"):
        sessions.begin("", _messages("x"), tenant=None)


def test_the_engine_is_called_outside_the_registrys_lock():
    """The step loop's thread ends turns while holding the engine's lock; a request starting a
    session meanwhile must not hold the registry's lock while it waits for the engine."""
    import threading

    from samcache.serve.sessions import ServerSessions

    engine = _Engine()
    sessions = ServerSessions(engine)
    first = sessions.begin("a", _messages("hi"), tenant=None)
    entered, release = threading.Event(), threading.Event()
    real = engine.new_session

    def waits_for_the_engine(**kw):
        entered.set()
        assert release.wait(10)
        return real(**kw)

    engine.new_session = waits_for_the_engine
    starting = threading.Thread(target=lambda: sessions.begin("b", _messages("x"), tenant=None))
    starting.start()
    assert entered.wait(10)
    ending = threading.Thread(target=lambda: sessions.finish(first, _messages("hi"), "hello", end=True))
    ending.start()
    ending.join(5)
    assert not ending.is_alive()  # it did not wait for the session being created
    release.set()
    starting.join(10)
    assert len(sessions) == 1 and engine.abandoned and not starting.is_alive()
