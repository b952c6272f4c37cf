"""paged_kv: move KV between token-major tensors and paged caches, and blocks between caches.

A paged cache is one tensor per layer for K and one for V, shaped
``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot id = ``block * block_size +
offset``, exactly as ``BlockPool.append_*`` returns it. The ops copy bytes without converting
them, so any dtype works (float32/float16/bfloat16 KV, later int8/fp8 quantized KV).

- ``paged_write``: new tokens' K/V into their slots (after the pool's ``copy_blocks`` pairs).
- ``paged_gather``: one sequence's K/V back as contiguous ``[num_tokens, heads, head_dim]``.
- ``swap_blocks``: blocks between two caches, e.g. GPU <-> pinned host for tiering.

Contracts and errors: ``docs/ops/paged_kv.md``.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch

IndexLike = Union[torch.Tensor, np.ndarray]


def _check_tensors(op: str, **tensors: object) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _index_tensor(op: str, name: str, values: object) -> torch.Tensor:
    """A tensor of indices; numpy arrays (BlockPool's outputs) become CPU tensors."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":
            raise TypeError(f"{op}: {name} must hold integers, got numpy dtype {values.dtype}")
        return torch.from_numpy(np.ascontiguousarray(values))
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor or numpy array, got {type(values).__name__}")
    return values


@torch.library.register_fake("samcache::paged_write")
def _paged_write_fake(key, value, key_cache, value_cache, slot_mapping) -> None:
    torch._check(key_cache.dim() == 4, lambda: "paged_write: key_cache must be [num_blocks, block_size, heads, head_dim]")
    torch._check(value_cache.shape == key_cache.shape, lambda: "paged_write: value_cache must match key_cache")
    torch._check(key.dim() == 3 and value.shape == key.shape, lambda: "paged_write: key/value must be [N, heads, head_dim]")
    torch._check(slot_mapping.dim() == 1, lambda: "paged_write: slot_mapping must be 1-D")
    torch._check(slot_mapping.size(0) == key.size(0), lambda: "paged_write: slot_mapping needs one slot per token")


@torch.library.register_fake("samcache::paged_gather")
def _paged_gather_fake(key_cache, value_cache, block_table, num_tokens):
    torch._check(key_cache.dim() == 4, lambda: "paged_gather: key_cache must be [num_blocks, block_size, heads, head_dim]")
    torch._check(value_cache.shape == key_cache.shape, lambda: "paged_gather: value_cache must match key_cache")
    torch._check(block_table.dim() == 1, lambda: "paged_gather: block_table must be 1-D")
    torch._check(num_tokens >= 0, lambda: "paged_gather: num_tokens must be >= 0")
    torch._check(
        num_tokens <= block_table.size(0) * key_cache.size(1), lambda: "paged_gather: block_table is too short"
    )
    shape = (num_tokens, key_cache.size(2), key_cache.size(3))
    return key_cache.new_empty(shape), value_cache.new_empty(shape)


@torch.library.register_fake("samcache::swap_blocks")
def _swap_blocks_fake(src, dst, block_pairs) -> None:
    torch._check(src.dim() >= 1 and src.shape[1:] == dst.shape[1:], lambda: "swap_blocks: per-block shapes differ")
    torch._check(block_pairs.dim() == 2 and block_pairs.size(1) == 2, lambda: "swap_blocks: block_pairs must be [n, 2]")


def paged_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: IndexLike,
) -> None:
    """Write token ``i``'s K/V (``key[i]``, ``value[i]``) at slot ``slot_mapping[i]`` of the caches.

    key, value: ``[N, heads, head_dim]``, the caches' dtype and device; any token and head
        strides (e.g. slices of a fused QKV projection) but a contiguous last dim.
    key_cache, value_cache: contiguous ``[num_blocks, block_size, heads, head_dim]``; modified.
    slot_mapping: int32/int64 ``[N]`` on the caches' device (a numpy array, as
        ``BlockPool.append_tokens`` returns, is moved there); ``-1`` skips the token (padding).
        On the CPU out-of-range (``IndexError``) and duplicate (``ValueError``) slots are
        rejected before anything is written; on CUDA the indices cannot be read without a
        sync, so out-of-range slots are skipped and duplicates leave one of the tokens.
    """
    _check_tensors("paged_write", key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    if isinstance(slot_mapping, np.ndarray):
        slot_mapping = _index_tensor("paged_write", "slot_mapping", slot_mapping).to(key_cache.device)
    slot_mapping = _index_tensor("paged_write", "slot_mapping", slot_mapping)
    torch.ops.samcache.paged_write(key, value, key_cache, value_cache, slot_mapping)


def paged_gather(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: IndexLike, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``0 .. num_tokens - 1`` of the sequence with ``block_table``, as new contiguous
    ``[num_tokens, heads, head_dim]`` K and V tensors on the caches' device.

    block_table: int32/int64 ``[num_table_blocks]`` on the CPU (numpy accepted, as
        ``BlockPool.block_table`` returns) or on the caches' device;
        ``num_table_blocks * block_size >= num_tokens``. A CPU table's used entries are checked
        (``IndexError``); on CUDA a device table cannot be, so tokens of an out-of-range block
        come back as zeros.
    """
    _check_tensors("paged_gather", key_cache=key_cache, value_cache=value_cache)
    block_table = _index_tensor("paged_gather", "block_table", block_table)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
        raise TypeError(f"paged_gather: num_tokens must be an int, got {type(num_tokens).__name__}")
    return torch.ops.samcache.paged_gather(key_cache, value_cache, block_table, int(num_tokens))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_pairs: IndexLike) -> None:
    """Copy block ``s`` of ``src`` to block ``d`` of ``dst`` for each ``(s, d)`` row of ``block_pairs``.

    src, dst: contiguous caches with the same per-block shape and dtype (block counts may
        differ), on any of: GPU and pinned host (tiering, either direction), the same GPU, CPU.
    block_pairs: CPU int32/int64 ``[n, 2]`` (numpy accepted); destinations distinct; if src and
        dst are the same tensor no destination may also be a source.

    On CUDA the copies run on the *current* stream of the GPU involved; choose it with
    ``with torch.cuda.stream(s):``. GPU memory and pinned host memory are copied by one kernel
    for all pairs (pinned memory through its mapped address); pageable host memory, and pinned
    host memory in runs averaging >= 1 MiB, by ``cudaMemcpyAsync`` per run of consecutive blocks
    (``SAMCACHE_SWAP_BLOCKS=kernel|memcpy`` forces a path). The call is asynchronous with respect
    to the host only when the host side is pinned (``tensor.pin_memory()``), and then the caller
    must keep ``src`` and ``dst`` alive (and not reuse the host buffer) until the stream has
    reached the copy, e.g. by waiting on an event recorded after the call.
    """
    _check_tensors("swap_blocks", src=src, dst=dst)
    torch.ops.samcache.swap_blocks(src, dst, _index_tensor("swap_blocks", "block_pairs", block_pairs))


__all__ = ["paged_gather", "paged_write", "swap_blocks"]
