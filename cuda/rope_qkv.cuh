// Raw-pointer launcher of cuda/rope_qkv.cu (no torch types: the .cu compiles alone with nvcc).
// The torch-facing wrapper is cpp/kernels/rope_qkv_cuda.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "paged_kv.cuh"  // IndexType

namespace samcache::cuda {

enum RopeQkvDtype : int { kRopeQkvFloat32 = 0, kRopeQkvFloat16 = 1, kRopeQkvBFloat16 = 2 };

// Row t of qkv / cos / sin starts at base + t * stride (elements), its columns contiguous: qkv's
// are [heads | kv_heads | kv_heads] x head_dim. q_out is contiguous [num_tokens, heads, head_dim];
// the caches contiguous [num_slots, kv_heads, head_dim]. Slots outside [0, num_slots) are skipped.
struct RopeQkvArgs {
  const void* qkv;
  int64_t qkv_stride;
  const void* cos;
  int64_t cos_stride;
  const void* sin;
  int64_t sin_stride;
  void* q_out;
  void* key_cache;
  void* value_cache;
  const void* slot_mapping;
  IndexType slot_type;
  int64_t num_tokens;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t num_slots;
  int dtype;  // RopeQkvDtype
};
cudaError_t rope_qkv_write(const RopeQkvArgs& args, cudaStream_t stream);

}  // namespace samcache::cuda
