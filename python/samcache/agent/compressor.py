"""A deterministic context compressor for agent requests (AgentMem's stages), each stage on its own
and measurable.

Stages, in order (``CompressorConfig.stages`` picks and orders them):

``results``   tool results longer than ``max_result_chars``: into the :class:`ToolResultStore`
              (replaced by its compact reference) when one is given, else cut to a head and a
              tail around a marker saying how much was cut.
``dedupe``    a paragraph (text between blank lines, or a whole text part) of at least
              ``dedupe_min_chars`` repeated verbatim is replaced, after its first occurrence, by
              "[same as message i]".
``tools``     tool descriptions (the request's ``tools``) shortened to their first sentence, at
              most ``tool_description_chars``; the same for each parameter's description.
``history``   turns older than the last ``keep_recent_turns`` user turns: assistant and tool
              text cut to its first line (at most ``history_line_chars``) followed by " …".

Rules every stage keeps: the system prompt and the last turn (the last user message and what
follows it) are never touched; images are never touched (reusing them is samcache's job); the
output depends only on the input and the config (no clock, no randomness), so a compressed
prefix is the same every turn and still hits the prefix cache; compressing twice gives the same
result as compressing once (idempotent).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from samcache._checks import check_int
from samcache.agent.tool_store import _check_tenant

STAGES = ("results", "dedupe", "tools", "history")
_WORDS = re.compile(r"\w+|[^\w\s]")
_ELLIPSIS = " …"
_SAME_AS = re.compile(r"\[same as message (\d+)\]")


def approx_tokens(text: str) -> int:
    """A tokenizer-free token count (words and punctuation marks): the default measure."""
    return len(_WORDS.findall(text))


@dataclass(frozen=True)
class CompressorConfig:
    stages: tuple[str, ...] = STAGES
    max_result_chars: int = 2000
    dedupe_min_chars: int = 200
    tool_description_chars: int = 120
    keep_recent_turns: int = 2
    history_line_chars: int = 160

    def __post_init__(self):
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown or len(set(self.stages)) != len(self.stages):
            raise ValueError(f"stages must be distinct names from {', '.join(STAGES)}, got {self.stages!r}")
        check_int("max_result_chars", self.max_result_chars, 200)
        check_int("dedupe_min_chars", self.dedupe_min_chars, 32)
        check_int("tool_description_chars", self.tool_description_chars, 16)
        check_int("keep_recent_turns", self.keep_recent_turns, 0)
        check_int("history_line_chars", self.history_line_chars, 16)


@dataclass(frozen=True)
class StageReport:
    """One stage's effect: tokens of the whole request (messages + tools) before and after, and
    how many text parts it changed."""

    stage: str
    tokens_before: int
    tokens_after: int
    parts_changed: int

    @property
    def saved(self) -> int:
        return self.tokens_before - self.tokens_after


@dataclass
class Compressed:
    messages: list[dict]
    tools: list[dict] | None
    stages: list[StageReport] = field(default_factory=list)

    @property
    def tokens_before(self) -> int:
        return self.stages[0].tokens_before if self.stages else 0

    @property
    def tokens_after(self) -> int:
        return self.stages[-1].tokens_after if self.stages else 0


class ContextCompressor:
    """Compress agent requests (samcache's message format: ``content`` a str or a list of parts,
    images as ``{"type": "image", ...}``; roles system, user, assistant, tool).

    ``store``: a :class:`~samcache.agent.tool_store.ToolResultStore` for the ``results`` stage
    (None: cut instead); ``tenant``: the store's tenant; ``count_tokens``: the measure in the
    reports (a tokenizer's ``lambda s: len(tok(s).input_ids)``; default :func:`approx_tokens`)."""

    def __init__(self, config: CompressorConfig | None = None, *, store=None, tenant: str = "default",
                 count_tokens: Callable[[str], int] | None = None):
        self.config = config or CompressorConfig()
        self.store = store
        _check_tenant(tenant)
        if count_tokens is not None and not callable(count_tokens):
            raise TypeError(f"count_tokens must be a function of a str, got {type(count_tokens).__name__}")
        self.tenant = tenant
        self.count_tokens = count_tokens or approx_tokens

    def compress(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> Compressed:
        """The compressed request (the input is not modified) with one report per stage."""
        _check_messages(messages)
        msgs = [_copy_message(m) for m in messages]
        tools = copy.deepcopy(list(tools)) if tools is not None else None
        frozen = _frozen_indices(msgs)
        out = Compressed(msgs, tools)
        for stage in self.config.stages:
            before = self._tokens(msgs, tools)
            changed = getattr(self, f"_stage_{stage}")(msgs, tools, frozen)
            out.stages.append(StageReport(stage, before, self._tokens(msgs, tools), changed))
        return out

    # -------------------------------------------------------------------------------- stages

    def _stage_results(self, msgs, tools, frozen) -> int:
        limit = self.config.max_result_chars
        changed = 0
        for i, m in enumerate(msgs):
            if i in frozen or m["role"] != "tool":
                continue
            for get, put in _text_slots(m):
                text = get()
                if len(text) <= limit:
                    continue
                put(self.store.reference(text, tenant=self.tenant) if self.store is not None else _cut(text, limit))
                changed += 1
        return changed

    def _stage_dedupe(self, msgs, tools, frozen) -> int:
        first_seen: dict[str, int] = {}
        changed = 0
        for i, m in enumerate(msgs):
            for get, put in _text_slots(m):
                paragraphs = get().split("\n\n")
                hit = False
                for k, para in enumerate(paragraphs):
                    if len(para) < self.config.dedupe_min_chars:
                        continue
                    if para in first_seen and i not in frozen:
                        paragraphs[k] = f"[same as message {first_seen[para]}]"
                        hit = True
                    else:
                        first_seen.setdefault(para, i)
                if hit:
                    put("\n\n".join(paragraphs))
                    changed += 1
        return changed

    def _stage_tools(self, msgs, tools, frozen) -> int:
        if not tools:
            return 0
        changed = 0
        for tool in tools:
            spec = tool.get("function", tool)  # OpenAI's {"type": "function", "function": {...}} or bare
            if isinstance(spec.get("description"), str):
                short = _first_sentence(spec["description"], self.config.tool_description_chars)
                changed += short != spec["description"]
                spec["description"] = short
            props = (spec.get("parameters") or {}).get("properties") or {}
            for prop in props.values():
                if isinstance(prop, dict) and isinstance(prop.get("description"), str):
                    short = _first_sentence(prop["description"], self.config.tool_description_chars)
                    changed += short != prop["description"]
                    prop["description"] = short
        return changed

    def _stage_history(self, msgs, tools, frozen) -> int:
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        keep = self.config.keep_recent_turns
        if keep == 0:
            cutoff = users[-1] if users else len(msgs)
        else:
            cutoff = users[-keep] if len(users) >= keep else 0
        # A message that a dedupe marker points at keeps its text: the marker stands for it.
        pointed_at = {int(k) for m in msgs for get, _ in _text_slots(m) for k in _SAME_AS.findall(get())}
        changed = 0
        for i, m in enumerate(msgs[:cutoff]):
            if i in frozen or i in pointed_at or m["role"] not in ("assistant", "tool"):
                continue
            for get, put in _text_slots(m):
                text = get()
                if _SAME_AS.search(text):  # cutting a marker would unpin its message on the next pass
                    continue
                short = _first_line(text, self.config.history_line_chars)
                if short != text:
                    put(short)
                    changed += 1
        return changed

    # --------------------------------------------------------------------------------- helpers

    def _tokens(self, msgs, tools) -> int:
        total = sum(self.count_tokens(get()) for m in msgs for get, _ in _text_slots(m))
        for tool in tools or ():
            spec = tool.get("function", tool)
            total += self.count_tokens(str(spec.get("name", ""))) + self.count_tokens(str(spec.get("description", "")))
            for prop in ((spec.get("parameters") or {}).get("properties") or {}).values():
                if isinstance(prop, dict):
                    total += self.count_tokens(str(prop.get("description", "")))
        return total


def _check_messages(messages) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"message {i} has unknown role {m['role']!r}")
        if not isinstance(m["content"], (str, list)):
            raise ValueError(f"message {i}: content must be a str or a list of parts")


def _copy_message(m: dict) -> dict:
    """A copy whose texts can be changed; images are shared, never copied (nothing changes them)."""
    content = m["content"] if isinstance(m["content"], str) else [dict(p) if isinstance(p, dict) else p for p in m["content"]]
    return {**m, "content": content}


def _frozen_indices(msgs: list[dict]) -> set[int]:
    """Messages no stage may change: system prompts and the last turn (the last user message on)."""
    frozen = {i for i, m in enumerate(msgs) if m["role"] == "system"}
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    start = users[-1] if users else 0
    return frozen | set(range(start, len(msgs)))


def _text_slots(message: dict):
    """(getter, setter) of every text in ``message``: its content if a str, else each text part."""
    if isinstance(message["content"], str):
        yield (lambda: message["content"]), (lambda v: message.__setitem__("content", v))
        return
    for part in message["content"]:
        if isinstance(part, dict) and part.get("type") == "text":
            yield (lambda p=part: p["text"]), (lambda v, p=part: p.__setitem__("text", v))


def _cut(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` chars: 2/3 head, 1/3 tail, a marker between. Cutting a cut
    text again leaves it as it is (its length is within ``limit``)."""
    marker = f"\n[... {len(text):,} chars in all, cut ...]\n"
    room = limit - len(marker)
    head = room * 2 // 3
    return text[:head] + marker + text[len(text) - (room - head):]


def _first_sentence(text: str, limit: int) -> str:
    text = " ".join(text.split())
    m = re.search(r"(?<=[.!?])\s", text)
    short = text[:m.start()] if m else text
    return short if len(short) <= limit else short[:limit - len(_ELLIPSIS)].rstrip() + _ELLIPSIS


def _first_line(text: str, limit: int) -> str:
    """``text`` cut to its first line, at most ``limit`` chars, with " …" where something was cut;
    a text already cut that way stays as it is."""
    lines = text.strip().splitlines()
    if len(lines) <= 1 and len(text.strip()) <= limit:
        return text
    if len(lines) == 1 and lines[0].endswith(_ELLIPSIS) and len(lines[0]) <= limit + len(_ELLIPSIS):
        return text
    return lines[0][:limit].rstrip() + _ELLIPSIS


__all__ = ["STAGES", "Compressed", "CompressorConfig", "ContextCompressor", "StageReport", "approx_tokens"]
