// Block-sparse recompute attention on CUDA cores, split-KV (flash-decoding style).
//
// One CTA = one query row (of any sequence of the batch) x one group of up to 8 query heads
// sharing a KV head x one split of the row's visible key range [lo, position]. Each of its 4
// warps scores 32 keys at a time (one key per lane, 16-byte loads, all heads of the group at
// once), keeps an online softmax per head, and accumulates V with lanes owning strided dims
// (coalesced reads). Warps merge in
// shared memory; with several splits, a second kernel merges the splits through their
// (max, sum) pairs. Keys outside a query's range are never read.
//
// Guards instead of host validation (device indices cannot be read without a sync, see row_keys):
// a query whose sequence, position or pages are inconsistent gets NaN output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "dtype.cuh"
#include "sparse_attention.cuh"

namespace samcache::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxGroup = 8;                  // query heads per CTA
constexpr int kMaxDimsPerLane = 256 / 32;     // output dims a lane owns
constexpr int kMinKeysPerSplit = 512;


// Loads 8 consecutive elements (16 bytes for 2-byte types, two 16-byte loads for float).
template <typename T>
__device__ __forceinline__ void load8(const T* src, float (&dst)[8]) {
  if constexpr (sizeof(T) == 2) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = to_float(v[i]);
  } else {
    const float4 a = reinterpret_cast<const float4*>(src)[0];
    const float4 b = reinterpret_cast<const float4*>(src)[1];
    dst[0] = a.x, dst[1] = a.y, dst[2] = a.z, dst[3] = a.w;
    dst[4] = b.x, dst[5] = b.y, dst[6] = b.z, dst[7] = b.w;
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

struct KeyRange {
  int64_t lo, hi;  // inclusive; empty when lo > hi
};

__device__ __forceinline__ KeyRange split_range(const SparseAttentionParams& p, int64_t index, int split) {
  const int64_t lo = p.window > 0 ? max(int64_t{0}, index - p.window + 1) : 0;
  const int64_t len = index - lo + 1;
  const int64_t per = (len + p.num_splits - 1) / p.num_splits;
  return {lo + split * per, min(index, lo + (split + 1) * per - 1)};
}

template <typename T>
__global__ void __launch_bounds__(kThreads) split_kernel(SparseAttentionParams p) {
  const int64_t query = blockIdx.x;  // x: up to 2^31-1 queries; y: splits (<= 65535)
  const int split = blockIdx.y;
  const int groups_per_kv = static_cast<int>((p.num_q_heads / p.num_kv_heads + kMaxGroup - 1) / kMaxGroup);
  const int64_t kv_head = blockIdx.z / groups_per_kv;
  const int64_t G_all = p.num_q_heads / p.num_kv_heads;
  const int64_t head0 = kv_head * G_all + (blockIdx.z % groups_per_kv) * kMaxGroup;
  const int G = static_cast<int>(min(int64_t{kMaxGroup}, kv_head * G_all + G_all - head0));
  const int D = static_cast<int>(p.head_dim);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  extern __shared__ float smem[];
  float* q_s = smem;                               // [G][D]
  float* o_s = q_s + kMaxGroup * D;                // [kWarps][G][D]
  float* m_s = o_s + kWarps * kMaxGroup * D;       // [kWarps][G]
  float* l_s = m_s + kWarps * kMaxGroup;           // [kWarps][G]
  __shared__ int bad;

  const RowKeys keys = row_keys(p, query);
  const int64_t index = keys.position, page0 = keys.page0;
  if (threadIdx.x == 0) bad = !keys.ok;
  const T* q = static_cast<const T*>(p.q) + (query * p.num_q_heads + head0) * D;
  for (int i = threadIdx.x; i < G * D; i += kThreads) q_s[i] = to_float(q[i]);
  __syncthreads();

  float m[kMaxGroup], l[kMaxGroup], o[kMaxGroup][kMaxDimsPerLane];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    m[g] = -FLT_MAX;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxDimsPerLane; ++i) o[g][i] = 0.f;
  }

  const KeyRange range = bad ? KeyRange{1, 0} : split_range(p, index, split);
  const T* kc = static_cast<const T*>(p.key_cache);
  const T* vc = static_cast<const T*>(p.value_cache);
  for (int64_t tile = range.lo + warp * 32; tile <= range.hi; tile += kWarps * 32) {
    const int64_t key = tile + lane;
    bool valid = key <= range.hi;
    int64_t row = 0;  // element offset of this key's [kv_head] row
    if (valid) {
      const int64_t blk = p.kv_indices[page0 + key / p.block_size];
      if (blk < 0 || blk >= p.num_cache_blocks) {
        valid = false;
        bad = 1;  // benign race: every writer stores 1
      }
      row = ((blk * p.block_size + key % p.block_size) * p.num_kv_heads + kv_head) * D;
    }
    float s[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) s[g] = 0.f;
    if (valid) {
      for (int d = 0; d < D; d += 8) {
        float k8[8];
        load8(kc + row + d, k8);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g < G) {
            const float* qg = q_s + g * D + d;
#pragma unroll
            for (int i = 0; i < 8; ++i) s[g] += qg[i] * k8[i];
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {  // constant trip count: arrays stay in registers
      if (g >= G) continue;
      float x = s[g] * p.scale;
      if (p.logit_cap > 0.f) x = p.logit_cap * tanhf(x / p.logit_cap);
      x = valid ? x : -FLT_MAX;
      const float m_new = fmaxf(m[g], warp_max(x));
      const float alpha = __expf(m[g] - m_new);
      const float pr = valid ? __expf(x - m_new) : 0.f;
      l[g] = l[g] * alpha + warp_sum(pr);
      m[g] = m_new;
#pragma unroll
      for (int i = 0; i < kMaxDimsPerLane; ++i) o[g][i] *= alpha;
      s[g] = pr;  // reuse: this lane's probability for its key
    }
    const int n_keys = static_cast<int>(min(int64_t{32}, range.hi - tile + 1));
    for (int k = 0; k < n_keys; ++k) {  // o += p_k * V[key k], lanes own dims lane + 32 i
      const int64_t vrow = __shfl_sync(0xffffffffu, row, k);
      const bool vvalid = __shfl_sync(0xffffffffu, valid, k);
      if (!vvalid) continue;
      float v[kMaxDimsPerLane];
#pragma unroll
      for (int i = 0; i < kMaxDimsPerLane; ++i) {
        const int d = lane + 32 * i;
        v[i] = d < D ? to_float(vc[vrow + d]) : 0.f;
      }
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g >= G) continue;
        const float pk = __shfl_sync(0xffffffffu, s[g], k);
#pragma unroll
        for (int i = 0; i < kMaxDimsPerLane; ++i) o[g][i] += pk * v[i];
      }
    }
  }

  // Merge the warps' (m, l, o) in shared memory.
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= G) continue;
    if (lane == 0) {
      m_s[warp * kMaxGroup + g] = m[g];
      l_s[warp * kMaxGroup + g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < kMaxDimsPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < D) o_s[(warp * kMaxGroup + g) * D + d] = o[g][i];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float M = -FLT_MAX;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, m_s[w * kMaxGroup + g]);
    float L = 0.f, acc = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float f = __expf(m_s[w * kMaxGroup + g] - M);
      L += l_s[w * kMaxGroup + g] * f;
      acc += o_s[(w * kMaxGroup + g) * D + d] * f;
    }
    const int64_t head = head0 + g;
    if (p.num_splits == 1) {
      T* out = static_cast<T*>(p.out) + (query * p.num_q_heads + head) * D;
      out[d] = from_float<T>(bad || L == 0.f ? __int_as_float(0x7fffffff) : acc / L);
      if (d == 0) p.lse[query * p.num_q_heads + head] = bad || L == 0.f ? __int_as_float(0x7fffffff) : M + __logf(L);
    } else {
      const int64_t slot = (split * p.num_queries + query) * p.num_q_heads + head;
      p.partial_o[slot * D + d] = acc;
      if (d == 0) {
        p.partial_ml[2 * slot] = bad ? __int_as_float(0x7fffffff) : M;
        p.partial_ml[2 * slot + 1] = L;
      }
    }
  }
}

// Merges the splits of one (query, head): out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M).
template <typename T>
__global__ void __launch_bounds__(kThreads) combine_kernel(SparseAttentionParams p) {
  const int64_t query = blockIdx.x, head = blockIdx.y;
  const int D = static_cast<int>(p.head_dim);
  const int64_t stride = p.num_queries * p.num_q_heads;
  const int64_t base = query * p.num_q_heads + head;
  float M = -FLT_MAX;
  bool bad = false;
  for (int s = 0; s < p.num_splits; ++s) {
    const float ms = p.partial_ml[2 * (s * stride + base)];
    bad |= ms != ms;
    M = fmaxf(M, ms);
  }
  float L = 0.f;
  for (int s = 0; s < p.num_splits; ++s)
    L += p.partial_ml[2 * (s * stride + base) + 1] * __expf(p.partial_ml[2 * (s * stride + base)] - M);
  T* out = static_cast<T*>(p.out) + base * D;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float acc = 0.f;
    for (int s = 0; s < p.num_splits; ++s)
      acc += p.partial_o[(s * stride + base) * D + d] * __expf(p.partial_ml[2 * (s * stride + base)] - M);
    out[d] = from_float<T>(bad || L == 0.f ? __int_as_float(0x7fffffff) : acc / L);
  }
  if (threadIdx.x == 0) p.lse[base] = bad || L == 0.f ? __int_as_float(0x7fffffff) : M + __logf(L);
}

template <typename T>
cudaError_t launch(const SparseAttentionParams& p, cudaStream_t stream) {
  const int64_t G = p.num_q_heads / p.num_kv_heads;
  const int64_t groups = (G + kMaxGroup - 1) / kMaxGroup;
  const dim3 grid(static_cast<unsigned>(p.num_queries), p.num_splits, static_cast<unsigned>(p.num_kv_heads * groups));
  const size_t smem = sizeof(float) * (kMaxGroup * p.head_dim + kWarps * kMaxGroup * p.head_dim + 2 * kWarps * kMaxGroup);
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(split_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  split_kernel<T><<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_combine(const SparseAttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_queries), static_cast<unsigned>(p.num_q_heads));
  combine_kernel<T><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

int sparse_attention_num_splits(int64_t num_queries, int64_t num_kv_heads, int64_t num_q_heads, int64_t max_keys,
                                int num_sms) {
  const int64_t groups = num_kv_heads > 0 ? (num_q_heads / num_kv_heads + kMaxGroup - 1) / kMaxGroup : 0;
  const int64_t ctas = num_queries * num_kv_heads * groups;
  if (ctas <= 0) return 1;
  const int64_t want = (2 * static_cast<int64_t>(num_sms) + ctas - 1) / ctas;
  const int64_t most = (max_keys + kMinKeysPerSplit - 1) / kMinKeysPerSplit;
  return static_cast<int>(max(int64_t{1}, min(min(want, most), int64_t{65535})));
}

cudaError_t sparse_attention(const SparseAttentionParams& p, AttnDType dtype, cudaStream_t stream) {
  if (p.num_queries == 0 || p.num_q_heads == 0) return cudaSuccess;
  const int64_t head_groups = p.num_kv_heads * ((p.num_q_heads / p.num_kv_heads + kMaxGroup - 1) / kMaxGroup);
  if (p.head_dim % 8 != 0 || p.head_dim > kSparseAttentionMaxHeadDim || p.num_queries > 0x7fffffff ||
      p.num_splits < 1 || p.num_splits > 65535 || head_groups > 65535 || p.num_q_heads > 65535)
    return cudaErrorInvalidValue;
  cudaError_t e = cudaErrorInvalidValue;
  switch (dtype) {
    case AttnDType::kFloat32: e = launch<float>(p, stream); break;
    case AttnDType::kFloat16: e = launch<__half>(p, stream); break;
    case AttnDType::kBFloat16: e = launch<__nv_bfloat16>(p, stream); break;
  }
  if (e != cudaSuccess || p.num_splits == 1) return e;
  return sparse_attention_combine(p, dtype, stream);
}

cudaError_t sparse_attention_combine(const SparseAttentionParams& p, AttnDType dtype, cudaStream_t stream) {
  if (p.num_queries == 0 || p.num_q_heads == 0 || p.num_splits == 1) return cudaSuccess;
  switch (dtype) {
    case AttnDType::kFloat32: return launch_combine<float>(p, stream);
    case AttnDType::kFloat16: return launch_combine<__half>(p, stream);
    case AttnDType::kBFloat16: return launch_combine<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace samcache::cuda
