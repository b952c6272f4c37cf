"""Requests as token sequences: chat messages -> token ids, image spans and M-RoPE positions.

The chat template renders one ``<|vision_start|><|image_pad|><|vision_end|>`` per image; each
``<|image_pad|>`` expands to the image's token count. Positions follow Qwen-VL's M-RoPE layout
(transformers' ``get_rope_index``): a text token advances (t, h, w) together by one; an image
starting at position ``s`` covers ``t = s``, ``h = s + row``, ``w = s + col`` of its merged grid,
and the next token starts at ``s + max(rows, cols)``. An image's positions therefore depend only
on its start, so moving an image moves all three components by the same delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from samcache.engine.images import PreparedImage


@dataclass
class ImageSpan:
    """Image ``index`` of the request occupies tokens [start, start + length)."""

    index: int
    start: int
    length: int
    image: PreparedImage

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class Prompt:
    token_ids: np.ndarray  # int32 [N]
    positions: torch.Tensor  # int64 [3, N]
    images: list[ImageSpan] = field(default_factory=list)
    next_position: int = 0  # position of the first generated token

    def __len__(self) -> int:
        return int(self.token_ids.size)

    def extra_keys(self, limit: int | None = None) -> list[tuple[int, int, Any]]:
        """(start, end, content hash) of each image span, clipped to tokens < ``limit``."""
        limit = len(self) if limit is None else limit
        return [(s.start, min(s.end, limit), s.image.content) for s in self.images if s.start < limit]


def image_positions(start: int, grid: tuple[int, int, int], merge_size: int) -> torch.Tensor:
    """int64 [3, t*h*w/merge^2]: M-RoPE (t, h, w) positions of an image whose first token is at ``start``."""
    t, h, w = grid[0], grid[1] // merge_size, grid[2] // merge_size
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def _placeholders(token_ids: Sequence[int], images: Sequence[PreparedImage], image_token_id: int,
                  marker: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, positions of the image placeholders), checked against the number of images."""
    ids = np.asarray(token_ids, dtype=np.int64)
    holes = np.flatnonzero(ids == image_token_id)
    if holes.size != len(images):
        raise ValueError(
            f"the prompt has {holes.size} image placeholder(s) but {len(images)} image(s) were given "
            f"(does the text itself contain {marker}?)"
        )
    return ids, holes


def build_prompt(
    token_ids: Sequence[int], images: Sequence[PreparedImage], *, image_token_id: int, merge_size: int
) -> Prompt:
    """Expand each ``image_token_id`` placeholder of ``token_ids`` into its image's tokens and
    compute every token's M-RoPE position."""
    ids, holes = _placeholders(token_ids, images, image_token_id, "<|image_pad|>")
    out_ids, out_pos, spans = [], [], []
    cursor, pos, n = 0, 0, 0
    for index, (hole, image) in enumerate(zip(holes.tolist(), images)):
        text = ids[cursor:hole]
        out_ids.append(text)
        out_pos.append(torch.arange(pos, pos + text.size).expand(3, -1))
        pos += text.size
        n += text.size
        out_ids.append(np.full(image.num_tokens, image_token_id, dtype=np.int64))
        out_pos.append(image_positions(pos, image.grid, merge_size))
        spans.append(ImageSpan(index, n, image.num_tokens, image))
        n += image.num_tokens
        pos += max(image.grid[1], image.grid[2]) // merge_size
        cursor = hole + 1
    text = ids[cursor:]
    out_ids.append(text)
    out_pos.append(torch.arange(pos, pos + text.size).expand(3, -1))
    positions = torch.cat(out_pos, dim=1).contiguous()
    return Prompt(
        token_ids=np.concatenate(out_ids).astype(np.int32),
        positions=positions,
        images=spans,
        next_position=int(positions.max()) + 1 if positions.numel() else 0,
    )


def build_prompt_tiles(
    token_ids: Sequence[int], images: Sequence[PreparedImage], *, image_token_id: int, start_id: int, end_id: int,
    coordinates,
) -> Prompt:
    """InternVL's layout: each ``image_token_id`` placeholder becomes ``start_id`` + the image's
    tokens + ``end_id`` (what ``InternVLProcessor`` writes), and positions are plain 1-D. Row 0 of
    ``positions`` is the RoPE position; for image tokens rows 1 and 2 hold the image's start plus
    the token's (row, col) on the image's token grid (``coordinates(grid)``), so moving an image
    still moves every row by one delta, and compression reads the layout as it does M-RoPE's."""
    ids, holes = _placeholders(token_ids, images, image_token_id, "<IMG_CONTEXT>")
    out_ids, spans, coords = [], [], []
    cursor, n = 0, 0
    for index, (hole, image) in enumerate(zip(holes.tolist(), images)):
        text = np.concatenate([ids[cursor:hole], [start_id]])
        out_ids.append(text)
        n += text.size
        out_ids.append(np.full(image.num_tokens, image_token_id, dtype=np.int64))
        spans.append(ImageSpan(index, n, image.num_tokens, image))
        coords.append((n, coordinates(image.grid)))
        n += image.num_tokens
        out_ids.append(np.array([end_id], dtype=np.int64))
        n += 1
        cursor = hole + 1
    out_ids.append(ids[cursor:])
    token_ids_ = np.concatenate(out_ids)
    positions = torch.arange(token_ids_.size).expand(3, -1).clone()
    for start, grid_coords in coords:
        rc = torch.from_numpy(grid_coords) + start
        positions[1:, start:start + rc.shape[1]] = rc
    return Prompt(token_ids=token_ids_.astype(np.int32), positions=positions.contiguous(), images=spans,
                  next_position=int(token_ids_.size))


#: The roles Qwen-VL's chat template knows; anything else would be rendered verbatim as a role.
ROLES = ("system", "user", "assistant", "tool")


def normalize_messages(messages: Sequence[dict]) -> tuple[list[dict], list[Any]]:
    """Chat messages for the template (images replaced by ``{"type": "image"}``) and the image
    objects in order of appearance."""
    if isinstance(messages, (dict, str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a turn needs at least one message")
    rendered, images = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {message!r:.80}")
        if message["role"] not in ROLES:
            raise ValueError(f"message {i}: role must be one of {', '.join(ROLES)}, got {message['role']!r}")
        content = message["content"]
        if isinstance(content, str):
            rendered.append({"role": message["role"], "content": content})
            continue
        if isinstance(content, dict) or not isinstance(content, Sequence):
            raise TypeError(f"message {i}: content must be a str or a list of parts, got {type(content).__name__}")
        parts = []
        for part in content:
            if not isinstance(part, dict) or "type" not in part:
                raise ValueError(f"message {i}: each content part is a dict with a 'type', got {part!r:.80}")
            if part["type"] == "image":
                if "image" not in part:
                    raise ValueError(f"message {i}: an image part needs an 'image' (path, PIL image or array)")
                images.append(part["image"])
                parts.append({"type": "image"})
            elif part["type"] == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                raise ValueError(f"message {i}: unsupported content type {part['type']!r} (use 'text' or 'image')")
        rendered.append({"role": message["role"], "content": parts})
    return rendered, images


def user_message(images: Sequence[Any], prompt: str) -> dict:
    """One user turn: the images first, then the text (Qwen-VL's convention)."""
    return {"role": "user", "content": [*({"type": "image", "image": im} for im in images), {"type": "text", "text": prompt}]}


__all__ = ["ImageSpan", "Prompt", "build_prompt", "build_prompt_tiles", "image_positions", "normalize_messages",
           "user_message"]
