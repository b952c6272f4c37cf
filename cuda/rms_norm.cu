// rms_norm CUDA kernel: one block per row. Each thread adds the residual to its columns (when
// fused), accumulates their squares in float32, a block reduction gives the row's mean, and the
// same thread scales its columns: x is read from global memory twice at most, out written once.
#include "dtype.cuh"
#include "rms_norm.cuh"

namespace samcache::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[kThreads / 32];
  __shared__ float total;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < kThreads / 32 ? warp_sums[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(RmsNormArgs a) {
  const int64_t row = blockIdx.x;
  T* x = static_cast<T*>(a.x) + row * a.x_stride;
  const T* delta = a.delta ? static_cast<const T*>(a.delta) + row * a.delta_stride : nullptr;
  const T* w = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out) + row * a.dim;
  float squares = 0.0f;
  for (int64_t i = threadIdx.x; i < a.dim; i += kThreads) {
    T v = x[i];
    if (delta) {
      v = from_float<T>(to_float(v) + to_float(delta[i]));
      x[i] = v;
    }
    const float f = to_float(v);
    squares += f * f;
  }
  const float mean = block_sum(squares) / static_cast<float>(a.dim);
  const float inv_rms = 1.0f / sqrtf(mean + a.eps);
  // Each thread reads back only the columns it wrote itself: no barrier needed for x.
  for (int64_t i = threadIdx.x; i < a.dim; i += kThreads)
    out[i] = from_float<T>(to_float(w[i]) * to_float(from_float<T>(to_float(x[i]) * inv_rms)));
}

template <typename T>
cudaError_t launch(const RmsNormArgs& a, cudaStream_t stream) {
  rms_norm_kernel<T><<<static_cast<unsigned>(a.num_rows), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rms_norm(const RmsNormArgs& args, cudaStream_t stream) {
  if (args.num_rows == 0 || args.dim == 0) return cudaSuccess;
  if (args.num_rows > 0x7fffffff) return cudaErrorInvalidValue;
  switch (args.dtype) {
    case kNormFloat32:
      return launch<float>(args, stream);
    case kNormFloat16:
      return launch<__half>(args, stream);
    case kNormBFloat16:
      return launch<__nv_bfloat16>(args, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace samcache::cuda
