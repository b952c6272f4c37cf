"""vLLM's CPU attention backend, able to compute a subset of a step's rows.

Registered in place of ``CPU_ATTN``; identical to it unless the model runs a sparse step
(:mod:`.sparse_context`). Then the layer's queries, keys and values are only the rows this layer
computes: their K/V go to those rows' slots, and attention is vLLM's own CPU kernel over the
whole paged cache with each contiguous run of rows as one causal query block
(:class:`~.step.AttentionBatch`), built once per distinct row set and shared by the layers. An
isolated model's side rows come after those (:mod:`samcache.integrations.isolated_rows`): their
image rows' keys and values go to the image's slots, and they attend among themselves.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from samcache.integrations.vllm import sparse_context
from samcache.integrations.vllm.connector import active_worker


class SamcacheCPUAttentionImpl(CPUAttentionBackendImpl):
    def _sparse(self, layer):
        ctx = sparse_context.current()
        if ctx is None or self.attn_type != AttentionType.DECODER:
            return None
        step, worker = ctx
        return step, worker.layer_of(layer.layer_name)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        sparse = self._sparse(layer)
        captured = key, value
        if sparse is not None:
            step, index = sparse
            slot_mapping = step.slots[index]
            if step.side is not None:  # the step's rows, then the side images' rows into their own slots
                rows, pick = step.rows[index].numel(), step.side.write_at
                key = torch.cat([key[:rows], key[rows:].index_select(0, pick)])
                value = torch.cat([value[:rows], value[rows:].index_select(0, pick)])
                slot_mapping = torch.cat([slot_mapping, step.side_slots])
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        key, value = captured
        if self.attn_type == AttentionType.DECODER:
            worker = active_worker()
            if worker is not None:  # new images' KV, as written (stored when the step ends)
                worker.capture_layer_kv(layer.layer_name, key, value)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        sparse = self._sparse(layer) if attn_metadata is not None else None
        if sparse is None or output_scale is not None or output_block_scale is not None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        step, index = sparse
        batch = step.attention_batch(index, lambda b: ops.cpu_attn_get_scheduler_metadata(
            num_reqs=b.seq_lens.numel(), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_size, seq_lens=b.seq_lens, dtype=query.dtype, query_start_loc=b.query_start_loc,
            causal=True, sliding_window_size=self.sliding_window, isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype))
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        key_cache, value_cache = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)
        rows = int(batch.query_start_loc[-1])
        ops.cpu_attention_with_kv_cache(
            query=query[:rows], key_cache=key_cache, value_cache=value_cache, output=output[:rows],
            query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, scale=self.scale, causal=True,
            alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window, block_table=batch.block_table,
            softcap=self.logits_soft_cap, scheduler_metadata=batch.scheduler_metadata, s_aux=self.sinks,
            dynamic_causal=None, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)
        if step.side is not None:  # each side row over its own side sequence
            side = slice(rows, rows + step.side.size)
            out = output.view(output.size(0), self.num_heads, self.head_size)
            out[side] = step.side.attention(query[side], key[side], value[side], self.scale).to(out.dtype)
        return output


class SamcacheCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[SamcacheCPUAttentionImpl]:
        return SamcacheCPUAttentionImpl
