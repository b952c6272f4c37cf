"""The reuse side of a samcache model override: one per model instance, shared by its forwards.

It holds the settings (``SAMCACHE_SGLANG``), the image-KV store (the process's shared store, which
the HiCache backend also uses), the model's rotary parameters, the recompute budget and the summed
stats; :meth:`ModelReuse.forward` runs a Qwen-VL model's extend step with reuse, and
:func:`run_rows` is the decoder stack over each layer's rows.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.model_executor.forward_context import get_attn_backend

from samcache.reuse import image_key
from samcache.hashing import Namespace
from samcache.integrations.forward_plan import Rotary
from samcache.integrations.settings import ReuseSettings
from samcache.integrations.sglang.attention import SamcacheAttnBackend
from samcache.integrations.sglang.exactness import tree_keeps_approximate_out
from samcache.integrations.sglang.identity import image_refs, model_id, model_path
from samcache.integrations.store_policy import StorePolicy
from samcache.integrations.sglang.step import PoolWriter, ReuseStats, SglangStep, plan_step, save_images

logger = logging.getLogger("sglang.samcache")
ENV_SETTINGS = "SAMCACHE_SGLANG"
_stats = ReuseStats()


def _env_values() -> dict:
    raw = os.environ.get(ENV_SETTINGS, "").strip()
    if not raw:
        return {}
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"samcache: {ENV_SETTINGS} must be a JSON object, got {raw!r} ({e})") from None
    if not isinstance(values, dict):
        raise ValueError(f"samcache: {ENV_SETTINGS} must be a JSON object, got {raw!r}")
    return values


def settings_from_env() -> ReuseSettings:
    """``SAMCACHE_SGLANG='{"recompute_ratio": 0.05, ...}'`` (JSON; the keys of ReuseSettings)."""
    return ReuseSettings.from_mapping(_env_values(), source=ENV_SETTINGS)


def _process_store():
    """The process's shared store (also the HiCache backend's): sized by ``store_bytes`` when
    ``SAMCACHE_SGLANG`` names it, else by whichever user creates it first."""
    from samcache.integrations.sglang.hicache import shared_store

    explicit = "store_bytes" in _env_values()
    return shared_store(settings_from_env().store_bytes if explicit else None)


def stats() -> ReuseStats:
    """This process's counters, summed over every model override's steps (a copy)."""
    out = ReuseStats()
    out.add(_stats)
    return out


def write_stats(path: str) -> None:
    """Write this process's counters as JSON (atomically: a reader never sees half a file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(stats().counters(), f)
    os.replace(tmp, path)


def reset_stats() -> None:
    global _stats
    _stats = ReuseStats()


def _gather_stream(hidden: Any, forward_batch: Any, sel: torch.Tensor) -> Any:
    """Keep rows ``sel`` of SGLang's residual stream: the layer output and the residual are handed
    off (SGLang's replay handoff), gathered apart and handed back, so the next layer's fused
    add + norm sees exactly the operands it would (no rounded ``hidden + residual`` in between)."""
    handoff = residual_batch.export_replay_handoff(hidden, forward_batch)
    pick = lambda t: None if t is None else t.index_select(0, sel.to(t.device))  # noqa: E731
    return residual_batch.import_replay_handoff(handoff._replace(value=pick(handoff.value),
                                                                 residual=pick(handoff.residual)), forward_batch)


def run_rows(language_model: torch.nn.Module, step: SglangStep, positions: torch.Tensor, forward_batch: Any,
             inputs_embeds: torch.Tensor, input_deepstack_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """SGLang's decoder stack over ``step``'s rows (``positions``: M-RoPE ``[3, T]``); skipped rows
    of the result are zero (never read: SGLang samples each request's last row, always computed).
    ``input_deepstack_embeds`` (Qwen3-VL): the vision tower's per-layer features, added to the
    output of the first decoder layers as SGLang's inference path adds them."""
    rows, select, side = step.rows, step.select, step.side
    hidden = inputs_embeds.index_select(0, rows[0].to(inputs_embeds.device))
    pos = positions.index_select(1, rows[0].to(positions.device))
    if side is not None:  # an isolated model's first-seen images: side rows after the step's, every layer
        if input_deepstack_embeds is not None:
            raise ValueError("samcache: isolated image attention is not served for deepstack models (Qwen3-VL)")
        hidden = torch.cat([hidden, side.embeddings(inputs_embeds, language_model.embed_tokens)])
        side_pos = side.positions.to(pos.device)
        pos = torch.cat([pos, side_pos], dim=1)
    deepstack_layers = getattr(language_model, "deepstack_embed_to_decoder_layer", ())
    width = inputs_embeds.size(-1)
    residual_batch.start(forward_batch)
    for index in range(language_model.start_layer, language_model.end_layer):
        sel = select[index]
        if sel is not None:  # this layer computes fewer rows than the one before
            if side is not None:  # the side rows stay, after the step's
                before = rows[index - 1].numel()
                sel = torch.cat([sel, torch.arange(before, before + side.size)])
            hidden = _gather_stream(hidden, forward_batch, sel)
            pos = positions.index_select(1, rows[index].to(positions.device))
            if side is not None:
                pos = torch.cat([pos, side_pos], dim=1)
        hidden = language_model.layers[index](pos, hidden, forward_batch)
        if input_deepstack_embeds is not None and index in deepstack_layers:
            extra = input_deepstack_embeds[:, width * index: width * (index + 1)]
            hidden = residual_batch.add_to_output(hidden, forward_batch,
                                                  extra.index_select(0, rows[index].to(extra.device)))
    hidden = residual_batch.final_norm(hidden, forward_batch, language_model.norm, skip_empty=True)
    out = hidden.new_zeros((inputs_embeds.size(0), hidden.size(-1)))
    out.index_copy_(0, rows[-1].to(out.device), hidden[:rows[-1].numel()])
    return out


class _RowsLanguageModel:
    """The language model SGLang's multimodal embed routine calls, running :func:`run_rows`; every
    other attribute is the real model's (the routine reads its embeddings)."""

    def __init__(self, model: torch.nn.Module, step: SglangStep) -> None:
        self._model, self._step = model, step

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __call__(self, input_ids=None, positions=None, forward_batch=None, input_embeds=None,
                 input_deepstack_embeds=None, pp_proxy_tensors=None, **kwargs):
        if input_embeds is None:
            input_embeds = self._model.embed_tokens(input_ids)
        return run_rows(self._model, self._step, positions, forward_batch, input_embeds, input_deepstack_embeds)


class ModelReuse:
    """samcache's reuse for one SGLang Qwen-VL model instance (its ``model``: the decoder stack)."""

    def __init__(self, model: torch.nn.Module, settings: ReuseSettings | None = None, store: Any = None) -> None:
        self.settings = settings if settings is not None else settings_from_env()
        language_model = model.model
        self.num_layers = language_model.end_layer - language_model.start_layer
        if language_model.start_layer != 0 or not language_model.pp_group.is_last_rank:
            raise ValueError("samcache: the SGLang plugin does not support pipeline parallelism")
        from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size

        if get_tensor_model_parallel_world_size() != 1:
            raise ValueError("samcache: the SGLang plugin runs with --tp-size 1 in this version")
        if getattr(language_model, "use_hf_deepstack_order", False):
            raise ValueError("samcache: the SGLang plugin does not support the HF deepstack order (RL on-policy mode)")
        self.rotary = Rotary.of(language_model.layers[0].self_attn.rotary_emb, "SGLang")
        self.attention_layers = [layer.self_attn.attn for layer in language_model.layers]
        profile = self.settings.reuse_profile(model_path(model), self.num_layers)
        config = getattr(model, "config", None)
        self.isolated = self.settings.isolated_serving(model_path(model), profile,
                                                       getattr(config, "vision_start_token_id", None))
        if self.isolated is not None:  # exact at any index: nothing recomputed, the order kept only if asked
            if getattr(language_model, "deepstack_embed_to_decoder_layer", None):
                raise ValueError("samcache: isolated image attention is not served for deepstack models (Qwen3-VL) "
                                 "in this version")
            self.budget, self.keep_image_order = None, self.settings.keep_image_order is True
        else:
            self.budget = self.settings.budget(self.num_layers, profile)
            self.keep_image_order = self.settings.keeps_image_order(self.num_layers, profile)
        self.store = store if store is not None else _process_store()
        self.policy = StorePolicy(self.settings, self.store)
        dtype = next(model.parameters()).dtype
        self.model_id = model_id(model, dtype)
        self._tree_safe = tree_keeps_approximate_out()  # None outside a server: tools and tests
        self._warned = self._warned_tree = False

    def namespace_of(self, forward_batch: Any):
        """The namespace of each request: the model and its tenant (the configured tenant with the
        request's SGLang ``extra_key`` and ``cache_salt``, recorded by the plugin's batch hook)."""
        extra = getattr(forward_batch, "samcache_extra_keys", None)

        def namespace(b: int) -> Namespace:
            keys = list(extra[b]) if extra is not None else [None, None]
            # JSON keeps the parts apart (no separator inside a value can join two tenants).
            return Namespace(self.model_id, json.dumps([self.settings.tenant, *keys]))

        return namespace

    def observe(self, forward_batch: Any) -> None:
        """Tell the store's eviction policy which agent ran which images in this extend step
        (nothing for plain LRU)."""
        if not self.policy.tracks:
            return
        agents = getattr(forward_batch, "samcache_agents", None) or ()
        namespace = self.namespace_of(forward_batch)
        mm_inputs = forward_batch.mm_inputs or [None] * len(agents)
        for b, (rid, agent) in enumerate(agents):
            refs = image_refs(mm_inputs[b]) if b < len(mm_inputs) and mm_inputs[b] is not None else []
            self.policy.observe(rid if rid is not None else ("batch", id(forward_batch), b), agent,
                                [image_key(namespace(b), r.content, index, self.keep_image_order)
                                 for index, r in enumerate(refs) if r.content is not None])
        self.policy.apply()  # before this step's images are stored (and others evicted)

    def begin(self, forward_batch: Any) -> SglangStep | None:
        """Plan this forward (splicing stored images into the pool); None: SGLang's own path."""
        mode = forward_batch.forward_mode
        if not mode.is_extend() or mode.is_target_verify():
            return None
        self.observe(forward_batch)
        if not forward_batch.contains_image_inputs():
            return None
        if any(lora is not None for lora in (forward_batch.lora_ids or ())):
            return None  # an adapter changes an image's KV, and its token segments cannot be subset
        if self._tree_safe is False:
            if not self._warned_tree:
                logger.warning("samcache: this server's prefix cache is not samcache's (--radix-cache-backend "
                               "samcache) and would serve spliced, approximate KV as exact: images are computed as "
                               "SGLang computes them")
                self._warned_tree = True
            return None
        backend = get_attn_backend()
        if not isinstance(backend, SamcacheAttnBackend):
            if not self._warned:
                logger.warning("samcache: the model override reuses images only with --attention-backend samcache "
                               "(this server runs %s): images are computed as SGLang computes them",
                               type(backend).__name__)
                self._warned = True
            return None
        cache = PoolWriter(backend.token_to_kv_pool, self.attention_layers)
        return plan_step(forward_batch, cache=cache, rotary=self.rotary, store=self.store,
                         namespace_of=self.namespace_of(forward_batch), budget=self.budget,
                         num_layers=self.num_layers, keep_image_order=self.keep_image_order, isolated=self.isolated)

    def finish(self, step: SglangStep, forward_batch: Any) -> None:
        if step.stats.isolated_fallbacks:
            logger.warning("samcache: %d image(s) of this isolated model could not be computed alone (split by a "
                           "chunk, first tokens from the prefix cache and no longer stored, or the prompt's first "
                           "token unknown): computed in context, kept out of the prefix cache",
                           step.stats.isolated_fallbacks)
        backend = get_attn_backend()
        save_images(step, forward_batch, PoolWriter(backend.token_to_kv_pool, self.attention_layers), self.store,
                    self.num_layers)
        _stats.add(step.stats)
        if self.settings.metrics_path:
            write_stats(self.settings.metrics_path)

    def hidden_states(self, model: torch.nn.Module, step: SglangStep, input_ids: torch.Tensor,
                      forward_batch: Any, embed_routine, **embed_kwargs) -> torch.Tensor:
        """The final hidden states of an extend step run on ``step``'s rows."""
        backend = get_attn_backend()
        backend.use_rows(step.rows)
        backend.use_side(step.side)
        real = getattr(forward_batch, "global_num_token_non_padded_cpu", None)
        if step.side is not None and real is not None:
            # SGLang takes the rows past this count for padding and drops them before attention.
            forward_batch.global_num_token_non_padded_cpu = int(real) + step.side.size
        try:
            return embed_routine(input_ids=input_ids, forward_batch=forward_batch,
                                 language_model=_RowsLanguageModel(model.model, step), multimodal_model=model,
                                 positions=forward_batch.mrope_positions, **embed_kwargs)
        finally:
            backend.use_rows(None)
            backend.use_side(None)
            if step.side is not None and real is not None:
                forward_batch.global_num_token_non_padded_cpu = real


class ReuseOverride:
    """What samcache adds to an SGLang Qwen-VL model class (mixed in before SGLang's class): a
    :class:`ModelReuse` built on first use, and the extend forward with reuse."""

    _samcache_reuse: ModelReuse | None = None
    _samcache_off = False

    def samcache_reuse(self) -> ModelReuse | None:
        """The model's :class:`ModelReuse`; None if the model cannot be served (e.g. scaled M-RoPE:
        then SGLang's path, logged once)."""
        if self._samcache_reuse is None and not self._samcache_off:
            try:
                self._samcache_reuse = ModelReuse(self)
            except ValueError as e:
                logger.error("%s: image reuse disabled", e)
                self._samcache_off = True
        return self._samcache_reuse

    def samcache_forward(self, input_ids, forward_batch, sglang_forward, embed_routine, **embed_kwargs):
        """``sglang_forward()`` (the model's own forward) unless this step reuses images; else the
        extend step on each layer's rows, then SGLang's logits processor."""
        if self.capture_aux_hidden_states or not self.is_mrope_enabled:
            return sglang_forward()
        reuse = self.samcache_reuse()
        step = reuse.begin(forward_batch) if reuse is not None else None
        if step is None or not step.sparse:
            out = sglang_forward()
            if step is not None:
                reuse.finish(step, forward_batch)
            return out
        hidden = reuse.hidden_states(self, step, input_ids, forward_batch, embed_routine, **embed_kwargs)
        reuse.finish(step, forward_batch)
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch)


__all__ = ["ENV_SETTINGS", "ModelReuse", "ReuseOverride", "reset_stats", "run_rows", "settings_from_env", "stats", "write_stats"]
