"""Moving KV between the pool and the tiers below it (:mod:`samcache.cache.tiers`), for the executor.

Image KV found in a lower tier loads straight into the new sequence's slots, layer by layer,
while the forward runs (:class:`TierLoad`); images fetched but not kept go back down. Cached
prefix blocks the pool is about to evict are copied to the prefix tier first, come back when a
prompt continues their prefix, and, with a shared store, the exact blocks a turn prefilled are
published there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from samcache.cache.block_pool import BlockPool, slot_ids
from samcache.engine.metrics import TurnMetrics
from samcache.engine.prompt import Prompt
from samcache.engine.runner import ModelRunner
from samcache.hashing import Namespace
from samcache.reuse import PromptLayout, ReusePlan
from samcache.cache.stores import ImageKVStore
from samcache.cache.tiers.lower import Fetched
from samcache.cache.tiers.prefix import PrefixTier
from samcache.cache.tiers.transfer import LayerLoad, TransferEngine

if TYPE_CHECKING:
    from samcache.engine.executor import Prepared


class TierLoad:
    """Images' KV loading from a lower tier straight into a sequence's slots, layer by layer: before
    layer l runs, :meth:`before_layer` waits for layer l's copy and re-rotates its keys in place to
    the new positions. Idempotent per layer (a step may be run twice, e.g. for fidelity)."""

    def __init__(self, runner: ModelRunner, load: LayerLoad, slots: np.ndarray, deltas: np.ndarray) -> None:
        self.runner, self.load, self.slots, self.deltas = runner, load, slots, deltas
        self._moved = bool(np.any(deltas))
        self._done: set[int] = set()

    def before_layer(self, layer: int) -> None:
        if layer in self._done:
            return
        self.load.wait(layer)
        if self._moved:
            self.runner.splice(self.slots, self.slots, self.deltas, layers=(layer,))
        self._done.add(layer)

    def finish(self) -> None:
        """Every layer in place now (for what reads the KV before the forward)."""
        for layer in range(self.runner.num_layers):
            self.before_layer(layer)

    def release(self) -> None:
        self.load.release()


class TierIO:
    """The executor's traffic with the tiers: ``image_kv_store.lower`` (image KV in host memory,
    on disk, in a shared store; None: no tier) and ``prefix_tier`` (evicted prefix blocks)."""

    def __init__(self, runner: ModelRunner, pool: BlockPool, image_kv_store: ImageKVStore,
                 prefix_tier: PrefixTier | None = None) -> None:
        self.runner = runner
        self.pool = pool
        self.image_kv_store = image_kv_store
        self.prefix_tier = prefix_tier
        # Hits in the tiers below the pool load into the sequence layer by layer (TierLoad).
        self.transfer = (TransferEngine(runner.k_cache, runner.v_cache)
                         if image_kv_store.lower is not None else None)

    def fetch(self, key, namespace: Namespace, check, m: TurnMetrics) -> Fetched | None:
        """An image's KV from the tiers below the pool (None: no tier has it)."""
        got = self.image_kv_store.lower.fetch(namespace, key, check)
        if got is not None:
            if got.tier == "host":
                m.image_kv_host_hits += 1
            elif got.tier == "disk":
                m.image_kv_disk_hits += 1
            else:
                m.image_kv_remote_hits += 1
        return got

    def start_load(self, layout: PromptLayout, plan: ReusePlan, loaded: dict, table: np.ndarray,
                    namespace: Namespace) -> TierLoad | None:
        """Start loading the spliced spans of images fetched from a lower tier into the sequence's
        slots (one transfer job, layer by layer); images fetched but not spliced go back down."""
        spans = [s for s in plan.spliced if layout.images[s.image].key in loaded]
        used = {layout.images[s.image].key for s in spans}
        self.give_back({k: v for k, v in loaded.items() if k not in used}, namespace)
        for key in set(loaded) - used:
            del loaded[key]
        if not spans:
            return None
        bs = self.pool.block_size
        kv = torch.cat([loaded[layout.images[s.image].key][0].kv[:, :, s.offset:s.offset + s.length] for s in spans],
                       dim=2)
        slots = np.concatenate([slot_ids(table, np.arange(s.start, s.end), bs) for s in spans])
        deltas = np.concatenate([np.full(s.length, s.delta, dtype=np.int64) for s in spans])
        return TierLoad(self.runner, self.transfer.load(kv, slots), slots, deltas)

    def give_back(self, loaded: dict, namespace: Namespace) -> None:
        """Fetched images this turn does not keep go back down a tier (a fetch takes them out of
        host memory)."""
        lower = self.image_kv_store.lower
        for key, (got, check) in loaded.items():
            lower.demote(namespace, key, got.kv, got.position, check)

    def demote_for(self, need: int) -> None:
        """Before ``need`` blocks are handed out: evict the cached blocks that would go and copy
        their KV to the prefix tier (the pool would evict them anyway, losing it)."""
        if self.prefix_tier is None:
            return
        short = need - int(self.pool.stats()["free_blocks"])
        if short <= 0:
            return
        ids, hashes = self.pool.evict_reporting(short)
        if not ids.size:
            return
        bs = self.pool.block_size
        kv = self.runner.read_kv((ids.astype(np.int64)[:, None] * bs + np.arange(bs)).reshape(-1))
        for i, h in enumerate(hashes):
            self.prefix_tier.put(h.tobytes(), kv[:, :, i * bs:(i + 1) * bs])

    def restore_prefix(self, seq: int, prompt: Prompt, adopted: int, space: Namespace, m: TurnMetrics) -> int:
        """Continue the adopted prefix with the blocks the prefix tier holds for the prompt's next
        block hashes (exact copies, registered again); the new adopted length."""
        pool, bs, n = self.pool, self.pool.block_size, len(prompt)
        hashes = pool.prefix_hashes(prompt.token_ids[: n - 1], prompt.extra_keys(n - 1), namespace=space)
        found = []
        for h in hashes[adopted // bs:]:
            kv = self.prefix_tier.take(h.tobytes())
            if kv is None:
                break
            found.append((h.tobytes(), kv))
        if not found:
            return adopted
        k = len(found)
        self.demote_for(k)
        if pool.num_free_blocks() < k:  # no room: back down, prefill as usual
            for h, kv in found:
                self.prefix_tier.put(h, kv)
            return adopted
        res = pool.append_tokens(seq, prompt.token_ids[adopted: adopted + k * bs], prompt.extra_keys())
        self.runner.copy_on_write(res.copies)
        self.runner.write_kv(res.slots, torch.cat([kv for _, kv in found], dim=2))
        m.prefix_restored_tokens += k * bs
        return adopted + k * bs

    def publish_prefix(self, pre: "Prepared", space: Namespace) -> None:
        """With a shared store under the prefix tier: publish the exact full blocks this turn
        prefilled (from the adopted prefix to where exact KV ends), by their prefix hashes."""
        tier = self.prefix_tier
        if tier is None or tier.remote is None or not pre.options.register_prefix or not pre.options.use_prefix:
            return
        pool, bs, prompt = self.pool, self.pool.block_size, pre.prompt
        n = len(prompt)
        exact = max(pre.plan.prefix_tokens, pre.plan.exact_tokens)
        if pre.compressed_from is not None:
            exact = min(exact, pre.compressed_from)
        first, last = pre.plan.prefix_tokens // bs, min(exact, n - 1) // bs
        if last <= first:
            return
        hashes = pool.prefix_hashes(prompt.token_ids[: n - 1], prompt.extra_keys(n - 1),
                                    namespace=space)
        todo = [b for b in range(first, min(last, len(hashes))) if not tier.published(hashes[b].tobytes())]
        if not todo:  # a prompt sent again: its blocks were offered before, read nothing
            return
        table = pool.block_table(pre.seq)
        kv = self.runner.read_kv(slot_ids(table, np.concatenate([np.arange(b * bs, (b + 1) * bs) for b in todo]), bs))
        tier.publish([(hashes[b].tobytes(), kv[:, :, i * bs:(i + 1) * bs]) for i, b in enumerate(todo)])

    def finish_load(self, pre: "Prepared") -> dict:
        """Release the turn's tier load (after its forward, or when it is dropped), note its times;
        the images it loaded (key -> (Fetched, check)), for the caller to keep or send back."""
        if pre.load is not None:
            pre.load.release()
            pre.metrics.tier_load_s = pre.load.load.copy_seconds
            pre.metrics.tier_load_wait_s = pre.load.load.waited_seconds
            pre.load = None
        loaded, pre.loaded = pre.loaded, {}
        return loaded
