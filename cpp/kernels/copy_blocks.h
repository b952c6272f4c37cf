// copy_blocks: copy whole KV blocks src -> dst inside each paged cache tensor, for the
// copy-on-write pairs the BlockPool returns. Shared by the CPU and CUDA implementations.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace samcache::kernels {

struct CopyBlocksPlan {
  std::vector<int64_t> pairs;  // flattened (src, dst), validated
  int64_t block_bytes = 0;     // bytes of one block in every cache
};

// Checks the arguments (same shape/dtype/device caches, CPU int32/int64 [n, 2] pairs, indices
// in range, distinct destinations that are not also sources) and raises a clear error otherwise.
CopyBlocksPlan plan_copy_blocks(at::TensorList caches, const at::Tensor& block_pairs);

void copy_blocks_cpu(at::TensorList caches, const at::Tensor& block_pairs);
#ifdef SAMCACHE_WITH_CUDA
void copy_blocks_cuda(at::TensorList caches, const at::Tensor& block_pairs);
#endif

}  // namespace samcache::kernels
