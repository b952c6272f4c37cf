// rope_qkv_write CUDA kernel: one thread per rotary pair (i, i + head_dim / 2) of every q and k
// head, and per pair of value elements, over a grid-stride loop; consecutive threads take
// consecutive pairs of a row, so loads and stores coalesce. Each product and the sum are rounded
// to the dtype, as torch computes x * cos + swap_halves(x) * sin.
#include "dtype.cuh"
#include "rope_qkv.cuh"

namespace samcache::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ T rotated(T x, T cos, T other, T sin) {
  const T a = from_float<T>(__fmul_rn(to_float(x), to_float(cos)));
  const T b = from_float<T>(__fmul_rn(to_float(other), to_float(sin)));
  return from_float<T>(__fadd_rn(to_float(a), to_float(b)));
}

template <typename T, typename Index>
__global__ void __launch_bounds__(kThreads) rope_qkv_kernel(RopeQkvArgs a) {
  const int64_t half = a.head_dim / 2;
  const int64_t heads = a.num_heads + 2 * a.num_kv_heads;
  const int64_t per_token = heads * half;
  const int64_t total = a.num_tokens * per_token;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t t = i / per_token;
    const int64_t within = i - t * per_token;
    const int64_t head = within / half;
    const int64_t j = within - head * half;
    const T* x = static_cast<const T*>(a.qkv) + t * a.qkv_stride + head * a.head_dim;
    if (head >= a.num_heads + a.num_kv_heads) {  // value: copied as it is
      const int64_t slot = static_cast<int64_t>(static_cast<const Index*>(a.slot_mapping)[t]);
      if (slot < 0 || slot >= a.num_slots) continue;
      T* v = static_cast<T*>(a.value_cache) + (slot * a.num_kv_heads + head - a.num_heads - a.num_kv_heads) * a.head_dim;
      v[j] = x[j];
      v[j + half] = x[j + half];
      continue;
    }
    const T* c = static_cast<const T*>(a.cos) + t * a.cos_stride;
    const T* s = static_cast<const T*>(a.sin) + t * a.sin_stride;
    const T lo = rotated(x[j], c[j], x[j + half], s[j]);
    const T hi = rotated(x[j + half], c[j + half], x[j], s[j + half]);
    T* out;
    if (head < a.num_heads) {
      out = static_cast<T*>(a.q_out) + (t * a.num_heads + head) * a.head_dim;
    } else {
      const int64_t slot = static_cast<int64_t>(static_cast<const Index*>(a.slot_mapping)[t]);
      if (slot < 0 || slot >= a.num_slots) continue;  // padding, or an index we cannot trust
      out = static_cast<T*>(a.key_cache) + (slot * a.num_kv_heads + head - a.num_heads) * a.head_dim;
    }
    out[j] = lo;
    out[j + half] = hi;
  }
}

template <typename T>
cudaError_t launch(const RopeQkvArgs& a, cudaStream_t stream) {
  const int64_t total = a.num_tokens * (a.num_heads + 2 * a.num_kv_heads) * (a.head_dim / 2);
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8);
  if (a.slot_type == IndexType::kInt32)
    rope_qkv_kernel<T, int32_t><<<grid, kThreads, 0, stream>>>(a);
  else
    rope_qkv_kernel<T, int64_t><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rope_qkv_write(const RopeQkvArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0 || args.head_dim == 0) return cudaSuccess;
  switch (args.dtype) {
    case kRopeQkvFloat32:
      return launch<float>(args, stream);
    case kRopeQkvFloat16:
      return launch<__half>(args, stream);
    case kRopeQkvBFloat16:
      return launch<__nv_bfloat16>(args, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace samcache::cuda
