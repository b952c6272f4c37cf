"""Synthetic agent requests for the agent-memory benchmarks, deterministic per seed.

``tool_heavy_request``: a GUI agent that calls tools (file reads, searches, shell commands) between
screenshots. Its context fills with what agents' contexts fill with: long tool results (logs,
listings, search hits), the same file read twice, verbose tool descriptions and long reasoning in
old turns. This is what the tool-result store and the context compressor act on.

``long_context``: a long multimodal context (a system prompt, several screenshots, earlier turns)
that a planner forks into sub-agents (the branch-memory benchmark).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from samcache._checks import check_int, check_seed

_WORDS = ("window", "button", "config", "server", "request", "timeout", "value", "render", "cache", "module",
          "handler", "session", "token", "layout", "widget", "export", "import", "update", "record", "index")
_FILES = ("settings.yaml", "app/main.py", "app/views.py", "logs/server.log", "README.md", "app/models.py")


def _sentence(rng: np.random.Generator, n: int) -> str:
    words = [str(rng.choice(_WORDS)) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def _paragraph(rng: np.random.Generator, sentences: int) -> str:
    return " ".join(_sentence(rng, int(rng.integers(6, 14))) for _ in range(sentences))


def _tools(rng: np.random.Generator) -> list[dict]:
    """Six tools in the OpenAI function format, with verbose descriptions."""
    names = ("read_file", "search_files", "run_shell", "click", "type_text", "take_screenshot")
    tools = []
    for name in names:
        params = {p: {"type": "string", "description": _paragraph(rng, 2)} for p in ("target", "options")}
        tools.append({"type": "function", "function": {
            "name": name, "description": f"{name.replace('_', ' ').capitalize()}. " + _paragraph(rng, 4),
            "parameters": {"type": "object", "properties": params, "required": ["target"]}}})
    return tools


def _file_text(rng: np.random.Generator, name: str, lines: int) -> str:
    return "\n".join(f"{name}:{i + 1}: {_sentence(rng, int(rng.integers(5, 12)))}" for i in range(lines))


def _tool_result(rng: np.random.Generator, kind: int, files: dict[str, str]) -> tuple[str, str]:
    """(the call the assistant makes, its result)."""
    if kind == 0:  # read a file (files are read again later: the same text twice)
        name = str(rng.choice(list(files)))
        return f"read_file(target={name!r})", files[name]
    if kind == 1:  # search hits
        word = str(rng.choice(_WORDS))
        hits = [f"{rng.choice(_FILES)}:{int(rng.integers(1, 400))}: {_sentence(rng, 9)}" for _ in range(30)]
        return f"search_files(target={word!r})", "\n".join(hits)
    lines = [f"[{int(rng.integers(0, 24)):02d}:{int(rng.integers(0, 60)):02d}] INFO {_sentence(rng, 10)}" for _ in range(45)]
    return "run_shell(target='make check')", "\n".join(lines) + "\nexit status 0"


def tool_heavy_request(seed: int = 0, *, turns: int = 8, image_size: tuple[int, int] = (112, 168)
                       ) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of one agent request after ``turns`` tool-using steps: each step a user
    turn with a screenshot, the assistant's reasoning and tool call, and the tool's result; then the
    last user turn. Images are uint8 arrays (``samcache.engine.screenshot``)."""
    from samcache.synthetic import screenshot

    check_seed(seed)
    check_int("turns", turns, 1)
    rng = np.random.default_rng(seed)
    files = {name: _file_text(rng, name, int(rng.integers(30, 50))) for name in _FILES[:3]}
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a GUI agent. Use the tools to finish the "
                                       "user's task; call one tool per step and explain why."}]
    for t in range(turns):
        messages.append({"role": "user", "content": [
            {"type": "image", "image": screenshot(seed * 1000 + t, image_size)},
            {"type": "text", "text": f"Step {t + 1}: here is the screen. Continue the task."}]})
        call, result = _tool_result(rng, t % 3, files)
        messages.append({"role": "assistant", "content": "\n".join(
            [f"Thought: {_paragraph(rng, 3)}", f"Plan: {_paragraph(rng, 2)}", f"Action: {call}"])})
        messages.append({"role": "tool", "content": result})
    messages.append({"role": "user", "content": [
        {"type": "image", "image": screenshot(seed * 1000 + turns, image_size)},
        {"type": "text", "text": f"Step {turns + 1}: is the task done? Answer yes or no, then the next action."}]})
    return messages, _tools(rng)


def render_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` with the tools' descriptions appended to the system prompt, for engines whose
    prompt builder takes no ``tools`` argument (the text the model sees either way)."""
    import json

    if not tools:
        return list(messages)
    listing = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
    first = messages[0]
    if first["role"] != "system" or not isinstance(first["content"], str):
        raise ValueError("render_tools needs a text system prompt first")
    return [{"role": "system", "content": first["content"] + "\n\nTools:\n" + listing}, *messages[1:]]


def long_context(seed: int = 0, *, screenshots: int = 6, history_turns: int = 3,
                 image_size: tuple[int, int] = (336, 504)) -> list[dict]:
    """A long multimodal context: a system prompt, ``history_turns`` earlier exchanges and a user
    turn with ``screenshots`` screenshots, ready for the planner's first reply."""
    from samcache.synthetic import screenshot

    check_seed(seed)
    check_int("screenshots", screenshots, 1)
    check_int("history_turns", history_turns, 0)
    rng = np.random.default_rng(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You plan GUI tasks and hand steps to workers. "
                                       + _paragraph(rng, 3)}]
    for t in range(history_turns):
        messages.append({"role": "user", "content": f"Earlier request {t + 1}: {_paragraph(rng, 2)}"})
        messages.append({"role": "assistant", "content": _paragraph(rng, 2)})
    messages.append({"role": "user", "content": [
        *({"type": "image", "image": screenshot(seed * 1000 + i, image_size)} for i in range(screenshots)),
        {"type": "text", "text": "These are the open windows. Plan the task and split it into steps."}]})
    return messages


__all__ = ["long_context", "render_tools", "tool_heavy_request"]
