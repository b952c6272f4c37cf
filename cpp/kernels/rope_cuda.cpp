// Torch-facing CUDA wrappers of rope: validate (the same plan as the CPU), take the current
// stream, call the raw launchers in cuda/. Compiled only when the CUDA kernels are built.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "rope.cuh"  // cuda/: the raw-pointer launchers
#include "rope.h"

namespace samcache::kernels {

namespace {

samcache::cuda::RopeDtype rope_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return samcache::cuda::RopeDtype::kFloat16;
    case at::kBFloat16: return samcache::cuda::RopeDtype::kBFloat16;
    default: return samcache::cuda::RopeDtype::kFloat32;  // the plan admits only these three
  }
}

// Arguments shared by both ops; `freqs` must outlive the launch (it is the caller's local).
samcache::cuda::RopeArgs common_args(const RopePlan& plan, const at::Tensor& key, const at::Tensor& delta,
                                     const at::Tensor& freqs) {
  static_assert(kRopeMaxRotaryHalf <= samcache::cuda::kRopeMaxRotaryHalfCuda);
  samcache::cuda::RopeArgs a;
  a.dtype = rope_dtype(key.scalar_type());
  a.interleaved_pairs = plan.style == RopeStyle::kGptj;
  a.multi_axis = delta.dim() == 2;
  a.num_tokens = plan.num_tokens;
  a.num_heads = plan.num_heads;
  a.head_dim = plan.head_dim;
  a.rotary_half = plan.rotary_half;
  a.inv_freq = freqs.const_data_ptr<float>();
  a.delta = delta.const_data_ptr<int64_t>();
  a.delta_axis_stride = a.multi_axis ? delta.stride(0) : 0;
  a.delta_token_stride = a.multi_axis ? delta.stride(1) : delta.stride(0);
  a.src = key.const_data_ptr();
  a.src_token_stride = key.stride(0);
  a.src_head_stride = key.stride(1);
  std::copy(plan.axis.begin(), plan.axis.end(), a.axis);
  return a;
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, " CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace

void rope_rerotate_cuda(const at::Tensor& key, const at::Tensor& delta, const at::Tensor& inv_freq,
                        std::string_view style, at::IntArrayRef mrope_section) {
  const RopePlan plan = plan_rope_rerotate(key, delta, inv_freq, style, mrope_section);
  if (plan.num_tokens == 0 || plan.num_heads == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  const at::Tensor freqs = inv_freq.contiguous();
  samcache::cuda::RopeArgs a = common_args(plan, key, delta, freqs);
  a.dst = key.data_ptr();
  a.dst_block_stride = key.stride(0);  // in place: token t is "slot" t of a block size of 1
  a.dst_offset_stride = 0;
  a.dst_head_stride = key.stride(1);
  check_launch(samcache::cuda::rope_rerotate(a, c10::cuda::getCurrentCUDAStream()), "rope_rerotate");
}

void rope_rerotate_write_cuda(const at::Tensor& key, const at::Tensor& delta, const at::Tensor& inv_freq,
                              std::string_view style, at::IntArrayRef mrope_section, const at::Tensor& key_cache,
                              const at::Tensor& slot_mapping) {
  const RopePlan plan =
      plan_rope_rerotate_write(key, delta, inv_freq, style, mrope_section, key_cache, slot_mapping);
  if (plan.num_tokens == 0 || plan.num_heads == 0 || plan.num_slots == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  const at::Tensor freqs = inv_freq.contiguous();
  const at::Tensor slots = slot_mapping.contiguous();
  samcache::cuda::RopeArgs a = common_args(plan, key, delta, freqs);
  a.dst = key_cache.data_ptr();
  a.dst_block_stride = key_cache.stride(0);
  a.dst_offset_stride = key_cache.stride(1);
  a.dst_head_stride = key_cache.stride(2);
  a.slots = slots.const_data_ptr();
  a.slots_int64 = slots.scalar_type() == at::kLong;
  a.block_size = plan.block_size;
  a.num_slots = plan.num_slots;
  check_launch(samcache::cuda::rope_rerotate_write(a, c10::cuda::getCurrentCUDAStream()), "rope_rerotate_write");
}

}  // namespace samcache::kernels
