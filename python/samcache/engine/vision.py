"""The vision tower at engine speed on the CPU.

The checkpoint's own vision modules run unchanged, with two routes swapped in for the duration
of a ``with fast_vision(visual):`` block:

- every ``nn.Linear`` computes through oneDNN (``samcache.engine.linear``);
- long non-causal attention (the full-attention blocks of Qwen-VL's ViT see all of an image's
  patches: 4,784 for a 1280x720 screenshot, 16-dim heads) goes through samcache's own attention
  kernel: each patch is a query row at the last position of one sequence holding the image's
  keys, so it sees them all. On this project's machines that is 1.7x faster than ATen's SDPA at
  that shape (docs/benchmark.md). Short windows (64 patches) stay with SDPA.

transformers picks a module's attention function by its config's ``_attn_implementation``; the
block registers ours under :data:`ATTENTION_NAME` (transformers' ``AttentionInterface``, its public
plug point) and sets it on the vision config, then restores the previous value.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from samcache.engine.linear import onednn_linears

ATTENTION_NAME = "samcache_vision"
MIN_KERNEL_ROWS = 512  # shorter runs (windowed attention) stay with SDPA


def _attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, is_causal=None, **kwargs):
    """transformers' attention-function contract: [B, H, L, D] inputs -> ([B, L, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, n, d = query.shape
    usable = (b == 1 and attention_mask is None and not is_causal and query.device.type == "cpu" and n >= MIN_KERNEL_ROWS
              and key.shape == query.shape and query.dtype == torch.float32 and d <= 256 and not dropout)
    if not usable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    from samcache.ops import full_attention

    out = full_attention(*(t[0].transpose(0, 1) for t in (query, key, value)), scale=scaling)
    return out[None], None


_SWITCH_LOCK = threading.Lock()


@contextlib.contextmanager
def fast_vision(visual: torch.nn.Module):
    """Inside the block, ``visual``'s linear layers run through oneDNN and its long attention
    through samcache's kernel (see the module docstring)."""
    from transformers import AttentionInterface

    # One block at a time: engines sharing weights (share_weights_with) may encode from several
    # threads, and the switch below is on the shared module.
    with _SWITCH_LOCK:
        AttentionInterface.register(ATTENTION_NAME, _attention)
        config = visual.config
        previous = config._attn_implementation
        config._attn_implementation = ATTENTION_NAME
        try:
            with onednn_linears(visual):
                yield visual
        finally:
            config._attn_implementation = previous


__all__ = ["ATTENTION_NAME", "fast_vision"]
