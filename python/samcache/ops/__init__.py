"""Python wrappers of the ``torch.ops.samcache`` kernels, one module per kernel family.

Each op is defined once in ``cpp/bindings/torch_ops.cpp`` with CPU and (when built) CUDA
implementations. Each module here documents the op contract, checks arguments before dispatch
and registers the op's fake (meta) implementation so it traces under ``torch.compile``.
"""

from samcache.ops.copy_blocks import copy_blocks
from samcache.ops.kv_quant import dequantize_kv_blocks, quantize_kv_blocks
from samcache.ops.token_merge import token_merge

__all__ = ["copy_blocks", "dequantize_kv_blocks", "quantize_kv_blocks", "token_merge"]
