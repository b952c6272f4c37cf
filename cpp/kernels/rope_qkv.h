// rope_qkv_write: a decoder layer's attention inputs in one pass. From the fused q/k/v projection
// of each computed row, rotate q and k by RoPE (the rows' own cos/sin), write the rotated key and
// the value into the layer's paged caches at the row's slot, and return the rotated queries
// (in the layer loop this was about twenty torch ops: slices, views, the rotation, the write).
//
// Rotation (rotate-half pairing, the full head): out = x * cos + swap_halves(x) * sin, where
// `sin` carries rotate_half's sign (its first half negated) and each product and the sum are
// rounded to the tensor's dtype, as torch computes the same expression: the results are torch's
// bits. Shared by the CPU and CUDA implementations.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "paged_kv.h"

namespace samcache::kernels {

struct RopeQkvPlan {
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  PagedWritePlan write;  // the caches' geometry; slots read and checked when they are on the CPU
};

// qkv [N, (H + 2 KV) * D] float32/float16/bfloat16, contiguous last dim; cos and sin [N, D] of
// qkv's dtype and device, contiguous last dim, D even; the caches [num_blocks, block_size, KV, D]
// and slot_mapping (int32/int64 [N], -1 = padding) as paged_write takes them.
RopeQkvPlan plan_rope_qkv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                int64_t num_heads, int64_t num_kv_heads, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& slot_mapping);

// Returns the rotated queries [N, H, D] (contiguous).
at::Tensor rope_qkv_write_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                              int64_t num_heads, int64_t num_kv_heads, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& slot_mapping);
#ifdef SAMCACHE_WITH_CUDA
at::Tensor rope_qkv_write_cuda(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               int64_t num_heads, int64_t num_kv_heads, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& slot_mapping);
#endif

}  // namespace samcache::kernels
