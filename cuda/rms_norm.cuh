// Raw-pointer launchers of cuda/rms_norm.cu (no torch types: the .cu compiles alone with nvcc).
// The torch-facing wrapper is cpp/kernels/rms_norm_cuda.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace samcache::cuda {

enum NormDtype : int { kNormFloat32 = 0, kNormFloat16 = 1, kNormBFloat16 = 2 };

// Row r of x starts at x + r * x_stride (elements), dim contiguous elements; out is contiguous
// [num_rows, dim]. With delta (non-null), x += delta first (written back into x, in x's dtype).
struct RmsNormArgs {
  void* x;
  int64_t x_stride;
  const void* delta;
  int64_t delta_stride;
  const void* weight;
  void* out;
  int64_t num_rows;
  int64_t dim;
  float eps;
  int dtype;  // NormDtype
};
cudaError_t rms_norm(const RmsNormArgs& args, cudaStream_t stream);

}  // namespace samcache::cuda
