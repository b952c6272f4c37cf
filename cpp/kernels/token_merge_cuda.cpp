// Torch-facing CUDA wrapper of token_merge. The number of anchors is data-dependent, so one
// device -> host copy is unavoidable: the validation kernel's status (anchor count, first error)
// travels in that same copy, which lets CUDA raise exactly the CPU path's errors. Grouping uses
// torch's stable sort; the merge itself is one fused kernel (cuda/token_merge.cu).
#include <ATen/core/Tensor.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "token_merge.cuh"  // cuda/: the raw-pointer launchers
#include "token_merge.h"

namespace samcache::kernels {

namespace {

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "token_merge CUDA ", what, " failed: ", cudaGetErrorString(err));
}

template <typename T>
T read_one(const at::Tensor& t, int64_t index) {
  return t.narrow(0, index, 1).to(at::kCPU).const_data_ptr<T>()[0];
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> token_merge_cuda(const at::Tensor& hidden_in, const at::Tensor& target_in,
                                                    const at::Tensor& weight_in) {
  check_token_merge_args(hidden_in, target_in, weight_in);
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = hidden_in.size(0), dim = hidden_in.size(1);
  const at::Tensor hidden = hidden_in.stride(1) == 1 ? hidden_in : hidden_in.contiguous();
  const at::Tensor target = target_in.contiguous(), weight = weight_in.contiguous();
  const auto opts = target.options();

  at::Tensor flags = at::zeros({2, n}, opts.dtype(at::kInt));  // anchor_flag, has_weight
  at::Tensor status = at::empty({2}, opts.dtype(at::kLong));
  check_cuda(samcache::cuda::token_merge_validate(
                 target.const_data_ptr<int64_t>(), weight.const_data_ptr<float>(), n, flags[0].mutable_data_ptr<int32_t>(),
                 flags[1].mutable_data_ptr<int32_t>(), reinterpret_cast<unsigned long long*>(status.mutable_data_ptr<int64_t>()),
                 stream),
             "validation");
  // Queued before the synchronising copy, so they overlap the round trip.
  const auto [sorted_target, order] = at::sort(target, std::optional<bool>(true), /*dim=*/0);
  const at::Tensor anchor_rank = at::cumsum(flags[0], 0, at::kLong);

  const at::Tensor host_status = status.to(at::kCPU);
  const int64_t m = host_status.const_data_ptr<int64_t>()[0];
  const auto key = static_cast<unsigned long long>(host_status.const_data_ptr<int64_t>()[1]);
  if (key != samcache::cuda::kTokenMergeNoError) {
    const auto code = static_cast<TokenMergeError>(key >> samcache::cuda::kTokenMergeCodeShift);
    const auto index = static_cast<int64_t>(key & ((1ull << samcache::cuda::kTokenMergeCodeShift) - 1));
    double value = 0.0;
    if (code == TokenMergeError::kTargetOutOfRange || code == TokenMergeError::kTargetNotAnchor)
      value = static_cast<double>(read_one<int64_t>(target, index));
    else if (code == TokenMergeError::kBadWeight)
      value = read_one<float>(weight, index);
    raise_token_merge_error(code, index, value, n);
  }

  at::Tensor merged = at::empty({m, dim}, hidden.options());
  at::Tensor kept = at::empty({m}, opts);
  if (m == 0) return {merged, kept};
  at::Tensor offsets = at::empty({m + 1}, opts);
  const int dtype = hidden.scalar_type() == at::kFloat  ? samcache::cuda::kMergeFloat32
                    : hidden.scalar_type() == at::kHalf ? samcache::cuda::kMergeFloat16
                                                        : samcache::cuda::kMergeBFloat16;
  check_cuda(samcache::cuda::token_merge_reduce(
                 hidden.const_data_ptr(), dtype, hidden.stride(0), n, dim, weight.const_data_ptr<float>(),
                 sorted_target.const_data_ptr<int64_t>(), order.const_data_ptr<int64_t>(),
                 anchor_rank.const_data_ptr<int64_t>(), m, kept.mutable_data_ptr<int64_t>(),
                 offsets.mutable_data_ptr<int64_t>(), merged.mutable_data_ptr(), stream),
             "merge");
  return {merged, kept};
}

}  // namespace samcache::kernels
