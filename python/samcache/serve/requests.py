"""``POST /v1/chat/completions`` bodies: OpenAI's chat-completions fields samcache serves, checked,
and turned into the engine's :class:`~samcache.engine.ChatRequest`.

Fields OpenAI defines and samcache does not serve (``n`` > 1, ``logprobs``, ``tools``, ...) are
refused with a 400 naming them rather than ignored; fields nobody defines are ignored, as vLLM does.
samcache's own fields come through the client's ``extra_body``, every one optional: ``tenant``
(the cache scope: requests of one tenant never see another's cached KV), ``agent`` (the agent of a
multi-agent workflow, for the workflow-aware eviction policies), ``ignore_eos``, and the session
fields ``session``, ``fork_of`` and ``end_session`` (:mod:`samcache.serve.sessions`).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from samcache.engine import ChatRequest
from samcache.serve.errors import ApiError
from samcache.serve.images import DecodedImages, load_image

UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call", "response_format",
               "logit_bias", "audio", "modalities", "prediction")


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # samcache's own (the openai client's extra_body)
    tenant: str | None = Field(default=None, min_length=1)
    agent: str | None = Field(default=None, min_length=1)
    ignore_eos: bool = False
    session: str | None = Field(default=None, min_length=1, max_length=256)
    fork_of: str | None = Field(default=None, min_length=1, max_length=256)
    end_session: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v != 1:
            raise ValueError("samcache serve returns one choice per request (n=1)")
        return v

    def unsupported(self) -> list[str]:
        extra = self.model_extra or {}
        return [name for name in UNSUPPORTED if extra.get(name) not in (None, False, [], {})]


@dataclass(frozen=True)
class MediaLimits:
    """What a request's images may be: at most ``max_images``, each at most ``max_bytes`` encoded
    and ``max_pixels`` decoded; local files only inside ``allowed_dirs``. ``decoded``: the
    server's cache of decoded data-URL images (None: decode every time)."""

    max_images: int = 16
    max_bytes: int = 20 << 20
    max_pixels: int = 4096 * 4096
    allowed_dirs: tuple[pathlib.Path, ...] = ()
    decoded: DecodedImages | None = field(default=None, compare=False)


def engine_messages(messages: Sequence[Message], limits: MediaLimits) -> list[dict]:
    """The engine's chat messages (images decoded) for OpenAI ``messages``."""
    out, images = [], 0
    for i, m in enumerate(messages):
        if m.content is None or isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(m.content):
            if part.type == "text":
                if part.text is None:
                    raise ApiError(400, f"messages[{i}].content[{j}]: a text part needs 'text'", f"messages[{i}]")
                parts.append({"type": "text", "text": part.text})
                continue
            if part.image_url is None:
                raise ApiError(400, f"messages[{i}].content[{j}]: an image_url part needs 'image_url'", f"messages[{i}]")
            if m.role != "user":
                raise ApiError(400, f"messages[{i}]: images are taken in user messages only", f"messages[{i}]")
            images += 1
            if images > limits.max_images:
                raise ApiError(400, f"more than the server's limit of {limits.max_images} images in one request",
                               "messages")
            try:
                image = load_image(part.image_url.url, max_bytes=limits.max_bytes, max_pixels=limits.max_pixels,
                                   allowed_dirs=limits.allowed_dirs, decoded=limits.decoded)
            except ApiError as e:
                raise ApiError(e.status, f"messages[{i}].content[{j}]: {e.message}", f"messages[{i}]") from None
            parts.append({"type": "image", "image": image})
        out.append({"role": m.role, "content": parts})
    return out


def chat_request(body: ChatCompletionRequest, limits: MediaLimits, turn=None) -> ChatRequest:
    """The engine's request for ``body`` (its images decoded). Without ``max_tokens`` its
    ``max_new_tokens`` is a placeholder: the caller submits it to fill up to max_model_len.
    ``turn``: its :class:`~samcache.serve.sessions.SessionTurn` (the messages past the session's
    history go to the engine's held session)."""
    refused = body.unsupported()
    if refused:
        raise ApiError(400, f"samcache serve does not support {', '.join(refused)}", refused[0])
    max_tokens = body.max_completion_tokens or body.max_tokens or 1
    messages, session = body.messages, None
    if turn is not None:
        messages, session = messages[turn.messages_from:], turn.open.session
    return ChatRequest(messages=engine_messages(messages, limits), session=session, max_new_tokens=max_tokens,
                       temperature=body.temperature, top_p=body.top_p, seed=body.seed, tenant=body.tenant,
                       agent=body.agent, ignore_eos=body.ignore_eos)


__all__ = ["ChatCompletionRequest", "MediaLimits", "Message", "chat_request", "engine_messages"]
