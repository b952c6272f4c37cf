"""Where a sequence's tokens sit in each layer's KV once compression has merged some away.

A compression stage at layer L merges visual tokens into anchors; from layer L+1 on the merged
tokens no longer exist. Each layer stores the tokens it still has *compacted*: in order, left to
right, the same block table as every other layer. Layer ``l`` of a sequence is therefore just a
shorter sequence: token at position ``p`` sits at slot ``p - (tokens removed before p)``, its
causal order is unchanged, and the attention kernel needs no mask (its ``q_pos`` and ``kv_len``
are the compacted ones). RoPE is applied with each token's own M-RoPE position before the write,
so anchors keep their positions. The slots a layer no longer uses stay allocated (blocks hold all
layers) but are never read.

Layers before the first stage keep every token at its own slot, so KV blocks that end before the
first compressed token are exactly a normal prefill's and may enter the prefix cache; later blocks
hold compacted rows and never do.
"""

from __future__ import annotations

import numpy as np

from samcache._checks import check_int

_EMPTY = np.zeros(0, dtype=np.int64)


class Compaction:
    """Per layer of one sequence: the positions merged away (sorted, int64)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = check_int("num_layers", num_layers, 1)
        self.removed: list[np.ndarray] = [_EMPTY] * num_layers
        # The merges of this sequence's stages: (layer, positions, target positions, weights), so a
        # compressed record can replay them when its tokens are recomputed.
        self.merges: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []

    def remove(self, from_layer: int, positions: np.ndarray) -> None:
        """Positions no layer from ``from_layer`` on holds any more (merged into anchors)."""
        if isinstance(from_layer, bool) or not isinstance(from_layer, int) or not 1 <= from_layer < self.num_layers:
            raise ValueError(f"from_layer must be an int in [1, {self.num_layers}), got {from_layer!r}")
        positions = np.asarray(positions, dtype=np.int64)
        if not positions.size:
            return
        union: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layers of one stage share one array, and keep sharing
        for layer in range(from_layer, self.num_layers):
            before = self.removed[layer]
            if id(before) not in union:
                union[id(before)] = (before, np.union1d(before, positions))
            self.removed[layer] = union[id(before)][1]

    @property
    def active(self) -> bool:
        return bool(self.removed[-1].size)

    def kept(self, layer: int, positions: np.ndarray) -> np.ndarray:
        """Those of ``positions`` that layer ``layer`` still holds."""
        removed = self.removed[layer]
        return positions if not removed.size else positions[~np.isin(positions, removed)]

    def slots(self, layer: int, positions: np.ndarray) -> np.ndarray:
        """Compacted indices (in the sequence) of ``positions``, which layer ``layer`` holds."""
        removed = self.removed[layer]
        return positions if not removed.size else positions - np.searchsorted(removed, positions)

    def length(self, layer: int, num_tokens: int) -> int:
        """Tokens layer ``layer`` holds of a sequence of ``num_tokens``."""
        return num_tokens - int(np.searchsorted(self.removed[layer], num_tokens))

    def tokens_per_layer(self, num_tokens: int) -> list[int]:
        return [self.length(layer, num_tokens) for layer in range(self.num_layers)]


__all__ = ["Compaction"]
