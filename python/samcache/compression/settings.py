"""What an engine's visual-token compression does: how much it keeps and at which layers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from samcache.compression.anchors import stage_keeps
from samcache.compression.router_scores import stage_layers

#: Default fraction of an image's visual tokens left after the last stage.
DEFAULT_KEEP = 0.25


@dataclass(frozen=True)
class CompressionSettings:
    """``keep``: fraction of each new image's visual tokens left after the last stage (in (0, 1]).
    ``layers``: the decoder layers whose router logits start a stage (increasing; a stage at layer
    L merges tokens from layer L+1 on). ``spread``: how far apart anchors are kept on the image
    grid (:func:`samcache.compression.select_anchors`)."""

    keep: float
    layers: tuple[int, ...]
    spread: float = 0.5

    @classmethod
    def for_model(cls, num_layers: int, *, keep: float = DEFAULT_KEEP, layers: Sequence[int] | None = None,
                  spread: float = 0.5) -> "CompressionSettings":
        """Settings checked against a model of ``num_layers`` decoder layers; ``layers=None``: the
        seed's layers 2 / 6 / 15 of 48 scaled to this depth (:func:`stage_layers`)."""
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.0 < keep <= 1.0:
            raise ValueError(f"compression keep ratio must be a fraction in (0, 1], got {keep!r}")
        if isinstance(spread, bool) or not isinstance(spread, (int, float)) or spread < 0:
            raise ValueError(f"compression spread must be a number >= 0, got {spread!r}")
        if layers is None:
            chosen = stage_layers(num_layers)
        else:
            if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
                raise ValueError(f"compression layers must be a non-empty list of layer indices, got {layers!r}")
            chosen = tuple(layers)
            if any(isinstance(x, bool) or not isinstance(x, int) for x in chosen):
                raise ValueError(f"compression layers must be ints, got {list(layers)!r}")
            if any(b <= a for a, b in zip(chosen, chosen[1:])):
                raise ValueError(f"compression layers must be strictly increasing, got {list(chosen)}")
            if chosen[0] < 0 or chosen[-1] > num_layers - 2:
                raise ValueError(f"compression layers must lie in [0, {num_layers - 2}] for this {num_layers}-layer "
                                 f"model (a stage at layer L compresses from layer L+1 on), got {list(chosen)}")
        return cls(float(keep), chosen, float(spread))

    @property
    def stage_keeps(self) -> tuple[float, ...]:
        """Fraction of the remaining tokens each stage keeps (their product is ``keep``)."""
        return stage_keeps(self.keep, len(self.layers))

    def keep_at(self, layer: int) -> float | None:
        """The keep fraction of the stage at ``layer`` (None: no stage there)."""
        return self.stage_keeps[self.layers.index(layer)] if layer in self.layers else None


__all__ = ["CompressionSettings", "DEFAULT_KEEP"]
