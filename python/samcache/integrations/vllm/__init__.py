"""samcache inside vLLM: image KV reused at new positions, with one flag.

``pip install samcache`` registers :func:`register` under vLLM's ``vllm.general_plugins`` entry
point; vLLM calls it in every process it starts. It registers

- the KV connector ``SamcacheConnector`` (:mod:`.connector`), which does nothing until enabled::

      vllm serve MODEL --kv-transfer-config \\
        '{"kv_connector": "SamcacheConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"recompute_ratio": 0.05}}'

  or ``LLM(MODEL, kv_transfer_config=KVTransferConfig(kv_connector="SamcacheConnector",
  kv_role="kv_both", kv_connector_extra_config={...}))``;
- Qwen2.5-VL's model class (:mod:`.model`) and vLLM's CPU attention backend (:mod:`.attention`),
  both vLLM's own unless the connector is enabled (they can compute a subset of a step's rows).

``SAMCACHE_VLLM_PLUGIN=0`` in the environment turns the whole plugin off.
"""

from __future__ import annotations

import os

from samcache.integrations.vllm.config import CONNECTOR_NAME, SamcacheVllmConfig
from samcache.integrations.vllm.metrics import PluginMetrics, read_metrics

_registered = False


def register() -> None:
    """vLLM's plugin hook (idempotent): register the connector, model and attention overrides."""
    global _registered
    if _registered or os.environ.get("SAMCACHE_VLLM_PLUGIN", "1") == "0":
        return
    from vllm import ModelRegistry
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "samcache.integrations.vllm.connector",
                                              "SamcacheConnector")
    ModelRegistry.register_model("Qwen2_5_VLForConditionalGeneration",
                                 "samcache.integrations.vllm.model:SamcacheQwen2_5_VLForConditionalGeneration")
    register_backend(AttentionBackendEnum.CPU_ATTN, "samcache.integrations.vllm.attention.SamcacheCPUAttentionBackend")
    _registered = True


__all__ = ["CONNECTOR_NAME", "PluginMetrics", "SamcacheVllmConfig", "read_metrics", "register"]
