// Raw-pointer launcher of cuda/copy_blocks.cu (no torch types: the .cu compiles alone with
// nvcc). The torch-facing wrapper is cpp/kernels/copy_blocks_cuda.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace samcache::cuda {

// For every pair p < num_pairs and cache c < num_caches, copies block_bytes from block
// pairs[2p] to block pairs[2p+1] of cache c. `cache_ptrs` and `pairs` are device arrays.
cudaError_t copy_blocks(const int64_t* cache_ptrs, int num_caches, const int64_t* pairs, int64_t num_pairs,
                        int64_t block_bytes, cudaStream_t stream);

}  // namespace samcache::cuda
