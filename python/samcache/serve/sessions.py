"""Sessions of ``samcache serve``: an agent's conversation held by the engine between requests,
and forked for its sub-agents.

OpenAI's API is stateless: every request sends the whole conversation, and the engine's prefix
cache already reuses what it has seen. A session adds what a cache cannot promise: the
conversation's KV is *held* between turns (``engine.new_session(hold_context=True)``: nothing of
it is evicted while the pool has cached blocks of others to give up), and a sub-agent forked from
it (``fork_of``) shares those blocks by reference. A request names them in its ``extra_body``:

- ``session``: the conversation's name on this server (created by its first request);
- ``fork_of``: start ``session`` as a branch of this existing session (its history and held KV);
- ``end_session``: after this turn, the session is closed and its blocks released.

Every request still sends the whole conversation: its messages must repeat the session's history
(what earlier requests sent and the replies they got, compared by digest, images included) and add
one user message, which the engine appends to the held session. A request that does not continue
its session is refused (400) rather than silently answered from another history. One request at a
time per session (409 while one runs); sessions are scoped to their tenant (another tenant's name
is not found, 404); at most ``max_sessions`` are open (the least recently used idle one is closed
to make room; 503 when all are busy).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from samcache.serve.errors import ApiError


def message_digest(message: Any) -> bytes:
    """A digest of one OpenAI message (its role, text and image URLs): what a later request of the
    session must repeat. ``message``: a request's pydantic message, or the assistant's reply text."""
    h = xxhash.xxh3_128()
    if isinstance(message, str):  # a reply the server gave
        h.update(b"assistant\x00text\x00" + message.encode())
        return h.digest()
    h.update(message.role.encode() + b"\x00")
    content = message.content
    if isinstance(content, list) and all(part.type == "text" for part in content):
        content = "".join(part.text or "" for part in content)  # text parts read as the one text they make
    if content is None or isinstance(content, str):
        h.update(b"text\x00" + (content or "").encode())
        return h.digest()
    for part in content:
        if part.type == "text":
            h.update(b"text\x00" + (part.text or "").encode() + b"\x00")
        else:
            h.update(b"image\x00" + part.image_url.url.encode() + b"\x00")
    return h.digest()


@dataclass(eq=False)
class OpenSession:
    """A session of the server: the engine's held ``session``, its ``tenant``, the digests of its
    history, and whether a request runs on it now."""

    name: str
    session: Any
    tenant: str | None
    digests: list[bytes] = field(default_factory=list)
    busy: bool = False


@dataclass(eq=False)
class SessionTurn:
    """One request's turn on an open session: the history the engine appends to (``new``: the
    session was created by this request, ``messages_from``: where the turn's messages start)."""

    open: OpenSession
    new: bool
    messages_from: int


class ServerSessions:
    """The server's open sessions, by (tenant, name)."""

    def __init__(self, engine, max_sessions: int = 256) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be an int >= 1, got {max_sessions!r}")
        self.engine = engine
        self.max_sessions = max_sessions
        self._open: OrderedDict[tuple, OpenSession] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._open)

    def begin(self, name: str, messages: Sequence[Any], *, tenant: str | None, fork_of: str | None = None
              ) -> SessionTurn:
        """Start a request's turn on session ``name`` (created here, or as a fork of ``fork_of``).
        ``messages``: the request's OpenAI messages, which must repeat the session's history and
        add one user message. Raises :class:`ApiError` (400, 404, 409, 503) naming the problem.

        The engine is called outside this registry's lock: the step loop's thread ends turns
        (:meth:`finish`) while it holds the engine's lock, so the two locks are never taken in the
        other order."""
        for field_name, value in (("session", name), ("fork_of", fork_of)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ApiError(400, f"{field_name} must be a non-empty string, got {value!r}", field_name)
        if not messages or messages[-1].role != "user":
            raise ApiError(400, "a session's request ends with the user message the turn adds", "messages")
        key, parent = (tenant, name), None
        with self._lock:
            found = self._open.get(key)
            if fork_of is not None:
                if found is not None:
                    raise ApiError(409, f"session {name!r} exists already; fork into a new name", "session")
                parent = self._open.get((tenant, fork_of))
                if parent is None or parent.session is None:
                    raise ApiError(404, f"no open session {fork_of!r} to fork", "fork_of")
                if parent.busy:
                    raise ApiError(409, f"session {fork_of!r} is answering a request; fork it after that", "fork_of")
                history = parent.digests
            elif found is not None:
                if found.busy:
                    raise ApiError(409, f"session {name!r} is answering another request; one at a time", "session")
                history = found.digests
            else:
                history = None  # a new session takes any history
            if history is not None and (len(messages) != len(history) + 1
                                        or [message_digest(m) for m in messages[:-1]] != history):
                raise ApiError(400, self._mismatch(fork_of or name, messages, history), "messages")
            if found is not None:
                found.busy = True
                self._open.move_to_end(key)
                return SessionTurn(found, False, len(history))
            if parent is not None:
                parent.busy = True  # not closed to make room, nor forked twice at once, while it is copied
                self._open.move_to_end((tenant, fork_of))
            try:
                closed = self._make_room()
            except ApiError:
                if parent is not None:
                    parent.busy = False
                raise
            found = OpenSession(name, None, tenant, list(history or ()), busy=True)
            self._open[key] = found  # reserved: a request racing for the name sees it busy
        self._abandon(closed)
        try:
            found.session = (self.engine.fork_session(parent.session, name) if parent is not None
                             else self.engine.new_session(tenant=tenant, hold_context=True))
        except BaseException:
            with self._lock:
                self._open.pop(key, None)
            raise
        finally:
            if parent is not None:
                with self._lock:
                    parent.busy = False
        return SessionTurn(found, parent is None, 0 if parent is None else len(history))

    def finish(self, turn: SessionTurn, messages: Sequence[Any], reply: str | None, end: bool) -> None:
        """End a turn: with its ``reply`` (None: it failed, nothing recorded) the session's history
        is the request's messages and the reply; ``end`` closes the session."""
        closed = []
        with self._lock:
            open_ = turn.open
            open_.busy = False
            key = (open_.tenant, open_.name)
            if reply is not None:
                open_.digests = [message_digest(m) for m in messages] + [message_digest(reply)]
                held = open_.session.messages
                if held and held[-1].get("role") == "assistant":  # the reply as the client got it (stop strings cut)
                    held[-1] = {"role": "assistant", "content": reply}
            elif turn.new:
                end = True  # a session its first request could not start is not kept
            if end and self._open.get(key) is open_:
                closed.append(self._open.pop(key))
        self._abandon(closed)

    @staticmethod
    def _mismatch(name: str, messages: Sequence[Any], history: list[bytes]) -> str:
        for i, (m, d) in enumerate(zip(messages, history)):
            if message_digest(m) != d:
                return (f"messages[{i}] is not what session {name!r} holds there: a session's request repeats "
                        "its history (earlier messages and the replies they got) and adds one user message")
        return (f"session {name!r} holds {len(history)} messages; a request on it sends them and one new user "
                f"message ({len(messages)} sent)")

    def _make_room(self) -> list[OpenSession]:
        """Under the lock: take the least recently used idle sessions out until one more fits; the
        caller abandons them (outside the lock)."""
        closed = []
        while len(self._open) >= self.max_sessions:
            idle = next((k for k, s in self._open.items() if not s.busy), None)
            if idle is None:
                self._open.update({(s.tenant, s.name): s for s in closed})  # nothing closed after all
                raise ApiError(503, f"all {self.max_sessions} sessions are answering requests; retry later", "session")
            closed.append(self._open.pop(idle))
        return closed

    def _abandon(self, closed: list[OpenSession]) -> None:
        for found in closed:
            if found.session is not None and not found.session.abandoned:
                self.engine.abandon_session(found.session)

    def close_all(self) -> None:
        with self._lock:
            closed = list(self._open.values())
            self._open.clear()
        self._abandon(closed)


__all__ = ["OpenSession", "ServerSessions", "SessionTurn", "message_digest"]
