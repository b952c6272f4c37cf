"""Calibration of the layer-aware recompute budget, on its own runner, pool and stores.

A calibration pair shows some images once, then again at new positions after other text: pairs
of requests from the traffic to serve, or by default two synthetic screenshots, reversed behind
another system prompt. For each layer and rate, the reused turn gets the exact KV (from a full
prefill) for that fraction of its reused tokens at that layer only, in the order the served plan
uses (span heads, then the turn's own relevance scores); the loss is the KL against the full
prefill over the reference's greedy reply (its first ``continuation`` tokens), averaged over the
pairs. Each run is teacher-forced with that reply in one forward step (``Executor.forced_step``),
so a continuation as long as the reply costs about one more prefill, not one step per token.
``solve_layer_budget`` turns the curves into rates.

The curves are then checked end to end: at each probe rate, the pairs run through the served
recompute path with the solved rates and with the same rate at every layer. The solver adds up
losses measured one layer at a time; where layers repair together that sum misleads it, and the
check (``SensitivityCurves.checked``) lets the engine fall back to the uniform rates there.
The same runs, on the pairs where a reused image changed its index among the prompt's images (plus
one at rate 0 and one at rate 1 each), count how often the reuse still picks the reference's
confident tokens (``SensitivityCurves.image_order``, :mod:`samcache.recompute.image_order`): where
recompute cannot repair such reuse, ``keep_image_order="auto"`` keeps images at their own index.

The calibrator shares the serving engine's weights but has its own KV cache, block pool and
stores, so calibrating never touches what the engine serves from; it works between the
executor's stages (splice, then overwrite one layer's KV, then run), not through a switch in the
serving path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from samcache import ops
from samcache._checks import check_int
from samcache.cache.block_pool import BlockPool, slot_ids
from samcache.engine.executor import Executor, RequestOptions
from samcache.engine.metrics import next_token_fidelity
from samcache.engine.prompt import Prompt, user_message
from samcache.engine.runner import ModelRunner
from samcache.engine.fidelity import reference_prefill
from samcache.hashing import Namespace
from samcache.recompute import SensitivityCurves, probe_layer_sensitivity
from samcache.recompute.budget import check_probe_rates, solve_layer_budget, tokens_per_layer
from samcache.recompute.image_order import ImageOrderCheck, confident_agreement
from samcache.engine.vit_chain import VitChain
from samcache.cache.stores import ImageKVStore

if TYPE_CHECKING:  # the engine calls this module; the annotation alone names it back
    from samcache.engine.api import SAMcacheEngine

#: Reply tokens the calibration's loss covers by default: a whole reply (it ends earlier where the
#: reply does), since a model that describes images first goes wrong dozens of tokens in.
CALIBRATION_CONTINUATION = 256

#: What the calibrator reads from the engine it calibrates.
_ENGINE_PARTS = ("runner", "executor", "repair", "model_id", "build_prompt", "recompute_budget_for", "eos_token_ids")


class Calibrator:
    """Probes each layer's sensitivity for the model of ``engine`` (a :class:`SAMcacheEngine`)."""

    def __init__(self, engine: SAMcacheEngine) -> None:
        if not all(hasattr(engine, part) for part in _ENGINE_PARTS):
            raise TypeError(f"engine must be a SAMcacheEngine, got {type(engine).__name__}")
        self.engine = engine

    def _executor(self, tokens: int) -> Executor:
        """A runner sharing the engine's weights, with its own KV for ``tokens`` tokens, pool and stores."""
        e = self.engine
        runner = ModelRunner(e.model_path, e.family, device=e.device, dtype=e.dtype, block_size=e.runner.block_size,
                             num_blocks=-(-tokens // e.runner.block_size) + 4, model=e.runner.model)
        pool = BlockPool(runner.num_blocks, runner.block_size)
        return Executor(runner, pool, VitChain(runner, e.processor, device_bytes=256 << 20, name="calibration-vit"),
                        image_kv_store=ImageKVStore(pool, runner.num_blocks * runner.block_bytes, runner.block_bytes))

    def run(self, images: Sequence[Any] | None = None, *, requests: Sequence[tuple[list, list]] | None = None,
            rates: Sequence[float] = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), continuation: int = CALIBRATION_CONTINUATION,
            check: bool = True, progress: bool = True) -> SensitivityCurves:
        """The curves: for each (layer, rate), the KL of the reused turn against a full prefill,
        summed over the reference's first ``continuation`` greedy tokens (fewer where its reply
        ends; each run is teacher-forced with them in one forward step), averaged over the
        calibration pairs.

        ``requests``: (first, reused) pairs of chat messages, e.g. consecutive turns of the traffic
        to serve: the first request's images are kept, the reused one shows some of them again at
        other positions. Default: ``images`` (else two synthetic screenshots) shown once, then
        reversed behind another system prompt.
        ``continuation``: why more than the next token: a model whose replies open the same way
        whatever it is shown ('First screenshot: ...') has a next-token KL near 0 at every rate,
        and the budget solved from it spends the recompute where nothing changes. Why longer: a
        model that describes the images before answering goes wrong in the description of a moved
        image, dozens of tokens in; a continuation as long as the reply scores that part too.
        ``check``: measure the solved rates against uniform ones end to end at each probe rate
        (``SensitivityCurves.checked``; about a third more runs), and on the pairs where a reused
        image changed its index, how often the reuse keeps the reference's confident tokens
        (``SensitivityCurves.image_order``, read by ``keep_image_order="auto"``)."""
        from samcache.synthetic import screenshot

        rates = check_probe_rates(rates)  # before any of the L x R forward passes
        check_int("continuation", continuation, 1)
        if requests is not None and images is not None:
            raise ValueError("give calibration images or requests, not both")
        if requests is None:
            images = list(images) if images is not None else [screenshot(101, (224, 320)), screenshot(102, (224, 320))]
            if not images:
                raise ValueError("calibration needs at least one image (or images=None for two synthetic screenshots)")
            requests = [([{"role": "system", "content": "Calibration."}, user_message(images, "Describe.")],
                         [{"role": "system", "content": "You are an agent operating a computer. Earlier steps are above."},
                          user_message(images[::-1], "What changed between these screenshots, and what should be "
                                                     "clicked next?")])]
        requests = list(requests)
        if not requests or not all(isinstance(r, (tuple, list)) and len(r) == 2 for r in requests):
            raise ValueError("requests must be a non-empty list of (first messages, reused messages) pairs")
        pairs = [(self.engine.build_prompt(first), self.engine.build_prompt(reused)) for first, reused in requests]
        losses = []
        for index, (first, reused) in enumerate(pairs):
            with self._pair(index, first, reused, continuation) as (one_layer, _):
                losses.append(probe_layer_sensitivity(one_layer, self.engine.runner.num_layers, rates,
                                                      progress=progress).loss)
        curves = SensitivityCurves(rates=rates, loss=np.mean(losses, axis=0))
        return self._check(curves, pairs, continuation, progress) if check else curves

    def _check(self, curves: SensitivityCurves, pairs: list[tuple[Prompt, Prompt]], continuation: int,
               progress: bool) -> SensitivityCurves:
        """``curves`` with ``checked``: the mean loss over the pairs, through the served recompute,
        of the solved rates and of uniform ones at each probe rate strictly between 0 and 1; and
        with ``image_order``: on the pairs where an image changed its index, the confident reference
        tokens those runs kept, at those rates and at 0 and 1 too (one more run each)."""
        layers = curves.num_layers
        rates = curves.rates
        checked = np.full((rates.size, 2), np.nan)
        schedules = {}
        for i, rate in enumerate(rates):
            if 0.0 < rate < 1.0:
                schedules[i] = (tuple(solve_layer_budget(curves, float(rate)).rates), (float(rate),) * layers)
        moved = {index for index, (first, reused) in enumerate(pairs) if _changes_an_index(first, reused)}
        ends = [i for i, rate in enumerate(rates) if rate in (0.0, 1.0)]  # solved = uniform there
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(pairs) * len(schedules) + len(moved) * len(ends), desc="checking the solved rates",
                       unit="run")
        sums = np.zeros_like(checked)
        agreed = np.zeros_like(checked)
        confident = 0  # the references' confident tokens over the moved pairs
        for index, (first, reused) in enumerate(pairs):
            runs = dict(schedules)
            if index in moved:
                runs.update({i: ((float(rates[i]),) * layers,) * 2 for i in ends})
            if not runs:
                continue
            with self._pair(index, first, reused, continuation) as (_, served):
                for i, (solved, uniform) in runs.items():
                    a = served(solved)
                    b = a if np.allclose(solved, uniform) else served(uniform)
                    if i in schedules:
                        sums[i] += (a.kl, b.kl)
                    if index in moved:
                        agreed[i] += (a.agreed, b.agreed)
                    if bar is not None:
                        bar.update(1)
                if index in moved:
                    confident += a.confident  # the reference's: the same in every run of this pair
        if bar is not None:
            bar.close()
        for i in schedules:
            checked[i] = sums[i] / len(pairs)
        image_order = None
        if moved:
            measured = sorted({*schedules, *ends})
            counts = np.full_like(checked, np.nan)
            counts[measured] = agreed[measured]
            image_order = ImageOrderCheck(rates=rates, agreed=counts, confident=confident, pairs=len(moved))
        return SensitivityCurves(rates=rates, loss=curves.loss, checked=checked, image_order=image_order)

    @contextmanager
    def _pair(self, index: int, prime: Prompt, target: Prompt, continuation: int
              ) -> Iterator[tuple[Callable[[int, float], float], Callable[[Sequence[float]], "_Score"]]]:
        """One (first, reused) pair set up for measuring: yields ``one_layer(layer, rate)``, the
        loss with the exact KV at that fraction of the reused tokens at that layer only, and
        ``served(rates)``, the score (loss and confident-token agreement) through the engine's own
        recompute at per-layer ``rates``."""
        engine = self.engine
        ns = Namespace(engine.model_id, "samcache/calibration")
        # The first showing's images stay held while the reused turn and the reference run.
        ex = self._executor(len(prime) + 2 * (len(target) + continuation) + 4 * engine.runner.block_size)
        r = ex.runner
        try:
            # The first showing: its images' KV is kept (held in the calibrator's pool).
            pre, _ = ex.prefill(prime, ns, RequestOptions(use_prefix=False, register_prefix=False,
                                                          isolated_images=engine.repair.isolated))
            ex.register(pre)
            ex.pool.free_sequence(pre.seq)
            # The reused turn with the engine's recompute policy at rate 0: nothing recomputed.
            budget = engine.recompute_budget_for((0.0,) * r.num_layers)
            options = RequestOptions(use_prefix=False, register_prefix=False, store_images=False, budget=budget)
            probe = ex.prepare(target, ns, options)
            try:
                shown = {s.image.content for s in prime.images}
                expected = sum(s.image.content in shown for s in target.images)
                if expected == 0:
                    raise ValueError(f"calibration pair {index}: the reused request shows none of the first one's images")
                if probe.metrics.image_kv_hits != expected:  # else every "reused" turn is exact: loss 0
                    raise ValueError(f"calibration pair {index} could reuse {probe.metrics.image_kv_hits} of its "
                                     f"{expected} images: raise its KV space or use smaller images")
                # The order the served plan uses: relevance scores from the reused turn itself.
                scores = ex.relevance(target, probe.plan, ex.pool.block_table(probe.seq), probe.vit) \
                    if budget.wants_scores else None
            finally:
                ex.pool.free_sequence(probe.seq)
            order = budget.order(probe.plan.reused_spans, [probe.plan.image_reused_tokens], scores).order
            ref, ref_logits = reference_prefill(ex, target, engine.model_id, ns)
            try:
                exact_k, exact_v = r.gather_kv(slot_ids(ex.pool.block_table(ref.seq), order, r.block_size))
                tokens, ref_logits = _greedy(ex, ref.seq, ref_logits, target.next_position, continuation,
                                             engine.eos_token_ids)
            finally:
                ex.pool.free_sequence(ref.seq)

            def reused_logits(run_options: RequestOptions, before_forward=None) -> list[torch.Tensor]:
                """The reused turn's logits, teacher-forced with the reference's continuation."""
                run = ex.prepare(target, ns, run_options)
                try:
                    if before_forward is not None:
                        before_forward(run)
                    first = ex.forward([run.step])[0]
                    return _forced(ex, run.seq, first, target.next_position, tokens)
                finally:
                    ex.pool.free_sequence(run.seq)

            def loss(logits: list[torch.Tensor]) -> float:
                """The KL against the reference, summed over the continuation."""
                return sum(next_token_fidelity(a, b)[0] for a, b in zip(ref_logits, logits))

            def one_layer(layer: int, rate: float) -> float:
                k = tokens_per_layer([rate], order.size)[0]

                def write_exact(run) -> None:  # this layer only: the exact KV of the first k tokens of the order
                    slots = r.slot_tensor(ex.pool.block_table(run.seq), order[:k])
                    ops.paged_write(exact_k[layer, :k], exact_v[layer, :k], r.k_cache[layer], r.v_cache[layer], slots)

                return loss(reused_logits(options, write_exact if k else None))

            def served(rates: Sequence[float]) -> _Score:
                logits = reused_logits(replace(options, budget=engine.recompute_budget_for(rates)))
                return _Score(loss(logits), *confident_agreement(ref_logits, logits))

            yield one_layer, served
        finally:
            ex.image_kv_store.clear()


class _Score(NamedTuple):
    """One run of a reused turn against the reference: the summed KL over the continuation, and
    how many of the reference's confident tokens it predicted (``image_order.confident_agreement``)."""

    kl: float
    agreed: int
    confident: int


def _changes_an_index(first: Prompt, reused: Prompt) -> bool:
    """Whether ``reused`` shows an image of ``first`` at another index among its images."""
    shown = {s.image.content for s in first.images}
    where = {(s.image.content, s.index) for s in first.images}
    return any(s.image.content in shown and (s.image.content, s.index) not in where for s in reused.images)


def _greedy(ex: Executor, seq: int, first: torch.Tensor, position: int, n: int,
            stop: set[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Up to ``n`` greedy tokens of sequence ``seq`` from its next-token logits ``first`` on,
    ending with the first ``stop`` token (the end of the reply): (the tokens, their logits)."""
    logits, tokens = [first], [int(first.argmax())]
    while len(tokens) < n and tokens[-1] not in stop:
        logits.append(ex.forward([ex.decode_step(seq, tokens[-1], position + len(tokens) - 1, hashed=False)])[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def _forced(ex: Executor, seq: int, first: torch.Tensor, position: int, tokens: Sequence[int]) -> list[torch.Tensor]:
    """The logits of sequence ``seq`` fed ``tokens`` (teacher forcing) from its next-token logits
    ``first`` on: one per token, ``first`` included, all but the first from one forward step."""
    if len(tokens) < 2:
        return [first]
    rest = ex.forward([ex.forced_step(seq, tokens[:-1], position)], every_row=True)
    return [first, *rest]


__all__ = ["Calibrator"]
