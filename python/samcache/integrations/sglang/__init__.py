"""samcache inside SGLang: image KV reused at new positions, with one flag.

``pip install samcache`` registers :func:`register` under SGLang's ``sglang.srt.plugins`` entry
point; SGLang's ``load_plugins()`` calls it in the server, engine and scheduler processes. Through
SGLang's own registries it adds

- the attention backend ``samcache`` (:mod:`.attention`) and its ``--attention-backend`` choice;
- model overrides for Qwen2.5-VL (:mod:`.models`), SGLang's classes plus reuse in their extend
  forward, active with ``--attention-backend samcache`` (SGLang's own path otherwise);
- the radix-cache backend ``samcache`` (``--radix-cache-backend samcache``, :mod:`.radix`);
- a HiCache storage backend over samcache's store (``--hicache-storage-backend dynamic`` with
  ``module_path`` ``samcache.integrations.sglang.hicache``, :mod:`.hicache`);
- a hook that records each request's ``extra_key`` and ``cache_salt`` (SGLang's cache isolation
  keys) on the forward batch, so image KV is reused only within a tenant.

A user runs::

    python -m sglang.launch_server --model-path Qwen/Qwen2.5-VL-7B-Instruct \\
        --attention-backend samcache --radix-cache-backend samcache \\
        --cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled

Settings come from ``SAMCACHE_SGLANG`` (JSON: ``recompute_ratio``, ``recompute_rates``,
``head_fraction``, ``store_bytes``, ``tenant``, ``eviction_policy``, ``eviction_options``; a
request names its agent with ``routing_key``: :mod:`samcache.integrations.store_policy`);
``SAMCACHE_SGLANG_PLUGIN=0`` turns the plugin off.
"""

from __future__ import annotations

import logging
import os

from samcache.integrations.sglang.exactness import BACKEND_NAME

logger = logging.getLogger("sglang.samcache")

# The SGLang releases whose classes the plugin is tested against (its plug points move between
# minor versions): [MIN, MAX_EXCLUSIVE).
SUPPORTED_SGLANG = ("0.5.23", "0.6")

_registered = False


def check_version(version: str) -> None:
    """Raise a clear error when SGLang ``version`` is outside the supported range."""
    from packaging.version import InvalidVersion, Version

    low, high = SUPPORTED_SGLANG
    try:
        v = Version(version)
    except InvalidVersion:
        raise RuntimeError(f"samcache: cannot read SGLang's version {version!r}; the plugin supports "
                           f"sglang>={low},<{high}") from None
    if not Version(low) <= Version(v.base_version) < Version(high):
        raise RuntimeError(f"samcache: the SGLang plugin supports sglang>={low},<{high}, this is sglang {version}; "
                           f"install a supported SGLang or set SAMCACHE_SGLANG_PLUGIN=0")


def _record_extra_keys(forward_batch, *args, **kwargs):
    """AFTER hook of ``ForwardBatch.init_new``: keep each request's isolation keys (SGLang's
    ``extra_key`` and ``cache_salt``): together with the configured tenant, its tenant; and its id
    and ``routing_key`` (the agent it names, for the store's eviction policy); and the requests
    themselves (:func:`samcache.integrations.sglang.exactness.mark_batch`)."""
    batch = next((a for a in args if hasattr(a, "reqs")), kwargs.get("batch"))
    reqs = getattr(batch, "reqs", None)
    if forward_batch is not None and reqs is not None:
        forward_batch.samcache_extra_keys = [(getattr(r, "extra_key", None), getattr(r, "cache_salt", None))
                                             for r in reqs]
        forward_batch.samcache_agents = [(getattr(r, "rid", None), getattr(r, "routing_key", None)) for r in reqs]
        forward_batch.samcache_reqs = list(reqs)  # to mark those whose KV a splice leaves approximate
    return forward_batch


def register() -> None:
    """SGLang's plugin hook (idempotent)."""
    global _registered
    if _registered or os.environ.get("SAMCACHE_SGLANG_PLUGIN", "1") == "0":
        return
    import sglang

    check_version(sglang.__version__)  # before any import that only a supported release has
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from samcache.integrations.sglang.attention import create_samcache_backend
    from samcache.integrations.sglang.reuse import settings_from_env

    settings_from_env()  # a typo in SAMCACHE_SGLANG stops the server now, naming the key
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_samcache_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in registered_radix_cache_backends():
        from samcache.integrations.sglang.radix import make_radix_cache

        register_radix_cache_backend(BACKEND_NAME, make_radix_cache)
    ModelRegistry.register("samcache.integrations.sglang.models", overwrite=True, strict=True)
    HookRegistry.register("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
                          _record_extra_keys, HookType.AFTER)
    _registered = True


def stats():
    """This process's reuse counters (:class:`~samcache.integrations.sglang.step.ReuseStats`)."""
    from samcache.integrations.sglang.reuse import stats as _stats

    return _stats()


__all__ = ["BACKEND_NAME", "SUPPORTED_SGLANG", "check_version", "register", "stats"]
