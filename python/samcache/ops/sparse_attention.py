"""sparse_attention: block-sparse recompute attention.

When samcache reuses cached KV, only a few tokens are computed: the new ones and the 2-5%
selected for recompute. Their queries, at their own sequence indices, attend to the whole
paged KV of the sequence (reused + recomputed + new). The cost falls with the number of
queries, and key chunks no query can see (beyond its index or outside a sliding window) are
never touched.
"""

from __future__ import annotations

import math

import torch


@torch.library.register_fake("samcache::sparse_attention")
def _sparse_attention_fake(q, q_index, key_cache, value_cache, block_table, num_kv_tokens, scale, window=-1, logit_cap=0.0):
    torch._check(q.dim() == 3, lambda: "q must be [num_queries, num_q_heads, head_dim]")
    torch._check(key_cache.dim() == 4, lambda: "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim]")
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


def sparse_attention(
    q: torch.Tensor,
    q_index: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_kv_tokens: int,
    *,
    scale: float | None = None,
    window: int = -1,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` (queries at sequence indices ``q_index``) against one sequence's paged KV.

    q: ``[num_queries, num_q_heads, head_dim]`` (float32/float16/bfloat16).
    q_index: int32/int64 ``[num_queries]``, each query's token index in the sequence; its own
        K/V must already be in the cache. Query i sees keys ``j <= q_index[i]`` (and
        ``j > q_index[i] - window`` when ``window > 0``).
    key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype;
        ``num_q_heads`` must be a multiple of ``num_kv_heads`` (GQA).
    block_table: int32/int64 blocks of the sequence; tokens ``0 .. num_kv_tokens-1`` are used.
    scale: logit scale, default ``1/sqrt(head_dim)``. logit_cap > 0: ``cap * tanh(logit / cap)``.

    Returns ``(out [num_queries, num_q_heads, head_dim] in q's dtype, lse [num_queries,
    num_q_heads] float32)``, lse being the natural log of the softmax denominator, so partial
    results over disjoint key sets can be merged.
    """
    for name, t in (("q", q), ("q_index", q_index), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if isinstance(num_kv_tokens, bool) or not isinstance(num_kv_tokens, int):
        raise TypeError(f"num_kv_tokens must be an int, got {type(num_kv_tokens).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.samcache.sparse_attention(
        q, q_index, key_cache, value_cache, block_table, num_kv_tokens, float(scale), int(window), float(logit_cap)
    )


__all__ = ["sparse_attention"]
