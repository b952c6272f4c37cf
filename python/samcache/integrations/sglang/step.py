"""One SGLang EXTEND (or MIXED) forward under the plugin: the reuse plans of its requests, executed
on SGLang's KV pool.

SGLang hands the model every request's extend range (``extend_prefix_lens`` / ``extend_seq_lens``:
the radix cache already holds the prefix), its KV slots (``out_cache_loc``), its M-RoPE positions
and its images (``mm_inputs``). For every request whose extend range holds whole images:

1. the per-request path samcache's engine runs too (:func:`samcache.reuse.plan_request`, through
   :class:`~samcache.integrations.forward_plan.StepPlan`) decides from the images the store holds
   which tokens take cached KV and which rows each layer computes (new rows + the layer's
   recompute rows, in the configured repair method's order);
2. the spliced images' keys are re-rotated to their new ``mrope_positions`` and written, with their
   values, into the request's slots through SGLang's own ``set_kv_buffer``;
3. the model override runs each layer on its rows only, and the ``samcache`` attention backend
   attends for those rows at their own positions (:meth:`SglangStep.rows`);
4. images computed whole in this step and not yet stored are read back from the pool after the
   forward (every layer's keys and values sit at their slots) and stored.

An isolated model's first-seen images are computed in side rows after the step's own
(:mod:`samcache.integrations.isolated_rows`), which write their keys and values into the images'
slots; the step's own rows of those images are skipped like a splice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from samcache.hashing import Namespace
from samcache.integrations.forward_plan import PendingSave, RequestImage, Rotary, StepPlan, layer_rows
from samcache.integrations.isolated_rows import IsolatedServing, SideRows
from samcache.integrations.sglang.exactness import mark_batch
from samcache.integrations.sglang.identity import image_refs
from samcache.reuse import RecomputeBudget, ReuseCounters


class ReuseStats(ReuseCounters):
    """What the plugin did, summed over steps (one per process: ``samcache.integrations.sglang.stats()``)."""


@dataclass
class SglangStep:
    """The executed plan of one forward. ``rows[l]``: flattened rows layer ``l`` computes (None:
    every row, SGLang's own path); ``select[l]``: their positions among ``rows[l - 1]``."""

    rows: list[torch.Tensor] | None
    select: list[torch.Tensor | None]
    saves: list[PendingSave]
    stats: ReuseStats = field(default_factory=ReuseStats)
    side: SideRows | None = None  # an isolated model's first-seen images, computed in rows after ``rows[l]``

    @property
    def sparse(self) -> bool:
        return self.rows is not None


class PoolWriter:
    """Writes a layer's keys and values into SGLang's KV pool through its own ``set_kv_buffer``."""

    def __init__(self, pool: Any, attention_layers: Sequence[Any]) -> None:
        self.pool = pool
        self.layers = list(attention_layers)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        dtype = self.pool.get_key_buffer(layer).dtype
        self.pool.set_kv_buffer(self.layers[layer], KVWriteLoc(slots, None), keys.to(dtype), values.to(dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.get_key_buffer(layer)[slots].clone(), self.pool.get_value_buffer(layer)[slots].clone()


def host_ints(host_values: Any, values: Any) -> np.ndarray:
    """A ForwardBatch field as int64 numpy: its host copy (``*_cpu``) when SGLang made one, else the
    tensor copied to the host."""
    v = host_values if host_values is not None else values
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().numpy().astype(np.int64)
    return np.asarray(v, dtype=np.int64)


def plan_step(forward_batch: Any, *, cache: PoolWriter, rotary: Rotary, store: Any,
              namespace_of: Callable[[int], Namespace], budget: RecomputeBudget | None,
              num_layers: int, keep_image_order: bool = False,
              isolated: IsolatedServing | None = None) -> SglangStep | None:
    """Plan and prepare one extend forward: splice the stored images into the pool, pick each
    layer's rows, list the images to save. None when nothing is to be done. ``isolated``: the
    model's images attend in isolation; first-seen ones are computed in side rows."""
    mm_inputs = forward_batch.mm_inputs
    positions = forward_batch.mrope_positions
    if not mm_inputs or positions is None or positions.dim() != 2 or positions.size(0) != 3:
        return None
    prefix = host_ints(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_prefix_lens)
    lens = host_ints(forward_batch.extend_seq_lens_cpu, forward_batch.extend_seq_lens)
    starts = np.concatenate([[0], np.cumsum(lens)])
    total = int(starts[-1])
    if positions.size(1) != total:
        return None
    slots = forward_batch.out_cache_loc
    # Rows SGLang reads besides each request's last: every row under a full hidden-state capture
    # (return_hidden_states, EAGLE), a request's prompt rows when it asks for input logprobs. Such
    # rows must be computed: those steps and requests splice nothing (their images are still saved).
    capture = getattr(forward_batch, "capture_hidden_mode", None)
    splice_none = capture is not None and capture.is_full()
    logprob_start = getattr(forward_batch, "extend_logprob_start_lens_cpu", None)
    wants_prompt_rows = [bool(forward_batch.return_logprob) and logprob_start is not None
                         and int(logprob_start[b]) < int(lens[b]) for b in range(lens.size)]
    plan = StepPlan(total, num_layers, counters=ReuseStats())
    reqs = getattr(forward_batch, "samcache_reqs", None)  # the prompt's first token: an isolated image's sink
    sinks = [int(r.origin_input_ids[0]) if getattr(r, "origin_input_ids", None) else None
             for r in reqs] if reqs is not None and len(reqs) == len(mm_inputs) else [None] * len(mm_inputs)
    for b, inputs in enumerate(mm_inputs):
        if inputs is None:
            continue
        begin, end, base = int(prefix[b]), int(prefix[b] + lens[b]), int(starts[b])
        images = [RequestImage(ref.content, ref.offset, ref.length)
                  for ref in image_refs(inputs, within=(begin, end))]
        plan.add_request(images, begin=begin, end=end, base=base, namespace=namespace_of(b), store=store,
                         budget=budget, keep_image_order=keep_image_order, positions=positions, slots=slots,
                         cache=cache, rotary=rotary, may_splice=not (splice_none or wants_prompt_rows[b]), owner=b,
                         isolated=isolated, sink_token=sinks[b])
    plan.settle()
    mark_batch(forward_batch, plan.approximate)  # their KV past the exact tokens stays out of the tree
    stats, saves, skipped = plan.counters, plan.saves, plan.skipped
    stats.images_saved = len(saves)
    recompute = plan.recompute
    if not skipped.any():
        if not saves and not stats.isolated_fallbacks:
            return None
        stats.computed_tokens = stats.prompt_tokens
        stats.steps = 1
        return SglangStep(rows=None, select=[], saves=saves, stats=stats)
    # Each request's last row is always computed: SGLang samples from it.
    last = (starts[1:] - 1)[lens > 0]
    rows, select = layer_rows(skipped, recompute, num_layers, always=last)
    side = plan.side.build(positions.dtype) if plan.side else None
    stats.computed_tokens = int(rows[0].numel()) + (side.size if side is not None else 0)
    stats.steps = 1
    return SglangStep(rows=rows, select=select, saves=saves, stats=stats, side=side)


def save_images(step: SglangStep, forward_batch: Any, cache: PoolWriter, store: Any, num_layers: int) -> None:
    """Store the images computed whole in this step, read back from the pool's slots
    (``step.stats.images_saved``: those the store took)."""
    saved = 0
    for save in step.saves:
        if save.key in store:
            continue  # another request of the batch stored it
        slots = forward_batch.out_cache_loc[save.rows.to(forward_batch.out_cache_loc.device)]
        for layer in range(num_layers):
            keys, values = cache.read(layer, slots)
            save.k.append(keys)
            save.v.append(values)
        saved += bool(store.put(save.key, save.image_kv(), check=save.check))
    step.stats.images_saved = saved


__all__ = ["PoolWriter", "ReuseStats", "SglangStep", "plan_step", "save_images"]
