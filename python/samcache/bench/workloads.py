"""Agent workloads as deterministic traces: what each turn of an agent sends to the engine.

A trace is a list of turns; each turn is the *whole* request (chat messages), as an agent
framework sends it. Assistant replies inside the history are scripted, not generated, so every
mode of the benchmark sees exactly the same prompts. Images are ``ImageRef``s (kind, seed, size),
drawn locally when the benchmark runs (``materialize``); nothing is downloaded.

Scenarios (``SCENARIOS``; every generator takes ``seed`` and sizes as keywords):

- ``gui``: a GUI agent keeping its last ``window`` screenshots. Each turn adds one screenshot and
  drops the oldest, so the exact prefix breaks every turn while most images repeat at new
  positions.
- ``docs``: a document agent that revisits ``pages`` pages, a few at a time, in changing order
  with changing questions.
- ``branch``: a planner that forks sub-agents (each with its own system prompt) over the same
  images, then continues the best branch for a few turns.
- ``chat``: plain multi-turn chat over one image: the prefix-friendly control case.

``Trace.new_content(t)`` cuts turn ``t`` down to what no cache can hold (the images seen for the
first time and the last message's text): the floor the benchmark's ``new-only`` mode measures.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from samcache._checks import check_int
from samcache.engine.prompt import user_message
from samcache.synthetic import document_page, screenshot

_KINDS: dict[str, Callable[..., np.ndarray]] = {"screenshot": screenshot, "page": document_page}


@dataclass(frozen=True)
class ImageRef:
    """A synthetic image by recipe: ``kind`` ('screenshot' or 'page'), ``seed``, ``size`` (h, w)."""

    kind: str
    seed: int
    size: tuple[int, int]

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown image kind {self.kind!r}; choose from {', '.join(_KINDS)}")


@functools.lru_cache(maxsize=256)
def materialize(ref: ImageRef) -> np.ndarray:
    """The HxWx3 uint8 pixels of ``ref`` (cached: every mode gets the same array)."""
    arr = _KINDS[ref.kind](ref.seed, tuple(ref.size))
    arr.flags.writeable = False
    return arr


@dataclass
class Turn:
    label: str
    messages: list[dict]
    max_new_tokens: int = 8

    def images(self) -> list[ImageRef]:
        return [p["image"] for m in self.messages if not isinstance(m["content"], str)
                for p in m["content"] if p.get("type") == "image"]

    def resolved(self) -> list[dict]:
        """The messages with every ImageRef replaced by its pixels."""
        out = []
        for m in self.messages:
            if isinstance(m["content"], str):
                out.append(m)
                continue
            parts = [{**p, "image": materialize(p["image"])} if p.get("type") == "image" else p for p in m["content"]]
            out.append({**m, "content": parts})
        return out


@dataclass
class Trace:
    scenario: str
    seed: int
    params: dict[str, Any]
    turns: list[Turn] = field(default_factory=list)

    def to_json(self) -> str:
        """Canonical JSON of the whole trace (images as recipes)."""
        def enc(o):
            if isinstance(o, ImageRef):
                return {"image": asdict(o)}
            raise TypeError(type(o).__name__)

        return json.dumps({"scenario": self.scenario, "seed": self.seed, "params": self.params,
                           "turns": [asdict(t) for t in self.turns]}, default=enc, sort_keys=True)

    def new_content(self, t: int) -> Turn:
        """Turn ``t`` cut down to what no cache can hold: its system message, the images no earlier
        turn sent (in order of appearance) and the text of its last message.

        Serving it costs less than serving turn ``t`` with every earlier image and token free
        (it skips even the new tokens' attention to that context), so its TTFT is a floor for any
        reuse scheme: the benchmark's ``new-only`` mode.
        """
        if not 0 <= t < len(self.turns):
            raise ValueError(f"turn index {t} is outside this {len(self.turns)}-turn trace")
        return _cut(self.turns[t], {r for turn in self.turns[:t] for r in turn.images()})

    def new_contents(self) -> list[Turn]:
        """``new_content(t)`` of every turn, in one pass."""
        seen: set[ImageRef] = set()
        out = []
        for turn in self.turns:
            out.append(_cut(turn, seen))
            seen.update(turn.images())
        return out

    def summary(self) -> dict[str, Any]:
        refs = [r for t in self.turns for r in t.images()]
        return {"scenario": self.scenario, "seed": self.seed, "params": self.params, "turns": len(self.turns),
                "images_sent": len(refs), "distinct_images": len(set(refs))}


def _cut(turn: Turn, seen: set[ImageRef]) -> Turn:
    """``turn`` with only its system message, the images not in ``seen`` and its last text."""
    fresh = list(dict.fromkeys(r for r in turn.images() if r not in seen))
    content = turn.messages[-1]["content"]
    text = content if isinstance(content, str) else " ".join(p["text"] for p in content if p.get("type") == "text")
    system = [m for m in turn.messages[:1] if m["role"] == "system"]
    return Turn(turn.label, [*system, user_message(fresh, text)], turn.max_new_tokens)


def _words(rng: np.random.Generator, n: int) -> str:
    vocab = ("open", "save", "menu", "report", "total", "invoice", "submit", "field", "date", "amount", "next",
             "page", "table", "row", "column", "button", "window", "search", "filter", "export", "settings")
    return " ".join(vocab[int(i)] for i in rng.integers(0, len(vocab), n))


def _common(size, max_new_tokens: int, seed: int) -> tuple[int, int]:
    """Checks shared by every scenario; returns the size as a tuple."""
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("seed", seed, 0)
    size = tuple(size)
    if len(size) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 28 for v in size):
        raise ValueError(f"size must be (height, width), each an int >= 28 pixels, got {size!r}")
    if max(size) / min(size) > 100:
        raise ValueError(f"size {size!r}: aspect ratio above 100 is not an image a VLM accepts")
    return size


def gui(*, seed: int = 0, turns: int = 20, window: int = 4, size: tuple[int, int] = (720, 1280),
        max_new_tokens: int = 8) -> Trace:
    check_int("turns", turns, 1), check_int("window", window, 1)
    size = _common(size, max_new_tokens, seed)
    rng = np.random.default_rng(seed)
    goal = f"file the expense report for {_words(rng, 2)}"
    system = f"You are a GUI agent operating a desktop computer. Your goal: {goal}. Answer with one action."
    shots = [ImageRef("screenshot", seed * 100_003 + i, size) for i in range(turns)]
    actions: list[str] = []
    trace = Trace("gui", seed, {"turns": turns, "window": window, "size": list(size), "max_new_tokens": max_new_tokens})
    for t in range(turns):
        visible = shots[max(0, t - window + 1): t + 1]
        history = "; ".join(actions[-3:]) or "none"
        question = (f"Step {t}. Previous actions: {history}. The last {len(visible)} screenshots are above, "
                    "newest last. What is the next action?")
        trace.turns.append(Turn(f"step {t}", [{"role": "system", "content": system}, user_message(visible, question)],
                                max_new_tokens))
        x, y = (int(v) for v in rng.integers(0, 1000, 2))
        actions.append(f"click({x}, {y}) on '{_words(rng, 2)}'")
    return trace


def docs(*, seed: int = 0, turns: int = 12, pages: int = 6, per_turn: int = 3, size: tuple[int, int] = (1100, 850),
         max_new_tokens: int = 8) -> Trace:
    check_int("turns", turns, 1), check_int("pages", pages, 1), check_int("per_turn", per_turn, 1)
    if per_turn > pages:
        raise ValueError(f"per_turn ({per_turn}) cannot exceed pages ({pages})")
    size = _common(size, max_new_tokens, seed)
    rng = np.random.default_rng(seed)
    refs = [ImageRef("page", seed * 100_003 + i, size) for i in range(pages)]
    system = "You are a document analyst. Answer from the pages shown; cite the page."
    trace = Trace("docs", seed, {"turns": turns, "pages": pages, "per_turn": per_turn, "size": list(size),
                                 "max_new_tokens": max_new_tokens})
    for t in range(turns):
        chosen = rng.choice(pages, per_turn, replace=False)
        question = f"Question {t}: where do the pages mention '{_words(rng, 2)}', and what is the {_words(rng, 1)}?"
        trace.turns.append(Turn(f"question {t}", [{"role": "system", "content": system},
                                                  user_message([refs[int(i)] for i in chosen], question)],
                                max_new_tokens))
    return trace


def branch(*, seed: int = 0, branches: int = 3, images: int = 3, continue_turns: int = 3,
           size: tuple[int, int] = (720, 1280), max_new_tokens: int = 8) -> Trace:
    check_int("branches", branches, 1), check_int("images", images, 1), check_int("continue_turns", continue_turns, 0)
    size = _common(size, max_new_tokens, seed)
    rng = np.random.default_rng(seed)
    refs = [ImageRef("screenshot", seed * 100_003 + i, size) for i in range(images)]
    task = f"reconcile the {_words(rng, 2)} across these screens"
    trace = Trace("branch", seed, {"branches": branches, "images": images, "continue_turns": continue_turns,
                                   "size": list(size), "max_new_tokens": max_new_tokens})
    trace.turns.append(Turn("plan", [{"role": "system", "content": "You are a planner. Split the task into sub-tasks."},
                                     user_message(refs, f"Task: {task}.")], max_new_tokens))
    subs = []
    for b in range(branches):
        system = f"You are sub-agent {b}, a specialist in {_words(rng, 2)}. Work only on your sub-task."
        sub = f"Sub-task {b}: check the {_words(rng, 3)}."
        subs.append((system, sub))
        trace.turns.append(Turn(f"branch {b}", [{"role": "system", "content": system}, user_message(refs, sub)],
                                max_new_tokens))
    best_system, best_sub = subs[int(rng.integers(0, branches))]
    history = [{"role": "system", "content": best_system}, user_message(refs, best_sub)]
    for c in range(continue_turns):
        history = history + [{"role": "assistant", "content": f"Found: {_words(rng, 6)}."},
                             {"role": "user", "content": f"Continue ({c + 1}): now verify the {_words(rng, 2)}."}]
        trace.turns.append(Turn(f"continue {c}", list(history), max_new_tokens))
    return trace


def chat(*, seed: int = 0, turns: int = 8, size: tuple[int, int] = (720, 1280), max_new_tokens: int = 8) -> Trace:
    check_int("turns", turns, 1)
    size = _common(size, max_new_tokens, seed)
    rng = np.random.default_rng(seed)
    ref = ImageRef("screenshot", seed * 100_003, size)
    history: list[dict] = [{"role": "system", "content": "You are a helpful assistant."},
                           user_message([ref], f"What is on this screen? Focus on the {_words(rng, 1)}.")]
    trace = Trace("chat", seed, {"turns": turns, "size": list(size), "max_new_tokens": max_new_tokens})
    for t in range(turns):
        if t:
            history = history + [{"role": "assistant", "content": f"It shows {_words(rng, 8)}."},
                                 {"role": "user", "content": f"And the {_words(rng, 2)}?"}]
        trace.turns.append(Turn(f"turn {t}", list(history), max_new_tokens))
    return trace


SCENARIOS: dict[str, Callable[..., Trace]] = {"gui": gui, "docs": docs, "branch": branch, "chat": chat}


def scenario_parameters(scenario: str) -> list[str]:
    """The keyword parameters of a scenario's generator, in order."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
    return list(inspect.signature(SCENARIOS[scenario]).parameters)


def make_trace(scenario: str, **params) -> Trace:
    """``SCENARIOS[scenario](**params)`` with a clear error for an unknown scenario or parameter."""
    known = scenario_parameters(scenario)
    unknown = [k for k in params if k not in known]
    if unknown:
        raise ValueError(f"scenario {scenario!r} has no parameter {', '.join(map(repr, unknown))}; "
                         f"its parameters: {', '.join(known)}")
    try:
        return SCENARIOS[scenario](**params)
    except TypeError as e:  # e.g. a size that is not a pair
        raise ValueError(f"scenario {scenario!r}: {e}") from None


__all__ = ["SCENARIOS", "ImageRef", "Trace", "Turn", "branch", "chat", "docs", "gui", "make_trace", "materialize",
           "scenario_parameters"]
