"""sparse_attention for contiguous query runs through torch's own flash attention (varlen).

A prefill, a prompt's suffix after a cached prefix and every layer that computes all of a step's
rows have one run of consecutive positions per sequence: that is ordinary causal attention over
the sequence's first ``end`` keys, which torch's FlashAttention kernel
(``aten._flash_attention_forward`` with cumulative sequence lengths) does at library speed. Its
causal mask is aligned to the bottom right (query ``i`` of ``n`` sees keys up to
``i + end - n``), exactly "row at position p sees keys <= p" for a run ending at ``end - 1``.

Flash attention reads keys from contiguous memory with pages of 256 tokens or more, so each
sequence's keys are first gathered out of the paged cache (one ``index_select`` of the slots,
planned once per step: a read and a write of the keys, a few percent of the attention's time).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .host_arrays import upload


@dataclass(frozen=True)
class FlashLayout:
    """One step's runs as flash attention takes them (device tensors, built once per step)."""

    cu_seq_q: torch.Tensor  # int32 [R+1]
    cu_seq_k: torch.Tensor  # int32 [R+1]
    slots: torch.Tensor  # int64 [sum of key lengths]: cache rows of each run's keys, runs concatenated
    max_q: int
    max_k: int
    min_q: int  # the shortest run
    row_run: torch.Tensor  # int64 [T]: each row's run, and its offset in it (a padded lse's index)
    row_offset: torch.Tensor


def plan_layout(host, device: torch.device) -> FlashLayout | None:
    """The flash layout of a batch whose host mirror is ``host`` (``HostMetadata``), or None when
    some sequence's rows are not one run of consecutive positions."""
    qo, pos, bs = host.qo_indptr, host.q_pos, host.block_size
    cu_q, cu_k, slots = [0], [0], []
    for b in range(len(qo) - 1):
        p = pos[qo[b]: qo[b + 1]]
        if not p.size:
            continue
        if np.any(np.diff(p) != 1):
            return None
        end = int(p[-1]) + 1
        pages = host.kv_indices[host.kv_indptr[b]: host.kv_indptr[b + 1]]
        tok = np.arange(end, dtype=np.int64)
        slots.append(pages[tok // bs].astype(np.int64) * bs + tok % bs)
        cu_q.append(cu_q[-1] + int(p.size))
        cu_k.append(cu_k[-1] + end)
    if len(cu_q) == 1:
        return None

    lengths = np.diff(cu_q)
    run_of_row = np.repeat(np.arange(lengths.size), lengths)
    offset = np.arange(cu_q[-1]) - np.repeat(np.asarray(cu_q[:-1]), lengths)
    cu_q_t, cu_k_t = upload([cu_q, cu_k], np.int32, device)
    slots_t, run_t, offset_t = upload([np.concatenate(slots), run_of_row, offset], np.int64, device)
    return FlashLayout(cu_q_t, cu_k_t, slots_t, int(lengths.max()), int(np.diff(cu_k).max()), int(lengths.min()),
                       run_t, offset_t)


def supported(q: torch.Tensor, logit_cap: float) -> bool:
    """Whether torch's flash kernel can serve these queries (CUDA, fp16/bf16, head_dim a multiple
    of 8 up to 256, no logit cap, compute capability >= 8.0)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or logit_cap > 0:
        return False
    d = q.shape[-1]
    if d % 8 or d > 256 or d == 0:
        return False
    return torch.cuda.get_device_capability(q.device)[0] >= 8 and torch.backends.cuda.flash_sdp_enabled()


def run(q: torch.Tensor, layout: FlashLayout, key_cache: torch.Tensor, value_cache: torch.Tensor, *, scale: float,
        window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the runs' rows (q ``[T, Hq, D]``, runs in order) over their gathered keys.
    Returns ``(out [T, Hq, D], lse [T, Hq] float32)``."""
    heads, dim = key_cache.shape[2], key_cache.shape[3]
    k = key_cache.view(-1, heads, dim).index_select(0, layout.slots)
    v = value_cache.view(-1, heads, dim).index_select(0, layout.slots)
    kwargs = {"scale": float(scale)}
    if window > 0:  # keys j > p - window: window - 1 keys to the left of the diagonal
        kwargs.update(window_size_left=int(window) - 1, window_size_right=0)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q.contiguous(), k, v, layout.cu_seq_q, layout.cu_seq_k, layout.max_q, layout.max_k, 0.0, True, False, **kwargs)
    if lse.dim() == 2:  # [heads, total rows]
        lse = lse.t()
    else:  # padded per run: [runs, heads, max_q]
        lse = lse.permute(0, 2, 1)[layout.row_run, layout.row_offset]
    return out, lse


__all__ = ["FlashLayout", "plan_layout", "run", "supported"]
