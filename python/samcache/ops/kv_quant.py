"""kv_quant: scaled 8-bit quantization of paged KV blocks for the cold tiers.

A cache is ``[num_blocks, block_size, H, D]`` (float32, float16 or bfloat16). Each selected block
(or each head of it, ``per_head=True``) gets one float32 ``scale = amax / qmax`` with ``qmax`` 448
for ``"fp8_e4m3"`` and 127 for ``"int8"``; values are stored as ``x / scale`` rounded to nearest
(even) and saturated to ``[-qmax, qmax]``. Contract details: ``docs/ops/kv_quant.md``.
"""

from __future__ import annotations

import numpy as np
import torch

QTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
QMAX: dict[str, float] = {"fp8_e4m3": 448.0, "int8": 127.0}


def _check_qtype(qtype: str) -> torch.dtype:
    if qtype not in QTYPES:
        raise ValueError(f"kv_quant: unknown qtype {qtype!r} (expected 'fp8_e4m3' or 'int8')")
    return QTYPES[qtype]


@torch.library.register_fake("samcache::quantize_kv_blocks")
def _quantize_kv_blocks_fake(cache: torch.Tensor, block_ids: torch.Tensor, qtype: str, per_head: bool):
    dtype = _check_qtype(qtype)
    torch._check(cache.dim() == 4, lambda: "quantize_kv_blocks: cache must be [num_blocks, block_size, H, D]")
    torch._check(block_ids.dim() == 1, lambda: "quantize_kv_blocks: block_ids must be [n]")
    n = block_ids.shape[0]
    q = cache.new_empty((n, *cache.shape[1:]), dtype=dtype)
    scales = cache.new_empty((n, cache.shape[2]) if per_head else (n,), dtype=torch.float32)
    return q, scales


@torch.library.register_fake("samcache::dequantize_kv_blocks")
def _dequantize_kv_blocks_fake(q: torch.Tensor, scales: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    torch._check(q.dim() == 4 and cache.dim() == 4, lambda: "dequantize_kv_blocks: q and cache must be 4-D")
    torch._check(scales.dim() in (1, 2), lambda: "dequantize_kv_blocks: scales must be [n] or [n, H]")


def _as_ids(block_ids) -> torch.Tensor:
    if isinstance(block_ids, np.ndarray):
        block_ids = torch.from_numpy(block_ids)
    if not isinstance(block_ids, torch.Tensor):
        raise TypeError(f"block_ids must be a tensor or numpy array, got {type(block_ids).__name__}")
    return block_ids


def quantize_kv_blocks(
    cache: torch.Tensor,
    block_ids: torch.Tensor | np.ndarray,
    qtype: str = "fp8_e4m3",
    per_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize blocks ``block_ids`` of ``cache``; returns ``(q, scales)``.

    cache: ``[num_blocks, block_size, H, D]`` float32/float16/bfloat16, each block contiguous.
    block_ids: int32/int64 ``[n]``, on the CPU (validated) or on the cache's device.
    qtype: ``"fp8_e4m3"`` (q is ``torch.float8_e4m3fn``) or ``"int8"`` (q is ``torch.int8``).
    per_head: one scale per (block, head) instead of one per block.

    Returns q ``[n, block_size, H, D]`` and float32 scales ``[n]`` or ``[n, H]``; ``q * scale``
    restores the values. An all-zero group has scale 0 (restores exact zeros); a group holding a
    NaN or an infinity has scale NaN and q = 0 (restores as NaN).
    """
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"cache must be a tensor, got {type(cache).__name__}")
    if not isinstance(qtype, str):
        raise TypeError(f"qtype must be a str, got {type(qtype).__name__}")
    if not isinstance(per_head, bool):
        raise TypeError(f"per_head must be a bool, got {type(per_head).__name__}")
    _check_qtype(qtype)
    return torch.ops.samcache.quantize_kv_blocks(cache, _as_ids(block_ids), qtype, per_head)


def dequantize_kv_blocks(
    q: torch.Tensor, scales: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor | np.ndarray
) -> None:
    """Write ``q * scales`` into blocks ``block_ids`` of ``cache`` (in place, in the cache's dtype).

    q: float8_e4m3fn or int8 ``[n, block_size, H, D]`` as ``quantize_kv_blocks`` returns it.
    scales: float32 ``[n]`` (per block) or ``[n, H]`` (per head).
    cache: ``[num_blocks, block_size, H, D]`` float32/float16/bfloat16, each block contiguous.
    block_ids: int32/int64 ``[n]``, distinct, on the CPU (validated) or on the cache's device.
    """
    for name, t in (("q", q), ("scales", scales), ("cache", cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    torch.ops.samcache.dequantize_kv_blocks(q, scales, cache, _as_ids(block_ids))


__all__ = ["QTYPES", "dequantize_kv_blocks", "quantize_kv_blocks"]
