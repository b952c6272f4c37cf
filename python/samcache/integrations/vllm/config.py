"""The plugin's settings: ``kv_connector_extra_config`` of vLLM's ``--kv-transfer-config``.

Checked when the connector starts (in vLLM's scheduler and in every worker), so a typo or a value
out of range stops ``vllm serve`` / ``LLM(...)`` at start-up with a message naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from samcache._checks import check_fraction, check_int

CONNECTOR_NAME = "SamcacheConnector"
# Architectures whose vLLM model class the plugin replaces (samcache.integrations.vllm.model).
SUPPORTED_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)


@dataclass(frozen=True)
class SamcacheVllmConfig:
    """``recompute_ratio``: fraction of a reused image's tokens recomputed at every layer (0: none,
    1: all, i.e. outputs equal vLLM's own prefill); ``recompute_rates``: per-layer fractions
    instead (non-increasing with depth, one per decoder layer; overrides the ratio);
    ``head_fraction``: share of each image's quota spent on its first tokens (track 1);
    ``store_bytes``: byte bound of the image-KV store (least recently used images go first);
    ``tenant``: default tenant of requests without a ``cache_salt`` (a request's cache_salt is its
    tenant); ``metrics_path``: a JSON file the worker rewrites after every step that reused or
    saved images (the counters of :mod:`samcache.integrations.vllm.metrics`)."""

    recompute_ratio: float = 0.05
    recompute_rates: tuple[float, ...] | None = None
    head_fraction: float = 0.1
    store_bytes: int = 1 << 30
    tenant: str = "default"
    metrics_path: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "SamcacheVllmConfig":
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"samcache: unknown kv_connector_extra_config key(s) {unknown}; "
                             f"known keys: {sorted(known)}")
        ratio = check_fraction("samcache: recompute_ratio", extra.get("recompute_ratio", cls.recompute_ratio))
        rates = extra.get("recompute_rates")
        if rates is not None:
            if isinstance(rates, (str, bytes)) or not hasattr(rates, "__iter__"):
                raise ValueError(f"samcache: recompute_rates must be a list of numbers in [0, 1], got {rates!r}")
            rates = tuple(check_fraction("samcache: recompute_rates[i]", r) for r in rates)
            if not rates or any(b > a for a, b in zip(rates, rates[1:])):
                raise ValueError(f"samcache: recompute_rates must be non-empty and non-increasing with depth, "
                                 f"got {list(rates)}")
        head = check_fraction("samcache: head_fraction", extra.get("head_fraction", cls.head_fraction))
        store = check_int("samcache: store_bytes", extra.get("store_bytes", cls.store_bytes), 1)
        tenant = extra.get("tenant", cls.tenant)
        if not isinstance(tenant, str):
            raise ValueError(f"samcache: tenant must be a string, got {tenant!r}")
        path = extra.get("metrics_path")
        if path is not None and (not isinstance(path, str) or not path):
            raise ValueError(f"samcache: metrics_path must be a non-empty string, got {path!r}")
        return cls(recompute_ratio=ratio, recompute_rates=rates, head_fraction=head, store_bytes=store,
                   tenant=tenant, metrics_path=path)

    def layer_rates(self, num_layers: int) -> tuple[float, ...]:
        """The per-layer recompute rates for a model of ``num_layers`` decoder layers."""
        if self.recompute_rates is None:
            return (self.recompute_ratio,) * num_layers
        if len(self.recompute_rates) != num_layers:
            raise ValueError(f"samcache: recompute_rates has {len(self.recompute_rates)} entries, "
                             f"the model has {num_layers} decoder layers")
        return self.recompute_rates


def check_engine_config(vllm_config: Any) -> None:
    """Refuse, at start-up, what the plugin cannot serve correctly (vLLM's VllmConfig)."""
    model = vllm_config.model_config
    archs = list(getattr(model.hf_config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"samcache: the vLLM plugin supports {list(SUPPORTED_ARCHITECTURES)}, this model is "
                         f"{archs or 'of an unknown architecture'}")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1 or parallel.tensor_parallel_size != 1:
        raise ValueError("samcache: the vLLM plugin runs with tensor_parallel_size=1 and "
                         "pipeline_parallel_size=1 in this version")
    if getattr(vllm_config, "lora_config", None) is not None:
        raise ValueError("samcache: the vLLM plugin does not support LoRA in this version (an image's KV depends "
                         "on the adapter, and the adapter rows of a step cannot be subset)")
    rope = getattr(model.hf_config, "text_config", model.hf_config)
    rope = getattr(rope, "rope_parameters", None) or getattr(rope, "rope_scaling", None) or {}
    rope = dict(rope) if hasattr(rope, "keys") else {"rope_type": str(rope)}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope") or rope.get("factor"):
        raise ValueError(f"samcache: the vLLM plugin supports unscaled M-RoPE only, the model has {rope}")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise ValueError("samcache: the vLLM plugin runs on vLLM's CPU backend in this version "
                         "(the GPU attention path is not written yet)")
    if vllm_config.cache_config.cache_dtype != "auto":
        raise ValueError(f"samcache: the vLLM plugin needs kv_cache_dtype='auto' in this version, got "
                         f"{vllm_config.cache_config.cache_dtype!r}")
    if vllm_config.speculative_config is not None:
        raise ValueError("samcache: the vLLM plugin does not support speculative decoding")
