// rms_norm: a decoder layer's RMS norm in one pass, alone or fused with the residual add before it
// (each of the layer loop's norms was six torch ops; on a GPU, six launches). Shared by the CPU and
// CUDA implementations.
//
// out = weight * dtype(x * rsqrt(mean(x^2) + eps)), the mean in float32, as Hugging Face's Qwen
// and Llama RMSNorm compute it (the product with weight in the tensor's dtype).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace samcache::kernels {

struct RmsNormShape {
  int64_t num_rows = 0;
  int64_t dim = 0;
};

// x [N, D] float32/float16/bfloat16 with a contiguous last dim; weight [D] contiguous, same dtype
// and device; eps finite and >= 0. delta (add_rms_norm): x's shape, dtype and device, contiguous
// last dim; x is then written in place, so its rows must not overlap.
RmsNormShape check_rms_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps);
RmsNormShape check_add_rms_norm_args(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                     double eps);

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
// x += delta (in x's dtype), then returns rms_norm(x).
at::Tensor add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps);
#ifdef SAMCACHE_WITH_CUDA
at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps);
#endif

}  // namespace samcache::kernels
