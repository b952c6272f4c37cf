"""The agent-memory benchmark's synthetic requests: deterministic per seed, shaped as the
engine and the compressor take them, and compressible the way the benchmark claims."""

from __future__ import annotations

import numpy as np
import pytest

from samcache.agent import CompressorConfig, ContextCompressor, ToolResultStore
from samcache.agent.scenarios import long_context, render_tools, tool_heavy_request


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, type(a)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_requests_are_deterministic_per_seed():
    assert _same(tool_heavy_request(3, turns=3), tool_heavy_request(3, turns=3))
    assert not _same(tool_heavy_request(3, turns=3), tool_heavy_request(4, turns=3))
    assert _same(long_context(1, screenshots=2, image_size=(56, 56)), long_context(1, screenshots=2, image_size=(56, 56)))


def test_tool_heavy_request_shape_and_compression(tmp_path):
    messages, tools = tool_heavy_request(0, turns=6)
    roles = [m["role"] for m in messages]
    assert roles[0] == "system" and roles[-1] == "user" and roles.count("tool") == 6 and len(tools) == 6
    tool_texts = [m["content"] for m in messages if m["role"] == "tool"]
    assert len(set(tool_texts)) < len(tool_texts)  # a file read twice: something to deduplicate
    with ToolResultStore(tmp_path / "r.sqlite") as store:
        out = ContextCompressor(CompressorConfig(), store=store).compress(messages, tools)
        assert out.tokens_after < 0.6 * out.tokens_before
        assert out.messages[0] == messages[0] and out.messages[-1]["content"][-1] == messages[-1]["content"][-1]
    rendered = render_tools(messages, tools)
    assert '"name": "read_file"' in rendered[0]["content"] and rendered[1:] == messages[1:]
    with pytest.raises(ValueError, match="system"):
        render_tools(messages[1:], tools)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="turns"):
        tool_heavy_request(0, turns=0)
    with pytest.raises(ValueError, match="screenshots"):
        long_context(0, screenshots=0)
