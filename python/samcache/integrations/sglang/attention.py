"""``--attention-backend samcache``: SGLang's attention contract on samcache's batched kernel.

One :class:`~samcache.ops.sparse_attention.AttentionMetadata` is built per step from SGLang's
``req_to_token`` table (``init_forward_metadata``); every layer then runs one
``torch.ops.samcache.sparse_attention`` call over SGLang's own KV pool, read in place (the pool's
``[tokens, heads, dim]`` buffer viewed as pages of ``page_size`` tokens), for EXTEND (with cached
prefixes), DECODE and MIXED batches alike: a query row sees the keys of its sequence up to its own
position.

The sparse path: while samcache's model override runs a layer on a subset of the step's rows (new
tokens + that layer's recompute rows; spliced image rows skipped), it hands the backend those rows
(:meth:`SamcacheAttnBackend.use_rows`). The backend then writes only those rows' keys and values and
attends for those rows only, each at its own position: the same kernel, fewer rows. An isolated
model's first-seen images come as side rows after those (:meth:`SamcacheAttnBackend.use_side`).

CUDA graphs are not supported yet (the metadata is built on the host each step, with a size that
varies); SGLang must run with ``--cuda-graph-backend-decode=disabled
--cuda-graph-backend-prefill=disabled`` (the hooks below say so when called).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from samcache.integrations.isolated_rows import SideRows
from samcache.integrations.sglang.step import host_ints
from samcache.ops.sparse_attention import AttentionMetadata, sparse_attention

_NO_CUDA_GRAPH = ("samcache's attention backend does not support CUDA graphs yet (its metadata is built on the host "
                  "every step); run SGLang with --cuda-graph-backend-decode=disabled "
                  "--cuda-graph-backend-prefill=disabled (older releases: --disable-cuda-graph)")


@dataclass
class StepMetadata:
    """The batch of one step: every query row's position and each sequence's pages."""

    attention: AttentionMetadata
    qo_indptr: np.ndarray                 # [B+1] rows of each sequence (host copy)
    _selected: dict[int, tuple[AttentionMetadata, torch.Tensor]] = field(default_factory=dict)


class SamcacheAttnBackend(AttentionBackend):
    """SGLang ``AttentionBackend`` over samcache's ``sparse_attention`` kernel."""

    def __init__(self, model_runner) -> None:
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = int(getattr(self.token_to_kv_pool, "page_size", 1) or 1)
        if getattr(self.token_to_kv_pool, "is_quantized_kv_cache", False):
            raise ValueError("samcache attention backend: quantized KV caches (--kv-cache-dtype fp8/fp4) are not "
                             "supported; use the model's dtype")
        self.forward_metadata: StepMetadata | None = None
        self._rows: list[torch.Tensor] | None = None
        self._side: SideRows | None = None

    # -- per step ------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch) -> None:
        mode = forward_batch.forward_mode
        self._rows = self._side = None
        if mode.is_idle():
            self.forward_metadata = None
            return
        if forward_batch.encoder_lens is not None:
            raise NotImplementedError("samcache attention backend: encoder-decoder (cross-attention) models are not "
                                      "supported")
        seq = host_ints(forward_batch.seq_lens_cpu, forward_batch.seq_lens)
        if mode.is_target_verify() or mode.is_draft_extend_v2():
            raise NotImplementedError("samcache attention backend: speculative decoding is not supported")
        if mode.is_decode():
            prefix = seq - 1
        elif mode.is_extend():
            prefix = host_ints(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_prefix_lens)
        else:
            raise NotImplementedError(f"samcache attention backend: forward mode {mode.name} is not supported")
        req_to_token = self.req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices.to(req_to_token.device)
        # One device-to-host copy of the batch's rows of the table, not one per request.
        table = req_to_token.index_select(0, rows)[:, : int(seq.max(initial=0))].cpu().numpy()
        ps = self.page_size
        positions, tables = [], []
        for b, (n, p) in enumerate(zip(seq, prefix)):
            positions.append(np.arange(p, n))
            # SGLang's paged allocator keeps a page's tokens together (slot % ps == position % ps):
            # a page's first slot names it.
            tables.append(table[b, :n:ps] // ps)
        meta = AttentionMetadata.build(positions, tables, [int(n) for n in seq], ps, device=self.device)
        self.forward_metadata = StepMetadata(meta, np.concatenate([[0], np.cumsum(seq - prefix)]).astype(np.int64))

    def use_rows(self, rows: list[torch.Tensor] | None) -> None:
        """Restrict each layer to the step's rows ``rows[layer_id]`` (sorted flattened row indices;
        None: every row). Set by the model override for one forward, cleared by the next step."""
        self._rows = rows

    def use_side(self, side: SideRows | None) -> None:
        """Side rows after each layer's rows (an isolated model's first-seen images,
        :mod:`samcache.integrations.isolated_rows`): their image rows' keys and values go to the
        images' slots, and they attend among themselves. Set with :meth:`use_rows`."""
        self._side = side

    # -- per layer -----------------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache):
        if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
            raise NotImplementedError("samcache attention backend: only causal decoder self-attention is supported")
        if layer.qk_head_dim != layer.v_head_dim:
            raise NotImplementedError("samcache attention backend: q/k and v head sizes must be equal")
        step = self.forward_metadata
        if step is None:
            raise RuntimeError("samcache attention backend: init_forward_metadata was not called for this batch")
        meta, loc = step.attention, forward_batch.out_cache_loc
        if self._rows is not None:
            meta, loc = self._selection(self._rows[layer.layer_id], forward_batch)
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, heads, dim)
        side, rows = self._side, meta.q_pos.numel()
        if q3.size(0) != rows + (side.size if side is not None else 0):
            raise ValueError(f"samcache attention backend: {q3.size(0)} query rows for a batch of {rows} rows"
                             + (f" and {side.size} side rows" if side is not None else ""))
        side_out = None
        if side is not None:
            k3 = k.reshape(q3.size(0), -1, dim)
            v3 = v.reshape(q3.size(0), -1, layer.v_head_dim)
            side_out = side.attention(q3[rows:], k3[rows:], v3[rows:], layer.scaling)
            if save_kv_cache:  # the step's rows first: a side row's slot may also be a computed row's
                self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k3[:rows], v3[:rows])
                pick = side.write_at.to(k3.device)
                side_loc = forward_batch.out_cache_loc.index_select(0, side.write_rows.to(loc.device))
                self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(side_loc, None), k3[rows:].index_select(0, pick),
                                                    v3[rows:].index_select(0, pick))
            q3 = q3[:rows]
        elif save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v)
        key_cache = self._paged(self.token_to_kv_pool.get_key_buffer(layer.layer_id))
        value_cache = self._paged(self.token_to_kv_pool.get_value_buffer(layer.layer_id))
        window = layer.sliding_window_size
        # SGLang's window keeps keys j >= i - w; samcache's keeps j > i - window.
        window = int(window) + 1 if window is not None and window > -1 else -1
        out, _ = sparse_attention(q3.to(key_cache.dtype).contiguous(), meta, key_cache, value_cache,
                                  scale=layer.scaling, window=window, logit_cap=float(layer.logit_cap or 0.0))
        if side_out is not None:
            out = torch.cat([out.to(side_out.dtype), side_out])
        return out.to(q.dtype).reshape(-1, heads * layer.v_head_dim)

    def _selection(self, rows: torch.Tensor, forward_batch) -> tuple[AttentionMetadata, torch.Tensor]:
        """The metadata and cache slots of a row subset (built once per distinct subset)."""
        step = self.forward_metadata
        hit = step._selected.get(id(rows))
        if hit is None:
            counts = np.diff(np.searchsorted(rows.numpy(), step.qo_indptr))
            hit = (step.attention.select(rows.to(step.attention.q_pos.device), counts, host_rows=rows.numpy()),
                   forward_batch.out_cache_loc.index_select(0, rows.to(forward_batch.out_cache_loc.device)))
            step._selected[id(rows)] = hit
        return hit

    def _paged(self, buffer: torch.Tensor) -> torch.Tensor:
        """SGLang's ``[tokens, heads, dim]`` buffer as ``[pages, page_size, heads, dim]`` (a view)."""
        return buffer.view(-1, self.page_size, *buffer.shape[1:])

    # -- CUDA graphs ---------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        raise NotImplementedError(_NO_CUDA_GRAPH)

    def init_forward_metadata_capture_cuda_graph(self, *args, **kwargs):
        raise NotImplementedError(_NO_CUDA_GRAPH)

    def init_forward_metadata_replay_cuda_graph(self, *args, **kwargs):
        raise NotImplementedError(_NO_CUDA_GRAPH)

    def get_cuda_graph_seq_len_fill_value(self):
        raise NotImplementedError(_NO_CUDA_GRAPH)

    def support_triton(self):
        return False


def create_samcache_backend(model_runner) -> SamcacheAttnBackend:
    """The factory SGLang's attention registry calls for ``--attention-backend samcache``."""
    return SamcacheAttnBackend(model_runner)


__all__ = ["SamcacheAttnBackend", "StepMetadata", "create_samcache_backend"]
