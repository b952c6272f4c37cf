// token_merge CUDA kernels. Grouping needs no float atomics: members are grouped by a stable sort
// (done by the wrapper), so each anchor row is reduced by one fixed set of threads in a fixed
// order and the result is bitwise reproducible. The reduce kernel is fused: weighted sum,
// weight total and normalisation in one pass, 16-byte loads of hidden rows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "dtype.cuh"
#include "token_merge.cuh"

namespace samcache::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void report(unsigned long long* status, int code, int64_t index) {
  atomicMin(status + 1, (static_cast<unsigned long long>(code) << kTokenMergeCodeShift) |
                            static_cast<unsigned long long>(index));
}

__global__ void validate_kernel(const int64_t* __restrict__ target, const float* __restrict__ weight, int64_t n,
                                int32_t* __restrict__ anchor_flag, int32_t* __restrict__ has_weight,
                                unsigned long long* status) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  bool anchor = false;
  if (i < n) {
    const int64_t t = target[i];
    const float w = weight[i];
    if (t < 0 || t >= n) {
      report(status, 1, i);
    } else if (target[t] != t) {
      report(status, 2, i);
    } else {
      anchor = t == i;
      if (!(w >= 0.0f) || isinf(w)) report(status, 3, i);
      else if (w > 0.0f) has_weight[t] = 1;  // racing stores of the same value
    }
    anchor_flag[i] = anchor ? 1 : 0;
  }
  const unsigned ballot = __ballot_sync(0xffffffffu, anchor);
  if ((threadIdx.x & 31) == 0 && ballot) atomicAdd(status, static_cast<unsigned long long>(__popc(ballot)));
}

// Weights are >= 0, so a total of 0 means every member weighs exactly 0: decided without summing.
__global__ void zero_weight_kernel(const int32_t* __restrict__ anchor_flag, const int32_t* __restrict__ has_weight,
                                   int64_t n, unsigned long long* status) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n && anchor_flag[i] && !has_weight[i]) report(status, 4, i);
}

// Row r of anchor a starts where the sorted targets change to a.
__global__ void segment_kernel(const int64_t* __restrict__ sorted_target, const int64_t* __restrict__ anchor_rank,
                               int64_t n, int64_t m, int64_t* __restrict__ kept, int64_t* __restrict__ offsets) {
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= n) return;
  const int64_t a = sorted_target[p];
  if (p == 0 || sorted_target[p - 1] != a) {
    const int64_t r = anchor_rank[a] - 1;
    kept[r] = a;
    offsets[r] = p;
  }
  if (p == 0) offsets[m] = n;
}


constexpr int kMaxWarps = 16;

// One thread block per (anchor row, 32-vector column slice). Warp w sums members w, w + warps, ...
// of the row; the warps' partial sums are then added in warp order: a fixed order, so results
// do not depend on scheduling.
template <typename T, int VEC>
__global__ void reduce_kernel(const T* __restrict__ hidden, int64_t hidden_stride, int64_t dim,
                              const float* __restrict__ weight, const int64_t* __restrict__ order,
                              const int64_t* __restrict__ kept, const int64_t* __restrict__ offsets,
                              int64_t col_blocks, T* __restrict__ merged) {
  __shared__ float partial[kMaxWarps][VEC][32];
  __shared__ float partial_weight[kMaxWarps];
  const int64_t r = blockIdx.x / col_blocks;
  const int64_t col = (blockIdx.x % col_blocks) * 32 + (threadIdx.x & 31);  // in vectors
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const bool active = col * VEC < dim;
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
  float wsum = 0.0f;
  const int64_t end = offsets[r + 1];
  for (int64_t p = offsets[r] + warp; p < end; p += warps) {
    const int64_t token = order[p];
    const float w = weight[token];
    wsum += w;
    if (active) {
      const Pack<T, VEC> x = *reinterpret_cast<const Pack<T, VEC>*>(hidden + token * hidden_stride + col * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += w * to_float(x.v[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) partial[warp][j][threadIdx.x & 31] = acc[j];
  if ((threadIdx.x & 31) == 0) partial_weight[warp] = wsum;
  __syncthreads();
  if (warp != 0 || !active) return;
  float total_weight = 0.0f;
  for (int w = 0; w < warps; ++w) total_weight += partial_weight[w];
  Pack<T, VEC> out;
  if (total_weight > 0.0f) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float s = 0.0f;
      for (int w = 0; w < warps; ++w) s += partial[w][j][threadIdx.x];
      out.v[j] = from_float<T>(s / total_weight);
    }
  } else {  // unreachable after validation; the anchor's own row rather than 0/0
    out = *reinterpret_cast<const Pack<T, VEC>*>(hidden + kept[r] * hidden_stride + col * VEC);
  }
  *reinterpret_cast<Pack<T, VEC>*>(merged + r * dim + col * VEC) = out;
}

template <typename T>
cudaError_t reduce_typed(const void* hidden, int64_t hidden_stride, int64_t n, int64_t dim, const float* weight,
                         const int64_t* order, const int64_t* kept, const int64_t* offsets, int64_t m, void* merged,
                         cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = reinterpret_cast<uintptr_t>(hidden) % 16 == 0 && reinterpret_cast<uintptr_t>(merged) % 16 == 0 &&
                   dim % kVec == 0 && hidden_stride % kVec == 0;
  const int64_t vecs = vec ? dim / kVec : dim;
  const int64_t col_blocks = (vecs + 31) / 32;
  if (m * col_blocks > 0x7fffffff) return cudaErrorInvalidValue;
  // Long rows (few anchors) get more warps each, so one row is not summed by a single warp.
  const int64_t members_per_row = (n + m - 1) / m;
  const int warps = members_per_row >= 64 ? kMaxWarps : (members_per_row >= 8 ? 4 : 1);
  const dim3 grid(static_cast<unsigned>(m * col_blocks)), block(32 * warps);
  const T* h = static_cast<const T*>(hidden);
  T* out = static_cast<T*>(merged);
  if (vec)
    reduce_kernel<T, kVec><<<grid, block, 0, stream>>>(h, hidden_stride, dim, weight, order, kept, offsets, col_blocks, out);
  else
    reduce_kernel<T, 1><<<grid, block, 0, stream>>>(h, hidden_stride, dim, weight, order, kept, offsets, col_blocks, out);
  return cudaGetLastError();
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

cudaError_t token_merge_validate(const int64_t* target, const float* weight, int64_t n, int32_t* anchor_flag,
                                 int32_t* has_weight, unsigned long long* status, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(status, 0, sizeof(unsigned long long), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(status + 1, 0xff, sizeof(unsigned long long), stream);
  if (err != cudaSuccess || n == 0) return err;
  if ((n + kThreads - 1) / kThreads > 0x7fffffff) return cudaErrorInvalidValue;
  validate_kernel<<<blocks_for(n), kThreads, 0, stream>>>(target, weight, n, anchor_flag, has_weight, status);
  zero_weight_kernel<<<blocks_for(n), kThreads, 0, stream>>>(anchor_flag, has_weight, n, status);
  return cudaGetLastError();
}

cudaError_t token_merge_reduce(const void* hidden, int dtype, int64_t hidden_stride, int64_t n, int64_t dim,
                               const float* weight, const int64_t* sorted_target, const int64_t* order,
                               const int64_t* anchor_rank, int64_t m, int64_t* kept, int64_t* offsets, void* merged,
                               cudaStream_t stream) {
  if (n == 0 || m == 0) return cudaSuccess;
  segment_kernel<<<blocks_for(n), kThreads, 0, stream>>>(sorted_target, anchor_rank, n, m, kept, offsets);
  if (dim == 0) return cudaGetLastError();
  switch (dtype) {
    case kMergeFloat32: return reduce_typed<float>(hidden, hidden_stride, n, dim, weight, order, kept, offsets, m, merged, stream);
    case kMergeFloat16: return reduce_typed<__half>(hidden, hidden_stride, n, dim, weight, order, kept, offsets, m, merged, stream);
    case kMergeBFloat16: return reduce_typed<__nv_bfloat16>(hidden, hidden_stride, n, dim, weight, order, kept, offsets, m, merged, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace samcache::cuda
