"""Compressed images inside the executor (:mod:`samcache.compression`): the strategy the core
calls where a request compresses its new images or splices records kept compressed.

A compressed record holds, per layer, only the tokens its stages kept; a sequence that splices
one has compacted layers (:class:`Compaction`), so its rows go to per-layer slots, recompute
over it closes over each anchor's merge group, and the record's routing confidence can order
track 2. After the step, each compressed image is kept packed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from samcache.cache.block_pool import BlockPool, slot_ids
from samcache.compression.compaction import Compaction
from samcache.engine.prompt import Prompt
from samcache.engine.runner import ModelRunner
from samcache.engine.tier_io import TierIO
from samcache.reuse import PromptLayout, ReusePlan
from samcache.cache.stores import ImageKVStore

if TYPE_CHECKING:
    from samcache.engine.executor import Prepared


class CompressedKV:
    """Compaction, splicing, recompute closure and storage of compressed image KV on ``runner``'s
    KV, ``pool`` and ``image_kv_store``; ``tiers`` makes room below before a record is packed."""

    def __init__(self, runner: ModelRunner, pool: BlockPool, image_kv_store: ImageKVStore, tiers: TierIO) -> None:
        self.runner = runner
        self.pool = pool
        self.image_kv_store = image_kv_store
        self.tiers = tiers

    @staticmethod
    def compressible(prompt: Prompt, plan: ReusePlan) -> list[tuple[int, int]]:
        """Image spans (start, length) a compressing request merges: the new images, which it
        computes in full at every layer (reused KV after them moves to its compacted slots at the
        stage: ``ModelRunner._compact``)."""
        new = set(plan.vit_images) - {s.image for s in plan.spliced}
        return [(s.start, s.length) for s in prompt.images if s.index in new and s.start >= plan.prefix_tokens]

    def compaction(self, packed, held: dict, layout: PromptLayout) -> Compaction:
        """The compacted layers of a sequence that splices these compressed records: each record's
        tokens a layer does not hold are gone from that layer on."""
        compaction = Compaction(self.runner.num_layers)
        for s in packed:
            kept = held[layout.images[s.image].key].kept
            for layer in range(1, len(kept)):
                if kept[layer] is not kept[layer - 1]:
                    compaction.remove(layer, s.start + np.setdiff1d(kept[layer - 1], kept[layer], assume_unique=True))
        return compaction

    def splice(self, spans, held: dict, layout: PromptLayout, table: np.ndarray,
                          compaction: Compaction) -> None:
        """Splice images into a sequence with compacted layers: per layer, each image's rows (all of
        them, or what a compressed record holds) go to that layer's compacted slots, keys re-rotated;
        one fused call for all of them."""
        runner, store, bs = self.runner, self.image_kv_store, self.pool.block_size
        src, dst, deltas = [], [], []
        for s in spans:
            h = held[layout.images[s.image].key]
            for layer in range(runner.num_layers):
                if h.packed:
                    offsets, rows = h.kept[layer], store.packed_rows(h, layer)
                else:
                    offsets = np.arange(s.offset, s.offset + s.length)
                    rows = runner.flat_rows(layer, store.slots(h, s.offset, s.length))
                where = compaction.slots(layer, s.start + offsets - s.offset)
                src.append(rows)
                dst.append(runner.flat_rows(layer, slot_ids(table, where, bs)))
                deltas.append(np.full(rows.size, s.delta, dtype=np.int64))
        runner.splice_flat(np.concatenate(src), np.concatenate(dst), np.concatenate(deltas))

    def close_groups(self, plan: ReusePlan, packed, held: dict, layout: PromptLayout,
                      compaction: Compaction) -> tuple[ReusePlan, list]:
        """Recompute over compressed records: an anchor recomputed after a stage needs its group's
        fresh hidden states at the stage (the record's merge replayed), so its whole group is
        recomputed up to there, and theirs before, down to layer 0. Returns the plan with the
        closed per-layer rows and the merges to replay (layer, positions, targets, weights)."""
        rows = list(plan.layer_rows)
        replays = []
        for s in packed:
            merges = {layer: (s.start + m, s.start + t, w) for layer, m, t, w in held[layout.images[s.image].key].merges}
            need: list[np.ndarray] = [None] * len(rows)  # type: ignore[list-item]
            above = None
            for layer in range(len(rows) - 1, -1, -1):
                r = rows[layer]
                mine = compaction.kept(layer, r[(r >= s.start) & (r < s.end)])
                if above is not None:
                    if layer in merges:  # the tokens above are this stage's anchors: their groups here
                        members, targets, _ = merges[layer]
                        mine = np.union1d(mine, members[np.isin(targets, above)])
                    else:
                        mine = np.union1d(mine, above)
                need[layer] = above = mine
            for layer, (members, targets, weights) in merges.items():
                if layer + 1 < len(rows) and need[layer + 1].size:
                    chosen = np.isin(targets, need[layer + 1])
                    replays.append((layer, members[chosen], targets[chosen], weights[chosen]))
            for layer, r in enumerate(rows):
                rows[layer] = np.union1d(r[(r < s.start) | (r >= s.end)], need[layer])
        return replace(plan, layer_rows=tuple(rows)), replays

    @staticmethod
    def routing_relevance(prompt: Prompt, packed, held: dict, layout: PromptLayout) -> np.ndarray:
        """Track-2 scores from the router instead of attention (the seed's variant, compressed
        records only): each token's routing confidence at its record's first stage; 0 elsewhere."""
        scores = np.zeros(len(prompt), dtype=np.float64)
        for s in packed:
            merges = held[layout.images[s.image].key].merges
            if merges:
                _, members, _, weights = merges[0]
                scores[s.start + members] = weights
        return scores

    def note_metrics(self, pre: "Prepared") -> None:
        """Per-layer token counts of a compressed prefill, in its metrics."""
        if pre.compaction is None:
            return
        m, n = pre.metrics, len(pre.prompt)
        m.compressed_images = len(pre.step.compress or ())
        m.layer_tokens = pre.compaction.tokens_per_layer(n)
        m.visual_tokens_merged = n - m.layer_tokens[-1]

    def store(self, pre: "Prepared", span, key, check) -> None:
        """Keep a compressed image's rows (what each layer holds), packed (``put_packed``)."""
        if key in self.image_kv_store:
            return  # held already: nothing to copy
        runner, compaction, bs = self.runner, pre.compaction, self.pool.block_size
        table = self.pool.block_table(pre.seq)
        tokens = np.arange(span.start, span.end)
        kept, sources = [], []
        for layer in range(runner.num_layers):
            held = compaction.kept(layer, tokens)
            offsets = held - span.start
            if kept and np.array_equal(kept[-1], offsets):
                offsets = kept[-1]  # layers of one stage share one array
            kept.append(offsets)
            sources.append(runner.flat_rows(layer, slot_ids(table, compaction.slots(layer, held), bs)))
        self.tiers.demote_for(self.image_kv_store.packed_blocks(tuple(kept)))  # evicted prefix blocks go down a tier first
        merges = tuple((layer, positions - span.start, targets - span.start, weights)
                       for layer, positions, targets, weights in compaction.merges
                       if positions.size and span.start <= positions[0] < span.end)
        self.image_kv_store.put_packed(key, tuple(kept), np.concatenate(sources), span.length,
                                       int(pre.prompt.positions[0, span.start]), runner.copy_rows,
                                       check=check, namespace=pre.namespace,
                                       merges=merges, index=span.index)
