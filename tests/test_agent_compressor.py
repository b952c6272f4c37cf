"""ContextCompressor: each stage does its one thing and reports it; the system prompt, the last
turn and images are never touched; compressing is deterministic and idempotent (hypothesis)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from samcache.agent import STAGES, CompressorConfig, ContextCompressor, ToolResultStore, approx_tokens

SYSTEM = {"role": "system", "content": "You are a GUI agent. " * 30}
IMAGE = np.zeros((8, 8, 3), np.uint8)


def log(i: int, lines: int = 200) -> str:
    return "\n".join(f"line {k} of tool output {i}: status ok, value {k * i}" for k in range(lines))


def conversation() -> list[dict]:
    readme = "README: " + "install with pip, then run the agent. " * 12
    return [
        SYSTEM,
        {"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": "Open the app.\n\n" + readme}]},
        {"role": "assistant", "content": "I will call the tool.\nFirst I check the state, then I click."},
        {"role": "tool", "content": log(1)},
        {"role": "user", "content": "Now open settings.\n\n" + readme},
        {"role": "assistant", "content": "Clicking settings.\nDone."},
        {"role": "tool", "content": log(2)},
        {"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": "What do you see?\n\n" + readme}]},
        {"role": "tool", "content": log(3)},
    ]


TOOLS = [{"type": "function", "function": {
    "name": "click", "description": "Click at a point on the screen. The point is in pixels from the top left. "
                                   "Use it for buttons, links and fields. " * 3,
    "parameters": {"type": "object", "properties": {"x": {"type": "integer", "description": "Pixels from the left. Must be inside the screen."}}}}}]


def test_each_stage_does_its_part_and_is_measured(tmp_path):
    store = ToolResultStore(tmp_path / "t.db")
    msgs = conversation()
    out = ContextCompressor(store=store).compress(msgs, TOOLS)
    assert [s.stage for s in out.stages] == list(STAGES)
    by = {s.stage: s for s in out.stages}
    assert by["results"].parts_changed == 2 and by["results"].saved > 0  # two old tool logs stored
    assert by["dedupe"].parts_changed == 1  # the README repeated in message 4 (message 7 is the last turn)
    assert by["tools"].parts_changed == 2 and out.tools[0]["function"]["description"] == "Click at a point on the screen."
    assert by["history"].parts_changed >= 1
    assert out.tokens_after < 0.4 * out.tokens_before
    texts = [m["content"] if isinstance(m["content"], str) else p["text"] for m in msgs
             for p in ([None] if isinstance(m["content"], str) else m["content"]) if p is None or p["type"] == "text"]
    assert out.stages[0].tokens_before == sum(map(approx_tokens, texts)) + sum(approx_tokens(t) for t in ("click", TOOLS[0]["function"]["description"],
                                                          "Pixels from the left. Must be inside the screen."))
    # Stored results expand back; the input was not modified.
    refs = [m["content"] for m in out.messages[:7] if m["role"] == "tool"]
    assert all(r.startswith("[tool result ") for r in refs) and store.expand(refs[0]) == log(1)
    assert _plain(msgs) == _plain(conversation())


def test_system_prompt_last_turn_and_images_are_never_touched(tmp_path):
    msgs = conversation()
    out = ContextCompressor(CompressorConfig(keep_recent_turns=0)).compress(msgs)
    assert out.messages[0] == SYSTEM
    assert _plain(out.messages[7:]) == _plain(msgs[7:])  # the last user message and what follows
    images = [p["image"] for m in out.messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]
    assert len(images) == 2 and all(im is IMAGE for im in images)  # passed through, not copied
    assert _plain(msgs) == _plain(conversation())  # the input is unchanged


def test_without_a_store_long_results_are_cut_around_a_marker():
    out = ContextCompressor(CompressorConfig(stages=("results",), max_result_chars=500)).compress(conversation())
    cut = out.messages[3]["content"]
    assert len(cut) <= 500 and cut.startswith(log(1)[:200]) and cut.endswith(log(1)[-100:])
    assert f"{len(log(1)):,} chars in all, cut" in cut


def test_history_keeps_the_recent_turns():
    msgs = conversation()
    out = ContextCompressor(CompressorConfig(stages=("history",), keep_recent_turns=2)).compress(msgs)
    assert out.messages[2]["content"] == "I will call the tool. …"  # older than the last 2 user turns
    assert _plain(out.messages[5:]) == _plain(msgs[5:])


@pytest.mark.parametrize("bad, match", [
    (dict(stages=("results", "nope")), "stages"), (dict(stages=("dedupe", "dedupe")), "stages"),
    (dict(max_result_chars=10), "max_result_chars"), (dict(keep_recent_turns=-1), "keep_recent_turns"),
])
def test_bad_config_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        CompressorConfig(**bad)


def test_bad_messages_are_refused():
    c = ContextCompressor()
    with pytest.raises(ValueError, match="role"):
        c.compress([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="'role' and 'content'"):
        c.compress([{"content": "x"}])
    with pytest.raises(TypeError):
        c.compress("hello")
    with pytest.raises(ValueError, match="tenant"):
        ContextCompressor(tenant="")
    with pytest.raises(TypeError, match="count_tokens"):
        ContextCompressor(count_tokens=5)


_text = st.text(alphabet=st.sampled_from("ab .\n"), min_size=0, max_size=400)
_message = st.one_of(
    st.builds(lambda r, t: {"role": r, "content": t}, st.sampled_from(["user", "assistant", "tool"]), _text),
    st.builds(lambda t: {"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": t}]}, _text),
)


@settings(max_examples=60, deadline=None)
@given(body=st.lists(_message, min_size=1, max_size=10), repeat=st.booleans(), keep=st.integers(0, 3))
# Found by CI: the history stage cut a dedupe marker to 16 characters, so the next pass no longer
# saw which message it pointed at and cut that one too.
@example(body=[{"role": "assistant", "content": "a" * 32},
               {"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": ""}]}],
         repeat=True, keep=0)
def test_deterministic_and_idempotent(body, repeat, keep):
    if repeat:  # duplicates for the dedupe stage
        body = body + copy.deepcopy(body)
    msgs = [SYSTEM, *body]
    config = CompressorConfig(max_result_chars=200, dedupe_min_chars=32, keep_recent_turns=keep, history_line_chars=16)
    once = ContextCompressor(config).compress(msgs, TOOLS)
    again = ContextCompressor(config).compress(msgs, TOOLS)
    assert _plain(once.messages) == _plain(again.messages) and once.tools == again.tools
    twice = ContextCompressor(config).compress(once.messages, once.tools)
    assert _plain(twice.messages) == _plain(once.messages) and twice.tools == once.tools
    assert all(s.parts_changed == 0 for s in twice.stages)
    assert once.messages[0] == SYSTEM


def _plain(msgs):
    return [(m["role"], m["content"] if isinstance(m["content"], str) else
             [p.get("text", "<image>") for p in m["content"]]) for m in msgs]
