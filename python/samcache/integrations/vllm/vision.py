"""samcache's attention kernel for the long non-causal attention of vLLM's vision tower (CPU).

Qwen2.5-VL's ViT has windowed blocks (64-patch windows) and full-attention blocks over all of an
image's patches (4,784 for a 1280x720 screenshot). vLLM runs both through ATen's SDPA; with the
plugin enabled, sequences of at least :data:`MIN_KERNEL_ROWS` patches go through
:func:`samcache.ops.full_attention` instead (1.7x faster than SDPA at that shape on this
project's machines; docs/benchmark.md), the windows stay with SDPA. Installed per module
(``MMEncoderAttention._forward_sdpa`` of the model's own vision tower), only when samcache's
connector is configured.
"""

from __future__ import annotations

import types

import torch

from samcache.ops import full_attention

MIN_KERNEL_ROWS = 512


def _count_kernel_sequence() -> None:
    from samcache.integrations.vllm.connector import active_worker

    worker = active_worker()  # the engine whose model this is: vLLM's KV connector of this process
    if worker is not None:
        worker.metrics.update(vit_kernel_sequences=1)


def _forward_sdpa(self, query, key, value, cu_seqlens=None):
    original = type(self)._forward_sdpa
    if cu_seqlens is None or query.dtype != torch.float32 or query.size(0) != 1:
        return original(self, query, key, value, cu_seqlens)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if max(lens) < MIN_KERNEL_ROWS:
        return original(self, query, key, value, cu_seqlens)
    from vllm.v1.attention.ops.vit_attn_wrappers import apply_sdpa

    bsz, q_len = query.size()[:2]
    is_reshaped = query.dim() != 4
    query, key, value = self.view_qkv_to_4d(query, key, value, bsz, q_len, key.size(1))
    outs = []
    for q, k, v in zip(query.split(lens, 1), key.split(lens, 1), value.split(lens, 1)):
        if q.size(1) >= MIN_KERNEL_ROWS:
            outs.append(full_attention(q[0], k[0], v[0], scale=self.scale)[None])
            _count_kernel_sequence()
        else:
            outs.append(apply_sdpa(q, k, v, scale=self.scale, enable_gqa=self.num_heads > self.num_kv_heads))
    output = torch.cat(outs, dim=1)
    return output.reshape(bsz, q_len, -1) if is_reshaped else output


def use_samcache_vision_attention(visual: torch.nn.Module) -> int:
    """Route ``visual``'s long attention through samcache's kernel on the CPU; the modules changed."""
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    changed = 0
    for module in visual.modules():
        if isinstance(module, MMEncoderAttention):
            module._forward_sdpa = types.MethodType(_forward_sdpa, module)
            changed += 1
    return changed
