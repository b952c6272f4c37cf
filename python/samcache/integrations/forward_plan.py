"""The engine-independent half of executing a reuse plan inside an engine's forward pass.

Both plugins (vLLM, SGLang) do the same three things once :func:`samcache.reuse.plan_reuse` has
decided a request's plan; only how they find rows and write the cache differs:

- splice a stored image (:class:`ImageKV`) into the engine's cache: its keys re-rotated from the
  cached M-RoPE positions to the new ones, every layer in one ``rope_rerotate`` call
  (:func:`splice_image`), written through the engine's own cache op (a :class:`KVWriter`);
- turn the rows no layer computes (spliced) and each layer's recompute rows into the row set of
  every layer, shrinking with depth (:func:`layer_rows`);
- keep the per-layer keys and values of images computed whole in the step, to store them when it
  ends (:class:`PendingSave`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from samcache.errors import InvariantViolation
from samcache.hashing import ContentKey
from samcache.ops.rope import rope_rerotate


@dataclass
class ReuseCounters:
    """What a plugin's forward passes did with images, summed over steps."""

    steps: int = 0                 # forward passes with reuse or saves
    scheduled_tokens: int = 0      # prompt tokens the engine scheduled in the planned requests
    computed_tokens: int = 0       # of those, rows the first layer computed (new + recomputed)
    reused_tokens: int = 0         # image tokens whose KV was spliced in at new positions
    recomputed_tokens: int = 0     # spliced tokens recomputed at the first layer
    recomputed_token_layers: int = 0
    images_reused: int = 0
    images_saved: int = 0
    images_missed: int = 0         # nameable images not in the store (then saved)

    def add(self, other: "ReuseCounters") -> None:
        for name in ReuseCounters.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def counters(self) -> dict[str, int]:
        """The counters alone (a subclass's gauges left out)."""
        values = asdict(self)
        return {name: values[name] for name in ReuseCounters.__dataclass_fields__}


@dataclass
class ImageKV:
    """A stored image: per-layer keys (rotated at ``positions``) and values, ``[L, n, H, D]``, and
    its M-RoPE positions ``[3, n]``."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor


@dataclass
class PendingSave:
    """An image computed whole in this step, to store: its flattened ``rows`` and M-RoPE
    ``positions`` ``[3, n]``; each layer's keys and values are captured as the layer writes them."""

    key: ContentKey
    rows: torch.Tensor
    positions: torch.Tensor
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)

    def capture(self, layer_rows: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep this image's rows of the keys and values a layer wrote for ``layer_rows`` (None:
        every row of the step)."""
        index = self.rows if layer_rows is None else torch.searchsorted(layer_rows, self.rows)
        self.k.append(keys.index_select(0, index))
        self.v.append(values.index_select(0, index))

    def image_kv(self) -> ImageKV:
        return ImageKV(torch.stack(self.k), torch.stack(self.v), self.positions)


class KVWriter(Protocol):
    """Writes keys and values ``[n, H, D]`` of decoder layer ``layer`` into the engine's paged cache
    at ``slots`` (the engine's own cache op: its layout is its business)."""

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class Rotary:
    """What re-rotating a cached key needs: the model's inverse frequencies and M-RoPE sections."""

    inv_freq: torch.Tensor
    style: str
    section: tuple[int, ...]

    @classmethod
    def of(cls, rope: Any, engine: str) -> "Rotary":
        """From an engine's M-RoPE module (vLLM's and SGLang's share these attribute names)."""
        section = tuple(int(s) for s in (getattr(rope, "mrope_section", None) or ()))
        if len(section) != 3 or not getattr(rope, "is_neox_style", True):
            raise ValueError(f"samcache: the model's rotary embedding is not a rotate-half M-RoPE ({engine} plugin)")
        if getattr(rope, "scaling_factor", None) not in (None, 1, 1.0):
            raise ValueError(f"samcache: M-RoPE with rope scaling is not supported by the {engine} plugin yet")
        style = "mrope_interleaved" if getattr(rope, "mrope_interleaved", False) else "mrope"
        inv_freq = rope._compute_inv_freq(rope.base).to(torch.float32).cpu()
        if 2 * inv_freq.numel() != rope.rotary_dim or sum(section) != inv_freq.numel():
            raise ValueError("samcache: the model's M-RoPE sections do not cover its rotary dimensions")
        return cls(inv_freq.contiguous(), style, section)


def splice_image(entry: ImageKV, cached_span: slice, new_positions: torch.Tensor, slots: torch.Tensor,
                 cache: KVWriter, rotary: Rotary, num_layers: int) -> None:
    """Write tokens ``cached_span`` of a stored image into the cache at ``slots``, their keys moved
    from the cached positions to ``new_positions`` ``[3, n]`` (per-token, per-axis deltas)."""
    keys = entry.k[:, cached_span].clone()
    delta = (new_positions.to(keys.device) - entry.positions[:, cached_span].to(keys.device)).to(torch.int64)
    # Every layer's keys re-rotated in one call (the same deltas at every layer).
    rope_rerotate(keys.view(-1, *keys.shape[2:]), delta.repeat(1, num_layers).contiguous(),
                  rotary.inv_freq.to(keys.device), rotary.style, rotary.section)
    for layer in range(num_layers):
        cache.write(layer, keys[layer], entry.v[layer, cached_span], slots)


def layer_rows(skipped: np.ndarray, recompute: list[list[np.ndarray]], num_layers: int,
               always: np.ndarray | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The flattened rows each layer computes (every row not ``skipped``, plus the layer's
    ``recompute`` rows, plus ``always``) and, per layer, their positions among the previous
    layer's rows (None: the same set, or layer 0). Raises if a set grows with depth."""
    rows: list[torch.Tensor] = []
    select: list[torch.Tensor | None] = []
    for layer in range(num_layers):
        keep = ~skipped
        if recompute[layer]:
            keep[np.concatenate(recompute[layer])] = True
        if always is not None:
            keep[always] = True
        current = torch.from_numpy(np.flatnonzero(keep))
        if layer and torch.equal(current, rows[-1]):
            current, sel = rows[-1], None                    # the same set: no gather, one batch
        else:
            sel = torch.searchsorted(rows[-1], current) if layer else None
            if sel is not None and (sel.numel() and int(sel.max()) >= rows[-1].numel()
                                    or not torch.equal(rows[-1][sel], current)):
                raise InvariantViolation(f"samcache: layer {layer} computes rows layer {layer - 1} skipped "
                                         "(recompute sets must shrink with depth)")
        rows.append(current)
        select.append(sel)
    return rows, select


__all__ = ["ImageKV", "KVWriter", "PendingSave", "ReuseCounters", "Rotary", "layer_rows", "splice_image"]
