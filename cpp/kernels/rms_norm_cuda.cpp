// Torch-facing CUDA wrappers of rms_norm: the CPU's checks, then one launch on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "rms_norm.cuh"  // cuda/: the raw-pointer launcher
#include "rms_norm.h"

namespace samcache::kernels {

namespace {

int norm_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat  ? samcache::cuda::kNormFloat32
         : x.scalar_type() == at::kHalf ? samcache::cuda::kNormFloat16
                                        : samcache::cuda::kNormBFloat16;
}

at::Tensor launch(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK_VALUE(x.size(0) <= 0x7fffffff, "rms_norm: CUDA takes at most 2^31 - 1 rows, got ", x.size(0));
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const at::Tensor w = weight.contiguous();
  samcache::cuda::RmsNormArgs args{};
  args.x = x.data_ptr();
  args.x_stride = x.stride(0);
  args.delta = delta ? delta->const_data_ptr() : nullptr;
  args.delta_stride = delta ? delta->stride(0) : 0;
  args.weight = w.const_data_ptr();
  args.out = out.data_ptr();
  args.num_rows = x.size(0);
  args.dim = x.size(1);
  args.eps = static_cast<float>(eps);
  args.dtype = norm_dtype(x);
  const cudaError_t err = samcache::cuda::rms_norm(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "rms_norm CUDA launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_args("rms_norm", x, weight, eps);
  return launch(x, nullptr, weight, eps);
}

at::Tensor add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_add_rms_norm_args(x, delta, weight, eps);
  return launch(x, &delta, weight, eps);
}

}  // namespace samcache::kernels
