"""The HTTP server: OpenAI's chat-completions API over samcache's online step loop (FastAPI).

Every request is turned into the engine's request and prepared (images decoded and hashed, text
tokenized) in worker threads, off the event loop and off the step loop's thread, then submitted to
the engine's :class:`~samcache.engine.online.OnlineLoop` (it joins the running batch at the next
step) and answered as OpenAI does: one JSON body, or server-sent events with one chunk per piece of
text. A request may name a session (:mod:`samcache.serve.sessions`). A client that closes its stream cancels its request: its
blocks are freed at the next step. Errors are OpenAI-style JSON with a 4xx/5xx status; the server
goes on serving the others.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from samcache.engine.online import LoopStopped
from samcache.errors import CacheFull, ImageLoadError, OutOfBlocks, PromptTooLong, RequestCancelled
from samcache.serve.errors import ApiError
from samcache.serve.metrics import ServerMetrics
from samcache.serve.reply_text import ReplyText
from samcache.serve.requests import ChatCompletionRequest, MediaLimits, chat_request
from samcache.serve.sessions import ServerSessions


DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
CLIENT_CLOSED = 499  # the status logged for a request whose client went away (nobody reads it)


class ClientGone(Exception):
    """The client of a request disconnected before its answer."""


@dataclass(frozen=True)
class ServeSettings:
    """``served_model_name``: the name requests must give; ``max_model_len``: prompt and reply
    tokens together; ``api_key``: required as a bearer token on /v1 (None: open);
    ``shutdown_timeout_s``: how long in-flight requests may finish on shutdown; ``max_sessions``:
    open sessions at most (:mod:`samcache.serve.sessions`); ``batch_wait_s``: how long an idle loop
    holds its first step for requests that arrived and are still being parsed (:class:`AnnounceChats`)."""

    served_model_name: str
    max_model_len: int
    api_key: str | None = None
    limits: MediaLimits = field(default_factory=MediaLimits)
    shutdown_timeout_s: float = 30.0
    max_sessions: int = 256
    batch_wait_s: float = 0.1


class AnnounceChats:
    """ASGI middleware: each chat-completions request is announced to the online loop as its
    headers arrive (:meth:`OnlineLoop.announce`), before its body is read, parsed and its images
    decoded, so that an idle loop starts requests sent together in one prefill step. The endpoint
    releases the announcement once it submits the request; the response's end releases it
    whatever happened (a refused or failed request). With an API key, only a request that carries
    it is announced: a client without one cannot hold the loop back by trickling its body."""

    def __init__(self, app, state: dict, api_key: str | None = None) -> None:
        self.app = app
        self.state = state
        self.authorization = None if api_key is None else f"Bearer {api_key}".encode()

    def authorized(self, scope) -> bool:
        return self.authorization is None or any(
            name == b"authorization" and value == self.authorization for name, value in scope.get("headers", ()))

    async def __call__(self, scope, receive, send) -> None:
        loop = self.state.get("loop")
        if (loop is None or scope["type"] != "http" or scope["method"] != "POST"
                or scope["path"] != "/v1/chat/completions"
                or not self.authorized(scope)):
            await self.app(scope, receive, send)
            return
        arrival = loop.announce()
        scope.setdefault("state", {})["samcache_arrival"] = arrival
        try:
            await self.app(scope, receive, send)
        finally:
            arrival.release()


def engine_error(e: BaseException) -> ApiError:
    """The HTTP answer to an exception the engine raised for one request."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, (OutOfBlocks, CacheFull)):
        return ApiError(503, f"the KV pool is full right now; retry later ({e})")
    if isinstance(e, LoopStopped):
        return ApiError(503, "the server is shutting down")
    if isinstance(e, RequestCancelled):
        return ApiError(503, str(e))
    if isinstance(e, (PromptTooLong, ImageLoadError, ValueError, TypeError)):
        return ApiError(400, str(e))
    return ApiError(500, f"internal error: {type(e).__name__}: {e}")


def usage(result) -> dict:
    m = result.metrics
    n = len(result.token_ids)
    return {"prompt_tokens": m.prompt_tokens, "completion_tokens": n, "total_tokens": m.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": m.reused_tokens},
            "samcache": {"prefix_reused_tokens": m.prefix_reused_tokens, "image_reused_tokens": m.image_reused_tokens,
                         "prefilled_tokens": m.prefilled_tokens, "recomputed_tokens": m.recomputed_tokens,
                         "vit_calls": m.vit_calls, "vit_hits": m.vit_hits, "ttft_s": m.ttft_s}}


def create_app(engine, settings: ServeSettings) -> FastAPI:
    """The server's app over ``engine``; its lifespan starts and stops the engine's online loop."""
    state: dict = {}
    sessions = ServerSessions(engine, settings.max_sessions)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["loop"] = engine.start_online(max_model_len=settings.max_model_len, gather_s=settings.batch_wait_s)
        state["metrics"] = ServerMetrics(engine, state["loop"])
        yield
        # In-flight requests finish (or are cancelled past the timeout); the tiers are flushed.
        loop = state["loop"]
        await asyncio.to_thread(loop.stop, settings.shutdown_timeout_s)
        await asyncio.to_thread(sessions.close_all)
        print(f"samcache serve: stopped after {loop.steps} steps" + (f" ({loop.error!r})" if loop.error else "")
              + "; nothing in flight, the tiers flushed", flush=True)

    app = FastAPI(title="samcache", lifespan=lifespan)
    app.add_middleware(AnnounceChats, state=state, api_key=settings.api_key)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return JSONResponse(ApiError(400, "the request body is not valid JSON").body(), status_code=400)
        where = [".".join(str(p) for p in err["loc"][1:]) or "body" for err in errors]
        problems = "; ".join(f"{w}: {err['msg']}" for w, err in zip(where[:5], errors))
        return JSONResponse(ApiError(400, f"invalid request: {problems}", where[0] if where else None).body(),
                            status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        error = engine_error(e)
        return JSONResponse(error.body(), status_code=error.status)

    def authorized(request: Request) -> None:
        if settings.api_key is not None and request.headers.get("authorization") != f"Bearer {settings.api_key}":
            raise ApiError(401, "a valid API key is needed (Authorization: Bearer <key>)")

    def check_model(name: str) -> None:
        if name != settings.served_model_name:
            raise ApiError(404, f"the model `{name}` does not exist; this server serves "
                                f"`{settings.served_model_name}`", "model")

    @app.get("/health")
    async def health():
        loop = state.get("loop")
        if loop is None or not loop.running:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        body = await asyncio.to_thread(state["metrics"].exposition)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": settings.served_model_name, "object": "model",
                                            "created": int(time.time()), "owned_by": "samcache",
                                            "max_model_len": settings.max_model_len}]}

    async def until_done(handle, waiting, request: Request):
        """Await ``waiting`` (a task); a client that goes away meanwhile cancels ``handle``."""
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
            if done:
                return waiting.result()
            if await request.is_disconnected():
                handle.cancel()
                state["metrics"].failed("cancelled")
                waiting.cancel()
                raise ClientGone

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        arrival = http.scope.get("state", {}).get("samcache_arrival")  # AnnounceChats's; submit releases it
        check_model(body.model)
        fill = body.max_tokens is None and body.max_completion_tokens is None
        if body.fork_of is not None and body.session is None:
            raise ApiError(400, "fork_of names the session to fork; give the new one's name as session", "fork_of")
        turn = None
        if body.session is not None:
            turn = await asyncio.to_thread(sessions.begin, body.session, body.messages, tenant=body.tenant,
                                           fork_of=body.fork_of)
        try:  # images decoded and hashed, text tokenized: off the event loop and the step loop's thread
            request = await asyncio.to_thread(lambda: engine.prepare(chat_request(body, settings.limits, turn)))
        except Exception as e:  # noqa: BLE001 - this request's bad input, as an HTTP error
            if turn is not None:
                await asyncio.to_thread(sessions.finish, turn, body.messages, None, False)
            state["metrics"].failed(str(engine_error(e).status))
            raise engine_error(e) from None
        text = ReplyText(engine.tokenizer, body.stop or ())
        reply_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        aloop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        streaming = body.stream

        def on_token(token: int) -> bool:
            stop = text.add(token)
            if streaming:
                piece = text.take()
                if piece:
                    aloop.call_soon_threadsafe(pieces.put_nowait, piece)
            return stop

        # The text is followed token by token only where it is streamed or searched for stops.
        follow = streaming or bool(text.stops)
        try:
            handle = state["loop"].submit(request, on_token if follow else None, fill=fill, arrival=arrival)
        except LoopStopped as e:
            if turn is not None:
                await asyncio.to_thread(sessions.finish, turn, body.messages, None, False)
            raise engine_error(e) from None
        if turn is not None:
            def record(future) -> None:  # the loop's thread, as the request ends: the session's history
                ok = not future.cancelled() and future.exception() is None
                reply = (text.text if text.stopped else future.result().text) if ok else None
                sessions.finish(turn, body.messages, reply, body.end_session)

            handle.future.add_done_callback(record)
        handle.future.add_done_callback(lambda _: aloop.call_soon_threadsafe(pieces.put_nowait, None))
        if not streaming:
            try:
                result = await until_done(handle, asyncio.wrap_future(handle.future), http)
            except ClientGone:
                return Response(status_code=CLIENT_CLOSED)
            except asyncio.CancelledError:
                handle.cancel()
                raise
            except Exception as e:  # noqa: BLE001 - this request's failure, as an HTTP error
                state["metrics"].failed(str(engine_error(e).status))
                raise engine_error(e) from None
            state["metrics"].finished(result.metrics)
            content = text.text if text.stopped else result.text
            return {"id": reply_id, "object": "chat.completion", "created": created, "model": body.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                 "finish_reason": result.finish_reason}],
                    "usage": usage(result)}

        # Streaming: the first piece (or the end) comes before the response, so a request the
        # engine refuses at admission gets its 4xx, not a 200 with an error inside.
        try:
            first = await until_done(handle, asyncio.ensure_future(pieces.get()), http)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except asyncio.CancelledError:
            handle.cancel()
            raise
        if first is None and handle.future.exception() is not None:
            e = handle.future.exception()
            state["metrics"].failed(str(engine_error(e).status))
            raise engine_error(e)
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(delta: dict, finish: str | None = None) -> str:
            return "data: " + json.dumps({"id": reply_id, "object": "chat.completion.chunk", "created": created,
                                          "model": body.model, "choices": [{"index": 0, "delta": delta,
                                                                            "finish_reason": finish}]}) + "\n\n"

        async def events():
            piece = first
            yield chunk({"role": "assistant", "content": ""})
            while piece is not None:
                yield chunk({"content": piece})
                piece = await pieces.get()
            error = handle.future.exception()
            if error is not None:
                state["metrics"].failed(str(engine_error(error).status))
                yield "data: " + json.dumps(engine_error(error).body()) + "\n\n"
            else:
                result = handle.future.result()
                state["metrics"].finished(result.metrics)
                rest = text.take(final=True)
                if rest:
                    yield chunk({"content": rest})
                yield chunk({}, result.finish_reason)
                if include_usage:
                    yield "data: " + json.dumps({"id": reply_id, "object": "chat.completion.chunk",
                                                 "created": created, "model": body.model, "choices": [],
                                                 "usage": usage(result)}) + "\n\n"
            yield "data: [DONE]\n\n"

        def cancel_if_unfinished() -> None:
            # Runs once the response ends, sent or not: a client that left mid-stream frees its blocks.
            if not handle.future.done():
                handle.cancel()
                state["metrics"].failed("cancelled")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 background=BackgroundTask(cancel_if_unfinished))

    return app


__all__ = ["ServeSettings", "create_app", "engine_error", "usage"]
