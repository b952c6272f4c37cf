// copy_blocks CUDA kernel: one thread block per (pair, cache), 16-byte vector copies when the
// block is 16-byte aligned (paged caches always are), bytes otherwise.
#include <cstdint>

#include "copy_blocks.cuh"

namespace samcache::cuda {

namespace {

template <typename Vec>
__device__ __forceinline__ void copy_span(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  const int64_t n = bytes / static_cast<int64_t>(sizeof(Vec));
  Vec* d = reinterpret_cast<Vec*>(dst);
  const Vec* s = reinterpret_cast<const Vec*>(src);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

__global__ void copy_blocks_kernel(const int64_t* cache_ptrs, const int64_t* pairs, int64_t block_bytes) {
  const int64_t pair = blockIdx.x;
  uint8_t* base = reinterpret_cast<uint8_t*>(cache_ptrs[blockIdx.y]);
  const uint8_t* src = base + pairs[2 * pair] * block_bytes;
  uint8_t* dst = base + pairs[2 * pair + 1] * block_bytes;
  const bool aligned = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                         static_cast<uintptr_t>(block_bytes)) & 15) == 0;
  if (aligned) {
    copy_span<uint4>(dst, src, block_bytes);
  } else {
    copy_span<uint8_t>(dst, src, block_bytes);
  }
}

}  // namespace

cudaError_t copy_blocks(const int64_t* cache_ptrs, int num_caches, const int64_t* pairs, int64_t num_pairs,
                        int64_t block_bytes, cudaStream_t stream) {
  if (num_pairs == 0 || num_caches == 0 || block_bytes == 0) return cudaSuccess;
  if (num_caches > 65535 || num_pairs > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(num_caches));
  copy_blocks_kernel<<<grid, 256, 0, stream>>>(cache_ptrs, pairs, block_bytes);
  return cudaGetLastError();
}

}  // namespace samcache::cuda
