// Raw-pointer launchers of the CUDA kernels in cuda/*.cu (no torch types: each .cu compiles
// alone with nvcc). The torch-facing wrappers are in cpp/kernels/cuda_launchers.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace samcache::cuda {

// For every pair p < num_pairs and cache c < num_caches, copies block_bytes from block
// pairs[2p] to block pairs[2p+1] of cache c. `cache_ptrs` and `pairs` are device arrays.
cudaError_t copy_blocks(const int64_t* cache_ptrs, int num_caches, const int64_t* pairs, int64_t num_pairs,
                        int64_t block_bytes, cudaStream_t stream);

}  // namespace samcache::cuda
