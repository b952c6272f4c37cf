// Torch-facing CUDA wrapper of copy_blocks: validate, take the current stream, call the raw
// launcher in cuda/. Compiled only when the CUDA kernels are built.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "copy_blocks.h"
#include "copy_blocks.cuh"  // cuda/: the raw-pointer launcher

namespace samcache::kernels {

void copy_blocks_cuda(at::TensorList caches, const at::Tensor& block_pairs) {
  const CopyBlocksPlan plan = plan_copy_blocks(caches, block_pairs);
  const int64_t n = static_cast<int64_t>(plan.pairs.size() / 2);
  if (n == 0 || plan.block_bytes == 0) return;
  const c10::cuda::CUDAGuard guard(caches[0].device());
  // One host->device copy carries the cache base pointers followed by the pairs.
  const int64_t num_caches = static_cast<int64_t>(caches.size());
  // Pinned, so the upload is asynchronous; torch's caching host allocator keeps the buffer
  // until the copy has run.
  at::Tensor host = at::empty({num_caches + 2 * n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_caches; ++i) h[i] = reinterpret_cast<int64_t>(caches[i].data_ptr());
  std::copy(plan.pairs.begin(), plan.pairs.end(), h + num_caches);
  at::Tensor dev = host.to(caches[0].device(), /*non_blocking=*/true);
  const int64_t* d = dev.data_ptr<int64_t>();
  const cudaError_t err = samcache::cuda::copy_blocks(d, static_cast<int>(num_caches), d + num_caches, n,
                                                      plan.block_bytes, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "copy_blocks CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace samcache::kernels
