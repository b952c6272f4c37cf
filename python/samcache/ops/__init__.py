"""Python wrappers of the ``torch.ops.samcache`` kernels, one module per kernel family.

Each op is defined once in ``cpp/bindings/torch_ops.cpp`` with CPU and (when built) CUDA
implementations. Each module here documents the op contract, checks arguments before dispatch
and registers the op's fake (meta) implementation so it traces under ``torch.compile``.
"""

from samcache.ops.copy_blocks import copy_blocks
from samcache.ops.kv_quant import dequantize_kv_blocks, quantize_kv_blocks
from samcache.ops.paged_kv import paged_gather, paged_write, swap_blocks
from samcache.ops.rms_norm import add_rms_norm, rms_norm
from samcache.ops.rope import rope_rerotate, rope_rerotate_write
from samcache.ops.rope_qkv import rope_qkv_write
from samcache.ops.sparse_attention import AttentionMetadata, full_attention, sparse_attention
from samcache.ops.token_merge import token_merge

__all__ = [
    "AttentionMetadata",
    "add_rms_norm",
    "copy_blocks",
    "dequantize_kv_blocks",
    "full_attention",
    "paged_gather",
    "paged_write",
    "quantize_kv_blocks",
    "rms_norm",
    "rope_qkv_write",
    "rope_rerotate",
    "rope_rerotate_write",
    "sparse_attention",
    "swap_blocks",
    "token_merge",
]
