"""copy_blocks: copy whole KV blocks for the BlockPool's copy-on-write pairs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


@torch.library.register_fake("samcache::copy_blocks")
def _copy_blocks_fake(caches: Sequence[torch.Tensor], block_pairs: torch.Tensor) -> None:
    torch._check(len(caches) > 0, lambda: "copy_blocks: caches is empty")
    torch._check(block_pairs.dim() == 2 and block_pairs.size(1) == 2, lambda: "block_pairs must be [n, 2]")


def copy_blocks(caches: Sequence[torch.Tensor], block_pairs: torch.Tensor | np.ndarray) -> None:
    """Copy block ``src`` to block ``dst`` in every cache, for each ``(src, dst)`` row.

    caches: tensors of identical shape ``[num_blocks, ...]``, dtype and device, contiguous
        (e.g. every layer's K and V cache); modified in place.
    block_pairs: int32/int64 ``[n, 2]`` on the CPU, as ``BlockPool.append_*`` returns in
        ``copies``. Destinations must be distinct and must not also be sources.
    """
    if isinstance(block_pairs, np.ndarray):
        block_pairs = torch.from_numpy(block_pairs)
    if not isinstance(block_pairs, torch.Tensor):
        raise TypeError(f"block_pairs must be a tensor or numpy array, got {type(block_pairs).__name__}")
    caches = list(caches)
    if not all(isinstance(c, torch.Tensor) for c in caches):
        raise TypeError("caches must be a sequence of tensors")
    torch.ops.samcache.copy_blocks(caches, block_pairs)


__all__ = ["copy_blocks"]
