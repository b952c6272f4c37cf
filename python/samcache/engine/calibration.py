"""Calibration of the layer-aware recompute budget, on its own runner, pool and stores.

A calibration request shows some images (default: two synthetic screenshots) once, then again at
new positions behind another system prompt. For each layer and rate, the reused turn gets the
exact KV (from a full prefill) for that fraction of its reused tokens at that layer only, in the
order the served plan uses (span heads, then the turn's own relevance scores); the loss is the
next-token KL against the full prefill. ``solve_layer_budget`` turns the curves into rates.

The calibrator shares the serving engine's weights but has its own KV cache, block pool and
stores, so calibrating never touches what the engine serves from; it works between the
executor's stages (splice, then overwrite one layer's KV, then run), not through a switch in the
serving path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from samcache import ops
from samcache.block_pool import BlockPool, slot_ids
from samcache.engine.api import SAMcacheEngine
from samcache.engine.executor import Executor, RequestOptions
from samcache.engine.metrics import next_token_fidelity
from samcache.engine.prompt import user_message
from samcache.engine.runner import ModelRunner
from samcache.eval.fidelity import reference_prefill
from samcache.hashing import Namespace
from samcache.recompute import SensitivityCurves, probe_layer_sensitivity
from samcache.recompute.budget import check_probe_rates, tokens_per_layer
from samcache.stores import ImageKVStore, TensorStore


class Calibrator:
    """Probes each layer's sensitivity for the model of ``engine`` (a :class:`SAMcacheEngine`)."""

    def __init__(self, engine: SAMcacheEngine) -> None:
        if not isinstance(engine, SAMcacheEngine):
            raise TypeError(f"engine must be a SAMcacheEngine, got {type(engine).__name__}")
        self.engine = engine

    def _executor(self, tokens: int) -> Executor:
        """A runner sharing the engine's weights, with its own KV for ``tokens`` tokens, pool and stores."""
        e = self.engine
        runner = ModelRunner(e.model_path, e.family, device=e.device, dtype=e.dtype, block_size=e.runner.block_size,
                             num_blocks=-(-tokens // e.runner.block_size) + 4, model=e.runner.model)
        pool = BlockPool(runner.num_blocks, runner.block_size)
        return Executor(runner, pool, e.processor, vit_store=TensorStore("calibration-vit", 256 << 20),
                        image_kv_store=ImageKVStore(pool, runner.num_blocks * runner.block_bytes, runner.block_bytes))

    def run(self, images: Sequence[Any] | None = None, *,
            rates: Sequence[float] = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), progress: bool = True) -> SensitivityCurves:
        from samcache.engine.synthetic import screenshot

        engine = self.engine
        rates = check_probe_rates(rates)  # before any of the L x R forward passes
        images = list(images) if images is not None else [screenshot(101, (224, 320)), screenshot(102, (224, 320))]
        if not images:
            raise ValueError("calibration needs at least one image (or images=None for two synthetic screenshots)")
        ns = Namespace(engine.model_id, "samcache/calibration")
        prime = engine.build_prompt([{"role": "system", "content": "Calibration."}, user_message(images, "Describe.")])
        target = engine.build_prompt([
            {"role": "system", "content": "You are an agent operating a computer. Earlier steps are above."},
            user_message(images[::-1], "What changed between these screenshots, and what should be clicked next?"),
        ])
        # The first showing's images stay held while the reused turn and the reference run.
        ex = self._executor(len(prime) + 2 * len(target) + 4 * engine.runner.block_size)
        r = ex.runner
        try:
            # The first showing: its images' KV is kept (held in the calibrator's pool).
            pre, _ = ex.prefill(prime, ns, RequestOptions(use_prefix=False, register_prefix=False))
            ex.register(pre)
            ex.pool.free_sequence(pre.seq)
            # The reused turn with the engine's recompute policy at rate 0: nothing recomputed.
            budget = engine.recompute_budget_for((0.0,) * r.num_layers)
            options = RequestOptions(use_prefix=False, register_prefix=False, store_images=False, budget=budget)
            probe = ex.prepare(target, ns, options)
            try:
                if probe.metrics.image_kv_hits != len(target.images):  # else every "reused" turn is exact: loss 0
                    raise ValueError(f"calibration could reuse {probe.metrics.image_kv_hits} of its "
                                     f"{len(target.images)} images: raise its KV space or use smaller images")
                # The order the served plan uses: relevance scores from the reused turn itself.
                scores = ex.relevance(target, probe.plan, ex.pool.block_table(probe.seq), probe.vit) \
                    if budget.wants_scores else None
            finally:
                ex.pool.free_sequence(probe.seq)
            order = budget.order(probe.plan.reused_spans, [probe.plan.image_reused_tokens], scores).order
            ref, ref_logits = reference_prefill(ex, target, engine.model_id, ns)
            try:
                exact_k, exact_v = r.gather_kv(slot_ids(ex.pool.block_table(ref.seq), order, r.block_size))
            finally:
                ex.pool.free_sequence(ref.seq)

            def measure(layer: int, rate: float) -> float:
                k = tokens_per_layer([rate], order.size)[0]
                run = ex.prepare(target, ns, options)
                try:
                    if k:  # this layer only: the exact KV of the first k tokens of the order
                        slots = r.slot_tensor(ex.pool.block_table(run.seq), order[:k])
                        ops.paged_write(exact_k[layer, :k], exact_v[layer, :k], r.k_cache[layer], r.v_cache[layer],
                                        slots)
                    logits = ex.forward([run.step])[0]
                finally:
                    ex.pool.free_sequence(run.seq)
                return next_token_fidelity(ref_logits, logits)[0]

            return probe_layer_sensitivity(measure, r.num_layers, rates, progress=progress)
        finally:
            ex.image_kv_store.clear()


__all__ = ["Calibrator"]
