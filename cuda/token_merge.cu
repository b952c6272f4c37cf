// token_merge CUDA kernels. Grouping needs no float atomics: members are grouped by a stable sort
// (done by the wrapper), rows are cut into chunks at fixed positions, each chunk is summed by one
// warp in member order and the partial sums of a long row are added in chunk order, so results
// are bitwise reproducible run to run.
//
// The reduce is memory bound: one warp per (chunk, 32 x 16-byte column slice), consecutive warps
// of a CTA take consecutive slices of the same chunk; each lane keeps 8 independent 16-byte loads
// of hidden rows in flight (the members' token ids and weights are loaded once per 32 members,
// one per lane, and broadcast with shuffles). Long rows are cut into up to 64 chunks, so a single
// anchor still spreads over the whole GPU; the chunk list makes short and long rows alike.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "dtype.cuh"
#include "token_merge.cuh"

namespace samcache::cuda {

namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ void report(unsigned long long* status, int code, int64_t index) {
  atomicMin(status + 1, (static_cast<unsigned long long>(code) << kTokenMergeCodeShift) |
                            static_cast<unsigned long long>(index));
}

// Every thread of the block reaches the warp-wide calls (no early return before them).
__global__ void __launch_bounds__(kThreads)
    validate_kernel(const int64_t* __restrict__ target, const float* __restrict__ weight, int64_t n,
                    int32_t* __restrict__ anchor_flag, int32_t* __restrict__ has_weight, unsigned long long* status) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  bool anchor = false;
  unsigned weight_bits = 0;  // of a valid weight > 0 (never -0.0f's sign bit): orders like the float
  if (i < n) {
    const int64_t t = target[i];
    const float w = weight[i];
    if (t < 0 || t >= n) {
      report(status, 1, i);
    } else if (target[t] != t) {  // t is in range here
      report(status, 2, i);
    } else {
      anchor = t == i;
      if (!(w >= 0.0f) || isinf(w)) {
        report(status, 3, i);
      } else {
        if (w > 0.0f) {
          weight_bits = __float_as_uint(w);
          has_weight[t] = 1;  // racing stores of the same value
        }
      }
    }
    anchor_flag[i] = anchor ? 1 : 0;
  }
  const unsigned ballot = __ballot_sync(kFullMask, anchor);
  const unsigned max_bits = __reduce_max_sync(kFullMask, weight_bits);
  if ((threadIdx.x & 31) == 0) {
    if (ballot) atomicAdd(status, static_cast<unsigned long long>(__popc(ballot)));
    if (max_bits) atomicMax(status + 2, static_cast<unsigned long long>(max_bits));
  }
}

// Weights are >= 0, so a total of 0 means every member weighs exactly 0: decided without summing.
__global__ void __launch_bounds__(kThreads)
    zero_weight_kernel(const int32_t* __restrict__ anchor_flag, const int32_t* __restrict__ has_weight, int64_t n,
                       unsigned long long* status) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n && anchor_flag[i] && !has_weight[i]) report(status, 4, i);
}

__device__ __forceinline__ bool plan_is_bad(const unsigned long long* status) {
  return *reinterpret_cast<const volatile unsigned long long*>(status + 1) != kTokenMergeNoError;
}

// Members per chunk of a row of `len` members (identical in every kernel that cuts rows).
__device__ __forceinline__ int32_t merge_chunk_len(int32_t len) {
  if (len <= kMergeMinChunk) return len;
  const auto even = static_cast<int32_t>((static_cast<int64_t>(len) + kMergeMaxChunks - 1) / kMergeMaxChunks);
  return even > kMergeMinChunk ? even : kMergeMinChunk;
}

// Row r starts where the sorted targets change to its anchor; offsets[m] = n.
__global__ void __launch_bounds__(kThreads)
    segment_kernel(const int32_t* __restrict__ sorted_target, const int32_t* __restrict__ anchor_rank, int64_t n,
                   const unsigned long long* status, int32_t* __restrict__ offsets) {
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= n || plan_is_bad(status)) return;
  const int32_t a = sorted_target[p];
  if (p == 0 || sorted_target[p - 1] != a) offsets[anchor_rank[a] - 1] = static_cast<int32_t>(p);
  if (p == n - 1) offsets[anchor_rank[n - 1]] = static_cast<int32_t>(n);
}

struct RowOf {
  int32_t row, start, len;
};

__device__ __forceinline__ RowOf row_of(const int32_t* sorted_target, const int32_t* anchor_rank,
                                        const int32_t* offsets, int64_t p) {
  RowOf r;
  r.row = anchor_rank[sorted_target[p]] - 1;
  r.start = offsets[r.row];
  r.len = offsets[r.row + 1] - r.start;
  return r;
}

__global__ void __launch_bounds__(kThreads)
    mark_kernel(const int32_t* __restrict__ sorted_target, const int32_t* __restrict__ anchor_rank,
                const int32_t* __restrict__ offsets, int64_t n, const unsigned long long* status,
                int64_t* __restrict__ marks) {
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= n || plan_is_bad(status)) return;
  const RowOf r = row_of(sorted_target, anchor_rank, offsets, p);
  const bool start = (static_cast<int32_t>(p) - r.start) % merge_chunk_len(r.len) == 0;
  const bool partial = start && r.len > kMergeMinChunk;
  marks[p] = (start ? 1ll : 0ll) | (partial ? (1ll << 32) : 0ll);
}

__global__ void __launch_bounds__(kThreads)
    chunk_kernel(const int32_t* __restrict__ sorted_target, const int32_t* __restrict__ anchor_rank,
                 const int32_t* __restrict__ offsets, const int64_t* __restrict__ marks,
                 const int64_t* __restrict__ cum, int64_t n, const unsigned long long* status,
                 MergeChunk* __restrict__ chunks, int32_t* __restrict__ slot_chunk) {
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= n || plan_is_bad(status)) return;
  const int64_t mark = marks[p];
  if (!(mark & 1)) return;
  const RowOf r = row_of(sorted_target, anchor_rank, offsets, p);
  const int32_t g = static_cast<int32_t>(cum[p] & 0xffffffffll) - 1;
  const int32_t slot = (mark >> 32) ? static_cast<int32_t>(cum[p] >> 32) - 1 : -1;
  const int64_t end_of_row = static_cast<int64_t>(r.start) + r.len;
  const int64_t end = p + merge_chunk_len(r.len);
  chunks[g] = MergeChunk{static_cast<int32_t>(p), static_cast<int32_t>(end < end_of_row ? end : end_of_row), r.row, slot};
  if (slot >= 0) slot_chunk[slot] = g;
}

constexpr int kMergeWarps = kThreads / 32;  // tasks per CTA
constexpr int kMergeUnroll = 8;             // hidden rows in flight per lane

// VEC consecutive floats (16-byte accesses when VEC % 4 == 0; the caller keeps them aligned).
template <int VEC>
__device__ __forceinline__ void load_floats(const float* p, float* out) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 4) {
      const float4 v = *reinterpret_cast<const float4*>(p + j);
      out[j] = v.x, out[j + 1] = v.y, out[j + 2] = v.z, out[j + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = p[j];
  }
}

template <int VEC>
__device__ __forceinline__ void store_floats(float* p, const float* in) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 4) *reinterpret_cast<float4*>(p + j) = make_float4(in[j], in[j + 1], in[j + 2], in[j + 3]);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) p[j] = in[j];
  }
}

// Task = (chunk g, column slice c); lane l covers elements [col, col + VEC), col = (32c + l) VEC.
// Members are added in sorted order, w * x accumulated in float32 and the weights summed in
// the same order; a whole-row chunk divides and stores, a partial chunk parks its sums in its slot.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    merge_chunks_kernel(const T* __restrict__ hidden, int64_t hidden_stride, int64_t dim,
                        const float* __restrict__ weight, const int64_t* __restrict__ order,
                        const int32_t* __restrict__ sorted_target, const int32_t* __restrict__ offsets,
                        const int64_t* __restrict__ cum, int64_t n, const MergeChunk* __restrict__ chunks,
                        int64_t col_blocks, float* __restrict__ partial, float* __restrict__ partial_weight,
                        int64_t* __restrict__ kept, T* __restrict__ merged) {
  using P = Pack<T, VEC>;
  const int lane = threadIdx.x & 31;
  const int64_t task = blockIdx.x * static_cast<int64_t>(kMergeWarps) + (threadIdx.x >> 5);
  const int64_t g = task / col_blocks, c = task - g * col_blocks;
  if (g >= (cum[n - 1] & 0xffffffffll)) return;  // past the last chunk (the grid is an upper bound)
  const MergeChunk ch = chunks[g];
  const int64_t col = (c * 32 + lane) * VEC;
  const bool active = col < dim;
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
  float wsum = 0.0f;
  for (int64_t base = ch.start; base < ch.end; base += 32) {
    const int count = ch.end - base < 32 ? static_cast<int>(ch.end - base) : 32;  // the same in every lane
    int64_t my_token = 0;
    float my_weight = 0.0f;
    if (lane < count) {
      my_token = order[base + lane];
      my_weight = weight[my_token];
    }
    int j = 0;
    for (; j + kMergeUnroll <= count; j += kMergeUnroll) {
      P x[kMergeUnroll];
      float w[kMergeUnroll];
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        const int64_t token = __shfl_sync(kFullMask, my_token, j + u);
        w[u] = __shfl_sync(kFullMask, my_weight, j + u);
        if (active) x[u] = *reinterpret_cast<const P*>(hidden + token * hidden_stride + col);
      }
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        wsum += w[u];
        if (active) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[k] += w[u] * to_float(x[u].v[k]);
        }
      }
    }
    for (; j < count; ++j) {
      const int64_t token = __shfl_sync(kFullMask, my_token, j);
      const float w = __shfl_sync(kFullMask, my_weight, j);
      wsum += w;
      if (active) {
        const P x = *reinterpret_cast<const P*>(hidden + token * hidden_stride + col);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += w * to_float(x.v[k]);
      }
    }
  }
  if (c == 0 && lane == 0 && offsets[ch.row] == ch.start) kept[ch.row] = sorted_target[ch.start];
  if (ch.slot < 0) {  // the whole row: wsum > 0 (validated), normalise like the CPU (acc / sum)
    if (active) {
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(acc[k] / wsum);
      *reinterpret_cast<P*>(merged + ch.row * dim + col) = out;
    }
  } else {
    if (active) store_floats<VEC>(partial + ch.slot * dim + col, acc);
    if (c == 0 && lane == 0) partial_weight[ch.slot] = wsum;
  }
}

// Task = (slot q, column slice c): the first slot of a row adds its row's partial sums in slot
// order, then divides and stores.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    merge_partials_kernel(const float* __restrict__ partial, const float* __restrict__ partial_weight,
                          const int32_t* __restrict__ offsets, const int64_t* __restrict__ cum, int64_t n,
                          const MergeChunk* __restrict__ chunks, const int32_t* __restrict__ slot_chunk,
                          int64_t dim, int64_t col_blocks, T* __restrict__ merged) {
  using P = Pack<T, VEC>;
  constexpr int kUnroll = 8;
  const int lane = threadIdx.x & 31;
  const int64_t task = blockIdx.x * static_cast<int64_t>(kMergeWarps) + (threadIdx.x >> 5);
  const int64_t q = task / col_blocks, c = task - q * col_blocks;
  if (q >= (cum[n - 1] >> 32)) return;  // past the last slot
  const MergeChunk ch = chunks[slot_chunk[q]];
  const int32_t row_start = offsets[ch.row];
  if (ch.start != row_start) return;  // not the row's first chunk
  const int32_t len = offsets[ch.row + 1] - row_start;
  const int32_t chunk = merge_chunk_len(len);
  const auto parts = static_cast<int32_t>((static_cast<int64_t>(len) + chunk - 1) / chunk);  // slots q .. q + parts - 1
  const int64_t col = (c * 32 + lane) * VEC;
  const bool active = col < dim;
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
  float wsum = 0.0f;
  for (int32_t i = 0; i < parts; i += kUnroll) {
    float v[kUnroll][VEC];
    float w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i + u < parts) {
        w[u] = partial_weight[q + i + u];
        if (active) load_floats<VEC>(partial + (q + i + u) * dim + col, v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i + u < parts) {
        wsum += w[u];
        if (active) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[k] += v[u][k];
        }
      }
    }
  }
  if (active) {
    P out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(acc[k] / wsum);
    *reinterpret_cast<P*>(merged + ch.row * dim + col) = out;
  }
}

template <typename T>
cudaError_t reduce_typed(const void* hidden, int64_t hidden_stride, int64_t n, int64_t dim, const float* weight,
                         const int64_t* order, const int32_t* sorted_target, const int32_t* offsets,
                         const int64_t* cum, const MergeChunk* chunks, const int32_t* slot_chunk, int64_t m,
                         float* partial, float* partial_weight, int64_t* kept, void* merged, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = reinterpret_cast<uintptr_t>(hidden) % 16 == 0 && reinterpret_cast<uintptr_t>(merged) % 16 == 0 &&
                   dim % kVec == 0 && hidden_stride % kVec == 0;
  const int64_t vecs = vec ? dim / kVec : dim;
  const int64_t col_blocks = vecs > 0 ? (vecs + 31) / 32 : 1;  // dim 0: one idle slice still writes kept
  const int64_t max_chunks = merge_max_chunks(n, m), max_slots = merge_max_slots(n, m);
  if (max_slots > 0 && (partial == nullptr || partial_weight == nullptr)) return cudaErrorInvalidValue;
  const int64_t chunk_ctas = (max_chunks * col_blocks + kMergeWarps - 1) / kMergeWarps;
  const int64_t slot_ctas = (max_slots * col_blocks + kMergeWarps - 1) / kMergeWarps;
  if (chunk_ctas > 0x7fffffff || slot_ctas > 0x7fffffff) return cudaErrorInvalidValue;
  const T* h = static_cast<const T*>(hidden);
  T* out = static_cast<T*>(merged);
  auto launch = [&](auto vec_width) -> cudaError_t {
    constexpr int V = decltype(vec_width)::value;
    merge_chunks_kernel<T, V><<<static_cast<unsigned>(chunk_ctas), kThreads, 0, stream>>>(
        h, hidden_stride, dim, weight, order, sorted_target, offsets, cum, n, chunks, col_blocks, partial,
        partial_weight, kept, out);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || slot_ctas == 0) return err;
    merge_partials_kernel<T, V><<<static_cast<unsigned>(slot_ctas), kThreads, 0, stream>>>(
        partial, partial_weight, offsets, cum, n, chunks, slot_chunk, dim, col_blocks, out);
    return cudaGetLastError();
  };
  return vec ? launch(std::integral_constant<int, kVec>{}) : launch(std::integral_constant<int, 1>{});
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// n < 2^31 and a whole grid: checked once by every launcher.
bool bad_size(int64_t n) { return n < 0 || n > 0x7fffffff; }

}  // namespace

cudaError_t token_merge_validate(const int64_t* target, const float* weight, int64_t n, int32_t* anchor_flag,
                                 int32_t* has_weight, unsigned long long* status, cudaStream_t stream) {
  if (bad_size(n)) return cudaErrorInvalidValue;
  cudaError_t err = cudaMemsetAsync(status, 0, kTokenMergeStatusWords * sizeof(unsigned long long), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(status + 1, 0xff, sizeof(unsigned long long), stream);
  if (err != cudaSuccess || n == 0) return err;
  validate_kernel<<<blocks_for(n), kThreads, 0, stream>>>(target, weight, n, anchor_flag, has_weight, status);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  zero_weight_kernel<<<blocks_for(n), kThreads, 0, stream>>>(anchor_flag, has_weight, n, status);
  return cudaGetLastError();
}

cudaError_t token_merge_rows(const int32_t* sorted_target, const int32_t* anchor_rank, int64_t n,
                             const unsigned long long* status, int32_t* offsets, int64_t* marks, cudaStream_t stream) {
  if (bad_size(n)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  segment_kernel<<<blocks_for(n), kThreads, 0, stream>>>(sorted_target, anchor_rank, n, status, offsets);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  mark_kernel<<<blocks_for(n), kThreads, 0, stream>>>(sorted_target, anchor_rank, offsets, n, status, marks);
  return cudaGetLastError();
}

cudaError_t token_merge_chunks(const int32_t* sorted_target, const int32_t* anchor_rank, const int32_t* offsets,
                               const int64_t* marks, const int64_t* cum, int64_t n, const unsigned long long* status,
                               MergeChunk* chunks, int32_t* slot_chunk, cudaStream_t stream) {
  if (bad_size(n)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  chunk_kernel<<<blocks_for(n), kThreads, 0, stream>>>(sorted_target, anchor_rank, offsets, marks, cum, n, status,
                                                       chunks, slot_chunk);
  return cudaGetLastError();
}

cudaError_t token_merge_reduce(const void* hidden, int dtype, int64_t hidden_stride, int64_t n, int64_t dim,
                               const float* weight, const int64_t* order, const int32_t* sorted_target,
                               const int32_t* offsets, const int64_t* cum, const MergeChunk* chunks,
                               const int32_t* slot_chunk, int64_t m, float* partial, float* partial_weight,
                               int64_t* kept, void* merged, cudaStream_t stream) {
  if (bad_size(n) || m < 0 || m > n || dim < 0) return cudaErrorInvalidValue;
  if (n == 0 || m == 0) return cudaSuccess;
  switch (dtype) {
    case kMergeFloat32:
      return reduce_typed<float>(hidden, hidden_stride, n, dim, weight, order, sorted_target, offsets, cum, chunks,
                                 slot_chunk, m, partial, partial_weight, kept, merged, stream);
    case kMergeFloat16:
      return reduce_typed<__half>(hidden, hidden_stride, n, dim, weight, order, sorted_target, offsets, cum, chunks,
                                  slot_chunk, m, partial, partial_weight, kept, merged, stream);
    case kMergeBFloat16:
      return reduce_typed<__nv_bfloat16>(hidden, hidden_stride, n, dim, weight, order, sorted_target, offsets, cum,
                                         chunks, slot_chunk, m, partial, partial_weight, kept, merged, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace samcache::cuda
