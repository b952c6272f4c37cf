// sparse_attention: attention of query rows at arbitrary positions of many sequences (new and
// recomputed tokens, decode tokens) against each sequence's paged KV, in one call.
//
// Batch layout (FlashInfer-style metadata, built once per step and shared by every layer):
//   qo_indptr [B+1]        rows [qo_indptr[b], qo_indptr[b+1]) of q belong to sequence b
//   q_pos [T]              each row's position in its sequence (causal limit: keys j <= q_pos)
//   kv_indptr [B+1]        sequence b's pages are kv_indices[kv_indptr[b] .. kv_indptr[b+1])
//   kv_indices [P]         cache blocks
//   kv_last_page_len [B]   tokens in sequence b's last page (1 .. block_size)
// Causal by position, GQA, optional sliding window, softmax scale and logit soft-cap; returns the
// output per row and the log-sum-exp of its logits. Shared by the CPU and CUDA implementations.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace samcache::kernels {

// The batch's metadata as host values: read (and checked) once, only for CPU tensors.
struct SparseAttentionHostMetadata {
  std::vector<int64_t> qo_indptr, q_pos, kv_indptr, kv_indices, kv_last_page_len;
};

struct SparseAttentionPlan {
  int64_t num_rows, num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, num_cache_blocks;
  SparseAttentionHostMetadata host;  // empty for device tensors
};

// Checks every argument (shapes, dtypes, devices, GQA divisibility; on CPU also the metadata's
// values: ascending indptrs, positions inside their sequence, pages inside the cache) and raises a
// clear error otherwise. Nothing is written before this returns. `max_kv_len` (the longest
// sequence) only sizes the CUDA splits: required for device tensors, unused on the CPU.
SparseAttentionPlan plan_sparse_attention(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& qo_indptr,
                                          const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                                          const at::Tensor& kv_last_page_len, const at::Tensor& key_cache,
                                          const at::Tensor& value_cache, double scale, double logit_cap,
                                          int64_t max_kv_len);

// plan_sparse_attention as an op: the checks alone, on any device.
void sparse_attention_check(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& qo_indptr,
                            const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                            const at::Tensor& key_cache, const at::Tensor& value_cache, double scale, double logit_cap,
                            int64_t max_kv_len);

std::tuple<at::Tensor, at::Tensor> sparse_attention_cpu(const at::Tensor& q, const at::Tensor& q_pos,
                                                        const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
                                                        const at::Tensor& kv_indices,
                                                        const at::Tensor& kv_last_page_len,
                                                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                        double scale, int64_t window, double logit_cap,
                                                        int64_t max_kv_len);
#ifdef SAMCACHE_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> sparse_attention_cuda(const at::Tensor& q, const at::Tensor& q_pos,
                                                         const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
                                                         const at::Tensor& kv_indices,
                                                         const at::Tensor& kv_last_page_len,
                                                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                         double scale, int64_t window, double logit_cap,
                                                         int64_t max_kv_len);
#endif

}  // namespace samcache::kernels
