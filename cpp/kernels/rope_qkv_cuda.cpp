// Torch-facing CUDA wrapper of rope_qkv_write: the CPU's checks (slots on the GPU are not read
// back: the kernel skips out-of-range ones), then one launch on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "rope_qkv.cuh"  // cuda/: the raw-pointer launcher
#include "rope_qkv.h"

namespace samcache::kernels {

at::Tensor rope_qkv_write_cuda(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               int64_t num_heads, int64_t num_kv_heads, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const RopeQkvPlan plan =
      plan_rope_qkv_write(qkv, cos, sin, num_heads, num_kv_heads, key_cache, value_cache, slot_mapping);
  const c10::cuda::CUDAGuard guard(qkv.device());
  at::Tensor q = at::empty({plan.num_tokens, num_heads, plan.head_dim}, qkv.options());
  if (plan.num_tokens == 0) return q;
  const at::Tensor slots = slot_mapping.contiguous();  // on the GPU already: no sync
  samcache::cuda::RopeQkvArgs args{};
  args.qkv = qkv.const_data_ptr();
  args.qkv_stride = qkv.stride(0);
  args.cos = cos.const_data_ptr();
  args.cos_stride = cos.stride(0);
  args.sin = sin.const_data_ptr();
  args.sin_stride = sin.stride(0);
  args.q_out = q.data_ptr();
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.slot_mapping = slots.const_data_ptr();
  args.slot_type = slots.scalar_type() == at::kInt ? samcache::cuda::IndexType::kInt32
                                                   : samcache::cuda::IndexType::kInt64;
  args.num_tokens = plan.num_tokens;
  args.num_heads = num_heads;
  args.num_kv_heads = num_kv_heads;
  args.head_dim = plan.head_dim;
  args.num_slots = plan.write.cache.num_slots();
  args.dtype = qkv.scalar_type() == at::kFloat  ? samcache::cuda::kRopeQkvFloat32
               : qkv.scalar_type() == at::kHalf ? samcache::cuda::kRopeQkvFloat16
                                                : samcache::cuda::kRopeQkvBFloat16;
  const cudaError_t err = samcache::cuda::rope_qkv_write(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "rope_qkv_write CUDA launch failed: ", cudaGetErrorString(err));
  return q;
}

}  // namespace samcache::kernels
