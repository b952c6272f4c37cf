// Torch-facing CUDA wrapper of kv_quant: validate (the shared plan), take the current stream,
// call the raw launchers in cuda/. Compiled only when the CUDA kernels are built.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "kv_quant.cuh"  // cuda/: the raw-pointer launchers
#include "kv_quant.h"

namespace samcache::kernels {

namespace {

samcache::cuda::KvQuantGeometry geometry(const KvQuantPlan& p) {
  samcache::cuda::KvQuantGeometry g{};
  g.num_ids = p.num_ids;
  g.num_blocks = p.num_blocks;
  g.groups_per_block = p.groups_per_block;
  g.head_step = p.per_head ? p.head_dim : 0;
  g.rows = p.rows;
  g.row_len = p.row_len;
  g.row_stride = p.row_stride;
  g.block_stride = p.block_stride;
  g.block_elems = p.block_size * p.heads * p.head_dim;
  return g;
}

int cache_dtype_code(at::ScalarType dt) {
  return dt == at::kFloat ? samcache::cuda::kCacheFloat32
                          : (dt == at::kHalf ? samcache::cuda::kCacheFloat16 : samcache::cuda::kCacheBFloat16);
}

// int64 ids on the cache's device: validated host ids are uploaded asynchronously from a pinned
// buffer (torch's caching host allocator keeps it until the copy has run), so the host never
// waits for the stream; device ids are used as they are (the kernels skip the out-of-range ones).
at::Tensor device_ids(const at::Tensor& block_ids, const KvQuantPlan& plan, const at::Device& device) {
  if (!plan.ids_on_host) return block_ids.to(at::kLong).contiguous();
  at::Tensor host = at::empty({plan.num_ids}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(plan.ids.begin(), plan.ids.end(), host.mutable_data_ptr<int64_t>());
  return host.to(device, /*non_blocking=*/true);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_kv_blocks_cuda(const at::Tensor& cache, const at::Tensor& block_ids,
                                                           std::string_view qtype, bool per_head) {
  const KvQuantPlan plan = plan_quantize_kv_blocks(cache, block_ids, qtype, per_head);
  const c10::cuda::CUDAGuard guard(cache.device());
  at::Tensor q = at::empty({plan.num_ids, plan.block_size, plan.heads, plan.head_dim},
                           cache.options().dtype(kv_quant_storage_dtype(plan.qtype)));
  at::Tensor scales = per_head ? at::empty({plan.num_ids, plan.heads}, cache.options().dtype(at::kFloat))
                               : at::empty({plan.num_ids}, cache.options().dtype(at::kFloat));
  if (q.numel() == 0) {
    scales.zero_();
    return {q, scales};
  }
  const at::Tensor ids = device_ids(block_ids, plan, cache.device());
  const cudaError_t err = samcache::cuda::quantize_kv_blocks(
      cache.const_data_ptr(), cache_dtype_code(cache.scalar_type()), ids.const_data_ptr<int64_t>(), geometry(plan),
      static_cast<int>(plan.qtype), q.mutable_data_ptr(), scales.mutable_data_ptr<float>(),
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "quantize_kv_blocks CUDA launch failed: ", cudaGetErrorString(err));
  return {q, scales};
}

void dequantize_kv_blocks_cuda(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& cache,
                               const at::Tensor& block_ids) {
  const KvQuantPlan plan = plan_dequantize_kv_blocks(q, scales, cache, block_ids);
  if (q.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(cache.device());
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  const at::Tensor ids = device_ids(block_ids, plan, cache.device());
  const cudaError_t err = samcache::cuda::dequantize_kv_blocks(
      qc.const_data_ptr(), static_cast<int>(plan.qtype), sc.const_data_ptr<float>(), cache.mutable_data_ptr(),
      cache_dtype_code(cache.scalar_type()), ids.const_data_ptr<int64_t>(), geometry(plan),
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "dequantize_kv_blocks CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace samcache::kernels
