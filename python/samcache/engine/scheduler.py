"""The step loop: many requests served together, prefill and decode rows mixed in one step.

Requests are admitted in arrival order while their prompts fit the step's token budget
(``max_step_tokens``; the first is always admitted when nothing else runs). Every running request
adds its decode row to every step, so a queue longer than one step is served as a continuous
batch: new prompts are prefilled in the same forward steps that decode earlier ones. Each request
samples with its own sampler; its first token ends its TTFT.

A request that fails (a prompt that does not fit, a full pool) gets its exception as its result
and its blocks are dropped; the others go on. An interruption (``KeyboardInterrupt``) drops every
request's blocks before it propagates, so the pool and stores stay consistent.

The loop is incremental: a request submitted between steps joins the running batch at the next
one, each sampled token is handed to its request's callback at once, and a cancelled request's
blocks are freed at the next step. :meth:`Scheduler.run` serves a fixed list with it; the online
loop (:mod:`samcache.engine.online`) serves requests that keep arriving.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from samcache._checks import check_int
from samcache.engine.executor import Executor, Prepared, RequestOptions
from samcache.engine.prompt import Prompt
from samcache.engine.sampling import Sampler
from samcache.errors import OutOfBlocks, RequestCancelled
from samcache.hashing import Namespace


@dataclass
class Admission:
    """A request as the scheduler serves it. ``keep_prefill``: keep a fork of the prefilled
    sequence (``Finished.fork``, freed by the caller) for a comparison after the turn.
    ``keep_sequence``: keep the finished sequence itself (``Finished.sequence``, freed by the
    caller), e.g. for a session that holds its context. ``sample_attention``: measure where the
    prompt's last tokens attend (``Finished.attention``, for attention-aware eviction)."""

    prompt: Prompt
    namespace: Namespace
    options: RequestOptions
    sampler: Sampler
    max_new_tokens: int
    ignore_eos: bool = False
    keep_prefill: bool = False
    keep_sequence: bool = False
    sample_attention: bool = False
    arrival: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, Prompt):
            raise TypeError(f"Admission.prompt must be a Prompt, got {type(self.prompt).__name__}")
        if not isinstance(self.namespace, Namespace):
            raise TypeError(f"Admission.namespace must be a Namespace, got {type(self.namespace).__name__}")
        if not isinstance(self.options, RequestOptions):
            raise TypeError(f"Admission.options must be RequestOptions, got {type(self.options).__name__}")
        if not isinstance(self.sampler, Sampler):
            raise TypeError(f"Admission.sampler must be a Sampler, got {type(self.sampler).__name__}")
        check_int("max_new_tokens", self.max_new_tokens, 1)


@dataclass
class Finished:
    prepared: Prepared  # plan, metrics, ViT outputs (its sequence is freed)
    tokens: list[int]
    finish_reason: str  # "stop" (an end token) or "length"
    first_logits: torch.Tensor | None = None  # with keep_prefill: the prefill's next-token logits
    fork: int | None = None  # with keep_prefill: a fork of the prefilled sequence (the caller frees it)
    sequence: int | None = None  # with keep_sequence: the finished sequence (the caller frees it)
    blocks: np.ndarray | None = None  # the finished sequence's block table
    attention: dict | None = None  # with sample_attention: Executor.attention_sample


@dataclass
class _Running:
    prepared: Prepared
    first_logits: torch.Tensor | None
    tokens: list[int]
    decode_start: float
    fork: int | None


@dataclass(eq=False)  # identity: a ticket is one request, however equal its fields
class Ticket:
    """An admission in the step loop. ``on_token(token)`` is called (in the loop's thread) with
    every token as it is sampled; a true return ends the request there, finished by "stop" (a stop
    string the caller found). ``result`` is the :class:`Finished` or the exception the request
    ended with, once it has. :meth:`Scheduler.cancel` marks it ``cancelled``."""

    admission: Admission
    on_token: Callable[[int], None] | None = None
    result: Finished | BaseException | None = None
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return self.result is not None


class Scheduler:
    """The step loop over a changing set of requests: :meth:`submit` queues one (it joins the
    running batch at the next :meth:`step`), :meth:`cancel` ends one at the next step. One thread
    drives it (:meth:`run` for a fixed list, the online loop for requests that keep arriving)."""

    def __init__(self, executor: Executor, eos_token_ids: set[int], *, max_step_tokens: int = 16384) -> None:
        self.executor = executor
        self.eos_token_ids = set(eos_token_ids)
        self.max_step_tokens = check_int("max_step_tokens", max_step_tokens, 1)
        self._pending: deque[Ticket] = deque()
        self._prefilling: dict[Ticket, Prepared] = {}
        self._running: dict[Ticket, _Running] = {}

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing running."""
        return not self._pending and not self._running

    def submit(self, admission: Admission, on_token: Callable[[int], None] | None = None) -> Ticket:
        """Queue ``admission``; it is prefilled in the next step with room for it."""
        if not isinstance(admission, Admission):
            raise TypeError(f"submit takes an Admission, got {type(admission).__name__}")
        ticket = Ticket(admission, on_token)
        self._pending.append(ticket)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """End ``ticket``'s request at the next step (its result: :class:`RequestCancelled`; its
        blocks freed). Safe from any thread; a finished request is left as it is."""
        ticket.cancelled = True

    def run(self, admissions: Sequence[Admission]) -> list[Finished | Exception]:
        """Serve every admission; each result is its :class:`Finished` or the exception it failed with."""
        tickets = [self.submit(adm) for adm in admissions]
        try:
            while not all(t.done for t in tickets):
                self.step()
        except BaseException as e:
            self.abort(e)
            raise
        return [t.result for t in tickets]  # type: ignore[misc]

    def abort(self, error: BaseException) -> None:
        """Drop every request, queued or running (their blocks freed), ``error`` as their result:
        after an interruption the pool and stores stay consistent."""
        ex = self.executor
        for t, pre in self._prefilling.items():
            ex.discard_prepared(pre)
            t.result = error
        for t, st in self._running.items():
            self._drop(st, t.admission)
            t.result = error
        for t in self._pending:
            t.result = error
        self._prefilling.clear()
        self._running.clear()
        self._pending.clear()

    def step(self) -> list[Ticket]:
        """One forward step: the queued requests that fit are prefilled beside the running ones'
        decode rows; every sampled token goes to its ticket. Returns the tickets that ended."""
        ex = self.executor
        ended: list[Ticket] = []

        def end(t: Ticket, result) -> None:
            t.result = result
            ended.append(t)

        self._reap_cancelled(end)
        pending, running, prefilling = self._pending, self._running, self._prefilling
        steps, owners = [], []
        budget = self.max_step_tokens - len(running)
        while pending:
            t = pending[0]
            adm = t.admission
            if (steps or running) and len(adm.prompt) > budget:
                break  # next step: it would exceed the token budget
            pending.popleft()
            try:
                pre = ex.prepare(adm.prompt, adm.namespace, adm.options)
            except Exception as e:  # noqa: BLE001 - this request's failure only
                end(t, e)
                continue
            if running:  # the newcomer fails, not a request already decoding
                try:
                    ex._make_room(len(running), "the running requests' next tokens beside this prompt", OutOfBlocks)
                except OutOfBlocks as e:
                    ex.discard_prepared(pre)
                    end(t, e)
                    continue
            prefilling[t] = pre
            steps.append(pre.step)
            owners.append(t)
            budget -= int(pre.step.rows.size)
        for t in list(running):
            st = running[t]
            adm = t.admission
            try:
                steps.append(ex.decode_step(st.prepared.seq, st.tokens[-1],
                                            adm.prompt.next_position + len(st.tokens) - 1,
                                            adm.options.register_prefix, st.prepared.compaction))
                owners.append(t)
            except Exception as e:  # noqa: BLE001 - e.g. the pool is full: this request fails
                self._drop(running.pop(t), adm)
                end(t, e)
        if not steps:
            return ended
        try:
            logits = ex.forward(steps)
        except Exception as e:  # noqa: BLE001 - every request of the step fails; the queue goes on
            for t in owners:
                if t in prefilling:
                    ex.discard_prepared(prefilling.pop(t))
                else:
                    self._drop(running.pop(t), t.admission)
                end(t, e)
            return ended
        # Greedy rows: one argmax over the step's logits (one device sync for all of them).
        greedy = logits.argmax(-1).tolist() if any(t.admission.sampler.greedy for t in owners) else None
        if greedy is None and logits.is_cuda:  # the step's kernels are only queued until here
            torch.cuda.current_stream(logits.device).synchronize()
        now = time.perf_counter()  # after the step's GPU work: the first tokens exist now
        for row, t in enumerate(owners):
            adm = t.admission
            try:
                token = greedy[row] if adm.sampler.greedy else adm.sampler(logits[row])
                if t in prefilling:
                    pre = prefilling[t]  # left there until it runs: a failure below discards it
                    pre.metrics.ttft_s = now - adm.arrival
                    keep = adm.keep_prefill  # else no view of the step's logits outlives the step
                    first = logits[row].clone() if keep else None
                    running[t] = _Running(pre, first, [token], now, self._fork(pre) if keep else None)
                    del prefilling[t]
                    ex.register(pre)
                else:
                    running[t].tokens.append(token)
                stop = t.on_token is not None and bool(t.on_token(token))
                st = running[t]
                if (stop or (token in self.eos_token_ids and not adm.ignore_eos)
                        or len(st.tokens) >= adm.max_new_tokens):
                    done = self._finish(st, adm, now, token, stopped=stop)
                    del running[t]
                    end(t, done)
            except Exception as e:  # noqa: BLE001 - this request's failure only (its sampler, its caller's callback)
                if t in prefilling:
                    running.pop(t, None)
                    ex.discard_prepared(prefilling.pop(t))
                elif t in running:
                    self._drop(running.pop(t), adm)
                end(t, e)
        return ended

    def _reap_cancelled(self, end: Callable[[Ticket, BaseException], None]) -> None:
        if not any(t.cancelled for t in self._pending) and not any(t.cancelled for t in self._running):
            return
        for t in [t for t in self._pending if t.cancelled]:
            self._pending.remove(t)
            end(t, RequestCancelled("the request was cancelled before its prefill"))
        for t in [t for t in self._running if t.cancelled]:
            self._drop(self._running.pop(t), t.admission)
            end(t, RequestCancelled("the request was cancelled while it decoded"))

    def _fork(self, pre: Prepared) -> int | None:
        """A fork of the prefill for a comparison after the turn; None, with a warning, when it
        does not fit the pool (the turn itself goes on)."""
        try:
            return self.executor.fork_prefilled(pre)
        except OutOfBlocks as e:
            warnings.warn(f"fidelity not measured: no room for a copy of the prefill ({e})", stacklevel=2)
            return None

    def _finish(self, st: _Running, adm: Admission, now: float, last: int, stopped: bool = False) -> Finished:
        ex, pre = self.executor, st.prepared
        m = pre.metrics
        n = len(st.tokens)
        decode_s = now - st.decode_start
        m.decode_tokens = n
        m.decode_tokens_per_s = (n - 1) / decode_s if decode_s > 0 and n > 1 else 0.0
        block_bytes = ex.runner.block_bytes
        m.kv_bytes = len(ex.pool.block_table(pre.seq)) * block_bytes
        m.kv_pool_bytes = (ex.pool.num_blocks - ex.pool.stats()["free_blocks"]) * block_bytes
        m.image_kv_store_bytes = ex.image_kv_store.used_bytes
        m.latency_s = time.perf_counter() - adm.arrival
        blocks = ex.pool.block_table(pre.seq)
        attention = ex.attention_sample(pre) if adm.sample_attention else None
        if not adm.keep_sequence:
            ex.pool.free_sequence(pre.seq)
        reason = "stop" if stopped or last in self.eos_token_ids else "length"
        return Finished(pre, st.tokens, reason, st.first_logits, st.fork, pre.seq if adm.keep_sequence else None,
                        blocks, attention)

    def _drop(self, st: _Running, adm: Admission) -> None:
        """A request that failed after its prefill: the prompt's blocks stay valid, its decode
        blocks are dropped."""
        if st.fork is not None:
            self.executor.pool.free_sequence(st.fork)
        self.executor.discard(st.prepared.seq, table_from=len(adm.prompt) // self.executor.pool.block_size,
                              hashed=adm.options.register_prefix)


__all__ = ["Admission", "Finished", "Scheduler", "Ticket"]
