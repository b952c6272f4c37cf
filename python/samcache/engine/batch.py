"""One forward step over many sequences: what each computes, and the metadata built once for it.

A step mixes sequences freely: a prefill computes a prompt's new and recomputed rows, a decode
one row; each sequence says which of its rows each layer computes (recompute sets shrink with
depth). :meth:`StepBatch.build` concatenates the rows and plans the step once: KV slots, the
attention metadata of all rows (FlashInfer-style, :class:`samcache.ops.AttentionMetadata`) and,
for each distinct per-layer row set, the row subset and its metadata. Every layer then only
looks its plan up (plan/run split).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from samcache.block_pool import slot_ids
from samcache.ops.sparse_attention import AttentionMetadata


@dataclass
class SequenceStep:
    """Rows ``rows`` (ascending positions) of one sequence, computed this step.

    ``layer_rows[l]``: the positions layer ``l`` computes (a subset of ``rows`` holding the last
    one; None: all rows at every layer). ``embeds`` / ``positions``: layer-0 inputs and M-RoPE
    positions of ``rows``; decode rows give ``token_ids`` instead of ``embeds`` (the executor
    embeds a step's decode tokens in one call). ``num_kv_tokens``: the sequence's KV length after
    this step.
    ``deepstack``: per DeepStack layer, features to add to the visual rows (``deepstack_rows``:
    index into the features per row, -1 for text).
    """

    rows: np.ndarray
    embeds: torch.Tensor | None
    positions: torch.Tensor
    block_table: np.ndarray
    num_kv_tokens: int
    token_ids: np.ndarray | None = None
    layer_rows: list[np.ndarray] | None = None
    deepstack_rows: np.ndarray | None = None
    deepstack_features: list[torch.Tensor] | None = None
    before_layer: Callable[[int], None] | None = None  # runs before each layer (KV still loading)


@dataclass
class RowSubset:
    """The rows one or more layers compute: indices into the step's rows, their slots and metadata,
    and which of them are visual rows taking DeepStack features (at ``deepstack_visual``, feature
    rows ``deepstack_index``): all on the device, built once per step."""

    index: torch.Tensor
    slots: torch.Tensor
    meta: AttentionMetadata
    deepstack_visual: torch.Tensor | None = None
    deepstack_index: torch.Tensor | None = None


@dataclass
class StepBatch:
    """A planned step: concatenated inputs, and each layer's row subset (None = every row)."""

    embeds: torch.Tensor  # [T, hidden]
    positions: torch.Tensor  # int64 [3, T]
    all_rows: RowSubset
    layers: list[RowSubset | None]
    logit_rows: torch.Tensor  # [B] each sequence's last row
    deepstack_features: list[torch.Tensor] | None = None
    before_layer: list[Callable[[int], None]] = field(default_factory=list)

    @classmethod
    def build(cls, steps: list[SequenceStep], *, num_layers: int, block_size: int,
              device: torch.device) -> "StepBatch":
        if not steps:
            raise ValueError("a step needs at least one sequence")
        counts = [int(s.rows.size) for s in steps]
        if any(c == 0 for c in counts):
            raise ValueError("every sequence of a step computes at least its last row")
        if any(s.embeds is None for s in steps):
            raise ValueError("every sequence of a step needs its layer-0 inputs (embeds)")
        offsets = np.concatenate([[0], np.cumsum(counts)])
        slots = np.concatenate([slot_ids(s.block_table, s.rows, block_size) for s in steps])
        tables = [s.block_table for s in steps]
        kv_lens = [s.num_kv_tokens for s in steps]
        meta = AttentionMetadata.build([s.rows for s in steps], tables, kv_lens, block_size, device)
        all_index = torch.arange(int(offsets[-1]), device=device)
        slots_t = torch.from_numpy(slots).to(device)

        # Deepstack features of all sequences, concatenated; rows index into them.
        ds_rows, ds_feats = None, None
        if any(s.deepstack_features is not None for s in steps):
            depth = max(len(s.deepstack_features) for s in steps if s.deepstack_features is not None)
            rows, feats, base = [], [[] for _ in range(depth)], 0
            for s, n in zip(steps, counts):
                r = np.full(n, -1, dtype=np.int64) if s.deepstack_rows is None else s.deepstack_rows.astype(np.int64)
                rows.append(np.where(r >= 0, r + base, -1))
                if s.deepstack_features is not None:
                    for layer, f in enumerate(s.deepstack_features):
                        feats[layer].append(f)
                    base += int(s.deepstack_features[0].shape[0])
            ds_rows = np.concatenate(rows)
            ds_feats = [torch.cat(f) for f in feats]

        def visual(rows_of_subset: np.ndarray | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            if ds_rows is None:
                return None, None
            feature = ds_rows if rows_of_subset is None else ds_rows[rows_of_subset]
            where = np.flatnonzero(feature >= 0)
            return torch.from_numpy(where).to(device), torch.from_numpy(feature[where]).to(device)

        all_rows = RowSubset(all_index, slots_t, meta, *visual(None))

        layers: list[RowSubset | None] = [None] * num_layers
        # Per-layer subsets exist only where some sequence recomputes a subset (decode steps and
        # full prefills compute every row at every layer).
        previous: tuple[np.ndarray, RowSubset] | None = None
        for layer in range(num_layers if any(s.layer_rows is not None for s in steps) else 0):
            if all(s.layer_rows is None or s.layer_rows[layer].size == s.rows.size for s in steps):
                continue
            parts = []
            for s, off in zip(steps, offsets):
                active = s.rows if s.layer_rows is None else s.layer_rows[layer]
                parts.append(off + np.searchsorted(s.rows, active))
            index = np.concatenate(parts)
            if previous is None or not np.array_equal(previous[0], index):  # else: the layer above's plan
                idx = torch.from_numpy(index).to(device)
                previous = (index, RowSubset(idx, slots_t.index_select(0, idx),
                                             meta.select(idx, [p.size for p in parts]), *visual(index)))
            layers[layer] = previous[1]
        embeds = torch.cat([s.embeds for s in steps]) if len(steps) > 1 else steps[0].embeds
        positions = torch.cat([s.positions for s in steps], dim=1) if len(steps) > 1 else steps[0].positions
        return cls(embeds=embeds, positions=positions.to(device), all_rows=all_rows, layers=layers,
                   logit_rows=torch.from_numpy(offsets[1:] - 1).to(device), deepstack_features=ds_feats,
                   before_layer=[s.before_layer for s in steps if s.before_layer is not None])


__all__ = ["RowSubset", "SequenceStep", "StepBatch"]
