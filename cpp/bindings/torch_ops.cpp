// The single registration file of torch.ops.samcache: every op's schema is defined here once,
// with its CPU and (when built) CUDA implementations. Fake (meta) implementations for
// torch.compile are registered in Python (samcache/ops/<family>.py). Later issues only add lines here.
#include <torch/library.h>

#include "../kernels/copy_blocks.h"
#include "../kernels/sparse_attention.h"
#include "../kernels/paged_kv.h"
#include "../kernels/rope.h"
#include "../kernels/kv_quant.h"
#include "../kernels/token_merge.h"
#include "../kernels/rms_norm.h"
#include "../kernels/rope_qkv.h"

TORCH_LIBRARY(samcache, m) {
  // Copies block src -> dst in every cache, for each (src, dst) row of block_pairs.
  m.def("copy_blocks(Tensor(a!)[] caches, Tensor block_pairs) -> ()");
  // Attention of query rows at arbitrary positions of many sequences against their paged KV
  // (FlashInfer-style metadata: qo_indptr, kv_indptr / kv_indices, kv_last_page_len; q_pos gives
  // each row's position): causal by position, GQA, optional window and logit cap. Returns (out, lse).
  m.def(
      "sparse_attention(Tensor q, Tensor q_pos, Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor kv_last_page_len, Tensor key_cache, Tensor value_cache, float scale, int window=-1, "
      "float logit_cap=0.0, int max_kv_len=-1) -> (Tensor, Tensor)");
  // The argument checks of sparse_attention alone (raises what it would raise, computes nothing):
  // the GPU's other attention paths (flash, Triton) run behind them.
  m.def(
      "sparse_attention_check(Tensor q, Tensor q_pos, Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor kv_last_page_len, Tensor key_cache, Tensor value_cache, float scale, float logit_cap=0.0, "
      "int max_kv_len=-1) -> ()");
  // Writes token i's K/V rows at slot slot_mapping[i] of the paged caches (-1 = skip).
  m.def("paged_write(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  // One sequence's first num_tokens tokens as contiguous [num_tokens, heads, head_dim] K and V.
  m.def("paged_gather(Tensor key_cache, Tensor value_cache, Tensor block_table, int num_tokens) -> (Tensor, Tensor)");
  // Copies block src of `src` to block dst of `dst` per row of block_pairs (CPU/GPU tiering).
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_pairs) -> ()");
  // Moves cached keys [N, H, D] from positions p to p + delta by re-rotating RoPE, in place.
  m.def("rope_rerotate(Tensor(a!) key, Tensor delta, Tensor inv_freq, str style, int[] mrope_section) -> ()");
  // The same rotation, written straight into the paged key cache at slot_mapping (key unchanged).
  m.def(
      "rope_rerotate_write(Tensor key, Tensor delta, Tensor inv_freq, str style, int[] mrope_section, "
      "Tensor(a!) key_cache, Tensor slot_mapping) -> ()");
  // Quantizes cache blocks to fp8 e4m3 or int8 with one float32 scale per block (or per block and head).
  m.def("quantize_kv_blocks(Tensor cache, Tensor block_ids, str qtype, bool per_head) -> (Tensor, Tensor)");
  // Writes q * scale back into the given cache blocks, in the cache's dtype.
  m.def("dequantize_kv_blocks(Tensor q, Tensor scales, Tensor(a!) cache, Tensor block_ids) -> ()");
  // Merges every token into its anchor by weighted average; returns (merged, kept_index).
  m.def("token_merge(Tensor hidden, Tensor target, Tensor weight) -> (Tensor, Tensor)");
  // A decoder layer's RMS norm [N, D] in one pass (float32 statistics, weight in x's dtype).
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // x += delta in place (the residual add), then rms_norm(x).
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  // From fused q/k/v rows: q and k rotated by RoPE (rows' cos, signed sin), k and v written into
  // the paged caches at slot_mapping (-1 = skip); returns the rotated q [N, heads, head_dim].
  m.def(
      "rope_qkv_write(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, "
      "Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> Tensor");
}

TORCH_LIBRARY_IMPL(samcache, CPU, m) {
  m.impl("copy_blocks", &samcache::kernels::copy_blocks_cpu);
  m.impl("sparse_attention", &samcache::kernels::sparse_attention_cpu);
  m.impl("sparse_attention_check", &samcache::kernels::sparse_attention_check);
  m.impl("paged_write", &samcache::kernels::paged_write_cpu);
  m.impl("paged_gather", &samcache::kernels::paged_gather_cpu);
  m.impl("swap_blocks", &samcache::kernels::swap_blocks_cpu);
  m.impl("rope_rerotate", &samcache::kernels::rope_rerotate_cpu);
  m.impl("rope_rerotate_write", &samcache::kernels::rope_rerotate_write_cpu);
  m.impl("quantize_kv_blocks", &samcache::kernels::quantize_kv_blocks_cpu);
  m.impl("dequantize_kv_blocks", &samcache::kernels::dequantize_kv_blocks_cpu);
  m.impl("token_merge", &samcache::kernels::token_merge_cpu);
  m.impl("rms_norm", &samcache::kernels::rms_norm_cpu);
  m.impl("add_rms_norm", &samcache::kernels::add_rms_norm_cpu);
  m.impl("rope_qkv_write", &samcache::kernels::rope_qkv_write_cpu);
}

#ifdef SAMCACHE_WITH_CUDA
TORCH_LIBRARY_IMPL(samcache, CUDA, m) {
  m.impl("copy_blocks", &samcache::kernels::copy_blocks_cuda);
  m.impl("sparse_attention", &samcache::kernels::sparse_attention_cuda);
  m.impl("sparse_attention_check", &samcache::kernels::sparse_attention_check);
  m.impl("paged_write", &samcache::kernels::paged_write_cuda);
  m.impl("paged_gather", &samcache::kernels::paged_gather_cuda);
  m.impl("swap_blocks", &samcache::kernels::swap_blocks_cuda);
  m.impl("rope_rerotate", &samcache::kernels::rope_rerotate_cuda);
  m.impl("rope_rerotate_write", &samcache::kernels::rope_rerotate_write_cuda);
  m.impl("quantize_kv_blocks", &samcache::kernels::quantize_kv_blocks_cuda);
  m.impl("dequantize_kv_blocks", &samcache::kernels::dequantize_kv_blocks_cuda);
  m.impl("token_merge", &samcache::kernels::token_merge_cuda);
  m.impl("rms_norm", &samcache::kernels::rms_norm_cuda);
  m.impl("add_rms_norm", &samcache::kernels::add_rms_norm_cuda);
  m.impl("rope_qkv_write", &samcache::kernels::rope_qkv_write_cuda);
}
#endif
