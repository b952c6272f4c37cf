"""``samcache serve MODEL``: the engine behind OpenAI's API (uvicorn). Flags follow ``vllm serve``
where they mean the same thing; the engine's settings and the reuse profile beside them."""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys
import threading


def _size(text: str) -> int:
    """Bytes from '256MiB', '2GiB', '1e9' or a plain integer."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for unit, scale in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * scale)
    return int(float(t))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory (a Qwen2.5-VL-style checkpoint samcache's engine runs)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name requests give (default: the model argument as given)")
    p.add_argument("--api-key", default=None, help="require this bearer token on /v1 (default: open)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt and reply tokens of one request together (default: what the model and the pool hold)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-cache-bytes", type=_size, default=None, help="KV pool size, e.g. 2GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384,
                   help="rows of one forward step (the engine's max_step_tokens)")
    p.add_argument("--profile", default=None,
                   help="the reuse profile (default: samcache_profile.json in the model's folder; 'none': none)")
    p.add_argument("--keep-image-order", default="auto", choices=["auto", "true", "false"])
    p.add_argument("--tenant", default=None, help="the cache scope of requests that name none")
    p.add_argument("--allowed-local-media-path", action="append", default=[], metavar="DIR",
                   help="folders images may be read from by path (default: none; data URLs only)")
    p.add_argument("--max-images-per-request", type=int, default=16)
    p.add_argument("--max-image-bytes", type=_size, default=20 << 20)
    p.add_argument("--max-image-pixels", type=int, default=4096 * 4096)
    p.add_argument("--image-decode-cache-bytes", type=_size, default=256 << 20,
                   help="decoded images kept by their data URL's content (agents re-send screenshots; default 256MiB, 0: off)")
    p.add_argument("--max-sessions", type=int, default=256,
                   help="open sessions at most (extra_body session / fork_of); the least recently used idle one "
                        "is closed to make room")
    p.add_argument("--batch-wait-ms", type=float, default=100.0,
                   help="how long an idle server holds its first step for requests that have arrived but are still "
                        "being read or parsed, so requests sent together are prefilled in one step (default 100; "
                        "0: never; a request is held only while others are arriving)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def build(args):
    """The engine and the app for ``args`` (tests build them in-process)."""
    from samcache.engine import SAMcacheEngine
    from samcache.serve.app import ServeSettings, create_app
    from samcache.serve.images import DecodedImages
    from samcache.serve.requests import MediaLimits

    order = {"auto": "auto", "true": True, "false": False}[args.keep_image_order]
    profile = False if args.profile == "none" else args.profile
    engine = SAMcacheEngine(args.model, device=args.device, dtype=args.dtype, kv_cache_bytes=args.kv_cache_bytes,
                            max_step_tokens=args.max_num_batched_tokens, profile=profile, keep_image_order=order,
                            tenant=args.tenant, seed=args.seed)
    room = min(engine.runner.max_positions, engine.pool.num_blocks * engine.pool.block_size)
    max_len = room if args.max_model_len is None else args.max_model_len
    if not 2 <= max_len <= room:
        raise ValueError(f"--max-model-len {max_len}: must be between 2 and {room} (the model's positions and the "
                         "pool's tokens)")
    dirs = []
    for d in args.allowed_local_media_path:
        path = pathlib.Path(d).resolve()
        if not path.is_dir():
            raise ValueError(f"--allowed-local-media-path {d}: not a folder")
        dirs.append(path)
    for name in ("max_images_per_request", "max_image_bytes", "max_image_pixels", "image_decode_cache_bytes"):
        if getattr(args, name) < (0 if name == "image_decode_cache_bytes" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {0 if name == 'image_decode_cache_bytes' else 1}")
    if args.max_sessions < 1:
        raise ValueError("--max-sessions must be >= 1")
    if not 0 <= args.batch_wait_ms <= 10_000:
        raise ValueError(f"--batch-wait-ms {args.batch_wait_ms}: must be between 0 and 10000")
    settings = ServeSettings(served_model_name=args.served_model_name or args.model, max_model_len=max_len,
                             api_key=args.api_key, max_sessions=args.max_sessions,
                             batch_wait_s=args.batch_wait_ms / 1e3,
                             limits=MediaLimits(args.max_images_per_request, args.max_image_bytes,
                                                args.max_image_pixels, tuple(dirs),
                                                DecodedImages(args.image_decode_cache_bytes)))
    return engine, create_app(engine, settings), settings


def startup_line(engine, settings, host: str, port: int, profile_from: str | None = None) -> str:
    pool = engine.pool
    if engine.profile is None:
        where = "none"
    else:
        from samcache.profile.reuse_profile import PROFILE_FILE

        where = profile_from or str(engine.model_path / PROFILE_FILE)
    return (f"samcache serve: {settings.served_model_name} on {engine.device} ({engine.dtype}); KV pool "
            f"{pool.num_blocks} blocks x {pool.block_size} tokens ({pool.num_blocks * engine.runner.block_bytes / 2**20:.0f} MiB); "
            f"image attention {engine.image_attention.name}; reuse profile: {where}; image order "
            f"{'kept' if engine.keeps_image_order() else 'any index'}; max_model_len {settings.max_model_len}; "
            f"http://{host}:{port}/v1")


def run(args) -> int:
    """Serve until SIGINT or SIGTERM. The main thread steps the model (``OnlineLoop.run``); uvicorn
    serves HTTP from a thread of its own, and its shutdown stops the loop."""
    import uvicorn

    try:
        engine, app, settings = build(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"samcache serve: {e}", file=sys.stderr)
        return 2
    print(startup_line(engine, settings, args.host, args.port, args.profile), flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=60))
    interrupts = 0
    http_error: list[BaseException] = []

    def on_signal(signum, frame) -> None:
        nonlocal interrupts
        server.should_exit = True  # uvicorn stops accepting, lets open requests finish, then its lifespan stops the loop
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts == 2:  # a second Ctrl-C: do not wait for open connections
                server.force_exit = True
                signal.signal(signal.SIGINT, signal.default_int_handler)  # a third interrupts the step itself

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # Bound to this thread before uvicorn starts: the app's lifespan finds this loop running.
        loop = engine.start_online(max_model_len=settings.max_model_len, gather_s=settings.batch_wait_s,
                                   own_thread=False)

        def serve_http() -> None:
            try:
                server.run()  # off the main thread, uvicorn installs no signal handlers: ours are above
            except BaseException as e:  # noqa: BLE001 - reported by the main thread (SystemExit: no start)
                http_error.append(e)
                if not isinstance(e, SystemExit):
                    raise
            finally:
                if loop.running:  # uvicorn never started, or ended without its lifespan's shutdown
                    loop.stop(settings.shutdown_timeout_s)

        http = threading.Thread(target=serve_http, name="samcache-http")
        http.start()
        try:
            loop.run()
        finally:
            server.should_exit = True
            http.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if loop.error is not None:
        print(f"samcache serve: the step loop failed: {loop.error!r}", file=sys.stderr)
    return 0 if server.started and loop.error is None and not http_error else 1


__all__ = ["add_arguments", "build", "run", "startup_line"]
