"""rope_qkv_write: a decoder layer's attention inputs in one kernel.

From the fused q/k/v projection of the rows a layer computes (``qkv`` ``[N, (heads + 2 kv_heads)
* head_dim]``), rotate q and k by RoPE with the rows' own ``cos`` and ``sin``, write the rotated
keys and the values into the layer's paged caches at ``slot_mapping``, and return the rotated
queries ``[N, heads, head_dim]``. In the layer loop this was about twenty torch ops (slices,
views, the rotation, the write): on a GPU, as many launches.

Rotation: rotate-half pairing over the whole head, ``x * cos + swap_halves(x) * sin`` where
``sin`` already carries rotate_half's sign (its first half negated). Each product and the sum
are rounded to the dtype as torch rounds the same expression, so the results are torch's bits.
Contracts: ``docs/ops/rope_qkv.md``.
"""

from __future__ import annotations

from numbers import Integral

import torch


@torch.library.register_fake("samcache::rope_qkv_write")
def _rope_qkv_write_fake(qkv, cos, sin, num_heads, num_kv_heads, key_cache, value_cache, slot_mapping):
    torch._check(qkv.dim() == 2 and cos.dim() == 2, lambda: "rope_qkv_write: qkv and cos must be 2-D")
    torch._check(qkv.size(1) == (num_heads + 2 * num_kv_heads) * cos.size(1),
                 lambda: "rope_qkv_write: qkv's columns must be (heads + 2 kv_heads) * head_dim")
    torch._check(key_cache.dim() == 4, lambda: "rope_qkv_write: key_cache must be [num_blocks, block_size, kv_heads, head_dim]")
    torch._check(slot_mapping.dim() == 1, lambda: "rope_qkv_write: slot_mapping must be 1-D")
    return qkv.new_empty((qkv.size(0), num_heads, cos.size(1)))


def rope_qkv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate, write K/V at ``slot_mapping`` (``-1`` skips a row), return the rotated queries.

    qkv: float32/float16/bfloat16, contiguous last dim (any row stride).
    cos, sin: ``[N, head_dim]`` of qkv's dtype and device, contiguous last dim; ``sin`` signed.
    key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, as ``paged_write``
        takes them; slot_mapping int32/int64 ``[N]`` on their device (checked on the CPU: range,
        no slot twice; on CUDA out-of-range slots are skipped unchecked, as ``paged_write``).
    """
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rope_qkv_write: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(n, Integral) or isinstance(n, bool):
            raise TypeError(f"rope_qkv_write: {name} must be an int, got {type(n).__name__}")
    return torch.ops.samcache.rope_qkv_write(qkv, cos, sin, int(num_heads), int(num_kv_heads), key_cache,
                                             value_cache, slot_mapping)


__all__ = ["rope_qkv_write"]
