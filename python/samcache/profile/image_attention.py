"""How a model's image tokens attend: a property of the model, declared by its checkpoint.

``causal`` is what every pretrained VLM does: an image's tokens attend to everything before them,
so an image's KV depends on its context (the text and the images before it, and its index among
them). ``isolated`` is what a model can be trained to do so that an image's KV does not depend on
its context at all: each image's tokens attend only to

- the image's own tokens before them (causally, as in the causal model);
- its frame token ``<|vision_start|>`` and, with ``sink``, the prompt's first token, both *as if
  the image sat right after that token* (canonical positions: sink 0, frame 1, image from 2).

Every text token (the frame and end tokens of an image in the prompt included) still attends
causally to everything before it, images included. An image's KV is then computed once alone, at
its canonical positions, and moved anywhere by re-rotating its keys: the same KV a full prefill of
any prompt gives it, up to rounding. Training (``samcache.tasks.image_isolation``) and serving (the
engine's executor, both plugins) compute exactly this.

``context_layers`` = k > 0 keeps the top k layers in context: images are isolated in layers
``0 .. L-k-1`` only, so their hidden state entering layer ``L-k`` is context-free; a reuse then
recomputes the image's top k layers in context (exact, at k/L of the image's cost). k = 1 changes
no output: layer ``L-1`` computes the image's KV from its context-free input, and the image's
outputs of that layer feed nothing; context first reaches the image's KV at k = 2.

Why a sink: an isolated image with nothing to put its attention on loses its content (a colour, a
cell) even for the first screenshot; with the prompt's first token to attend to, it reads as a
causal model does (docs/design.md, "Image-isolated attention").

A checkpoint declares it in its ``config.json`` under :data:`CONFIG_KEY`; no key means causal.
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import asdict, dataclass
from typing import Any

#: The key of a checkpoint's config.json that declares its image attention.
CONFIG_KEY = "samcache_image_attention"
MODES = ("causal", "isolated")


@dataclass(frozen=True)
class ImageAttention:
    """``mode``: ``"causal"`` or ``"isolated"``; for isolated, ``sink`` (images also see the
    prompt's first token, at a canonical distance) and ``context_layers`` (the top k layers attend
    in context)."""

    mode: str = "causal"
    sink: bool = True
    context_layers: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown image attention {self.mode!r}; choose from {', '.join(MODES)}")
        if not isinstance(self.sink, bool):
            raise TypeError(f"ImageAttention.sink must be a bool, got {self.sink!r}")
        if isinstance(self.context_layers, bool) or not isinstance(self.context_layers, int) or self.context_layers < 0:
            raise ValueError(f"ImageAttention.context_layers must be an int >= 0, got {self.context_layers!r}")
        if self.mode == "causal" and (self.context_layers or not self.sink):
            raise ValueError("context_layers and sink are settings of isolated image attention; causal takes none")

    @property
    def isolated(self) -> bool:
        return self.mode == "isolated"

    @property
    def name(self) -> str:
        """A short name: ``causal``, ``isolated``, ``isolated-nosink``, ``isolated-top2``, ..."""
        if not self.isolated:
            return "causal"
        return "isolated" + ("" if self.sink else "-nosink") + (f"-top{self.context_layers}" if self.context_layers else "")

    @classmethod
    def parse(cls, name: str) -> "ImageAttention":
        """The value a :attr:`name` names (``"isolated-top2"``, ``"isolated-nosink"``, ...)."""
        if not isinstance(name, str):
            raise TypeError(f"image attention must be a name (str), got {type(name).__name__}")
        head, *rest = name.split("-")
        if head == "causal" and not rest:
            return cls()
        if head != "isolated":
            raise ValueError(f"unknown image attention {name!r}; choose causal, isolated, isolated-nosink, "
                             "isolated-top<k> (or a combination: isolated-nosink-top2)")
        sink, k = True, 0
        for part in rest:
            if part == "nosink" and sink:
                sink = False
            elif part.startswith("top") and part[3:].isdigit() and not k:
                k = int(part[3:])
            else:
                raise ValueError(f"unknown image attention {name!r}: {part!r} is not 'nosink' or 'top<k>'")
        return cls("isolated", sink, k)

    def check_depth(self, num_layers: int) -> "ImageAttention":
        """This value, checked against a model of ``num_layers`` layers (at least one layer isolated)."""
        if self.isolated and self.context_layers >= num_layers:
            raise ValueError(f"image attention {self.name} keeps {self.context_layers} layers in context, "
                             f"but the model has {num_layers}: at least one layer must be isolated")
        return self

    def isolated_at(self, layer: int, num_layers: int) -> bool:
        """Whether images attend in isolation at ``layer`` of ``num_layers``."""
        return self.isolated and layer < num_layers - self.context_layers

    def segment_prefix(self, first_token: int, frame_token: int) -> list[int]:
        """The tokens an isolated image is computed after, at positions 0, 1, ...: the sink (the
        prompt's first token) if ``sink``, then the frame token. The image starts at position
        ``len(segment_prefix(...))``."""
        return [int(first_token), int(frame_token)] if self.sink else [int(frame_token)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: Any, where: str = "image attention") -> "ImageAttention":
        """The value a :meth:`to_dict` wrote; a clear error naming ``where`` otherwise."""
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping with 'mode', got {value!r:.80}")
        unknown = set(value) - {"mode", "sink", "context_layers"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        try:
            return cls(**value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None


CAUSAL = ImageAttention()


def declared(checkpoint: str | os.PathLike) -> ImageAttention:
    """The image attention a checkpoint folder declares in its config.json (causal if it declares
    none, or is not a local folder)."""
    config = pathlib.Path(checkpoint) / "config.json"
    if not config.is_file():
        return CAUSAL
    value = json.loads(config.read_text()).get(CONFIG_KEY)
    return CAUSAL if value is None else ImageAttention.from_dict(value, f"{config} [{CONFIG_KEY}]")


def declare(checkpoint: str | os.PathLike, attention: ImageAttention) -> None:
    """Write ``attention`` into a checkpoint folder's config.json (removing the key for causal)."""
    config = pathlib.Path(checkpoint) / "config.json"
    data = json.loads(config.read_text())
    if attention.isolated:
        data[CONFIG_KEY] = attention.to_dict()
    else:
        data.pop(CONFIG_KEY, None)
    tmp = config.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, config)


__all__ = ["CAUSAL", "CONFIG_KEY", "ImageAttention", "declare", "declared"]
