"""SamcacheConnector: samcache's reuse as a vLLM v1 KV connector.

Enabled with ``--kv-transfer-config '{"kv_connector": "SamcacheConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {...}}'`` (:class:`~.config.SamcacheVllmConfig` lists the keys).

- Scheduler side: tracks each request's blocks, images (vLLM identifiers = samcache content keys,
  :mod:`.identity`) and tenant (its ``cache_salt``), and sends the workers, per step, the prompt
  range scheduled for every request in which an image ends (:class:`~.step.RequestStep`). It
  claims no external prefix tokens: vLLM's own prefix cache serves the exact prefix.
- Worker side: holds the image-KV store (byte-bounded, least recently used first). At the start
  of the model's forward (:mod:`.model`) it plans the step (:func:`~.step.plan_forward`), writes
  the reused images' KV into vLLM's cache and tells the model which rows to compute; the attention
  backend hands it the new images' keys and values as each layer writes them
  (:meth:`SamcacheConnector.capture_layer_kv`), stored when the step ends (``wait_for_save``).

The plan is the worker's decision: an image the store no longer holds is computed as vLLM would,
so the scheduler's view of the store never has to be exact.

Approximate KV stays out of vLLM's prefix cache. vLLM hashes a request's full blocks into its
prefix cache when it schedules them, before the worker splices; a spliced image's KV (recompute
below 1) is approximate, and so is the KV of every token after it. The worker reports, per
request, the exact leading tokens of each such request (:class:`SamcacheWorkerMetadata`, vLLM's
worker-to-scheduler channel); the scheduler side then takes every block from the first
approximate one on out of the prefix cache (``KVCacheManager.evict_blocks``: a block the request
still uses stays its own, it only stops matching), again each step while the request decodes and
when it finishes. A later request with the same prefix is computed (or spliced again) rather
than served approximate KV as exact. The one window left: a request scheduled in the same step
as the splice, before the worker has run, may still match those blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole, KVConnectorWorkerMetadata)

from samcache.integrations.vllm.metrics import WorkerMetrics
from samcache.integrations.vllm.config import SamcacheVllmConfig, check_engine_config
from samcache.hashing import Namespace
from samcache.integrations.isolated_rows import IsolatedServing
from samcache.integrations.store_policy import StorePolicy
from samcache.integrations.vllm.identity import model_id
from samcache.integrations.vllm.step import (ForwardStep, ImageRef, RequestStep, Rotary, layer_index,
                                             plan_forward, request_images)
from samcache.reuse import RecomputeBudget, image_key
from samcache.cache.stores import TensorStore

logger = logging.getLogger("vllm.samcache")  # under vLLM's logger: its handlers and format


def active_worker() -> "SamcacheConnector | None":
    """This process's worker-side samcache connector: vLLM's own KV connector of the process when
    it is samcache's (None: the plugin is not enabled in this engine)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    connector = get_kv_transfer_group()
    return connector if isinstance(connector, SamcacheConnector) and connector.role == KVConnectorRole.WORKER else None


@dataclass
class SamcacheMetadata(KVConnectorMetadata):
    steps: list[RequestStep]


@dataclass
class SamcacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: the requests whose KV the step left approximate, each with
    its exact leading tokens."""

    approximate: dict[str, int]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = dict(self.approximate)
        for req_id, exact in getattr(other, "approximate", {}).items():
            merged[req_id] = min(exact, merged.get(req_id, exact))
        return SamcacheWorkerMetadata(merged)


@dataclass
class _Tracked:
    prompt_len: int
    images: tuple[ImageRef, ...]
    block_ids: list[int]
    tenant: str
    agent: str | None = None
    sink_token: int | None = None  # the prompt's first token


class SamcacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = SamcacheVllmConfig.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        check_engine_config(vllm_config)
        self.model_id = model_id(vllm_config)
        self._model_path = str(vllm_config.model_config.model)  # where its reuse profile is
        self._frame_token = getattr(vllm_config.model_config.hf_config, "vision_start_token_id", None)
        isolated = self.config.isolated_serving(self._model_path, self.config.reuse_profile(self._model_path, None),
                                                self._frame_token)
        scheduler = vllm_config.scheduler_config
        if isolated is not None and scheduler.enable_chunked_prefill and not scheduler.disable_chunked_mm_input:
            raise ValueError(f"samcache: {self._model_path} declares image attention {isolated.attention.name}: an "
                             "image split by a chunk boundary cannot be computed alone; serve it with "
                             "disable_chunked_mm_input=True (--disable-chunked-mm-input) or without chunked prefill")
        if role == KVConnectorRole.SCHEDULER:
            self._tracked: dict[str, _Tracked] = {}
            self._tenants: dict[str, str] = {}
            self._agents: dict[str, str | None] = {}
            self._track_agents = self.config.eviction_policy != "lru"
            self._block_size = int(vllm_config.cache_config.block_size)
            self._approximate: dict[str, int] = {}  # live requests with approximate KV -> exact tokens
            self._finished_blocks: dict[str, list[int]] = {}  # finished since the last schedule()
            if scheduler.enable_chunked_prefill and not scheduler.disable_chunked_mm_input:
                logger.info("samcache: chunked prefill is on; an image split by a chunk boundary is computed as "
                            "vLLM computes it (not reused, not saved)")
            return
        self.store = TensorStore("vllm-image-kv", self.config.store_bytes)
        self.policy = StorePolicy(self.config, self.store)
        self.metrics = WorkerMetrics()
        self._cache: VllmCacheWriter | None = None
        self._num_layers = 0
        self._rotary: Rotary | None = None
        self._budget: RecomputeBudget | None = None
        self._keep_order = False
        self._isolated: IsolatedServing | None = None
        self._step: ForwardStep | None = None
        self._reported: dict[str, int] = {}  # approximate requests not yet reported to the scheduler
        logger.info("samcache: vLLM plugin on (recompute %s, store %.1f MiB)",
                    list(self.config.recompute_rates) if self.config.recompute_rates else self.config.recompute_ratio,
                    self.config.store_bytes / 2**20)

    # ---------------------------------------------------------------- scheduler side
    def _tenant_of(self, request: Any) -> str:
        # A request's cache_salt is its tenant; the configured default is kept apart from any salt.
        salt = getattr(request, "cache_salt", None)
        return f"salt:{salt}" if salt else f"default:{self.config.tenant}"

    def _agent_of(self, request: Any) -> str | None:
        params = getattr(request, "kv_transfer_params", None) or {}
        agent = params.get("samcache_agent") if hasattr(params, "get") else None
        if agent is not None and (not isinstance(agent, str) or not agent):
            logger.warning("samcache: request %s: kv_transfer_params['samcache_agent'] must be a non-empty "
                           "string, got %r; the request counts as no agent's", request.request_id, agent)
            return None
        return agent

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._tenants[request.request_id] = self._tenant_of(request)
        if self._track_agents:
            self._agents[request.request_id] = self._agent_of(request)
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        # Every request admitted from waiting passes here (resumed ones and streamed sessions too).
        self._tenants[request.request_id] = self._tenant_of(request)
        if self._track_agents:
            self._agents[request.request_id] = self._agent_of(request)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._finished_blocks.clear()  # evicted by now where they had to be (update_connector_output)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            # A preempted request's blocks went back to the pool cached: none of its approximate ones may match.
            exact, tracked = self._approximate.pop(req_id, None), self._tracked.get(req_id)
            if exact is not None and tracked is not None:
                self._uncache(tracked.block_ids, exact)
        steps: list[RequestStep] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            # Every row's output is read when prompt logprobs or pooling are asked for: no rows skipped.
            sampling = new.sampling_params
            every_row = new.pooling_params is not None or (sampling is not None and sampling.prompt_logprobs is not None)
            images = () if every_row else tuple(ImageRef(f.identifier, f.mm_position.offset, f.mm_position.length)
                                                for f in new.mm_features if f.modality == "image")
            tenant = self._tenants.get(new.req_id)
            if tenant is None:  # never admitted through this connector: plan nothing for it
                images = ()
            tracked = _Tracked(len(new.prompt_token_ids or ()), images, list(new.block_ids[0]), tenant or "",
                               self._agents.get(new.req_id),
                               int(new.prompt_token_ids[0]) if new.prompt_token_ids else None)
            self._tracked[new.req_id] = tracked
            before = len(steps)
            self._add_step(steps, new.req_id, tracked, new.num_computed_tokens, scheduled.get(new.req_id, 0))
            if len(steps) == before and tracked.agent is not None:  # no image ends here: the agent still ran
                steps.append(RequestStep(new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0),
                                         (), (), tracked.tenant, tracked.agent))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                tracked.block_ids.extend(new_blocks[0])
            self._add_step(steps, req_id, tracked, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        return SamcacheMetadata(steps=steps)

    @staticmethod
    def _add_step(steps: list[RequestStep], req_id: str, tracked: _Tracked, start: int, num: int) -> None:
        end = min(start + num, tracked.prompt_len)
        # Every image up to the step's end, in prompt order: an image's index among them keys its KV
        # where the order is kept; a step is planned where an image ends in it.
        images = tuple(i for i in tracked.images if i.offset + i.length <= end)
        ends_here = any(start < i.offset + i.length for i in images)
        if ends_here and start + num <= tracked.prompt_len:  # prompt tokens only (no decode in the range)
            steps.append(RequestStep(req_id, start, num, tuple(tracked.block_ids), images, tracked.tenant,
                                     tracked.agent, tracked.sink_token))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, SamcacheWorkerMetadata):
            for req_id, exact in meta.approximate.items():
                finished = self._finished_blocks.get(req_id)
                if finished is not None:  # it finished in the step that spliced (request_finished came first)
                    self._uncache(finished, exact)
                else:
                    self._approximate[req_id] = min(exact, self._approximate.get(req_id, exact))
        manager = self._kv_cache_manager
        for req_id, exact in self._approximate.items():  # again each step: decode blocks fill and get cached
            if manager is not None and req_id in self._tracked:
                self._uncache(manager.get_block_ids(req_id)[0], exact)

    def _uncache(self, block_ids: list[int], exact_tokens: int) -> None:
        """Take the blocks from the one holding token ``exact_tokens`` on out of vLLM's prefix cache."""
        first = exact_tokens // self._block_size
        if self._kv_cache_manager is not None and first < len(block_ids):
            self._kv_cache_manager.evict_blocks(set(block_ids[first:]))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        exact = self._approximate.pop(request.request_id, None)
        if exact is not None:
            self._uncache(block_ids, exact)
        else:  # its report may come in this same update (the step that spliced also finished it)
            self._finished_blocks[request.request_id] = list(block_ids)
        self._tracked.pop(request.request_id, None)
        self._tenants.pop(request.request_id, None)
        self._agents.pop(request.request_id, None)
        return False, None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ordered = sorted(kv_caches.items(), key=lambda item: layer_index(item[0]))
        self._layer_of = {name: layer_index(name) for name, _ in ordered}
        self._cache = VllmCacheWriter([name for name, _ in ordered], [kv for _, kv in ordered])
        self._num_layers = len(ordered)
        self.metrics.set_gauges(num_layers=self._num_layers)
        profile = self.config.reuse_profile(self._model_path, self._num_layers)
        self._isolated = self.config.isolated_serving(self._model_path, profile, self._frame_token)
        if self._isolated is not None:  # exact at any index: nothing recomputed, the order kept only if asked
            self._budget, self._keep_order = None, self.config.keep_image_order is True
            logger.info("samcache: image attention %s: first-seen images computed alone, reused ones exact at any "
                        "index", self._isolated.attention.name)
        else:
            self._budget = self.config.budget(self._num_layers, profile)
            self._keep_order = self.config.keeps_image_order(self._num_layers, profile)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # the KV is written when the forward starts: it needs the step's M-RoPE positions

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def begin_forward(self, model: Any, positions: torch.Tensor) -> ForwardStep | None:
        """Plan this forward pass (called by the model with its positions); the step, or None."""
        self._step = None
        if self._cache is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        if not isinstance(meta, SamcacheMetadata) or not meta.steps:
            return None
        if self.policy.tracks:
            for s in meta.steps:
                namespace = Namespace(self.model_id, s.tenant)
                keys = [image_key(namespace, image.content, index, self._keep_order)
                        for index, image in enumerate(request_images(s)) if image.content is not None]
                self.policy.observe(s.req_id, s.agent, keys)
            self.policy.apply()  # before this step's images are stored (and others evicted)
        planned = [s for s in meta.steps if s.images]
        if not planned:
            return None
        from vllm.forward_context import get_forward_context

        attn = get_forward_context().attn_metadata
        if not isinstance(attn, dict) or not attn:
            return None
        if self._rotary is None:
            try:
                self._rotary = rotary_of(model)
            except ValueError as e:  # refused at start-up already; never take the engine down mid-service
                logger.error("%s: reuse disabled", e)
                self._cache = None
                return None
        first_layer = next(name for name, index in self._layer_of.items() if index == 0)
        self._step = plan_forward(planned, attn_metadata=attn.get(first_layer), positions=positions,
                                  cache=self._cache, rotary=self._rotary, store=self.store, model_id=self.model_id,
                                  budget=self._budget, num_layers=self._num_layers, keep_image_order=self._keep_order,
                                  isolated=self._isolated)
        if self._step is not None:
            if self._step.stats.get("isolated_fallbacks"):
                logger.warning("samcache: %d image(s) of this isolated model could not be computed alone (their "
                               "first tokens came from vLLM's prefix cache and the image-KV store no longer holds "
                               "them): computed in context, kept out of the prefix cache",
                               self._step.stats["isolated_fallbacks"])
            for req_id, exact in self._step.approximate.items():
                self._reported[req_id] = min(exact, self._reported.get(req_id, exact))
        return self._step

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        reported, self._reported = self._reported, {}
        return SamcacheWorkerMetadata(reported) if reported else None

    def layer_of(self, layer_name: str) -> int:
        return self._layer_of[layer_name]

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # the new images' KV was captured as the layer wrote it (ForwardStep.capture)

    def capture_layer_kv(self, layer_name: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Called by the attention backend with the keys and values a layer writes to the cache."""
        step = self._step
        if step is not None and step.saves:
            step.capture(self._layer_of[layer_name], keys, values)

    def wait_for_save(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        before = self.store.stats.evictions
        for save in step.saves:
            if len(save.k) == self._num_layers:
                self.store.put(save.key, save.image_kv(), check=save.check)
        self.metrics.update(steps=1, **step.stats, store_evictions=self.store.stats.evictions - before)
        self.metrics.set_gauges(store_bytes=self.store.index.used_bytes)
        if self.config.metrics_path:
            self.metrics.write(self.config.metrics_path)


class VllmCacheWriter:
    """Writes KV into vLLM's CPU paged cache with vLLM's own op and each layer's kernel ISA."""

    def __init__(self, layer_names: list[str], kv_caches: list[torch.Tensor]) -> None:
        self.layer_names = layer_names
        self.kv_caches = kv_caches
        self.block_size = int(kv_caches[0].shape[2])  # [blocks, kv heads, block_size, 2 * head_dim]
        self._layers: list[Any] | None = None

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        from vllm import _custom_ops as ops

        if self._layers is None:
            from vllm.forward_context import get_forward_context

            modules = get_forward_context().no_compile_layers
            self._layers = [modules[name] for name in self.layer_names]
        attn = self._layers[layer]
        kv = self.kv_caches[layer]
        num_blocks, num_kv_heads, block_size, _ = kv.shape
        key_cache, value_cache = kv.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys.contiguous(), values.contiguous(), key_cache, value_cache, slots, attn.isa,
                                       k_scale=attn._k_scale_float, v_scale=attn._v_scale_float,
                                       kv_cache_dtype=attn.kv_cache_dtype)


def rotary_of(model: Any) -> Rotary:
    """The inverse frequencies and M-RoPE sections of vLLM's Qwen2.5-VL language model."""
    return Rotary.of(model.language_model.model.layers[0].self_attn.rotary_emb, "vLLM")


__all__ = ["SamcacheConnector", "SamcacheMetadata", "active_worker"]
