"""One vLLM forward pass under the plugin: the reuse plans of its requests, executed on vLLM's cache.

vLLM's scheduler counts every prompt token past its exact prefix as computed in this step (a KV
connector can only extend the prefix). The plugin keeps that bookkeeping and changes the work:

1. For every request in whose scheduled tokens an image ends, the per-request path samcache's
   engine runs too (:func:`samcache.reuse.plan_request`, through
   :class:`~samcache.integrations.forward_plan.StepPlan`) decides, from the images the store
   holds, which tokens take cached KV and which rows each layer computes (new rows + the layer's
   recompute rows, in the configured repair method's order).
2. The spliced images' keys are re-rotated from their cached M-RoPE positions to the new ones
   (``rope_rerotate``, per-token deltas on all three M-RoPE axes) and written, with their values,
   straight into vLLM's paged cache at the request's slots through vLLM's own cache op (its CPU
   layout depends on the kernel ISA: keys are stored transposed inside a block for ``vec``).
3. The model runs each layer on its rows only (:mod:`.model`); attention runs vLLM's own CPU kernel
   over the whole cache, each contiguous run of computed rows being one causal query block
   (:class:`AttentionBatch`): exact for those rows, whatever was skipped around them.
4. Images computed in full this step and not yet stored have their per-layer keys and values
   captured as each layer writes them to the cache (:meth:`ForwardStep.capture`), and are stored
   when the step ends (the connector's ``wait_for_save``).

Rows are found by slot, not by batch order: the scheduler side sends each request's block ids, and
the request whose first scheduled token sits in the expected slot is that request.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from samcache.hashing import Namespace
from samcache.integrations.forward_plan import (ImageKV, KVWriter, PendingSave, RequestImage, Rotary, StepPlan,
                                                layer_rows)
from samcache.integrations.isolated_rows import IsolatedServing, SideRows
from samcache.integrations.vllm.identity import content_of
from samcache.reuse import RecomputeBudget

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    m = _LAYER_INDEX.search(layer_name)
    if m is None:
        raise ValueError(f"samcache: cannot tell the decoder layer of attention layer {layer_name!r}")
    return int(m.group(1))


@dataclass(frozen=True)
class ImageRef:
    """Image tokens ``[offset, offset + length)`` of a prompt, named by vLLM's identifier."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class RequestStep:
    """What the scheduler scheduled for one request this step: prompt tokens ``[start, start +
    num_tokens)``, the request's blocks, its images up to the range's end (all of them, in prompt
    order: an image's place among them is its index), its tenant, the agent
    it names (``kv_transfer_params["samcache_agent"]``; for the store's eviction policy) and its
    prompt's first token."""

    req_id: str
    start: int
    num_tokens: int
    block_ids: tuple[int, ...]
    images: tuple[ImageRef, ...]
    tenant: str
    agent: str | None = None
    sink_token: int | None = None  # the prompt's first token (an isolated model's images attend to it)

    def slot(self, position: int, block_size: int) -> int:
        return self.block_ids[position // block_size] * block_size + position % block_size


@dataclass
class AttentionBatch:
    """vLLM's CPU attention inputs for one set of computed rows: each contiguous run of rows of a
    request is a pseudo-request whose queries are the last ``len(run)`` of its ``seq_len`` keys."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: Any = None


@dataclass
class ForwardStep:
    """The executed plan of one forward pass. ``rows[l]``: flattened rows layer ``l`` computes
    (None: every row, vLLM's own path); ``select[l]``: their positions among ``rows[l - 1]``;
    ``side``: an isolated model's first-seen images, computed in rows after those at every layer
    (the keys and values of side rows ``side.write_at`` go to ``side_slots``)."""

    rows: list[torch.Tensor] | None
    select: list[torch.Tensor | None]
    slots: list[torch.Tensor]
    saves: list[PendingSave]
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: torch.Tensor
    _batches: dict[int, AttentionBatch] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)
    approximate: dict[str, int] = field(default_factory=dict)  # request id -> its exact leading tokens
    side: SideRows | None = None
    side_slots: torch.Tensor | None = None

    @property
    def sparse(self) -> bool:
        return self.rows is not None

    def capture(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep the saved images' rows of the keys and values layer ``layer`` writes (its computed
        rows, in order: every flattened row, or ``rows[layer]`` when sparse)."""
        for save in self.saves:
            save.capture(None if self.rows is None else self.rows[layer], keys, values)

    def attention_batch(self, layer: int, make_scheduler_metadata) -> AttentionBatch:
        """The attention inputs of layer ``layer``'s rows (built once per distinct row set)."""
        ident = id(self.rows[layer])
        batch = self._batches.get(ident)
        if batch is None:
            batch = self._build_batch(self.rows[layer].numpy())
            batch.scheduler_metadata = make_scheduler_metadata(batch)
            self._batches[ident] = batch
        return batch

    def _build_batch(self, rows: np.ndarray) -> AttentionBatch:
        qsl, seq = self.query_start_loc, self.seq_lens
        owner = np.searchsorted(qsl, rows, side="right") - 1           # request of every row
        breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(owner) != 0)) + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [rows.size]])
        req = owner[starts]
        last_row = rows[ends - 1]                                       # flattened row of each run's last query
        seq_len = seq[req] - (qsl[req + 1] - 1 - last_row)
        query_start_loc = np.concatenate([[0], np.cumsum(ends - starts)])
        return AttentionBatch(
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_len.astype(np.int32)),
            block_table=self.block_table.index_select(0, torch.from_numpy(req.astype(np.int64))),
        )


def request_images(step: RequestStep) -> list[RequestImage]:
    """A scheduled request's images in prompt order, named by content where vLLM named them from
    pixels (:func:`~samcache.integrations.vllm.identity.content_of`)."""
    return [RequestImage(content_of(ref.identifier), ref.offset, ref.length) for ref in step.images]


def plan_forward(
    steps: Sequence[RequestStep],
    *,
    attn_metadata: Any,
    positions: torch.Tensor,
    cache: KVWriter,
    rotary: Rotary,
    store,
    model_id: str,
    budget: RecomputeBudget | None,
    num_layers: int,
    keep_image_order: bool = False,
    isolated: IsolatedServing | None = None,
) -> ForwardStep | None:
    """Plan and prepare one forward pass: splice the stored images (writing their KV into the
    cache), pick each layer's rows, list the images to save. None when nothing is to be done.
    ``keep_image_order``: an image's KV is keyed by its content and its index among the request's
    images (reused only where it keeps its place). ``isolated``: the model's images attend in
    isolation; first-seen ones are computed in side rows."""
    if attn_metadata is None or getattr(attn_metadata, "dynamic_causal", None) is not None:
        return None
    qsl = attn_metadata.query_start_loc.numpy().astype(np.int64)
    seq = attn_metadata.seq_lens.numpy().astype(np.int64)
    slot_mapping = attn_metadata.slot_mapping
    num_reqs = seq.size
    total = int(qsl[num_reqs])
    if positions.dim() != 2 or positions.size(0) != 3 or positions.size(1) < total:
        return None  # not M-RoPE positions: nothing to plan with
    bs = cache.block_size
    first_slot = {int(slot_mapping[qsl[r]]): r for r in range(num_reqs) if qsl[r + 1] > qsl[r]}

    plan = StepPlan(total, num_layers)
    for step in steps:
        r = first_slot.get(step.slot(step.start, bs)) if step.start // bs < len(step.block_ids) else None
        if r is None:
            continue
        base, q = int(qsl[r]), int(qsl[r + 1] - qsl[r])
        if q != step.num_tokens or int(seq[r]) - q != step.start:
            continue  # not the step the scheduler described: compute it as vLLM does
        plan.add_request(request_images(step), begin=step.start, end=step.start + step.num_tokens, base=base,
                         namespace=Namespace(model_id, step.tenant), store=store, budget=budget,
                         keep_image_order=keep_image_order, positions=positions, slots=slot_mapping, cache=cache,
                         rotary=rotary, owner=step.req_id, isolated=isolated, sink_token=step.sink_token)
    plan.settle()
    saves, skipped, recompute = plan.saves, plan.skipped, plan.recompute
    stats = plan.counters.counters()
    del stats["steps"]  # counted by the connector
    stats["images_saved"] = len(saves)

    common = dict(saves=saves, query_start_loc=qsl, seq_lens=seq,
                  block_table=attn_metadata.block_table, stats=stats, approximate=plan.approximate)
    if not skipped.any():
        if not saves and not plan.approximate:
            return None
        stats["computed_tokens"] = stats["prompt_tokens"]
        return ForwardStep(rows=None, select=[], slots=[], **common)
    rows, select = layer_rows(skipped, recompute, num_layers)
    slot_rows = []
    for layer in range(num_layers):
        slot_rows.append(slot_mapping[rows[layer]] if select[layer] is not None or not layer else slot_rows[-1])
    stats["computed_tokens"] = stats["prompt_tokens"] - int(skipped.sum()) + stats["recomputed_tokens"]
    side = plan.side.build(positions.dtype) if plan.side else None
    if side is not None:
        stats["computed_tokens"] += side.size
        common.update(side=side, side_slots=slot_mapping[side.write_rows.to(slot_mapping.device)])
    return ForwardStep(rows=rows, select=select, slots=slot_rows, **common)


__all__ = ["AttentionBatch", "KVWriter", "ForwardStep", "ImageKV", "ImageRef", "PendingSave", "RequestStep", "request_images",
           "Rotary", "layer_index", "plan_forward"]
