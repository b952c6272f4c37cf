"""SAMcacheEngine: the chat and session API over the executor, the scheduler and the stores.

A turn goes: messages checked, images decoded and hashed, prompt tokens and M-RoPE positions
built (``prompt.py``) -> the executor adopts the exact prefix, looks images up, asks the planner
for the reuse plan, splices known images' KV in and describes the rows to compute
(``executor.py``, ``samcache.reuse``) -> the scheduler runs batched forward steps, prefill and
decode rows of many requests mixed (``scheduler.py``, ``runner.py``) -> what was computed is
kept for the next turns (image KV held in pool blocks, ViT outputs). Calibration
(``calibration.py``) and fidelity (``fidelity.py``) run beside the serving path on their own
state. docs/design.md explains the plan.

Threads: an engine may be called from several threads; each call holds the engine's lock for its
whole run, so calls are served one after another. To serve requests together, pass them to one
:meth:`SAMcacheEngine.chat_batch` call.

Why this module is long: it is the public surface of SAMcacheEngine (chat, chat_batch, sessions,
branches, calibration, fidelity, counters); every method is a thin, checked entry that hands the
work to the executor, scheduler or stores.
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from samcache._checks import SEED_LIMIT, check_int, check_seed
from samcache.agent.branches import Branch, ContextTree, TreeMemory
from samcache.cache.block_pool import BlockPool
from samcache.compression.settings import CompressionSettings
from samcache.engine.calibration import CALIBRATION_CONTINUATION, Calibrator
from samcache.engine.config import (CacheConfig, CompressionConfig, EngineConfig, EvictionConfig, RecomputeConfig,
                                    TierConfig)
from samcache.engine.executor import Executor, Prepared, RequestOptions
from samcache.engine.fidelity import measure_fidelity
from samcache.families import detect_family
from samcache.engine.isolated_images import IsolatedImages
from samcache.profile.image_attention import ImageAttention
from samcache.profile.image_attention import declared as declared_image_attention
from samcache.profile.reuse_profile import ReuseProfile, find_profile, make_profile, read_profile, write_profile
from samcache.engine.images import ImageGeometry, TileGeometry, prepare_image, preprocess_params
from samcache.engine.loading import load_processor, model_fingerprint, resolve_device, resolve_dtype
from samcache.engine.metrics import TurnMetrics
from samcache.engine.prompt import Prompt, build_prompt, build_prompt_tiles, normalize_messages, user_message
from samcache.engine.runner import ModelRunner
from samcache.engine.sampling import Sampler
from samcache.engine.vit_chain import VitChain
from samcache.engine.scheduler import Admission, Finished, Scheduler
from samcache.errors import PromptTooLong
from samcache.policies.cache_priorities import CachePriorities
from samcache.hashing import Namespace
from samcache.policies import LRUPolicy, Workflow, WorkflowAwarePolicy
from samcache.recompute import LayerBudget, SensitivityCurves
from samcache.recompute.serving import keeps_image_order, load_curves, serving_budget
from samcache.reuse import RecomputeBudget
from samcache.cache.stores import ImageKVStore
from samcache.cache.tiers import DiskTier, LowerTiers, RemoteTier
from samcache.cache.tiers.prefix import PrefixTier

if TYPE_CHECKING:
    from samcache.engine.online import OnlineLoop


@dataclass
class Session:
    """A conversation: the engine renders its whole history each turn (prefix reuse makes the
    repeated part cheap). ``messages`` uses the chat format of :meth:`SAMcacheEngine.chat`.

    ``branch``: with ``new_session(hold_context=True)``, the session's place in the engine's
    context tree (:class:`samcache.agent.ContextTree`): after each turn it holds the turn's KV
    blocks, so forks (:meth:`SAMcacheEngine.fork_session`) share them by reference and nothing a
    live branch needs is evicted while the pool has cached blocks of others to give up."""

    messages: list[dict] = field(default_factory=list)
    tenant: str | None = None
    branch: Branch | None = field(default=None, repr=False, compare=False)

    @property
    def abandoned(self) -> bool:
        return self.branch is not None and self.branch.state == "abandoned"


@dataclass
class ChatRequest:
    """One request of :meth:`SAMcacheEngine.chat_batch`; the fields are :meth:`SAMcacheEngine.chat`'s."""

    images: Sequence[Any] | None = None
    prompt: str | None = None
    messages: Sequence[dict] | None = None
    session: Session | None = None
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    tenant: str | None = None
    fidelity: bool = False
    fidelity_tokens: int = 8
    seed: int | None = None
    ignore_eos: bool = False
    agent: str | None = None

    def __post_init__(self) -> None:
        if self.session is not None and not isinstance(self.session, Session):
            raise TypeError(f"session must be a Session (engine.new_session()), got {type(self.session).__name__}")
        for name in ("fidelity", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_int("max_new_tokens", self.max_new_tokens, 1)
        if self.fidelity:
            check_int("fidelity_tokens", self.fidelity_tokens, 1)
        if self.seed is not None:
            check_seed(self.seed)
        if self.tenant is not None and not isinstance(self.tenant, (str, bytes)):
            raise TypeError(f"tenant must be a str, bytes or None, got {type(self.tenant).__name__}")
        if self.agent is not None and (not isinstance(self.agent, str) or not self.agent):
            raise TypeError(f"agent must be a non-empty str or None, got {self.agent!r}")


@dataclass(frozen=True)
class PreparedChat:
    """A :class:`ChatRequest` with its prompt built (:meth:`SAMcacheEngine.prepare`): what it sends
    (``history``) and its ``prompt``. The online loop admits it as it stands."""

    request: ChatRequest
    history: list
    prompt: Prompt


@dataclass
class ChatResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-turn token) or "length"
    metrics: TurnMetrics

    def __str__(self) -> str:
        return self.text


class BatchError(RuntimeError):
    """Some requests of a :meth:`SAMcacheEngine.chat_batch` call failed; ``results`` holds every
    request's :class:`ChatResult` or exception, in order."""

    def __init__(self, results: list) -> None:
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        super().__init__(f"{len(failed)} of {len(results)} requests failed; the first, request {failed[0][0]}: "
                         f"{type(failed[0][1]).__name__}: {failed[0][1]}")
        self.results = results


class SAMcacheEngine:
    """A multimodal chat engine that never encodes or prefills a known image twice.

    >>> engine = SAMcacheEngine("/path/to/Qwen2.5-VL-checkpoint")
    >>> r1 = engine.chat(images=["diagram.png"], prompt="Explain this architecture diagram.")
    >>> r2 = engine.chat(images=["diagram.png"], prompt="Where does the data flow?")  # reuses it
    >>> r2.text, r2.metrics.ttft_s, r2.metrics.image_reused_tokens

    Settings: five groups (:mod:`samcache.engine.config`: ``cache=CacheConfig(...)``,
    ``recompute=``, ``compression=``, ``tiers=``, ``eviction=``), or their fields as the flat
    keywords named below (``SAMcacheEngine(path, recompute_ratio=0.05)``); a keyword overrides
    the same field of a group given beside it.

    Cache levels (each can be switched off; ``cache_enabled=False`` switches off all three):
    ``vit_cache`` (vision-tower outputs by image content), ``prefix_cache`` (exact token prefix,
    images keyed by content; only KV equal to a full prefill's enters it) and ``image_kv_cache``
    (an image's KV reused at any position, RoPE re-rotated, with ``recompute_ratio`` of its tokens
    recomputed, split across layers by ``recompute_budget``: ``"layer-aware"`` solves per-layer
    rates from sensitivity curves (:meth:`calibrate`, or ``sensitivity=`` curves / a JSON path),
    ``"uniform"`` uses the same rate at every layer). ``prefix_reuse="exact"`` (default) keeps blocks
    whose KV came from reuse out of the prefix cache, so a prefix hit is always what a full prefill
    would have computed; ``"approximate"`` adopts them too (the next turn of a session then reuses
    its whole history, spliced images included), in a cache space of their own.
    ``keep_image_order=True`` reuses an image's KV only where the image keeps its index among the
    prompt's images (first stays first): for models that write an image's order into its KV, where
    reuse at another index misleads them whatever the recompute ratio (docs/design.md); a moved
    image is prefilled again from its cached ViT output. ``"auto"`` (default) lets the model decide
    (:meth:`keeps_image_order`): a model whose images attend in isolation is reused at any index
    (exact); otherwise the calibration keeps the order where reuse at another index, at this
    engine's recompute ratio, changed more than 1 in 100 of the reference's confident tokens
    (``SensitivityCurves.image_order``), and without a calibration (no profile, no curves) the
    order is kept: exact, never silently approximate.

    The model: ``image_attention`` (None: what the checkpoint declares in its config.json,
    :mod:`samcache.profile.image_attention`): with isolated image attention every image is computed
    alone and spliced, first sight included, and reused anywhere with nothing recomputed.
    ``profile``: the model's reuse profile (:mod:`samcache.profile.reuse_profile`; None: the
    ``samcache_profile.json`` in the checkpoint's folder, if any; False: none), whose curves serve
    where ``sensitivity`` is not given; a profile of another checkpoint is refused.

    Memory: ``kv_cache_bytes`` sizes the paged KV pool. Images' KV stays in the pool's blocks
    (held once, never copied beside them), at most ``image_kv_cache_bytes`` of it (default: the
    pool); when a prompt needs blocks, the least recently used images are released first.
    ``max_step_tokens`` bounds the rows of one forward step (continuous batching in
    :meth:`chat_batch`).

    Tiers below the pool (:mod:`samcache.cache.tiers`): ``host_kv_cache_bytes`` of host memory,
    ``disk_kv_cache_dir`` (at most ``disk_kv_cache_bytes``, ``cold_kv_qtype`` encoding) and a
    shared ``remote_kv_store``; images the pool lets go are demoted there, and come back up on a
    hit. ``eviction_policy`` ("lru", "priority-lru", "workflow", "attention", with
    ``eviction_options``) decides what goes first; with "workflow" and a tier below the pool, after
    every batch of turns a worker thread brings what the agents of the next ``prefetch_horizon``
    steps need up into host memory (0: no prefetch; :meth:`prefetch`). Beside them, in
    ``disk_kv_cache_dir``: ``disk_vit_cache_bytes`` of ViT outputs the ViT cache lets go and
    ``disk_prefix_cache_bytes`` of prefix blocks the host prefix tier (``host_prefix_cache_bytes``)
    cannot keep, both lossless. ``host_vit_cache_bytes``: ViT outputs the (device) ViT cache lets
    go are kept in host memory first, and only what host memory lets go goes to disk.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        cache: CacheConfig | None = None,
        recompute: RecomputeConfig | None = None,
        compression: CompressionConfig | None = None,
        tiers: TierConfig | None = None,
        eviction: EvictionConfig | None = None,
        max_step_tokens: int = 16384,
        seed: int = 0,
        share_weights_with: "SAMcacheEngine | None" = None,
        **settings: Any,
    ) -> None:
        config = EngineConfig.resolve({"cache": cache, "recompute": recompute, "compression": compression,
                                       "tiers": tiers, "eviction": eviction}, settings)
        cache, recompute, tiers = config.cache, config.recompute, config.tiers
        check_int("max_step_tokens", max_step_tokens, 1)
        check_seed(seed)
        if share_weights_with is not None and not isinstance(share_weights_with, SAMcacheEngine):
            raise TypeError(f"share_weights_with must be a SAMcacheEngine, got {type(share_weights_with).__name__}")
        self.config = config
        self.recompute_relevance = recompute.relevance
        self.keep_image_order = recompute.keep_image_order
        self.repair = recompute.repair
        policy = config.eviction.make_policy()
        self.model_path = pathlib.Path(model_path)
        self.family = detect_family(self.model_path)
        fingerprint = model_fingerprint(self.model_path)
        self._weights_digest = fingerprint.rsplit(":", 1)[1]  # without the folder name
        if share_weights_with is not None and self._weights_digest != share_weights_with._weights_digest:
            raise ValueError(f"share_weights_with holds the weights of {share_weights_with.model_path}, "
                             f"not those of {self.model_path}")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        kv_cache_bytes = cache.kv_cache_bytes
        if kv_cache_bytes is None:
            kv_cache_bytes = (8 << 30) if self.device.type == "cuda" else (256 << 20)
        self.runner = ModelRunner(
            self.model_path, self.family, device=self.device, dtype=self.dtype, block_size=cache.block_size,
            num_blocks=cache.num_blocks, kv_cache_bytes=kv_cache_bytes,
            model=share_weights_with.runner.model if share_weights_with is not None else None,
        )
        self.compression = self._compression_settings(config.compression)
        layer = self.repair.select_layer
        if layer is not None and layer >= self.runner.num_layers:
            raise ValueError(f"recompute_method {self.repair.describe()}: check_layer {layer} needs a model deeper "
                             f"than its {self.runner.num_layers} layers")
        if self.compression is not None and (layer is not None or self.repair.isolated):
            raise ValueError(f"recompute_method {self.repair.name!r} does not combine with compression_enabled=True "
                             "(compressed records fix their rows and KV before the step); use 'two-track' or 'boundary'")
        self.pool = BlockPool(self.runner.num_blocks, cache.block_size)
        self.processor = load_processor(self.model_path)
        self.tokenizer = self.processor.tokenizer
        if self.family.vision_input == "tiles":  # InternVL: tiles of a fixed token count
            self.geometry = TileGeometry.from_processor(self.processor.image_processor,
                                                        self.processor.image_seq_length)
        else:
            self.geometry = ImageGeometry.from_processor(self.processor.image_processor)
        self._preprocess = preprocess_params(self.processor.image_processor)
        cfg = self.runner.config
        self.image_token_id = int(cfg.image_token_id)
        eos = getattr(self.runner.model.generation_config, "eos_token_id", None) or cfg.text_config.eos_token_id
        self.eos_token_ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}

        self.image_attention = self._image_attention(recompute.image_attention)
        # The checkpoint's config (in the fingerprint) declares its attention; another one is another KV.
        if self.image_attention != declared_image_attention(self.model_path):
            fingerprint = f"{fingerprint}|image-attention={self.image_attention.name}"
        self.model_id = cache.model_id or fingerprint
        self.tenant = cache.tenant
        self.use_prefix = cache.use_prefix
        self.use_vit_cache = cache.use_vit_cache
        self.use_image_kv = cache.use_image_kv
        self.prefix_reuse = cache.prefix_reuse
        self.recompute_ratio = recompute.ratio
        self.recompute_budget = recompute.budget
        self.profile = self._load_profile(recompute.profile)
        self.sensitivity = self._load_sensitivity(recompute.sensitivity)
        if self.sensitivity is None and self.profile is not None:
            self.sensitivity = self.profile.curves
        self._warned_uniform = False
        self._solved: dict = {}
        self._build_stores(cache, tiers)
        self.scheduler = Scheduler(self.executor, self.eos_token_ids, max_step_tokens=max_step_tokens)
        self.eviction_policy = policy
        # Plain LRU is the pool's and the stores' own order: nothing to track or write.
        self.priorities = (None if isinstance(policy, LRUPolicy) else
                           CachePriorities(policy, self.pool, [self.image_kv_store.entries, self.vit_store],
                                           lower=self.lower_tiers))
        if self.priorities is not None and self.lower_tiers is not None:
            self.lower_tiers.priority_of = self.priorities.priority_of  # demotion order from the policy
        self.prefetch_horizon = config.eviction.prefetch_horizon
        self.seed = seed
        self._turns = 0
        self._online = None  # the background step loop, once start_online() runs
        self._lock = threading.RLock()
        self._text_lock = threading.Lock()

    def _build_stores(self, cache: CacheConfig, tiers: TierConfig) -> None:
        """The stores, the tiers below the pool and the executor over them."""
        pool_bytes = self.runner.num_blocks * self.runner.block_bytes
        disk_dir = None if tiers.disk_kv_cache_dir is None else pathlib.Path(tiers.disk_kv_cache_dir)
        # Items on disk beside image KV are framed under the model's id (their keys already carry the tenant).
        disk_namespace = Namespace(self.model_id, "samcache/disk")
        vit_disk = (DiskTier(disk_dir / "vit", tiers.disk_vit_cache_bytes, qtype=None)
                    if tiers.disk_vit_cache_bytes and self.use_vit_cache else None)
        self.lower_tiers = None
        if self.use_image_kv and tiers.holds_image_kv:
            disk = (DiskTier(disk_dir, tiers.disk_kv_cache_bytes, qtype=tiers.cold_kv_qtype, block_size=cache.block_size)
                    if disk_dir is not None else None)
            remote = (RemoteTier(tiers.remote_kv_store, qtype=tiers.cold_kv_qtype, block_size=cache.block_size)
                      if tiers.remote_kv_store is not None else None)
            self.lower_tiers = LowerTiers(tiers.host_kv_cache_bytes, disk, remote, pin_memory=self.device.type == "cuda")
        # ViT outputs: the device cache -> host memory -> disk, each letting go into the next.
        self.vit = VitChain(self.runner, self.processor, device_bytes=cache.vit_cache_bytes,
                            host_bytes=tiers.host_vit_cache_bytes if self.use_vit_cache else 0, disk=vit_disk,
                            disk_namespace=disk_namespace, lower=self.lower_tiers)
        self.vit_store = self.vit.store
        self.image_kv_store = ImageKVStore(self.pool, min(cache.image_kv_cache_bytes or pool_bytes, pool_bytes),
                                           self.runner.block_bytes, lower=self.lower_tiers,
                                           read_kv=self.runner.read_kv)
        self.contexts = ContextTree(self.pool)
        prefix_disk = (DiskTier(disk_dir / "prefix-blocks", tiers.disk_prefix_cache_bytes, qtype=None)
                       if tiers.disk_prefix_cache_bytes and self.use_prefix else None)
        # With a shared store, the exact prefix blocks this instance computes are published there too.
        prefix_remote = RemoteTier(tiers.remote_kv_store, qtype=None) if tiers.remote_kv_store is not None else None
        prefix_tier = (PrefixTier(tiers.host_prefix_cache_bytes, disk=prefix_disk, remote=prefix_remote,
                                  namespace=disk_namespace)
                       if tiers.host_prefix_cache_bytes and self.use_prefix else None)
        isolated = (IsolatedImages(self.image_attention, self.image_token_id, int(self.runner.config.vision_start_token_id),
                                   self.geometry.merge_size, self.runner.num_layers)
                    if self.image_attention.isolated else None)
        if isolated is not None and isolated.context_from is not None and self.lower_tiers is not None:
            raise ValueError(f"image_attention={self.image_attention.name!r}: the tiers below the pool keep an image's "
                             "KV but not its input to the layers in context; use a fully isolated model with them")
        self.executor = Executor(self.runner, self.pool, self.vit, image_kv_store=self.image_kv_store,
                                 contexts=self.contexts, prefix_tier=prefix_tier, isolated=isolated)

    # ---- public API ---------------------------------------------------------------------------
    def new_session(self, system: str | None = None, *, tenant: str | None = None, hold_context: bool = False
                    ) -> Session:
        """A conversation, optionally with a system prompt, scoped to ``tenant`` (default: the engine's).

        ``hold_context=True``: the session holds its KV blocks between turns (a root of the
        engine's context tree), for agents that fork it (:meth:`fork_session`) and abandon
        branches (:meth:`abandon_session`). Under memory pressure the least recently used holds
        are given up first, after cached images; the KV then stays in the prefix cache until evicted."""
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str, got {type(system).__name__}")
        if not isinstance(hold_context, bool):
            raise TypeError(f"hold_context must be a bool, got {hold_context!r}")
        messages = [{"role": "system", "content": system}] if system is not None else []
        tenant = tenant if tenant is not None else self.tenant
        with self._lock:
            branch = self.contexts.root(Namespace(self.model_id, tenant)) if hold_context else None
        return Session(messages=messages, tenant=tenant, branch=branch)

    def fork_session(self, session: Session, name: str | None = None) -> Session:
        """A branch of ``session``: a copy of its history whose held KV blocks are shared with it by
        reference (nothing copied; the first write into a shared partial block copies that block).
        The branches continue independently. ``session`` must hold its context."""
        self._check_branch(session, "fork")
        with self._lock:
            return Session(messages=list(session.messages), tenant=session.tenant, branch=session.branch.fork(name))

    def abandon_session(self, session: Session, *, reclaim: bool = False) -> int:
        """Close a held session for good: the blocks only it held become evictable at once, before
        every other cached block (``reclaim=True`` frees them now). Its forks are not affected.
        Returns how many blocks were released; a later turn on it raises ValueError."""
        self._check_branch(session, "abandon")
        with self._lock:
            return session.branch.abandon(reclaim=reclaim)

    def plan_workflow(self, workflow: Workflow) -> None:
        """Tell the workflow-aware policy (``eviction_policy="workflow"``) the order in which a
        workflow's agents run. Turns then name their agent (``chat(..., agent="name/agent")``);
        each turn of the agent whose step it is advances the workflow, and what the agents
        running soonest need is evicted last."""
        if not isinstance(self.eviction_policy, WorkflowAwarePolicy):
            raise ValueError(f"plan_workflow needs eviction_policy='workflow', this engine uses "
                             f"{self.eviction_policy.name!r}")
        if not isinstance(workflow, Workflow):
            raise TypeError(f"workflow must be a samcache.policies.Workflow, got {type(workflow).__name__}")
        with self._lock:
            self.eviction_policy.add(workflow)

    def image_tier(self, image, *, tenant: str | None = None) -> str | None:
        """Where this image's KV is held for ``tenant`` (default: the engine's): "device" (the
        pool's image-KV store), "host", "disk" or "remote" (the shared store: one round trip), or
        None. The fastest tier holding it is the one a turn would take it from."""
        with self._lock:
            prompt = self.build_prompt([user_message([image], "")])
            namespace = Namespace(self.model_id, self.tenant if tenant is None else tenant)
            key = namespace.key(prompt.images[0].image.content)
            if key in self.image_kv_store:
                return "device"
            lower = self.lower_tiers
            if lower is None:
                return None
            if lower.in_host(key):
                return "host"
            if lower.disk is not None and key in lower.disk:
                return "disk"
            if lower.remote is not None and (namespace, key) in lower.remote:
                return "remote"
            return None

    def tier_stats(self) -> dict[str, dict]:
        """Counters of every memory tier this engine has (image KV below the device, its disk
        and shared-store parts, prefix blocks, ViT outputs on disk): hits, demotions, drops,
        damaged / foreign / lost files, publishes, prefetches."""
        out: dict[str, dict] = {}
        lower = self.lower_tiers
        if lower is not None:
            out["image_kv"] = dict(lower.stats)
            if lower.disk is not None:
                out["image_kv_disk"] = lower.disk.stats()
            if lower.remote is not None:
                out["image_kv_remote"] = dict(lower.remote.stats)
        tier = self.executor.tiers.prefix_tier
        if tier is not None:
            out["prefix"] = dict(tier.stats)
            if tier.disk is not None:
                out["prefix_disk"] = tier.disk.stats()
            if tier.remote is not None:
                out["prefix_remote"] = dict(tier.remote.stats)
        if self.vit.host is not None:
            out["vit_host"] = vars(self.vit.host.stats).copy()
        if self.vit.disk is not None:
            out["vit_disk"] = self.vit.disk.stats()
        return out

    def memory_stats(self) -> dict:
        """What the engine's memory holds now, read between two steps: the pool's counters
        (``BlockPool.stats()``), ``image_kv_records`` / ``image_kv_bytes`` (images held for reuse)
        and ``tiers`` (:meth:`tier_stats`)."""
        with self._lock:
            return {"pool": self.pool.stats(), "image_kv_records": len(self.image_kv_store),
                    "image_kv_bytes": self.image_kv_store.used_bytes, "tiers": self.tier_stats()}

    def prefetch_plan(self, horizon: int = 2) -> list:
        """With ``eviction_policy="workflow"``: the cached items (image content keys, and
        ``("context", agent)``) that the agents of the next ``horizon`` steps will need, soonest
        first, excluding the agent running now. This is what the memory tiers bring up before their
        turn; with the pool alone there is no lower tier to bring them from. Empty otherwise."""
        with self._lock:
            return [] if self.priorities is None else self.priorities.prefetch(horizon)

    def prefetch(self, horizon: int | None = None, *, wait: bool = True) -> int:
        """Bring the images the agents of the next ``horizon`` steps need (:meth:`prefetch_plan`;
        default ``prefetch_horizon``) from disk or the shared store up into host memory, in a
        worker thread; with ``wait`` return once they are there. The number of images sent up
        (those not in the pool or host memory already). Their turn then finds them one tier
        higher, and a turn that needs one still on its way waits for that one only. Contexts
        (``("context", agent)``) are not sent up ahead: their blocks come back from the prefix tier
        when a turn's prefix match reaches them."""
        horizon = self.prefetch_horizon if horizon is None else horizon
        with self._lock:
            lower = self.lower_tiers
            if lower is None or self.priorities is None or not horizon:
                return 0
            items = []
            for key in self.priorities.prefetch(horizon):
                origin = self.priorities.origin(key)
                if origin is not None and key not in self.image_kv_store:
                    items.append((origin[0], key, origin[1]))
            futures = lower.prefetch(items)
        if wait:
            for f in futures:
                f.result()
        return len(futures)

    def context_memory(self) -> TreeMemory:
        """Blocks the held sessions hold: distinct, as full clones, and per branch."""
        with self._lock:
            return self.contexts.memory()

    @staticmethod
    def _check_branch(session: Any, action: str) -> None:
        if not isinstance(session, Session):
            raise TypeError(f"session must be a Session (engine.new_session()), got {type(session).__name__}")
        if session.branch is None:
            raise ValueError(f"cannot {action} a session that does not hold its context; create it with "
                             "engine.new_session(..., hold_context=True)")

    def chat(
        self,
        images: Sequence[Any] | None = None,
        prompt: str | None = None,
        *,
        messages: Sequence[dict] | None = None,
        session: Session | None = None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        tenant: str | None = None,
        fidelity: bool = False,
        fidelity_tokens: int = 8,
        seed: int | None = None,
        ignore_eos: bool = False,
        agent: str | None = None,
    ) -> ChatResult:
        """One turn. Either ``images`` + ``prompt`` (a user message; appended to ``session`` if
        given) or the whole ``messages`` list (``{"role", "content"}`` dicts; content is a string
        or a list of ``{"type": "text", "text"}`` / ``{"type": "image", "image"}`` parts, images as
        paths, PIL images or uint8 arrays); with a ``session``, ``messages`` are the turn's new
        messages, appended to the session's.

        ``fidelity=True`` also runs a full prefill of the same prompt and reports the next-token
        KL, top-1 agreement and the agreement of ``fidelity_tokens`` greedy tokens
        (``metrics.fidelity``); it is not counted in TTFT. ``ignore_eos=True`` always decodes
        ``max_new_tokens`` (benchmarks: the same work in every mode).

        ``agent``: which agent of a multi-agent workflow this turn belongs to ('workflow/agent'),
        for the workflow- and attention-aware eviction policies (:meth:`plan_workflow`).
        """
        request = ChatRequest(images=images, prompt=prompt, messages=messages, session=session,
                              max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, tenant=tenant,
                              fidelity=fidelity, fidelity_tokens=fidelity_tokens, seed=seed, ignore_eos=ignore_eos,
                              agent=agent)
        result = self._serve([request])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def chat_batch(self, requests: Sequence[ChatRequest], *, return_exceptions: bool = False) -> list:
        """Serve several requests together: their prefills share forward steps, then they decode in
        lock-step (one row each per step); prompts beyond ``max_step_tokens`` are admitted in later
        steps, next to the others' decode rows. Outputs equal serving each alone.

        Returns one :class:`ChatResult` per request, in order. A request that fails (bad input, a
        prompt that does not fit) does not stop the others: with ``return_exceptions=True`` its
        exception takes its place in the list; otherwise :class:`BatchError` is raised after the
        others are served, holding every result.
        """
        if isinstance(requests, ChatRequest) or not isinstance(requests, Sequence):
            raise TypeError(f"requests must be a list of ChatRequest, got {type(requests).__name__}")
        if not all(isinstance(r, ChatRequest) for r in requests):
            raise TypeError("requests must hold ChatRequest objects")
        seen: dict[int, int] = {}
        for i, r in enumerate(requests):
            if r.session is not None:
                if id(r.session) in seen:
                    raise ValueError(f"requests {seen[id(r.session)]} and {i} continue the same Session: each turn "
                                     "builds on the one before, so serve them one after another")
                seen[id(r.session)] = i
        results = self._serve(list(requests))
        if not return_exceptions and any(isinstance(r, BaseException) for r in results):
            raise BatchError(results)
        return results

    def warm_up(self, size: tuple[int, int] = (56, 56)) -> None:
        """One throwaway turn over a synthetic image of ``size`` (h, w), so first-call costs
        (allocations, the image path) stay out of the first measured turn. It reads no cache and
        leaves nothing in any (prefix blocks, image KV, ViT outputs)."""
        from samcache.synthetic import screenshot

        if self._online is not None and self._online.running:
            raise RuntimeError("warm_up() steps the engine's scheduler by itself: call it before start_online()")
        with self._lock:
            prompt = self.build_prompt([{"role": "system", "content": "samcache warm-up"},
                                        user_message([screenshot(987_654_321, size)], "warm-up")])
            options = replace(self.request_options(), use_prefix=False, register_prefix=False, use_image_kv=False,
                              store_images=False, use_vit=False, store_vit=False)
            for out in self.scheduler.run([Admission(prompt, Namespace(self.model_id, "samcache/warm-up"), options,
                                                     Sampler(0.0), max_new_tokens=2)]):
                if isinstance(out, BaseException):
                    raise out

    def build_prompt(self, messages: Sequence[dict]) -> Prompt:
        """Chat messages -> token ids, image spans and M-RoPE positions (images decoded and hashed)."""
        rendered, raw_images = normalize_messages(messages)
        images = [prepare_image(im, self.geometry, self._preprocess) for im in raw_images]
        with self._text_lock:  # a fast tokenizer's call may change its settings: one thread at a time
            text = self.processor.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if isinstance(self.geometry, TileGeometry):
            tok = self.tokenizer
            return build_prompt_tiles(ids, images, image_token_id=self.image_token_id, start_id=tok.start_image_token_id,
                                      end_id=tok.end_image_token_id, coordinates=self.geometry.coordinates)
        return build_prompt(ids, images, image_token_id=self.image_token_id, merge_size=self.geometry.merge_size)

    @property
    def recompute_method(self) -> str:
        return self.repair.name

    def recompute_budget_for(self, rates) -> RecomputeBudget:
        """This engine's recompute budget (its repair method) at per-layer ``rates``."""
        return RecomputeBudget(tuple(rates), self.repair)

    def request_options(self, recompute_ratio: float | None = None) -> RequestOptions:
        """The cache switches and recompute budget of this engine's requests."""
        ratio = self.recompute_ratio if recompute_ratio is None else recompute_ratio
        budget = None
        if self.use_image_kv and ratio > 0 and not self.image_attention.isolated:  # isolated: nothing to repair
            budget = self.recompute_budget_for(self.layer_budget(ratio).rates)
        return RequestOptions(use_prefix=self.use_prefix, use_image_kv=self.use_image_kv,
                              register_prefix=self.use_prefix, approximate_prefix=self.prefix_reuse == "approximate",
                              store_images=self.use_image_kv, budget=budget, use_vit=self.use_vit_cache,
                              compression=self.compression, relevance=self.recompute_relevance,
                              keep_image_order=self.keeps_image_order(ratio),
                              isolated_images=self.use_image_kv and self.repair.isolated)

    def _image_attention(self, given) -> ImageAttention:
        """How this engine's model attends to images: ``given`` (a name or an ImageAttention),
        else what the checkpoint declares; checked against the model."""
        if given is None:
            attention = declared_image_attention(self.model_path)
        else:
            attention = given  # RecomputeConfig parsed a name
        attention.check_depth(self.runner.num_layers)
        if attention.isolated:
            if self.family.vision_input == "tiles":
                raise ValueError(f"image_attention={attention.name!r}: isolated image attention is defined for "
                                 f"M-RoPE (Qwen-VL) models, not {self.family.name}")
            if self.compression is not None:
                raise ValueError(f"image_attention={attention.name!r} does not combine with compression_enabled=True")
            if attention.context_layers and self.runner.deepstack_layers:
                raise ValueError(f"image_attention={attention.name!r}: images isolated in the lower layers only are "
                                 "served for models without DeepStack features (Qwen2.5-VL)")
        return attention

    def keeps_image_order(self, recompute_ratio: float | None = None) -> bool:
        """Whether requests at ``recompute_ratio`` (default: the engine's) reuse an image's KV only
        at its own index among the prompt's images: ``keep_image_order`` itself, or with ``"auto"``
        what the calibration's image-order check found for the rates this engine serves at that
        ratio (:meth:`SensitivityCurves.image_order.keeps_order`); False without one."""
        ratio = self.recompute_ratio if recompute_ratio is None else recompute_ratio
        return keeps_image_order(self.keep_image_order, self.sensitivity, ratio, self.recompute_budget,
                                 isolated=self.image_attention.isolated)

    def _compression_settings(self, config: CompressionConfig) -> CompressionSettings | None:
        """Checked compression settings (None when off). Compression scores visual tokens with
        router logits, so it needs an MoE language model with a router at every stage layer."""
        if not config.enabled:
            return None
        runner = self.runner
        settings = CompressionSettings.for_model(runner.num_layers, keep=config.keep, layers=config.layers)
        dense = [l for l in settings.layers if not hasattr(getattr(runner.layers[l].mlp, "gate", None), "weight")]
        if dense:
            raise ValueError(
                f"compression_enabled=True needs an MoE language model (its router logits score the visual tokens); "
                f"{self.family.name} layer(s) {dense} have a dense MLP. Use a Qwen3-VL-MoE or InternVL3.5-MoE checkpoint, or stage layers "
                "that are MoE layers (compression_layers=...)")
        if any(w > 0 for w in runner.windows):
            raise ValueError("compression_enabled=True does not support sliding-window layers: compacted layers "
                             "would change what a window covers")
        return settings

    def prefill(self, prompt: Prompt, *, tenant: str | None = None, options: RequestOptions | None = None
                ) -> tuple[Prepared, torch.Tensor]:
        """Stage 1 and 2 of a request without decode or registration: its prepared sequence (the
        caller frees ``prepared.seq``) and next-token logits. For tools and tests."""
        with self._lock:
            return self.executor.prefill(prompt, Namespace(self.model_id, tenant if tenant is not None else self.tenant),
                                         options or self.request_options())

    def check_invariants(self) -> None:
        """Raise InvariantViolation if the pool, a store or the context tree is inconsistent."""
        self.executor.check_invariants()
        self.contexts.check_invariants()

    def layer_budget(self, ratio: float) -> LayerBudget:
        """Per-layer recompute rates for a mean ``ratio``: solved from the sensitivity curves
        (layer-aware), or the same rate everywhere (uniform, layer-aware before calibration, and
        layer-aware where the calibration's end-to-end check found uniform rates better)."""
        key = (id(self.sensitivity), ratio)  # the solve is the same for every turn: keep it
        if key not in self._solved:
            self._solved = {key: serving_budget(self.sensitivity, ratio, self.runner.num_layers, self.recompute_budget)}
        return self._solved[key]

    # ---- serving --------------------------------------------------------------------------------
    def prepare(self, req: ChatRequest) -> "PreparedChat":
        """``req`` with its prompt built: images decoded and hashed, text tokenized. Safe from any
        thread and needs no lock: a server prepares each request in a worker thread, and the
        online loop then admits it without building anything on its own thread. Raises for bad
        input as ``chat`` does."""
        if not isinstance(req, ChatRequest):
            raise TypeError(f"prepare takes a ChatRequest, got {type(req).__name__}")
        history = self._history(req)
        return PreparedChat(req, history, self.build_prompt(history))

    def _history(self, req: ChatRequest) -> list[dict]:
        """The messages ``req`` sends: its own, or its session's and the new turn (``messages``
        with a session: the turn's messages, appended to the session's)."""
        if req.session is not None and req.session.abandoned:
            raise ValueError("this session was abandoned (engine.abandon_session); fork another one to go on")
        if req.messages is not None:
            if req.images is not None or req.prompt is not None:
                raise ValueError("pass either messages=... or images/prompt, not both")
            if isinstance(req.messages, (str, bytes)) or not isinstance(req.messages, Sequence):
                raise TypeError(f"messages must be a list of chat messages, got {type(req.messages).__name__}")
            # checked by build_prompt
            history = (list(req.session.messages) if req.session is not None else []) + list(req.messages)
        else:
            images, prompt = req.images, req.prompt
            if isinstance(images, (str, os.PathLike, bytes)) or not isinstance(images, (Sequence, type(None))):
                raise TypeError(f"images must be a list of images (paths, PIL images, arrays), got {type(images).__name__}")
            if prompt is None and not images:
                raise ValueError("chat needs a prompt or images (or messages=...)")
            prompt = "" if prompt is None else prompt  # an image-only turn
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
            history = (list(req.session.messages) if req.session is not None else []) + [user_message(list(images or []), prompt)]
        return list(history)

    def _admission(self, req: "ChatRequest | PreparedChat", start: float) -> tuple[Admission, list[dict]]:
        prepared = req if isinstance(req, PreparedChat) else None
        req = prepared.request if prepared is not None else req
        sampler = Sampler(req.temperature, req.top_p,
                          seed=(self.seed + self._turns) % SEED_LIMIT if req.seed is None else req.seed)
        if prepared is None:
            history = self._history(req)
            prompt_ = self.build_prompt(history)
        else:
            history, prompt_ = prepared.history, prepared.prompt
        tenant = req.tenant if req.tenant is not None else (req.session.tenant if req.session is not None else self.tenant)
        self._turns += 1
        self._check_fits(prompt_, req.max_new_tokens)
        adm = Admission(prompt_, Namespace(self.model_id, tenant), self.request_options(), sampler,
                        req.max_new_tokens, ignore_eos=req.ignore_eos, keep_prefill=req.fidelity,
                        keep_sequence=req.session is not None and req.session.branch is not None,
                        sample_attention=self.priorities is not None and self.priorities.samples_attention,
                        arrival=start)
        return adm, list(history)

    def _serve(self, requests: list[ChatRequest]) -> list:
        online = self._online
        if online is not None and online.running:
            if online.in_loop_thread():
                raise RuntimeError("chat/chat_batch cannot be called from the online loop's thread (a token "
                                   "callback, or the thread that runs it): submit the request to the loop instead")
            return online.serve(requests)  # the running loop's batch: requests join it, nothing waits for a lock
        with self._lock:
            start = time.perf_counter()
            results: list = [None] * len(requests)
            admitted, where = [], []
            for i, req in enumerate(requests):
                try:
                    admitted.append(self._admission(req, start))
                    where.append(i)
                except Exception as e:  # noqa: BLE001 - this request's bad input only
                    results[i] = e
            self._before_turns([a for a, _ in admitted])
            done = self.scheduler.run([a for a, _ in admitted])
            for i, (adm, history), out in zip(where, admitted, done):
                results[i] = self._complete(requests[i], adm, history, out)
            self._after_turns(done)
            return results

    def _before_turns(self, admitted: list[Admission]) -> None:
        """Before admitted turns join the step loop: the eviction priorities, the tiers' prefetch."""
        if self.priorities is not None:
            self.priorities.apply()
        self._prefetch_admitted(admitted)

    def _complete(self, req: ChatRequest, adm: Admission, history: list[dict], out):
        """A request's result once the step loop is done with it (its exception passed through)."""
        if isinstance(out, BaseException):
            return out
        if self.priorities is not None:
            try:
                images = {s.key: (adm.namespace, self.executor.kv_check(adm.prompt.images[s.index],
                                                                       adm.options.compression, prompt=adm.prompt))
                          for s in self.executor.layout(adm.prompt, adm.namespace, adm.options).images}
                self.priorities.record(req.agent, images, out.blocks, out.attention)
            except BaseException:
                for seq in (out.sequence, out.fork):  # what the turn kept for the caller, freed
                    if seq is not None:
                        self.pool.free_sequence(seq)
                raise
        return self._result(req, adm, history, out)

    def _after_turns(self, done: list, *, flush: bool = True) -> None:
        """After turns ended: the next agents' prefetch, what the tiers hold published (``flush``)."""
        if self.prefetch_horizon and self.lower_tiers is not None and self.priorities is not None:
            self.prefetch(wait=False)  # the next agents' images come up while the caller goes on
        if flush and self.lower_tiers is not None:
            # Published while the turns decoded; in the shared store before the call returns, so
            # another instance the caller tells next finds it.
            self.lower_tiers.flush()
        if flush and self.executor.tiers.prefix_tier is not None:
            self.executor.tiers.prefix_tier.flush()
        reused = any(not isinstance(out, BaseException) and out.prepared.plan.recompute is not None for out in done)
        if reused and self.recompute_budget == "layer-aware" and self.sensitivity is None and not self._warned_uniform:
            order = (" and (keep_image_order='auto') images are reused only at their own index"
                     if self.keep_image_order == "auto" and not self.image_attention.isolated else "")
            warnings.warn(f"no sensitivity curves for this model yet: the recompute budget is uniform across layers{order} "
                          "until engine.calibrate() runs (or pass sensitivity=...)", stacklevel=4)  # chat's caller
            self._warned_uniform = True

    # ---- online serving -----------------------------------------------------------------------
    def start_online(self, *, max_model_len: int | None = None, gather_s: float = 0.1, own_thread: bool = True
                     ) -> "OnlineLoop":
        """Serve from a background step loop (:class:`samcache.engine.online.OnlineLoop`):
        requests submitted from any thread or coroutine join the running batch at the next step
        and stream their tokens; ``chat`` and ``chat_batch`` from other threads go through it too.
        ``max_model_len`` bounds a request's prompt and reply together; ``gather_s``: how long an
        idle loop holds its first step for requests announced to it (``OnlineLoop.announce``);
        ``own_thread=False``: the calling thread steps the model, in ``OnlineLoop.run()``.
        Returns the loop (started once; :meth:`OnlineLoop.stop` ends it)."""
        from samcache.engine.online import OnlineLoop

        with self._lock:
            if self._online is None or not self._online.running:
                self._online = OnlineLoop(self, request_type=(ChatRequest, PreparedChat), max_model_len=max_model_len,
                                          gather_s=gather_s)
                self._online.start(own_thread=own_thread)
            return self._online

    def _prefetch_admitted(self, admitted: list[Admission]) -> int:
        """As soon as the admitted turns' plans are known, start bringing the images they will take
        from disk or the shared store up into host memory (the tiers' worker thread), so decoding
        them overlaps this step's other work (the ViT of new images, earlier requests' forwards);
        a turn that reaches an image still on its way waits for that one only. Turns that compress
        take no lower-tier loads (their spliced images must all be in place before the step). Needs a
        host tier (``host_kv_cache_bytes``) for the items to come up into."""
        lower = self.lower_tiers
        # Items come up into host memory: without room there a prefetch would be read twice.
        if (lower is None or self.executor.tiers.transfer is None or not lower.host_bytes
                or (lower.disk is None and lower.remote is None)):
            return 0
        items, seen = [], set()
        for adm in admitted:
            if not adm.options.use_image_kv or adm.options.compression is not None:
                continue
            for slot in self.executor.layout(adm.prompt, adm.namespace, adm.options).images:
                if slot.key in seen or slot.key in self.image_kv_store:
                    continue
                seen.add(slot.key)
                # Local tiers are asked without I/O; the shared store only from the worker.
                if lower.remote is not None or lower.holds(slot.key):
                    items.append((adm.namespace, slot.key, self.executor.kv_check(adm.prompt.images[slot.index], None,
                                                                                        prompt=adm.prompt)))
        return len(lower.prefetch(items))

    def _result(self, req: ChatRequest, adm: Admission, history: list[dict], out: Finished) -> ChatResult:
        m = out.prepared.metrics
        if out.sequence is not None:  # a held session: its branch now holds this turn's blocks
            try:
                req.session.branch.hold(out.sequence)
            finally:
                self.pool.free_sequence(out.sequence)
        if out.fork is not None:

            m.fidelity = measure_fidelity(self.executor, adm.prompt, out.first_logits, out.fork, req.fidelity_tokens,
                                          model_id=self.model_id, vit_namespace=adm.namespace,
                                          compaction=out.prepared.compaction)
        text = self.tokenizer.decode(out.tokens, skip_special_tokens=True)
        if req.session is not None:
            req.session.messages = history + [{"role": "assistant", "content": text}]
        return ChatResult(text=text, token_ids=out.tokens, finish_reason=out.finish_reason, metrics=m)

    def _check_fits(self, prompt: Prompt, max_new_tokens: int) -> None:
        n = len(prompt)
        if prompt.next_position + max_new_tokens > self.runner.max_positions:
            raise PromptTooLong(
                f"the prompt reaches position {prompt.next_position} and {max_new_tokens} new tokens would pass "
                f"the model's {self.runner.max_positions} positions"
            )
        need = -(-(n + max_new_tokens) // self.pool.block_size)
        if need > self.pool.num_blocks:
            raise PromptTooLong(
                f"the prompt ({n} tokens) plus {max_new_tokens} new tokens needs {need} KV blocks of "
                f"{self.pool.block_size} tokens but the pool has {self.pool.num_blocks} "
                f"({self.pool.num_blocks * self.pool.block_size} tokens); raise kv_cache_bytes or num_blocks"
            )

    # ---- the layer-aware budget ---------------------------------------------------------------
    def _load_profile(self, given) -> ReuseProfile | None:
        """The model's reuse profile: ``given`` (a path or a ReuseProfile), else the one in the
        checkpoint's folder; checked against the checkpoint (fingerprint, image attention, depth)."""
        if given is None:
            return find_profile(self.model_path, num_layers=self.runner.num_layers)
        if given is False:
            return None
        if isinstance(given, ReuseProfile):
            digest = self._weights_digest
            if given.fingerprint != digest:
                raise ValueError(f"profile was made for checkpoint {given.fingerprint}, but {self.model_path} is {digest}")
            if given.curves is not None and given.curves.num_layers != self.runner.num_layers:
                raise ValueError(f"profile curves have {given.curves.num_layers} layers, the model has "
                                 f"{self.runner.num_layers}")
            return given
        return read_profile(given, self.model_path, num_layers=self.runner.num_layers)

    def _load_sensitivity(self, sensitivity) -> SensitivityCurves | None:
        if sensitivity is None or isinstance(sensitivity, SensitivityCurves):
            if sensitivity is not None and sensitivity.num_layers != self.runner.num_layers:
                raise ValueError(f"sensitivity curves have {sensitivity.num_layers} layers, the model has "
                                 f"{self.runner.num_layers}")
            return sensitivity
        return load_curves(sensitivity, num_layers=self.runner.num_layers, model_id=self.model_id)

    def calibrate(
        self,
        images: Sequence[Any] | None = None,
        *,
        requests: Sequence[tuple[list, list]] | None = None,
        rates: Sequence[float] = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
        continuation: int = CALIBRATION_CONTINUATION,
        check: bool = True,
        save: str | os.PathLike | None = None,
        progress: bool = True,
    ) -> SensitivityCurves:
        """Measure each layer's sensitivity offline (:class:`samcache.engine.calibration.Calibrator`,
        on its own KV and stores) and use the layer-aware budget from now on. ``requests``: (first,
        reused) message pairs from the traffic to serve (e.g. consecutive turns of an agent), else
        ``images`` or two synthetic screenshots shown twice; ``continuation``: tokens of the reply
        the loss covers (the reference's reply ends earlier where it ends; default: a whole reply
        of up to 256 tokens, since a model that describes images first goes wrong dozens of
        tokens in); ``check``: measure the solved rates against uniform ones end to end (where
        uniform ones were better, the engine uses them). ``save`` writes the curves as JSON (load them with ``sensitivity=path``)."""

        if self.image_attention.isolated:
            raise ValueError(f"{self.model_path} attends to images in isolation ({self.image_attention.name}): its "
                             "image KV is reused exactly at any index, there is nothing to calibrate "
                             "(save_profile() writes its profile)")
        with self._lock:
            curves = Calibrator(self).run(images, requests=requests, rates=rates, continuation=continuation,
                                          check=check, progress=progress)
            self.sensitivity = curves
            if save is not None:
                pathlib.Path(save).write_text(json.dumps(curves.to_dict(self.model_id), indent=1), encoding="utf-8")
            return curves

    def save_profile(self, path: str | os.PathLike | None = None) -> pathlib.Path:
        """Write this model's reuse profile (:mod:`samcache.profile.reuse_profile`: its fingerprint,
        image attention, the curves this engine serves with and the order decision at their probe
        rates) into the checkpoint's folder, or to ``path``; every engine loading the model reads it."""
        if self.image_attention != declared_image_attention(self.model_path):
            raise ValueError(f"this engine serves image attention {self.image_attention.name}, but the checkpoint "
                             f"declares {declared_image_attention(self.model_path).name}: a profile describes the "
                             "checkpoint as it is declared")
        profile = make_profile(self.model_path, self.sensitivity, self.image_attention)
        self.profile = profile
        return write_profile(profile, self.model_path if path is None else path)

    def __repr__(self) -> str:
        return (f"SAMcacheEngine({self.family.name}, {self.device}, {self.dtype}, pool={self.pool.num_blocks}x"
                f"{self.pool.block_size}, recompute={self.recompute_ratio} {self.recompute_budget})")


__all__ = ["BatchError", "CALIBRATION_CONTINUATION", "ChatRequest", "ChatResult", "PreparedChat", "SAMcacheEngine", "Session"]
