"""Images of a model whose image attention is isolated (:mod:`samcache.profile.image_attention`):
each computed once alone and spliced in like a reuse, first sight included.

An image's KV is computed in a side sequence: the model's segment prefix (the prompt's first
token as the sink, then the frame token ``<|vision_start|>``) at positions 0, 1, and the image's
tokens from there on. That KV is what a full prefill of *any* prompt holding the image computes
for it, once its keys are re-rotated into place, so it is spliced exactly (``CachedImage.exact``),
kept in the image-KV store for later turns, and nothing of it is ever recomputed. The side
sequences of one request run in one batched forward step before the request's own.

With the top k layers in context (``isolated-top<k>``), the side sequence's KV of the lower layers
is the image's, and the step also keeps the image rows' input to layer ``L - k`` (the record's
``hidden``); wherever the image is used, its rows are computed from there, in context, in the
top k layers only (:meth:`top_layers`): exact, at k/L of the image's cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from samcache.cache.stores import HeldImage
from samcache.engine.prompt import ImageSpan, Prompt, build_prompt
from samcache.profile.image_attention import ImageAttention


@dataclass(frozen=True)
class IsolatedImages:
    """How an isolated model's images are computed alone: ``attention`` (isolated, its variant),
    the model's image and frame token ids and the vision merge size (for M-RoPE positions)."""

    attention: ImageAttention
    image_token_id: int
    frame_token_id: int
    merge_size: int
    num_layers: int

    def __post_init__(self) -> None:
        if not self.attention.isolated:
            raise ValueError("IsolatedImages serves isolated image attention only")
        self.attention.check_depth(self.num_layers)

    @property
    def context_from(self) -> int | None:
        """The first layer where images attend in context (None: every layer isolated)."""
        k = self.attention.context_layers
        return self.num_layers - k if k else None

    def sink(self, prompt: Prompt) -> int | None:
        """The token an image of ``prompt`` attends to as its sink (None: the variant has none)."""
        return int(prompt.token_ids[0]) if self.attention.sink else None

    def check(self, prompt: Prompt) -> tuple:
        """What a record of this prompt's images must match beyond its geometry: the variant and
        the sink token it was computed after."""
        return ("image-attention", self.attention.name, self.sink(prompt))

    def side_prompt(self, prompt: Prompt, span: ImageSpan) -> Prompt:
        """The side sequence computing image ``span`` of ``prompt`` alone: the segment prefix at
        positions 0, 1, ..., then the image."""
        prefix = self.attention.segment_prefix(int(prompt.token_ids[0]), self.frame_token_id)
        return build_prompt([*prefix, self.image_token_id], [span.image], image_token_id=self.image_token_id,
                            merge_size=self.merge_size)

    def top_layers(self, plan, layout, held: dict) -> tuple[tuple, list]:
        """A plan whose spliced images are computed in context in the top layers: each layer's rows
        (the spliced images' rows added from the first layer in context on) and the rows' injected
        inputs there, (layer, positions, hidden), from the records in ``held`` (key -> HeldImage)."""
        cut = self.context_from
        spliced = [np.arange(s.start, s.end) for s in plan.spliced]
        if cut is None or not spliced:
            return plan.layer_rows, []
        images = np.concatenate(spliced)
        layer_rows = tuple(rows if l < cut else np.union1d(rows, images) for l, rows in enumerate(plan.layer_rows))
        inject = []
        for s in plan.spliced:
            h = held[layout.images[s.image].key]
            inject.append((cut, np.arange(s.start, s.end), h.hidden[s.offset:s.offset + s.length]))
        return layer_rows, inject

    @property
    def offset(self) -> int:
        """Where an image starts in its side sequence (its first token's position there)."""
        return 2 if self.attention.sink else 1

    def compute(self, executor, prompt: Prompt, spans: Sequence[ImageSpan], namespace, side_options, metrics
                ) -> tuple[dict[int, HeldImage], list[int]]:
        """The KV of ``spans`` (images of ``prompt``) computed alone, in one forward step of
        ``executor`` with ``side_options`` (no cache but the ViT cache, ``image_segment``): per image
        index, a :class:`HeldImage` over its side sequence (not in any store), and the side
        sequences, which the caller frees once it has spliced (and stored) them."""
        sides = []
        try:
            for span in spans:
                sides.append(executor.prepare(self.side_prompt(prompt, span), namespace, side_options))
                if self.context_from is not None:  # keep the image rows' input to the first layer in context
                    sides[-1].step.capture = (self.context_from, np.arange(self.offset, self.offset + span.length))
            if sides:
                executor.forward([s.step for s in sides])
        except BaseException:
            for s in sides:
                executor.discard_prepared(s)
            raise
        held = {}
        for span, side in zip(spans, sides):
            held[span.index] = HeldImage(side.seq, self.offset, span.length, self.offset, exact=True,
                                         hidden=side.step.captured)
            metrics.isolated_tokens += len(side.prompt)
            metrics.vit_calls += side.metrics.vit_calls
            metrics.vit_hits += side.metrics.vit_hits
        return held, [s.seq for s in sides]


__all__ = ["IsolatedImages"]
