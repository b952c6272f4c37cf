"""One forward step over many sequences: what each computes, and the metadata built once for it.

A step mixes sequences freely: a prefill computes a prompt's new and recomputed rows, a decode
one row; each sequence says which of its rows each layer computes (recompute sets shrink with
depth). :meth:`StepBatch.build` concatenates the rows and plans the step once: KV slots, the
attention metadata of all rows (FlashInfer-style, :class:`samcache.ops.AttentionMetadata`) and,
for each distinct per-layer row set, the row subset and its metadata. Every layer then only
looks its plan up (plan/run split).

With visual-token compression a sequence's later layers hold fewer tokens, compacted
(:class:`samcache.compression.Compaction`): those layers get metadata of their own, with the
compacted query positions, slots and KV lengths. A compression stage inside the step changes the
plan of the layers after it (:meth:`StepBatch.replan`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from samcache.cache.block_pool import slot_ids
from samcache.compression.compaction import Compaction
from samcache.compression.settings import CompressionSettings
from samcache.ops.host_arrays import upload
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
    ``compaction``: the sequence's compacted layers (compression); ``compress``: image spans
    (start, length) this step compresses with ``compression`` (computed in full at every layer).
    ``inject``: (layer, positions, hidden) rows whose input to ``layer`` is given (their first layer
    computing them; an image kept in context in the top layers of an isolated model);
    ``capture``: (layer, positions) rows whose input to ``layer`` the step keeps
    (:attr:`StepBatch.captured`).
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
    compaction: Compaction | None = None
    compress: list[tuple[int, int]] | None = None
    compression: CompressionSettings | None = None
    replays: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] | None = None  # (layer, positions, targets, weights)
    select: RowSelection | None = None  # the repair method picks the later layers' rows in the forward
    inject: list[tuple[int, np.ndarray, torch.Tensor]] | None = None
    capture: tuple[int, np.ndarray] | None = None
    captured: torch.Tensor | None = None  # the captured rows' input to the capture layer, after the forward


@dataclass
class RowSelection:
    """A repair method's second phase (``ReusePlan.select_layer``): at ``layer`` the forward
    measures how far the fresh keys of the reused ``positions`` (sorted; every one of them is
    computed up to that layer) deviate from their cached keys, and ``choose(deviation)`` returns
    the rows of each layer after it (``layer_rows[layer + 1:]``)."""

    layer: int
    positions: np.ndarray
    choose: Callable[[np.ndarray], list[np.ndarray]]


@dataclass
class SelectJob:
    """A :class:`RowSelection` in a planned step: its step rows (device int64), their KV slots,
    and the sequence it re-plans."""

    step: SequenceStep
    rows: torch.Tensor
    slots: torch.Tensor


@dataclass
class ReplayJob:
    """A stored merge replayed at ``layer`` over step rows ``rows`` (device int64): ``target``
    indexes into ``rows`` (``target[i] == i`` for an anchor), ``weight`` float32."""

    layer: int
    rows: torch.Tensor
    target: torch.Tensor
    weight: torch.Tensor


@dataclass
class CompressJob:
    """An image a step compresses: the step rows it still keeps (``rows``, device int64), their
    sequence positions and image-grid coordinates [n, 2]; its sequence's block table and length,
    and ``prior``: the sequence's positions whose KV this step does not write at every layer (it
    was there before: a prefix, spliced images), which a stage moves to their compacted slots."""

    settings: CompressionSettings
    compaction: Compaction
    rows: torch.Tensor
    positions: np.ndarray
    coords: torch.Tensor
    block_table: np.ndarray
    num_kv_tokens: int
    prior: np.ndarray


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
    deepstack_rows: np.ndarray | None = None  # per row: its feature row, -1 for text
    compress_jobs: list[CompressJob] = field(default_factory=list)
    replays: list[ReplayJob] = field(default_factory=list)
    select_jobs: list[SelectJob] = field(default_factory=list)
    steps: list[SequenceStep] = field(default_factory=list)
    offsets: np.ndarray | None = None  # first row of each sequence
    block_size: int = 0
    injects: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (layer, rows, hidden)
    captures: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (layer, rows), per sequence or None
    captured: list[torch.Tensor | None] = field(default_factory=list)  # filled by the forward, per sequence

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
        slots_t, logit_rows = upload([slots, offsets[1:] - 1], np.int64, device)  # one copy, no stream sync

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

        embeds = torch.cat([s.embeds for s in steps]) if len(steps) > 1 else steps[0].embeds
        positions = torch.cat([s.positions for s in steps], dim=1) if len(steps) > 1 else steps[0].positions
        batch = cls(embeds=embeds, positions=positions.to(device), all_rows=None, layers=[None] * num_layers,  # type: ignore[arg-type]
                    logit_rows=logit_rows, deepstack_features=ds_feats,
                    before_layer=[s.before_layer for s in steps if s.before_layer is not None],
                    deepstack_rows=ds_rows, steps=list(steps), offsets=offsets, block_size=block_size)
        batch.all_rows = RowSubset(all_index, slots_t, meta, *batch._visual(None))
        batch.replan(0)
        for s, off in zip(steps, offsets):
            for layer, positions, hidden in s.inject or ():
                local = np.searchsorted(s.rows, positions)
                if local.size and (local[-1] >= s.rows.size or not np.array_equal(s.rows[local], positions)):
                    raise ValueError("injected rows must be among the step's rows")
                batch.injects.append((layer, torch.from_numpy(off + local).to(device), hidden))
            if s.capture is not None:
                layer, positions = s.capture
                local = np.searchsorted(s.rows, positions)
                if local.size and (local[-1] >= s.rows.size or not np.array_equal(s.rows[local], positions)):
                    raise ValueError("captured rows must be among the step's rows")
                batch.captures.append((layer, torch.from_numpy(off + local).to(device)))
            else:
                batch.captures.append(None)
            for layer, positions, targets, weights in s.replays or ():
                local = np.searchsorted(s.rows, positions)
                if local.size and (local[-1] >= s.rows.size or not np.array_equal(s.rows[local], positions)):
                    raise ValueError("a replayed merge needs every member among the step's rows")
                batch.replays.append(ReplayJob(layer, torch.from_numpy(off + local).to(device),
                                               torch.from_numpy(np.searchsorted(positions, targets)).to(device),
                                               torch.from_numpy(weights).to(device)))
            if s.select is not None and s.layer_rows is not None:
                local = np.searchsorted(s.rows, s.select.positions)
                if local.size and (local[-1] >= s.rows.size or not np.array_equal(s.rows[local], s.select.positions)):
                    raise ValueError("a row selection needs every reused position among the step's rows")
                rows_t, slots_t2 = upload([off + local, slot_ids(s.block_table, s.select.positions, block_size)],
                                          np.int64, device)
                batch.select_jobs.append(SelectJob(s, rows_t, slots_t2))
            if s.compress:
                full = s.rows
                for rows in s.layer_rows or ():
                    if rows.size != full.size:
                        full = np.intersect1d(full, rows, assume_unique=True)
                prior = np.setdiff1d(np.arange(s.num_kv_tokens), full, assume_unique=True)
            for start, length in s.compress or ():
                if s.compaction is None or s.compression is None:
                    raise ValueError("a step that compresses images needs its compaction and compression settings")
                where = np.arange(start, start + length)
                local = np.searchsorted(s.rows, where)
                if local.size and (local[-1] >= s.rows.size or not np.array_equal(s.rows[local], where)):
                    raise ValueError(f"image tokens [{start}, {start + length}) are not all computed this step")
                rows = torch.from_numpy(off + local).to(device)
                coords = s.positions[1:3, torch.from_numpy(local)].T.contiguous()
                batch.compress_jobs.append(CompressJob(s.compression, s.compaction, rows, where, coords,
                                                       s.block_table, s.num_kv_tokens, prior))
        return batch

    def _visual(self, rows_of_subset: np.ndarray | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Which of a row subset's rows take DeepStack features, and their feature rows."""
        if self.deepstack_rows is None:
            return None, None
        device = self.all_rows.index.device if self.all_rows is not None else self.positions.device
        feature = self.deepstack_rows if rows_of_subset is None else self.deepstack_rows[rows_of_subset]
        where = np.flatnonzero(feature >= 0)
        return torch.from_numpy(where).to(device), torch.from_numpy(feature[where]).to(device)

    def select(self, layer: int, fresh_keys, cached_keys) -> None:
        """Run the row selections at ``layer``: ``fresh_keys(job)`` / ``cached_keys(job)`` give the
        job's reused rows' keys [n, kv_heads, d]; each sequence's later layers get the rows its
        selection chooses, and the layers after this one are planned again."""
        from samcache.recompute import key_deviation

        jobs = [job for job in self.select_jobs if job.step.select.layer == layer]
        for job in jobs:
            deviation = key_deviation(cached_keys(job), fresh_keys(job)).double().cpu().numpy()
            chosen = job.step.select.choose(deviation)
            if len(chosen) != len(self.layers) - layer - 1:
                raise ValueError(f"a row selection at layer {layer} must give the rows of the "
                                 f"{len(self.layers) - layer - 1} layers after it, got {len(chosen)}")
            job.step.layer_rows[layer + 1:] = chosen
        if jobs:
            self.replan(layer + 1)

    def replan(self, first_layer: int) -> None:
        """Plan the row subsets of layers ``first_layer`` on (again, after a compression stage)."""
        steps, offsets, device = self.steps, self.offsets, self.all_rows.index.device
        total = int(offsets[-1])
        subsetting = any(s.layer_rows is not None for s in steps)
        compacting = [s for s in steps if s.compaction is not None and s.compaction.active]
        if not subsetting and not compacting:
            return  # every layer computes every row of every sequence, at its own slot
        # Per-layer subsets exist only where some sequence recomputes a subset or holds fewer
        # tokens (decode steps and full prefills compute every row at every layer).
        previous: tuple[tuple, RowSubset] | None = None
        for layer in range(first_layer, len(self.layers)):
            parts, kept, compacted = [], [], False
            for s, off in zip(steps, offsets):
                active = s.rows if s.layer_rows is None else s.layer_rows[layer]
                if s.compaction is not None and s.compaction.removed[layer].size:
                    active = s.compaction.kept(layer, active)
                    compacted = True
                kept.append(active)
                parts.append(off + np.searchsorted(s.rows, active))
            index = np.concatenate(parts)
            if not compacted and index.size == total:
                self.layers[layer] = None
                previous = None
                continue
            key = (index.tobytes(), tuple(id(s.compaction.removed[layer]) if s.compaction is not None else 0
                                          for s in steps))
            if previous is None or previous[0] != key:  # else: the layer above's plan
                idx, = upload([index], np.int64, device)
                if compacted:
                    where = [active if s.compaction is None else s.compaction.slots(layer, active)
                             for s, active in zip(steps, kept)]
                    lengths = [s.num_kv_tokens if s.compaction is None else s.compaction.length(layer, s.num_kv_tokens)
                               for s in steps]
                    meta = AttentionMetadata.build(where, [s.block_table for s in steps], lengths, self.block_size,
                                                   device)
                    slots = torch.from_numpy(np.concatenate([slot_ids(s.block_table, w, self.block_size)
                                                             for s, w in zip(steps, where)])).to(device)
                else:
                    meta = self.all_rows.meta.select(idx, [p.size for p in parts], host_rows=index)
                    slots = self.all_rows.slots.index_select(0, idx)
                previous = (key, RowSubset(idx, slots, meta, *self._visual(index)))
            self.layers[layer] = previous[1]


__all__ = ["CompressJob", "ReplayJob", "RowSelection", "RowSubset", "SelectJob", "SequenceStep", "StepBatch"]
