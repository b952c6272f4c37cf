"""The plugin's settings: ``kv_connector_extra_config`` of vLLM's ``--kv-transfer-config``.

Checked when the connector starts (in vLLM's scheduler and in every worker), so a typo or a value
out of range stops ``vllm serve`` / ``LLM(...)`` at start-up with a message naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from samcache.integrations.settings import ReuseSettings

CONNECTOR_NAME = "SamcacheConnector"
# Architectures whose vLLM model class the plugin replaces (samcache.integrations.vllm.model).
SUPPORTED_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)


@dataclass(frozen=True)
class SamcacheVllmConfig(ReuseSettings):
    """The plugin's :class:`~samcache.integrations.settings.ReuseSettings`, read from
    ``kv_connector_extra_config`` (a request's ``cache_salt`` is its tenant; ``tenant`` is the
    default of requests without one)."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "SamcacheVllmConfig":
        return cls.from_mapping(extra, source="kv_connector_extra_config")


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
