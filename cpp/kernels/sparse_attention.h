// sparse_attention: attention of a sparse set of query tokens (new and recomputed tokens, at
// their sequence indices) against the full paged KV of one sequence. Causal by sequence
// index, GQA, optional sliding window, softmax scale and logit soft-cap; returns the output
// per query and the log-sum-exp of its logits. Shared by the CPU and CUDA implementations.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace samcache::kernels {

struct SparseAttentionShape {
  int64_t num_queries, num_q_heads, num_kv_heads, head_dim, block_size, num_kv_tokens;
  int64_t window;    // keys j with q_index - window < j <= q_index; <= 0: no window
  double scale;      // logits = scale * q.k
  double logit_cap;  // > 0: logits = cap * tanh(logits / cap)
};

// Checks every argument (shapes, dtypes, devices, GQA divisibility, block table long enough;
// on CPU also the values of q_index and block_table) and raises a clear error otherwise.
SparseAttentionShape plan_sparse_attention(const at::Tensor& q, const at::Tensor& q_index, const at::Tensor& key_cache,
                                           const at::Tensor& value_cache, const at::Tensor& block_table,
                                           int64_t num_kv_tokens, double scale, int64_t window, double logit_cap);

std::tuple<at::Tensor, at::Tensor> sparse_attention_cpu(const at::Tensor& q, const at::Tensor& q_index,
                                                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                        const at::Tensor& block_table, int64_t num_kv_tokens,
                                                        double scale, int64_t window, double logit_cap);
#ifdef SAMCACHE_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> sparse_attention_cuda(const at::Tensor& q, const at::Tensor& q_index,
                                                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                         const at::Tensor& block_table, int64_t num_kv_tokens,
                                                         double scale, int64_t window, double logit_cap);
#endif

}  // namespace samcache::kernels
