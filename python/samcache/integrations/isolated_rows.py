"""First-seen images of an isolated model, computed inside an engine plugin's forward step.

A model whose images attend in isolation (:mod:`samcache.profile.image_attention`) must compute
an image's KV as if the image sat right after its segment prefix (the prompt's first token as the
sink, then the frame token ``<|vision_start|>``), whatever comes before it in the prompt.
samcache's engine runs each such image as a side sequence of its own
(:class:`samcache.engine.isolated_images.IsolatedImages`); the plugins cannot add sequences to
their engine's batch, so they add *rows*: every first-seen image becomes a side sequence
``[sink, frame, image tokens]`` appended after the step's own rows at every layer
(:class:`SideRows`). The side rows

- take the image's embeddings from the step's rows (the engine's vision tower already ran) and the
  prefix tokens' embeddings from the model's table;
- sit at the image's own M-RoPE positions, the prefix at the two positions before it on all three
  axes: the image's relative positions are those of the canonical side sequence (sink 0, frame 1,
  image from 2), so its keys come out already rotated for where the image is;
- attend among themselves only, causally within each side sequence (:meth:`SideRows.attention`);
- write their image rows' keys and values into the image's own cache slots, while the step's copy
  of those rows is skipped like a splice. Text after the image then reads exactly the KV a full
  prefill of the isolated model gives it. Another request of the same step whose prefix hit
  covered the image's first tokens (vLLM hits blocks that an earlier request of the same step
  computes) gets the rest of the image written from the same side rows.

Only models isolated at every layer are served this way (``context_layers`` = 0): the top-k
variant would need the image's rows computed in context in the top layers from a stored input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from samcache.profile.image_attention import ImageAttention


@dataclass(frozen=True)
class IsolatedServing:
    """How a plugin serves an isolated model: its ``attention`` and its frame token id."""

    attention: ImageAttention
    frame_token: int

    def __post_init__(self) -> None:
        if not isinstance(self.attention, ImageAttention):
            raise TypeError(f"IsolatedServing.attention must be an ImageAttention, got {type(self.attention).__name__}")
        if isinstance(self.frame_token, bool) or not isinstance(self.frame_token, int) or self.frame_token < 0:
            raise ValueError(f"IsolatedServing.frame_token must be a token id (int >= 0), got {self.frame_token!r}")
        if not self.attention.isolated:
            raise ValueError("IsolatedServing is for isolated image attention")
        if self.attention.context_layers:
            raise ValueError(f"samcache: image attention {self.attention.name} keeps its top "
                             f"{self.attention.context_layers} layers in context, which the plugins do not serve "
                             "(every layer isolated only); serve it with samcache's engine")

    def prefix(self, sink_token: int | None) -> list[int]:
        """The side sequence's first tokens: the sink (the prompt's first token) if the variant has
        one, then the frame token."""
        if self.attention.sink and sink_token is None:
            raise ValueError("samcache: an isolated image with a sink needs its prompt's first token")
        return self.attention.segment_prefix(sink_token if self.attention.sink else 0, self.frame_token)

    def check(self, sink_token: int | None) -> tuple:
        """What a stored image's record must match beyond its length (as the engine's
        ``IsolatedImages.check``): the variant and the sink it was computed after."""
        sink = int(sink_token) if self.attention.sink and sink_token is not None else None
        return ("image-attention", self.attention.name, sink)  # an unknown sink matches no stored record


@dataclass
class SideRows:
    """The side sequences of one step, ``size`` rows in all, appended after the step's rows.

    ``tokens`` / ``token_at``: the prefix rows' token ids and their side indices; ``image_rows`` /
    ``image_at``: the step rows whose embeddings and positions the image rows take, and the image
    rows' side indices; ``write_rows`` / ``write_at``: the step rows whose cache slots take which
    side row's keys and values (the image's own rows, and those of another request of the step
    whose prefix hit covered the image's first tokens); ``positions`` ``[3, size]``; ``mask``
    ``[size, size]``: which side row sees which (causal within each side sequence)."""

    tokens: torch.Tensor
    token_at: torch.Tensor
    image_rows: torch.Tensor
    image_at: torch.Tensor
    write_rows: torch.Tensor
    write_at: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.positions.size(1))

    def embeddings(self, inputs_embeds: torch.Tensor, embed_tokens) -> torch.Tensor:
        """The side rows' inputs ``[size, hidden]``: the images' rows of ``inputs_embeds`` and the
        prefix tokens through ``embed_tokens`` (the model's embedding table)."""
        out = inputs_embeds.new_empty((self.size, inputs_embeds.size(-1)))
        out[self.image_at.to(out.device)] = inputs_embeds.index_select(0, self.image_rows.to(out.device))
        out[self.token_at.to(out.device)] = embed_tokens(self.tokens.to(out.device)).to(out.dtype)
        return out

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """The side rows' attention: ``query`` ``[size, H, D]``, ``key`` / ``value`` ``[size, Hkv, D]``
        (already rotated) -> ``[size, H, D]``, each row over its own side sequence up to itself."""
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=self.mask.to(q.device),
                                             scale=scale, enable_gqa=k.size(1) != q.size(1))
        return out.squeeze(0).transpose(0, 1)


class SideRowsBuilder:
    """Collects a step's side sequences (:meth:`add`); :meth:`build` makes the :class:`SideRows`."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._token_at: list[int] = []
        self._image_rows: list[torch.Tensor] = []
        self._image_at: list[torch.Tensor] = []
        self._positions: list[torch.Tensor] = []
        self._lengths: list[int] = []
        self._also: list[tuple[torch.Tensor, torch.Tensor]] = []  # (side indices, step rows) written too
        self.size = 0

    def __bool__(self) -> bool:
        return self.size > 0

    @property
    def sequences(self) -> int:
        """How many side sequences (first-seen images) were added."""
        return len(self._lengths)

    def add(self, prefix: list[int], image_rows: torch.Tensor, image_positions: torch.Tensor) -> int:
        """Add a side sequence: ``prefix`` token ids, then the image at step rows ``image_rows``
        (M-RoPE ``image_positions`` ``[3, n]``). Returns the side index of its first image row."""
        if image_rows.dim() != 1 or image_rows.numel() == 0:
            raise ValueError(f"image_rows must be a non-empty 1-D tensor of step rows, got shape {tuple(image_rows.shape)}")
        if image_positions.shape != (3, image_rows.numel()):
            raise ValueError(f"image_positions must be [3, {image_rows.numel()}] (M-RoPE, one per image row), got "
                             f"{tuple(image_positions.shape)}")
        if not prefix:
            raise ValueError("a side sequence starts with its segment prefix (at least the frame token)")
        start, p = self.size, len(prefix)
        first = image_positions[:, :1].to(torch.int64)
        self._tokens.extend(int(t) for t in prefix)
        self._token_at.extend(range(start, start + p))
        self._positions.append(first - torch.arange(p, 0, -1, dtype=torch.int64))  # p, ..., 1 before the image
        self._positions.append(image_positions.to(torch.int64))
        n = int(image_rows.numel())
        self._image_rows.append(image_rows.to(torch.int64))
        self._image_at.append(torch.arange(start + p, start + p + n))
        self._lengths.append(p + n)
        self.size += p + n
        return start + p

    def also_write(self, side_at: int, rows: torch.Tensor) -> None:
        """Write side rows ``side_at, side_at + 1, ...`` into step rows ``rows`` too."""
        if rows.dim() != 1 or not 0 <= side_at or side_at + rows.numel() > self.size:
            raise ValueError(f"side rows {side_at}..{side_at + rows.numel() - 1} are not among the {self.size} added")
        self._also.append((torch.arange(side_at, side_at + rows.numel()), rows.to(torch.int64)))

    def build(self, position_dtype: torch.dtype) -> SideRows:
        if not self.size:
            raise ValueError("no side sequence was added")
        mask = torch.zeros((self.size, self.size), dtype=torch.bool)
        at = 0
        for n in self._lengths:
            mask[at:at + n, at:at + n] = torch.ones((n, n), dtype=torch.bool).tril()
            at += n
        image_rows, image_at = torch.cat(self._image_rows), torch.cat(self._image_at)
        return SideRows(tokens=torch.tensor(self._tokens, dtype=torch.int64),
                        token_at=torch.tensor(self._token_at, dtype=torch.int64),
                        image_rows=image_rows, image_at=image_at,
                        write_rows=torch.cat([image_rows, *(r for _, r in self._also)]),
                        write_at=torch.cat([image_at, *(a for a, _ in self._also)]),
                        positions=torch.cat(self._positions, dim=1).to(position_dtype), mask=mask)


__all__ = ["IsolatedServing", "SideRows", "SideRowsBuilder"]
