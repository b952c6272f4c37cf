"""token_merge: compress visual tokens by merging each into an anchor by weighted average.

``target[i] == i`` keeps token ``i`` as an anchor; otherwise token ``i`` merges into anchor
``target[i]``. Each anchor's output row is the weight-normalised sum of its members (itself
included). Contract details: ``docs/ops/token_merge.md``.
"""

from __future__ import annotations

import torch


@torch.library.register_fake("samcache::token_merge")
def _token_merge_fake(hidden: torch.Tensor, target: torch.Tensor, weight: torch.Tensor):
    torch._check(hidden.dim() == 2, lambda: "token_merge: hidden must be [N, D]")
    torch._check(target.dim() == 1 and weight.dim() == 1, lambda: "token_merge: target and weight must be [N]")
    # The number of anchors depends on target's values.
    m = torch.library.get_ctx().new_dynamic_size()
    return hidden.new_empty((m, hidden.shape[1])), target.new_empty((m,))


def token_merge(hidden: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge tokens into anchors; returns ``(merged [M, D], kept_index int64 [M])``.

    hidden: ``[N, D]`` float32/float16/bfloat16.
    target: int64 ``[N]``; ``target[i] == i`` for an anchor, else the anchor ``j`` token ``i``
        merges into (``target[j] == j``).
    weight: float32 ``[N]``, finite and ``>= 0``; every anchor's members must weigh more than 0,
        and their float32 total must stay finite. Bad plans raise the same exception with the
        same message on CPU and CUDA.

    ``kept_index`` lists the anchors in ascending order and ``merged[r]`` is the weighted mean
    (accumulated in float32, returned in hidden's dtype) of the tokens whose target is
    ``kept_index[r]``.
    """
    for name, t in (("hidden", hidden), ("target", target), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    return torch.ops.samcache.token_merge(hidden, target, weight)


__all__ = ["token_merge"]
