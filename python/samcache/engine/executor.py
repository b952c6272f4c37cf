"""Executing reuse plans: prefill and decode of many sequences on one runner, pool and stores.

A request goes through three stages, so that a step can batch many of them and offline tools
(calibration, fidelity) can work between stages without reaching into the serving path:

1. :meth:`Executor.prepare`: adopt the exact prefix, look the images up, ask the planner
   (:func:`samcache.reuse.plan_reuse`), allocate the sequence's blocks, splice the known images'
   KV in at their new positions, run the ViT where the plan needs it, order track 2 by
   relevance, and describe the rows to compute (:class:`SequenceStep`).
2. :meth:`Executor.forward`: one batched forward step over any number of prepared requests.
3. :meth:`Executor.register`: keep what the turn computed (new images' KV, held in the pool's
   blocks; ViT outputs) for later turns.

The executor holds the core of these stages; three parts it calls do one job each: the ViT cache
chain (:class:`samcache.engine.vit_chain.VitChain`), the traffic with the tiers below the pool
(:class:`samcache.engine.tier_io.TierIO`) and compressed images' KV
(:class:`samcache.engine.compressed_kv.CompressedKV`).

Only blocks whose KV equals a full prefill's (``plan.exact_tokens``) are hashed into the exact
prefix cache; blocks holding approximate KV (spliced images and everything after them, unless
every reused token was recomputed at every layer) are never served as exact prefix hits.
A decode step (:meth:`decode_step`) is one row of a sequence; a forward step may mix them with
prefills. A failed stage drops
the blocks it added (nothing half-written is ever adopted) and leaves the pool and stores
consistent; the other requests of a batch are not affected by one request's failure to prepare.

Why this module is long: the three stages of a request (prepare, forward, register) and decode share
the pool, the runner and the failure rule (a failed stage drops what it added); its other jobs live
in vit_chain, tier_io and compressed_kv.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from samcache.agent.branches import ContextTree
from samcache.cache.block_pool import BlockPool, slot_ids
from samcache.compression.compaction import Compaction
from samcache.compression.settings import CompressionSettings
from samcache.engine.batch import RowSelection, SequenceStep, StepBatch
from samcache.engine.metrics import TurnMetrics
from samcache.engine.prompt import ImageSpan, Prompt
from samcache.engine.runner import ModelRunner
from samcache.engine.tier_io import TierIO, TierLoad
from samcache.engine.compressed_kv import CompressedKV
from samcache.engine.isolated_images import IsolatedImages
from samcache.engine.vit_chain import VitChain
from samcache.errors import OutOfBlocks, PromptTooLong
from samcache.hashing import ContentKey, Namespace
from samcache.recompute import attention_relevance, span_positions
from samcache.reuse import CachedImage, ImageSlot, PromptLayout, RecomputeBudget, ReusePlan, image_key, plan_request
from samcache.cache.stores import HeldImage, ImageKVStore
from samcache.cache.tiers.prefix import PrefixTier

_LOWEST = -(2**31)
_RELEVANCE_QUERIES = 32  # the prompt's last new tokens whose attention scores track 2


@dataclass(frozen=True)
class RequestOptions:
    """Which caches a request reads and feeds.

    ``use_prefix`` / ``use_image_kv``: adopt the exact prefix / splice known images' KV.
    ``register_prefix``: hash this prompt's exact blocks (and its decode tokens) into the prefix
    cache. ``approximate_prefix``: adopt and register blocks whatever their KV came from, in a
    prefix-cache space of their own (exact-only requests never see them). ``store_images``: keep
    new images' KV for later turns. ``budget``: the recompute budget of spliced tokens (None:
    none). ``use_vit``: look ViT outputs up in the ViT cache, in ``vit_namespace`` (default: the
    request's namespace); ``store_vit``: keep new ViT outputs there. ``compression``: merge the
    visual tokens of the images this request computes (None: keep every token). ``relevance``:
    what ranks track 2 of the recompute budget, ``"attention"`` (the prompt's last tokens' layer-0
    attention) or ``"routing"`` (compressed records' routing confidence). ``keep_image_order``:
    image KV is keyed by content *and* the image's index among the prompt's images, so it is reused
    only where the image keeps its place (for models that write an image's order into its KV; an
    image that moved to another place is prefilled again, from its cached ViT output).
    ``isolated_images``: the KV kept of a new image is computed again without left context (repair
    method ``isolated``). ``image_segment``: the prompt is one image's side sequence of an isolated
    model (:class:`~samcache.engine.isolated_images.IsolatedImages`), computed as it stands.
    """

    use_prefix: bool = True
    use_image_kv: bool = True
    register_prefix: bool = True
    approximate_prefix: bool = False
    store_images: bool = True
    budget: RecomputeBudget | None = None
    use_vit: bool = True
    vit_namespace: Namespace | None = None
    store_vit: bool = True
    compression: CompressionSettings | None = None
    relevance: str = "attention"
    keep_image_order: bool = False
    isolated_images: bool = False
    image_segment: bool = False

    def __post_init__(self) -> None:
        for name in ("use_prefix", "use_image_kv", "register_prefix", "approximate_prefix", "store_images",
                     "use_vit", "store_vit", "keep_image_order", "isolated_images", "image_segment"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"RequestOptions.{name} must be a bool, got {getattr(self, name)!r}")
        if self.budget is not None and not isinstance(self.budget, RecomputeBudget):
            raise TypeError(f"RequestOptions.budget must be a RecomputeBudget or None, got {type(self.budget).__name__}")
        if self.vit_namespace is not None and not isinstance(self.vit_namespace, Namespace):
            raise TypeError(f"RequestOptions.vit_namespace must be a Namespace or None, got "
                            f"{type(self.vit_namespace).__name__}")
        if self.relevance not in ("attention", "routing"):
            raise ValueError(f"RequestOptions.relevance must be 'attention' or 'routing', got {self.relevance!r}")
        if self.compression is not None and not isinstance(self.compression, CompressionSettings):
            raise TypeError(f"RequestOptions.compression must be CompressionSettings or None, got "
                            f"{type(self.compression).__name__}")


@dataclass
class Prepared:
    """A request after stage 1: its sequence holds every reused KV; ``step`` says what to compute."""

    seq: int
    prompt: Prompt
    namespace: Namespace
    options: RequestOptions
    plan: ReusePlan
    step: SequenceStep
    metrics: TurnMetrics
    vit: dict[int, tuple] = field(default_factory=dict)  # image index -> ViT output used this turn
    hashed: bool = False  # some of its blocks were hashed into the prefix cache
    load: TierLoad | None = None  # images' KV still loading from a lower tier into the sequence
    loaded: dict = field(default_factory=dict)  # key -> (Fetched, check): those images
    compaction: Compaction | None = None  # compressed images: which tokens each layer still holds
    compressed_from: int | None = None  # the first compressed image's start (later KV is compacted)


class Executor:
    """Stages of serving requests over ``runner`` (weights, KV caches), ``pool`` (blocks and the
    prefix cache) and the stores (ViT outputs, image KV)."""

    def __init__(self, runner: ModelRunner, pool: BlockPool, vit: VitChain, *, image_kv_store: ImageKVStore,
                 contexts: ContextTree | None = None, prefix_tier: PrefixTier | None = None,
                 isolated: IsolatedImages | None = None) -> None:
        self.runner = runner
        self.isolated = isolated  # a model whose images attend in isolation: every image computed alone
        self.pool = pool
        self.vit = vit  # ViT outputs: device, host, disk, the shared store
        self.image_kv_store = image_kv_store
        self.contexts = contexts  # held sessions' KV, given up under pressure after cached images
        self.tiers = TierIO(runner, pool, image_kv_store, prefix_tier)  # KV to and from the tiers below the pool
        self.compressed = CompressedKV(runner, pool, image_kv_store, self.tiers)  # compressed images' KV

    # ---- stage 1 -------------------------------------------------------------------------------
    def layout(self, prompt: Prompt, namespace: Namespace, options: RequestOptions | None = None) -> PromptLayout:
        """The planner's view of ``prompt``: images keyed as their KV is (:meth:`image_kv_key`)."""
        return PromptLayout(len(prompt), tuple(
            ImageSlot(s.index, s.start, s.length, self.image_kv_key(namespace, s, options),
                      int(prompt.positions[0, s.start]))
            for s in prompt.images))

    @staticmethod
    def image_kv_key(namespace: Namespace, span, options: RequestOptions | None = None) -> ContentKey:
        """The key of an image's KV: its namespaced content, and with ``options.keep_image_order``
        its index among the prompt's images too. (ViT outputs are keyed by content alone: they do
        not depend on where the image is.)"""
        return image_key(namespace, span.image.content, span.index, options is not None and options.keep_image_order)

    @staticmethod
    def prefix_space(namespace: Namespace, options: RequestOptions) -> Namespace:
        """The namespace a request's blocks are hashed under: its own, or for requests that accept
        approximate KV a derived one (no model id holds a NUL), so the two never share blocks."""
        if not options.approximate_prefix:
            return namespace
        return Namespace(namespace.model_id + "\x00approximate-prefix", namespace.tenant)

    def kv_check(self, span, compression: CompressionSettings | None = None, *, prompt: Prompt | None = None) -> tuple:
        """What an image's KV record must match: its grid, token count and the model's depth, for
        a compressed record the compression settings it was made with, and for an isolated model
        the variant and the sink token of ``prompt`` (required then)."""
        base = (span.image.grid, span.length, self.runner.num_layers)
        if self.isolated is not None:
            if prompt is None:
                raise ValueError("an isolated model's image KV check needs the prompt (its sink token)")
            base = (*base, self.isolated.check(prompt))
        return base if compression is None else (*base, ("compressed", compression))

    def prepare(self, prompt: Prompt, namespace: Namespace, options: RequestOptions) -> Prepared:
        pool, runner = self.pool, self.runner
        bs, n = pool.block_size, len(prompt)
        m = TurnMetrics(prompt_tokens=n, images=len(prompt.images))
        seq = pool.new_sequence(self.prefix_space(namespace, options))
        adopted, hashed = 0, False
        pinned: list = []
        loaded: dict = {}  # key -> (Fetched, check): images this turn takes from a lower tier
        load: TierLoad | None = None
        fresh: dict = {}  # isolated model: key -> HeldImage of the images computed alone this turn
        sides: list[int] = []  # ... and their side sequences, freed once spliced
        try:
            if options.use_prefix and n > 1:  # never the last token: its logits are this step's output
                adopted = pool.adopt_prefix(seq, prompt.token_ids[: n - 1], prompt.extra_keys(n - 1))
                if self.tiers.prefix_tier is not None:
                    adopted = self.tiers.restore_prefix(seq, prompt, adopted, self.prefix_space(namespace, options), m)
            layout = self.layout(prompt, namespace, options)
            held: dict[Any, HeldImage] = {}

            def lookup(slot: ImageSlot) -> tuple[CachedImage, Any] | None:
                """The pool's entry of an image, else one a lower tier holds (loaded during the step)."""
                check = self.kv_check(prompt.images[slot.index], options.compression, prompt=prompt)
                h = self.image_kv_store.get(slot.key, check=check)
                if h is not None and h.packed and slot.start < adopted:
                    h = None  # a compressed record is spliced whole or not at all
                if h is not None:
                    if self.image_kv_store.pin(slot.key):
                        pinned.append(slot.key)  # making room below must not evict it
                    held[slot.key] = h
                    return CachedImage(h.length, h.position, h.index, h.exact), h
                # Compacted layers need every spliced image in place before the step: no layer-by-layer loads.
                if self.tiers.transfer is not None and options.compression is None:
                    got = self.tiers.fetch(slot.key, namespace, check, m)
                    if got is not None:
                        loaded[slot.key] = (got, check)
                        return CachedImage(int(got.kv.shape[2]), got.position), got
                return None

            if self.isolated is not None and prompt.images and not options.image_segment:
                request, fresh, sides = self._plan_isolated(prompt, layout, adopted, lookup, held, namespace, options, m)
            else:
                request = plan_request(layout, prefix_tokens=adopted, lookup=lookup if options.use_image_kv else None,
                                       budget=options.budget, num_layers=runner.num_layers)
                m.image_kv_hits, m.image_kv_misses = request.hit_images, len(request.misses)
            plan = request.plan
            compress = self.compressed.compressible(prompt, plan) if options.compression is not None else []
            packed = [s for s in plan.spliced if layout.images[s.image].key in held
                      and held[layout.images[s.image].key].packed]
            compaction = self.compressed.compaction(packed, held, layout) if packed or compress else None
            starts = [s.start for s in packed] + [start for start, _ in compress]
            compressed_from = min(starts) if starts else None
            self._allocate(seq, prompt, adopted, plan, options, compressed_from)
            hashed = options.register_prefix and (options.approximate_prefix or plan.exact_tokens > adopted)
            table = pool.block_table(seq)
            from_pool = [s for s in plan.spliced if layout.images[s.image].key in held]
            if from_pool and (packed or (compaction is not None and compaction.active)):
                self.compressed.splice(from_pool, held, layout, table, compaction)
            elif from_pool:  # every image the pool holds, re-rotated into place, in one call
                src = [self.image_kv_store.slots(held[layout.images[s.image].key], s.offset, s.length)
                       for s in from_pool]
                dst = [slot_ids(table, np.arange(s.start, s.end), bs) for s in from_pool]
                deltas = np.concatenate([np.full(s.length, s.delta, dtype=np.int64) for s in from_pool])
                runner.splice(np.concatenate(src), np.concatenate(dst), deltas)
            if sides:
                self._keep_isolated(prompt, layout, fresh, namespace, options)
                sides = self._free(sides)
            load = self.tiers.start_load(layout, plan, loaded, table, namespace)
            # ViT outputs: images with new tokens, and (when some of their tokens may be recomputed)
            # the spliced ones; one batched vision-tower call for all misses.
            wanted = set(plan.vit_images)
            if plan.recompute is not None:
                wanted |= {s.image for s in plan.spliced}
            vit: dict[int, tuple] = {}
            self.vit.ensure(prompt, sorted(wanted), vit, m, options, namespace)
            if plan.needs_scores and options.relevance == "routing":
                plan = plan.with_scores(self.compressed.routing_relevance(prompt, packed, held, layout))
            elif plan.needs_scores:
                if load is not None:
                    load.finish()  # scoring reads the spliced keys
                plan = plan.with_scores(self.relevance(prompt, plan, table, vit))
            replays = []
            if packed and plan.recompute is not None:
                plan, replays = self.compressed.close_groups(plan, packed, held, layout, compaction)
            inject = []
            if self.isolated is not None and self.isolated.context_from is not None and not options.image_segment:
                layer_rows, inject = self.isolated.top_layers(plan, layout, held)
                plan = replace(plan, layer_rows=layer_rows)
            step = self.sequence_step(prompt, plan, table, vit, inject)
            if load is not None:
                step.before_layer = load.before_layer
            if compaction is not None:
                step.compaction, step.compress, step.compression = compaction, compress, options.compression
                step.replays = replays
        except BaseException:
            if load is not None:
                load.release()  # no copy may land in blocks freed below
            self.tiers.give_back(loaded, namespace)
            self._free(sides)
            self.discard(seq, table_from=adopted // bs, hashed=hashed)
            raise
        finally:
            for key in pinned:
                self.image_kv_store.unpin(key)
        m.prefix_reused_tokens = adopted
        m.image_reused_tokens = sum(s.length for s in plan.spliced if layout.images[s.image].key not in fresh)
        m.prefilled_tokens = int(plan.new_rows.size)
        m.recomputed_tokens = plan.recomputed_tokens
        m.recomputed_token_layers = plan.recomputed_token_layers
        if step.replays:  # closed over compressed records' groups: count what is computed
            m.recomputed_tokens = int(np.setdiff1d(plan.rows, plan.new_rows).size)
            m.recomputed_token_layers = sum(int(np.setdiff1d(r, plan.new_rows).size) for r in plan.layer_rows)
        m.recompute_rates = plan.recompute_rates
        if step.inject:  # isolated in the lower layers only: the spliced images' top layers, in context
            m.recomputed_token_layers += sum(len(positions) for _, positions, _ in step.inject) * (
                runner.num_layers - self.isolated.context_from)
        m.exact_tokens = plan.exact_tokens
        return Prepared(seq, prompt, namespace, options, plan, step, m, vit, hashed, load, loaded, step.compaction,
                        compressed_from)

    def _plan_isolated(self, prompt: Prompt, layout: PromptLayout, adopted: int, lookup, held: dict,
                       namespace: Namespace, options: RequestOptions, m: TurnMetrics):
        """The plan of an isolated model's request: every image past the prefix spliced, from the
        caches where they hold it, else computed alone now (:class:`IsolatedImages`), nothing
        recomputed. Returns the request plan, the images computed alone (key -> HeldImage, also in
        ``held``) and their side sequences."""
        found: dict = {}
        missing: list[ImageSlot] = []  # the first slot of each image no cache holds
        top = self.isolated.context_from is not None
        for slot in layout.images:
            if slot.end > adopted and slot.key not in found:
                got = lookup(slot) if options.use_image_kv else None
                if got is not None and top and getattr(got[1], "hidden", None) is None:
                    got = None  # the top layers need the image's input to them (not kept by the tiers below)
                found[slot.key] = got
                if got is None:
                    missing.append(slot)
        side_options = RequestOptions(use_prefix=False, use_image_kv=False, register_prefix=False, store_images=False,
                                      use_vit=options.use_vit, vit_namespace=options.vit_namespace,
                                      store_vit=options.store_vit, image_segment=True)
        computed, sides = self.isolated.compute(self, prompt, [prompt.images[s.index] for s in missing], namespace,
                                                side_options, m)
        fresh = {}
        for slot in missing:
            h = computed[slot.index]
            fresh[slot.key] = held[slot.key] = h
            found[slot.key] = (CachedImage(h.length, h.position, None, True), h)
        request = plan_request(layout, prefix_tokens=adopted, lookup=lambda slot: found[slot.key], budget=None,
                               num_layers=self.runner.num_layers)
        m.image_kv_hits, m.image_kv_misses = request.hit_images - len(missing), len(missing)
        return request, fresh, sides

    def _keep_isolated(self, prompt: Prompt, layout: PromptLayout, fresh: dict, namespace: Namespace,
                       options: RequestOptions) -> None:
        """Keep the images computed alone this turn in the image-KV store (exact records)."""
        if not (options.store_images and options.use_image_kv):
            return
        for slot in layout.images:
            h = fresh.get(slot.key)
            if h is None or slot.key in self.image_kv_store:
                continue
            self.image_kv_store.put(slot.key, h.seq, h.offset, h.length, h.position,
                                    check=self.kv_check(prompt.images[slot.index], prompt=prompt), namespace=namespace,
                                    exact=True, hidden=h.hidden)

    def _free(self, seqs: list[int]) -> list[int]:
        for seq in seqs:
            self.pool.free_sequence(seq)
        return []

    def fork_prefilled(self, pre: Prepared) -> int:
        """A sequence holding ``pre``'s prefill KV, to decode beside it. Compacted layers write a
        decode token into earlier blocks than its position's, so from the first compressed block
        on the fork gets copies of the blocks, not shared ones."""
        if pre.compaction is None or not pre.compaction.active:
            return self.pool.fork(pre.seq)
        pool, bs = self.pool, self.pool.block_size
        shared = pre.compressed_from // bs
        self._make_room(len(pool.block_table(pre.seq)) - shared, "a copy of the compressed prefill", OutOfBlocks)
        fork = pool.share_blocks(pre.seq, 0, shared) if shared else pool.new_sequence()
        try:
            res = pool.append_slots(fork, pool.num_tokens(pre.seq) - shared * bs)
            self.runner.copy_on_write(res.copies)
            table = pool.block_table(fork)
            source = pool.block_table(pre.seq)
            self.runner.copy_on_write(np.stack([source[shared:], table[shared:]], axis=1))
        except BaseException:
            pool.free_sequence(fork)
            raise
        return fork

    def _allocate(self, seq: int, prompt: Prompt, adopted: int, plan: ReusePlan, options: RequestOptions,
                  compressed_from: int | None = None) -> None:
        """Blocks for tokens ``[adopted, n)``: the exact part hashed into the prefix cache (if asked),
        the approximate rest not (``append_slots`` makes the sequence uncacheable from there), nor
        anything from the first compressed image on (its blocks hold compacted rows)."""
        pool, bs, n = self.pool, self.pool.block_size, len(prompt)
        self._make_room(-(-n // bs) - adopted // bs, "the prompt", OutOfBlocks)  # others hold them now
        exact_until = n if options.approximate_prefix else max(adopted, plan.exact_tokens)
        if compressed_from is not None:
            exact_until = max(adopted, min(exact_until, compressed_from))
        hash_until = exact_until if options.register_prefix else adopted
        if hash_until > adopted:
            res = pool.append_tokens(seq, prompt.token_ids[adopted:hash_until], prompt.extra_keys())
            self.runner.copy_on_write(res.copies)
        if n > hash_until:
            res = pool.append_slots(seq, n - hash_until)
            self.runner.copy_on_write(res.copies)

    def _make_room(self, need: int, what: str, error: type[Exception]) -> None:
        """Room for ``need`` more blocks, found the same way for a prefill, a decode step or a
        copy: release cached images, then released contexts' holds, then move the cached blocks
        the pool will evict down to the prefix tier. ``error`` (naming ``what``) if still short."""
        pool = self.pool
        if need > pool.num_free_blocks():
            self.image_kv_store.evict_for_blocks(need)
        if need > pool.num_free_blocks() and self.contexts is not None:
            self.contexts.release_for_blocks(need)
        if need > pool.num_free_blocks():
            raise error(f"{what} needs {need} more KV blocks but only {pool.num_free_blocks()} are free or evictable")
        self.tiers.demote_for(need)

    def _blocks_opened(self, seq: int, tokens: int) -> int:
        """Blocks that appending ``tokens`` to ``seq`` takes: the ones the tokens open, plus a
        copy of the last block where it is shared and not full (copy-on-write)."""
        pool, bs = self.pool, self.pool.block_size
        n0 = pool.num_tokens(seq)
        opened = -(-(n0 + tokens) // bs) - -(-n0 // bs)
        table = pool.block_table(seq)
        if n0 % bs and len(table) and pool.refcount(int(table[-1])) > 1:
            opened += 1
        return opened

    def _image_rows(self, prompt: Prompt, index: np.ndarray):
        """For each image with tokens among the (sorted) rows ``index``: (image, lo, hi, offsets),
        rows [lo, hi) being its tokens at ``offsets`` within the image (on the model's device)."""
        for i, span in enumerate(prompt.images):
            lo, hi = np.searchsorted(index, [span.start, span.end])
            if hi > lo:
                yield i, lo, hi, torch.from_numpy(index[lo:hi] - span.start).to(self.runner.device)

    def embeds(self, prompt: Prompt, index: np.ndarray, vit: dict) -> torch.Tensor:
        """Layer-0 inputs of prompt rows ``index`` (token embeddings, ViT outputs for image tokens)."""
        r = self.runner
        out = r.embed_tokens(torch.from_numpy(prompt.token_ids[index].astype(np.int64))).to(r.dtype)
        for i, lo, hi, offsets in self._image_rows(prompt, index):
            out[lo:hi] = vit[i][0][offsets]
        return out

    def relevance(self, prompt: Prompt, plan: ReusePlan, table: np.ndarray, vit: dict) -> np.ndarray:
        """Track-2 scores: attention of the prompt's last new tokens (at the first layer, whose KV of
        reused tokens is exact after re-rotation) on every reused token."""
        scores = np.zeros(len(prompt), dtype=np.float64)
        queries = plan.new_rows[-_RELEVANCE_QUERIES:]
        reused = span_positions(plan.reused_spans)
        if not queries.size or not reused.size:
            return scores
        r = self.runner
        q = r.layer0_queries(self.embeds(prompt, queries, vit), prompt.positions[:, torch.from_numpy(queries)])
        keys = r.layer_keys(0, slot_ids(table, reused, self.pool.block_size))
        scores[reused] = attention_relevance(q, keys).double().cpu().numpy()
        return scores

    def attention_sample(self, pre: Prepared, queries: int = 8) -> dict[Any, float]:
        """Attention mass that the prompt's last ``queries`` text tokens put, at the first layer, on
        each image (its namespaced content key) and on the rest of the context (key ``None``): a
        cheap sample for attention-aware eviction, read from the KV the turn already wrote."""
        prompt, bs = pre.prompt, self.pool.block_size
        n = len(prompt)
        in_image = np.zeros(n, dtype=bool)
        for s in prompt.images:
            in_image[s.start:s.start + s.length] = True
        rows = np.flatnonzero(~in_image)[-queries:]
        if not prompt.images or not rows.size:
            return {}
        r = self.runner
        with torch.no_grad():
            q = r.layer0_queries(self.embeds(prompt, rows, pre.vit), prompt.positions[:, torch.from_numpy(rows)])
            keys = r.layer_keys(0, slot_ids(self.pool.block_table(pre.seq), np.arange(n), bs))
            mass = attention_relevance(q, keys).double().cpu().numpy()
        out: dict[Any, float] = {None: float(mass[~in_image].sum())}
        for s in prompt.images:
            key = self.image_kv_key(pre.namespace, s, pre.options)
            out[key] = out.get(key, 0.0) + float(mass[s.start:s.start + s.length].sum())
        return out

    def sequence_step(self, prompt: Prompt, plan: ReusePlan, table: np.ndarray, vit: dict,
                      inject: list | None = None) -> SequenceStep:
        """The forward's input for ``plan``, which must be complete: its declared second phase
        (relevance scores, ``plan.needs_scores``) done. Only a choice the plan declares to happen in
        the forward (``plan.select_layer``) is left to it. ``inject``: (layer, positions, hidden)
        rows that start at a later layer from a given input (their layer-0 input is not computed)."""
        if plan.needs_scores:
            raise RuntimeError("the reuse plan is incomplete: its repair order needs relevance scores "
                               "(ReusePlan.with_scores) before the forward may run it")
        rows = plan.rows
        if inject:
            rows = np.union1d(rows, np.concatenate([positions for _, positions, _ in inject]))
            embeds = torch.zeros((rows.size, self.runner.hidden_size), dtype=self.runner.dtype, device=self.runner.device)
            first = plan.layer_rows[0]
            embeds[torch.from_numpy(np.searchsorted(rows, first)).to(embeds.device)] = self.embeds(prompt, first, vit)
        else:
            embeds = self.embeds(prompt, rows, vit)
        step = SequenceStep(
            rows=rows, embeds=embeds, positions=prompt.positions[:, torch.from_numpy(rows)],
            block_table=table, num_kv_tokens=len(prompt),
            layer_rows=None if all(r.size == rows.size for r in plan.layer_rows) else list(plan.layer_rows),
            inject=inject or None,
        )
        if plan.select_layer is not None and step.layer_rows is not None:
            step.select = self.row_selection(plan)
        if self.runner.deepstack_layers:
            ds_rows = np.full(rows.size, -1, dtype=np.int64)
            feats: list[list[torch.Tensor]] = [[] for _ in range(self.runner.deepstack_layers)]
            count = 0
            for i, lo, hi, offsets in self._image_rows(prompt, rows):
                ds_rows[lo:hi] = np.arange(count, count + hi - lo)
                count += hi - lo
                for layer, f in enumerate(vit[i][1]):
                    feats[layer].append(f[offsets])
            if count:
                step.deepstack_rows = ds_rows
                step.deepstack_features = [torch.cat(f) for f in feats]
        return step

    @staticmethod
    def row_selection(plan: ReusePlan) -> RowSelection | None:
        """The second phase of a plan whose repair method picks rows in the forward: at
        ``plan.select_layer`` the reused tokens' key deviations order them (the method's order with
        those scores), and each later layer computes the new rows and the first of that order."""
        layer, method = plan.select_layer, plan.budget.method
        if layer is None or layer + 1 >= plan.num_layers:
            return None
        spans, quota, new_rows = plan.reused_spans, plan.recompute.quota, plan.new_rows
        positions = span_positions(spans)

        def choose(deviation: np.ndarray) -> list[np.ndarray]:
            scores = np.zeros(plan.num_tokens, dtype=np.float64)
            scores[positions] = deviation
            order = method.order(spans, quota, scores)
            return [np.union1d(new_rows, order.positions(l)) for l in range(layer + 1, plan.num_layers)]

        return RowSelection(layer, positions, choose)

    # ---- stage 2 -------------------------------------------------------------------------------
    def forward(self, steps: Sequence[SequenceStep], *, every_row: bool = False) -> torch.Tensor:
        """One forward step over these sequences: logits [len(steps), vocab] of their last rows,
        or with ``every_row`` (one sequence) logits [rows, vocab] of each row it computes."""
        r = self.runner
        steps = list(steps)
        if every_row and len(steps) != 1:
            raise ValueError(f"every_row takes one sequence's step, got {len(steps)}")
        decoding = [i for i, s in enumerate(steps) if s.embeds is None]
        if decoding:  # decode rows give token ids: one embedding call for all of them
            ids = np.concatenate([steps[i].token_ids for i in decoding]).astype(np.int64)
            embeds = r.embed_tokens(torch.from_numpy(ids))
            at = 0
            for i in decoding:
                n = steps[i].token_ids.size
                steps[i] = replace(steps[i], embeds=embeds[at: at + n])
                at += n
        batch = StepBatch.build(steps, num_layers=r.num_layers, block_size=self.pool.block_size, device=r.device)
        if every_row:
            if batch.layers.count(None) != len(batch.layers):
                raise ValueError("every_row needs a step that computes all its rows at every layer")
            batch.logit_rows = batch.all_rows.index
        logits = r.forward(batch)
        for step, captured in zip(batch.steps, batch.captured):
            if captured is not None:
                step.captured = captured
        return logits

    def prefill(self, prompt: Prompt, namespace: Namespace, options: RequestOptions) -> tuple[Prepared, torch.Tensor]:
        """Stages 1 and 2 of one request, nothing registered: its prepared sequence (the caller
        frees ``prepared.seq``) and next-token logits. A failed forward step drops the sequence."""
        pre = self.prepare(prompt, namespace, options)
        try:
            logits = self.forward([pre.step])[0]
        except BaseException:
            self.discard_prepared(pre)
            raise
        self.tiers.give_back(self.tiers.finish_load(pre), pre.namespace)  # nothing registered: they go back down
        self.compressed.note_metrics(pre)
        return pre, logits

    # ---- stage 3 -------------------------------------------------------------------------------
    def register(self, pre: Prepared) -> None:
        """Keep the KV of every image this turn computed in full, or loaded whole from a lower
        tier (held in its blocks), for reuse at any position."""
        self.tiers.publish_prefix(pre, self.prefix_space(pre.namespace, pre.options))
        loaded = self.tiers.finish_load(pre)
        self.compressed.note_metrics(pre)
        if not (pre.options.store_images and pre.options.use_image_kv):
            self.tiers.give_back(loaded, pre.namespace)
            return
        for span in pre.prompt.images:  # promoted: the pool holds them again, at this turn's positions
            key = self.image_kv_key(pre.namespace, span, pre.options)
            if key in loaded and span.start >= pre.plan.prefix_tokens and key not in self.image_kv_store:
                position = int(pre.prompt.positions[0, span.start])
                if self.image_kv_store.put(key, pre.seq, span.start, span.length, position, check=loaded[key][1],
                                           namespace=pre.namespace):
                    del loaded[key]
        self.tiers.give_back(loaded, pre.namespace)
        spliced = {s.image for s in pre.plan.spliced}
        for span in pre.prompt.images:
            if span.index in spliced or span.start < pre.plan.prefix_tokens:
                continue  # its KV came from a cache: already held (or part of an adopted prefix)
            if pre.compressed_from is not None and span.start >= pre.compressed_from:
                if span.start in dict(pre.step.compress or ()):
                    self.compressed.store(pre, span, self.image_kv_key(pre.namespace, span, pre.options),
                                          self.kv_check(span, pre.options.compression, prompt=pre.prompt))
                continue  # compacted rows from here on: not one image's KV at its own slots
            key, check = self.image_kv_key(pre.namespace, span, pre.options), self.kv_check(span, prompt=pre.prompt)
            if key in self.image_kv_store:
                continue
            position = int(pre.prompt.positions[0, span.start])
            seq, start, index = pre.seq, span.start, span.index
            if pre.options.isolated_images:
                try:
                    seq, start, index = self._isolated(pre, span), 1, None
                except (OutOfBlocks, PromptTooLong):
                    pass  # no room to compute it alone now: keep the turn's own KV (its index says where it was)
            try:
                self.image_kv_store.put(key, seq, start, span.length, position, check=check,
                                        namespace=pre.namespace, index=index)
                lower = self.image_kv_store.lower
                if lower is not None and lower.remote is not None:  # what this instance computed, others reuse
                    table = self.pool.block_table(seq)
                    kv = self.runner.read_kv(slot_ids(table, np.arange(start, start + span.length),
                                                      self.pool.block_size))
                    lower.publish(pre.namespace, key, kv, position, check)
            finally:
                if seq != pre.seq:
                    self.pool.free_sequence(seq)  # the store shares the blocks it keeps

    def _isolated(self, pre: Prepared, span) -> int:
        """A sequence holding image ``span``'s KV computed without left context: its frame token
        (the one before it, ``<|vision_start|>``) and its tokens, at their positions in the turn
        (re-rotation moves them anyway). The caller frees it."""
        prompt, lo = pre.prompt, span.start - 1
        if lo < 0:
            raise ValueError("an isolated image needs its frame token before it")
        alone = Prompt(token_ids=prompt.token_ids[lo:span.end].copy(), positions=prompt.positions[:, lo:span.end],
                       images=[ImageSpan(0, 1, span.length, span.image)],
                       next_position=int(prompt.positions[:, span.end - 1].max()) + 1)
        options = RequestOptions(use_prefix=False, use_image_kv=False, register_prefix=False, store_images=False,
                                 use_vit=pre.options.use_vit, vit_namespace=pre.options.vit_namespace, store_vit=False)
        side = self.prepare(alone, pre.namespace, options)
        try:
            self.forward([side.step])
        except BaseException:
            self.discard_prepared(side)
            raise
        pre.metrics.isolated_tokens += len(alone)
        return side.seq

    # ---- decode ----------------------------------------------------------------------------------
    def decode_step(self, seq: int, token: int, position: int, hashed: bool,
                    compaction: Compaction | None = None) -> SequenceStep:
        """Append ``token`` to ``seq`` (hashed into the prefix cache if ``hashed`` and the sequence
        is still exact) at M-RoPE position ``position``: the row a decode step computes.
        ``compaction``: the sequence's compacted layers (its prefill's :attr:`Prepared.compaction`)."""
        r, pool = self.runner, self.pool
        self._make_room(self._blocks_opened(seq, 1), "a decode step", OutOfBlocks)
        res = pool.append_tokens(seq, [token]) if hashed else pool.append_slots(seq, 1)
        r.copy_on_write(res.copies)
        n = pool.num_tokens(seq)
        return SequenceStep(rows=np.array([n - 1]), embeds=None, token_ids=np.array([token]),
                            positions=torch.full((3, 1), position, dtype=torch.int64),
                            block_table=pool.block_table(seq), num_kv_tokens=n, compaction=compaction)

    def forced_step(self, seq: int, tokens: Sequence[int], position: int) -> SequenceStep:
        """Append ``tokens`` to ``seq`` (not hashed) at M-RoPE positions ``position``,
        ``position + 1``, ...: one step computing them all, the rows greedy decoding fed these
        tokens would compute one at a time (teacher forcing; ``forward(..., every_row=True)``
        gives each row's logits)."""
        if not len(tokens):
            raise ValueError("a forced step needs at least one token")
        pool = self.pool
        n0 = pool.num_tokens(seq)
        self._make_room(self._blocks_opened(seq, len(tokens)), "a forced step", OutOfBlocks)
        self.runner.copy_on_write(pool.append_slots(seq, len(tokens)).copies)
        n = pool.num_tokens(seq)
        return SequenceStep(rows=np.arange(n0, n), embeds=None, token_ids=np.asarray(tokens, dtype=np.int64),
                            positions=(position + torch.arange(len(tokens), dtype=torch.int64)).expand(3, -1).clone(),
                            block_table=pool.block_table(seq), num_kv_tokens=n)

    # ---- failures --------------------------------------------------------------------------------
    def discard_prepared(self, pre: Prepared) -> None:
        """Drop a prepared request whose forward step did not complete (its adopted prefix stays)."""
        self.tiers.give_back(self.tiers.finish_load(pre), pre.namespace)
        self.discard(pre.seq, table_from=pre.plan.prefix_tokens // self.pool.block_size, hashed=pre.hashed)

    def discard(self, seq: int, *, table_from: int, hashed: bool) -> None:
        """Drop a sequence whose KV may be incomplete, so no later request adopts its blocks from
        block ``table_from`` on."""
        try:
            blocks = self.pool.block_table(seq)[table_from:]
        except Exception:  # noqa: BLE001 - the sequence is already gone
            return
        cached = [int(b) for b in blocks if hashed and self.pool.block_hash(int(b)) is not None]
        if cached:
            self.pool.set_block_priority(np.asarray(cached, dtype=np.int32), _LOWEST)
        self.pool.free_sequence(seq)
        # Ours that are now cached and unreferenced (a duplicate of a block cached elsewhere was
        # freed and lost its hash; one still shared stays): evicted first, being lowest priority.
        ours = [b for b in cached if self.pool.refcount(b) == 0 and self.pool.block_hash(b) is not None]
        if ours:
            self.pool.evict(len(ours))

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.vit.check_invariants()
        self.image_kv_store.check_invariants()


__all__ = ["Executor", "Prepared", "RequestOptions"]
