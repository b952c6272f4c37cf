"""The engine served online: one background thread drives the step loop while requests arrive.

``SAMcacheEngine.chat_batch`` serves a list to completion; a server cannot wait for a list. The
:class:`OnlineLoop` owns the engine's step loop (:class:`~samcache.engine.scheduler.Scheduler`) in
a thread of its own. A request submitted from any thread or coroutine (:meth:`OnlineLoop.submit`)
is admitted at the next step and prefilled beside the running requests' decode rows; every token
is handed to the request's callback as soon as it is sampled; a cancelled request (a client that
went away) is dropped, and its blocks freed, at the next step. The engine's lock is held for one
step at a time, so ``chat`` and ``chat_batch`` called from other threads meanwhile join the same
loop (``SAMcacheEngine._serve`` routes them here) instead of waiting for it to drain.

Requests sent together should share one prefill step, as ``chat_batch`` gives them: a server
:meth:`announces <OnlineLoop.announce>` each request as it arrives, before its body is parsed and
its images decoded, and an idle loop that takes a request holds its first step until the announced
ones are submitted too (at most ``gather_s``). A request is held only while others are on their
way: alone, it starts at once.

Outputs equal serving each request alone: a request's rows in a step are computed as they would be
alone (the step loop's invariant), whoever shares the step.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from samcache._checks import check_int
from samcache.engine.scheduler import Ticket
from samcache.errors import PromptTooLong, RequestCancelled


class LoopStopped(RuntimeError):
    """The online loop is stopping or stopped: it takes no new requests."""


@dataclass(eq=False)
class RequestHandle:
    """A submitted request: ``future`` resolves to its ``ChatResult`` (or its exception);
    :meth:`cancel` ends it at the next step (the future then raises :class:`RequestCancelled`)."""

    request: Any
    on_token: Callable[[int], bool | None] | None = None
    fill: bool = False  # decode up to the loop's max_model_len (the request's max_new_tokens is ignored)
    submitted: float = field(default_factory=time.perf_counter)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    def result(self, timeout: float | None = None):
        return self.future.result(timeout)


class Arrival:
    """A request announced to the loop (:meth:`OnlineLoop.announce`) and not yet submitted.
    :meth:`release` (idempotent) says it will not keep the loop waiting any longer: it was
    submitted, or it failed before that."""

    def __init__(self, loop: "OnlineLoop") -> None:
        self._loop: OnlineLoop | None = loop

    def release(self) -> None:
        loop = self._loop
        if loop is not None:
            loop._arrived(self)


@dataclass(eq=False)
class _Live:
    handle: RequestHandle
    ticket: Ticket
    admission: Any
    history: list


class OnlineLoop:
    """The step loop of ``engine``, stepped by a background thread or by the thread that starts it
    (``engine.start_online()`` makes one)."""

    def __init__(self, engine, *, request_type: type | tuple = object, max_model_len: int | None = None,
                 poll_s: float = 0.05, gather_s: float = 0.1) -> None:
        self.engine = engine
        self.request_type = request_type  # what submit() takes (the engine's ChatRequest and PreparedChat)
        self.max_model_len = None if max_model_len is None else check_int("max_model_len", max_model_len, 2)
        if isinstance(gather_s, bool) or not isinstance(gather_s, (int, float)) or not 0 <= gather_s <= 10:
            raise ValueError(f"gather_s must be a number of seconds in [0, 10], got {gather_s!r}")
        self.poll_s = poll_s
        self.gather_s = float(gather_s)
        self._announced = 0  # requests on their way (announce() minus releases)
        self._announcing = threading.Condition()
        self.gathered_s = 0.0  # time an idle loop held its first step for announced requests, in all
        self._inbox: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()
        self._live: list[_Live] = []
        self._thread: threading.Thread | None = None  # the thread that steps the model
        self._own_thread = True  # started one of its own; False: the caller's thread, in run()
        self._ran = False
        self._ended = threading.Event()  # the step loop returned
        self._stopping = threading.Event()
        self._accepting = True
        self._gate = threading.Lock()  # submit vs stop: nothing lands in the inbox after the loop's last look
        self._cancel_all = False  # past stop()'s timeout
        self.error: BaseException | None = None  # what ended the thread, if not a stop
        self.steps = 0

    # -- the caller's side ---------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and not self._ended.is_set() and self._thread.is_alive()

    @property
    def live(self) -> int:
        """Requests admitted and not finished."""
        return len(self._live)

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def start(self, *, own_thread: bool = True) -> None:
        """Start taking requests. ``own_thread``: a background thread steps the model; False: the
        calling thread will, in :meth:`run` (requests submitted before it runs wait in the queue).
        A server steps on its main thread this way, the HTTP side in a thread of its own: on the
        CPU the model's many small ops (the vision tower, decode steps) ran 10-25% slower stepped
        from a second thread than from the main thread."""
        if self._thread is not None:
            raise RuntimeError("this OnlineLoop was started already; engine.start_online() makes a new one")
        if not isinstance(own_thread, bool):
            raise TypeError(f"own_thread must be a bool, got {own_thread!r}")
        self._own_thread = own_thread
        if own_thread:
            self._thread = threading.Thread(target=self._run, name="samcache-step-loop", daemon=True)
            self._thread.start()
        else:
            self._thread = threading.current_thread()

    def run(self) -> None:
        """Step the model on this thread until :meth:`stop`, called from another thread, ends the
        loop: for a loop started with ``own_thread=False``, from the thread that started it."""
        if self._own_thread or not self.in_loop_thread():
            raise RuntimeError("run() is for a loop started with own_thread=False, on the thread that started it")
        with self._gate:
            if self._ran:
                raise RuntimeError("this OnlineLoop has run already; engine.start_online() makes a new one")
            if self._ended.is_set():  # stopped before it ran
                return
            self._ran = True
        self._run()

    def announce(self) -> Arrival:
        """Announce a request on its way (its body still being read, parsed or prepared elsewhere).
        An idle loop that takes a request waits, up to ``gather_s``, until every announced request
        is submitted or released, so requests sent together share their prefill step. Pass the
        result to :meth:`submit` (which releases it), or release it where the request fails."""
        with self._announcing:
            self._announced += 1
        return Arrival(self)

    def _arrived(self, arrival: Arrival) -> None:
        with self._announcing:  # released once, whichever threads release it
            if arrival._loop is None:
                return
            arrival._loop = None
            self._announced -= 1
            self._announcing.notify_all()

    def submit(self, request, on_token: Callable[[int], bool | None] | None = None, *, fill: bool = False,
               arrival: Arrival | None = None) -> RequestHandle:
        """Queue ``request`` (a ``ChatRequest``, or a ``PreparedChat``: its prompt built beforehand,
        in the caller's thread, by ``engine.prepare``; else it is built here, on the loop's thread,
        between two steps); it joins the running batch at the next step.
        ``on_token(token_id)`` is called from the loop's thread with each sampled token; a true
        return ends the request there (finish reason "stop"). ``fill``: decode until the prompt and
        reply reach ``max_model_len`` (or an end token). ``arrival``: this request's announcement,
        released once it is queued (or refused)."""
        if arrival is not None and not isinstance(arrival, Arrival):
            raise TypeError(f"arrival must be an Arrival (from announce()) or None, got {type(arrival).__name__}")
        try:
            return self._submit(request, on_token, fill)
        finally:
            if arrival is not None:
                arrival.release()

    def _submit(self, request, on_token, fill: bool) -> RequestHandle:
        if not isinstance(request, self.request_type):
            kinds = self.request_type if isinstance(self.request_type, tuple) else (self.request_type,)
            raise TypeError(f"submit takes a {' or '.join(k.__name__ for k in kinds)}, got {type(request).__name__}")
        if on_token is not None and not callable(on_token):
            raise TypeError(f"on_token must be callable or None, got {type(on_token).__name__}")
        if not isinstance(fill, bool):
            raise TypeError(f"fill must be a bool, got {fill!r}")
        if fill and self.max_model_len is None:
            raise ValueError("fill=True needs the loop's max_model_len")
        handle = RequestHandle(request, on_token, fill)
        handle.future.set_running_or_notify_cancel()  # only cancel() ends it: the loop settles it once
        with self._gate:
            if not self._accepting or not self.running:
                raise LoopStopped("samcache's online loop is not running (stopped, or not started)")
            self._inbox.put(handle)
        return handle

    def serve(self, requests: Sequence) -> list:
        """Every request of ``requests`` through the loop; each result or its exception, in order."""
        handles = [self.submit(r) for r in requests]
        results = []
        for h in handles:
            try:
                results.append(h.result())
            except Exception as e:  # noqa: BLE001 - that request's failure, as chat_batch reports it
                results.append(e)
        return results

    def stop(self, timeout: float | None = None) -> None:
        """Take no new requests, finish the ones in flight, flush the tiers, end the loop (its
        thread, or :meth:`run`). Past ``timeout`` seconds the rest are cancelled (their callers get
        :class:`RequestCancelled`)."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):
            raise ValueError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        if self.in_loop_thread():
            raise RuntimeError("stop() cannot be called from the online loop's thread (a token callback, or the "
                               "thread that runs it)")
        with self._gate:
            self._accepting = False
            never_ran = self._thread is not None and not self._own_thread and not self._ran
            if never_ran:  # run() will not step it now: what was queued is refused
                self._ended.set()
        self._stopping.set()
        with self._announcing:  # a loop holding its first step for announced requests looks again
            self._announcing.notify_all()
        if never_ran:
            for handle in self._drain():
                self._settle(handle, LoopStopped("samcache's online loop was stopped before it ran"))
            return
        if self._thread is None:
            return
        if not self._ended.wait(timeout):
            self._cancel_all = True  # queued ones too: the loop settles them as cancelled
            self._ended.wait()

    # -- the loop's thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                arrived = self._take(wait=not self._live)
                if not self._live and not arrived and self._stopping.is_set():
                    with self._gate:  # a submit that passed the gate before stop() is in the inbox now
                        late = self._drain()
                    if not late:
                        break
                    arrived = late
                with engine._lock:
                    if arrived:
                        self._admit(arrived)
                    for live in self._live:
                        if live.handle.cancelled or self._cancel_all:
                            engine.scheduler.cancel(live.ticket)
                    if self._live:
                        engine.scheduler.step()
                        self.steps += 1
                    ended = [live for live in self._live if live.ticket.done]
                    if ended:  # settled first: a failure on the way leaves them live, settled below
                        self._finish(ended)
                        self._live = [live for live in self._live if not live.ticket.done]
        except BaseException as e:  # noqa: BLE001 - every caller learns why, then the thread ends
            self.error = e
            with self._gate:
                self._accepting = False
            with engine._lock:
                engine.scheduler.abort(e)
            for live in self._live:
                self._settle(live.handle, e)
            for handle in self._drain():
                self._settle(handle, e)
            self._live = []
            if not isinstance(e, Exception):
                raise
        finally:
            try:
                with engine._lock:
                    engine._after_turns([])
            finally:
                self._ended.set()

    def _take(self, wait: bool) -> list[RequestHandle]:
        """What the inbox holds; ``wait`` (the loop is idle): wait for a request first, then for the
        requests announced meanwhile (up to ``gather_s``), so a burst starts in one step."""
        got = []
        if wait:
            try:
                got.append(self._inbox.get(timeout=self.poll_s))
            except queue.Empty:
                return []
            self._gather()
        return got + self._drain()

    def _gather(self) -> None:
        start = time.perf_counter()
        deadline = start + self.gather_s
        with self._announcing:
            while self._announced > 0 and not self._stopping.is_set():
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._announcing.wait(left)
        self.gathered_s += time.perf_counter() - start

    def _drain(self) -> list[RequestHandle]:
        got = []
        while True:
            try:
                got.append(self._inbox.get_nowait())
            except queue.Empty:
                return got

    def _admit(self, handles: list[RequestHandle]) -> None:
        engine, admitted = self.engine, []
        for handle in handles:
            if handle.cancelled or self._cancel_all:
                self._settle(handle, RequestCancelled("the request was cancelled before its prefill"))
                continue
            try:
                admission, history = engine._admission(handle.request, handle.submitted)
                self._fit(admission, handle.fill)
            except Exception as e:  # noqa: BLE001 - this request's bad input only
                self._settle(handle, e)
                continue
            admitted.append((handle, admission, history))
        if not admitted:
            return
        try:
            engine._before_turns([a for _, a, _ in admitted])
        except Exception as e:  # noqa: BLE001 - these requests fail, the loop goes on
            for handle, _, _ in admitted:
                self._settle(handle, e)
            return
        for handle, admission, history in admitted:
            ticket = engine.scheduler.submit(admission, handle.on_token)
            self._live.append(_Live(handle, ticket, admission, history))

    def _fit(self, admission, fill: bool) -> None:
        """Hold the prompt and its reply to ``max_model_len`` (``fill``: as many new tokens as fit)."""
        limit = self.max_model_len
        if limit is None:
            return
        n = len(admission.prompt)
        room = limit - n
        if room < 1 or (not fill and admission.max_new_tokens > room):
            asked = "at least 1" if fill else str(admission.max_new_tokens)
            raise PromptTooLong(f"the prompt has {n} tokens and {asked} new tokens were asked for: more than the "
                                f"server's max_model_len of {limit}")
        if fill:
            self.engine._check_fits(admission.prompt, room)
            admission.max_new_tokens = room

    def _finish(self, ended: list[_Live]) -> None:
        engine = self.engine
        for live in ended:  # every one settled, whatever fails on the way
            if live.handle.future.done():
                continue
            try:
                request = getattr(live.handle.request, "request", live.handle.request)  # a PreparedChat's own
                result = engine._complete(request, live.admission, live.history, live.ticket.result)
            except Exception as e:  # noqa: BLE001 - e.g. a held session that could not keep its blocks
                result = e
            self._settle(live.handle, result)
        # Publishing to the tiers waits for their writes: once the loop is idle, not per request.
        engine._after_turns([live.ticket.result for live in ended], flush=len(ended) == len(self._live))

    @staticmethod
    def _settle(handle: RequestHandle, result) -> None:
        if handle.future.done():
            return
        try:
            if isinstance(result, BaseException):
                handle.future.set_exception(result)
            else:
                handle.future.set_result(result)
        except concurrent.futures.InvalidStateError:  # settled meanwhile: the first result stands
            pass


__all__ = ["Arrival", "LoopStopped", "OnlineLoop", "RequestHandle"]
