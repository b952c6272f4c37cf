// Tensor-core variant of sparse_attention (CuTe SM80 MMA atoms; runs on sm_80 and later).
//
// One CTA = 64 (query, head) rows of one KV head (queries sorted by index, so a tile's key
// ranges are close) x one split of the tile's key range. Per 64-key tile: gather K and V rows
// from the paged cache into shared memory, S = Q K^T on tensor cores, online softmax in shared
// memory (two threads per row), O = O * alpha + P V on tensor cores with O in registers.
// Operands move shared -> registers by plain element copies (no ldmatrix/swizzle yet: the
// first version favours obvious correctness; tuning needs a GPU).
//
// bf16/fp16 with head_dim 64 or 128; other cases use the CUDA-core kernel. Not yet run on a GPU:
// the wrapper only takes this path when SAMCACHE_SPARSE_ATTENTION_TC=1.
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

#include <cfloat>
#include <cstdint>

#include "dtype.cuh"
#include "sparse_attention.cuh"

namespace samcache::cuda {

namespace {

using namespace cute;

constexpr int kBlockM = 64;  // (query, head) rows per CTA
constexpr int kBlockN = 64;  // keys per tile
constexpr int kTcThreads = 128;

template <typename T>
struct TcTypes;
template <>
struct TcTypes<__nv_bfloat16> {
  using Elem = cute::bfloat16_t;
  using Mma = SM80_16x8x16_F32BF16BF16F32_TN;
};
template <>
struct TcTypes<__half> {
  using Elem = cute::half_t;
  using Mma = SM80_16x8x16_F32F16F16F32_TN;
};

template <typename Elem, int D>
struct TcSmem {
  Elem q[kBlockM * D];
  Elem k[kBlockN * D];
  Elem v[kBlockN * D];
  Elem p[kBlockM * kBlockN];
  float s[kBlockM * kBlockN];
  float m[kBlockM], l[kBlockM], alpha[kBlockM];
  int64_t row_query[kBlockM], row_index[kBlockM], row_lo[kBlockM];
  int32_t row_head[kBlockM];
  int64_t key_row[kBlockN];  // element offset of the key's row for this KV head, or -1
  int64_t range_lo, range_hi;
  int bad;
};

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// Copies rows x D elements into shared memory in 16-byte pieces; row_offset(r) < 0 fills zeros.
template <int D, typename Elem, typename RowOffset>
__device__ __forceinline__ void gather_rows(Elem* dst, const void* src, int rows, RowOffset row_offset) {
  constexpr int kPieces = D / 8;  // 8 two-byte elements per piece
  for (int c = threadIdx.x; c < rows * kPieces; c += kTcThreads) {
    const int r = c / kPieces, col = (c % kPieces) * 8;
    const int64_t off = row_offset(r);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (off >= 0) v = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(src) + off + col);
    *reinterpret_cast<uint4*>(dst + r * D + col) = v;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kTcThreads) tc_kernel(SparseAttentionParams p) {
  using Elem = typename TcTypes<T>::Elem;
  extern __shared__ __align__(16) char smem_raw[];
  auto& sm = *reinterpret_cast<TcSmem<Elem, D>*>(smem_raw);
  const int tid = threadIdx.x;
  const int64_t G = p.num_q_heads / p.num_kv_heads;
  const int64_t kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
  const int64_t total_rows = p.num_queries * G;

  if (tid < kBlockM) {  // this CTA's rows: sorted queries x the heads of this KV head
    const int64_t r = row0 + tid;
    int64_t query = -1, index = -1;
    bool valid = false;
    if (r < total_rows) {
      query = p.query_order[r / G];
      const RowKeys keys = row_keys(p, query);  // one sequence: every valid row shares its pages
      valid = keys.ok;
      index = keys.position;
      sm.row_head[tid] = static_cast<int32_t>(kv_head * G + r % G);
    }
    sm.row_query[tid] = query;
    sm.row_index[tid] = valid ? index : -1;  // -1: no keys; an existing row then gets NaN
    sm.row_lo[tid] = p.window > 0 ? max(int64_t{0}, index - p.window + 1) : 0;
    sm.m[tid] = neg_inf();
    sm.l[tid] = 0.f;
  }
  if (tid == 0) sm.bad = 0;
  __syncthreads();
  if (tid == 0) {  // the key range some row of the tile can see
    int64_t lo = INT64_MAX, hi = -1;
    for (int r = 0; r < kBlockM; ++r)
      if (sm.row_index[r] >= 0) {
        lo = min(lo, sm.row_lo[r]);
        hi = max(hi, sm.row_index[r]);
      }
    const int64_t len = hi >= lo ? hi - lo + 1 : 0;
    const int64_t per = (len + p.num_splits - 1) / p.num_splits;
    sm.range_lo = lo + split * per;
    sm.range_hi = len ? min(hi, lo + (split + 1) * per - 1) : -1;
  }
  gather_rows<D>(sm.q, p.q, kBlockM, [&](int r) -> int64_t {
    return sm.row_query[r] >= 0 ? (sm.row_query[r] * p.num_q_heads + sm.row_head[r]) * D : -1;
  });
  __syncthreads();

  using Atom = MMA_Atom<typename TcTypes<T>::Mma>;
  auto mma = make_tiled_mma(Atom{}, Layout<Shape<_4, _1, _1>>{});  // 4 warps x 16 rows
  auto thr = mma.get_slice(tid);
  Tensor sQ = make_tensor(make_smem_ptr(sm.q), Layout<Shape<Int<kBlockM>, Int<D>>, Stride<Int<D>, _1>>{});
  Tensor sK = make_tensor(make_smem_ptr(sm.k), Layout<Shape<Int<kBlockN>, Int<D>>, Stride<Int<D>, _1>>{});
  Tensor sS = make_tensor(make_smem_ptr(sm.s), Layout<Shape<Int<kBlockM>, Int<kBlockN>>, Stride<Int<kBlockN>, _1>>{});
  Tensor sP = make_tensor(make_smem_ptr(sm.p), Layout<Shape<Int<kBlockM>, Int<kBlockN>>, Stride<Int<kBlockN>, _1>>{});
  // V as the (N = head dim, K = key) operand: element (d, key) sits at key * D + d.
  Tensor sVt = make_tensor(make_smem_ptr(sm.v), Layout<Shape<Int<D>, Int<kBlockN>>, Stride<_1, Int<D>>>{});

  Tensor tSrQ = thr.partition_fragment_A(sQ);
  copy(thr.partition_A(sQ), tSrQ);
  Tensor tSsK = thr.partition_B(sK);
  Tensor tSrK = thr.partition_fragment_B(sK);
  Tensor tSsS = thr.partition_C(sS);
  Tensor tSrS = thr.partition_fragment_C(sS);
  Tensor tOsP = thr.partition_A(sP);
  Tensor tOrP = thr.partition_fragment_A(sP);
  Tensor tOsV = thr.partition_B(sVt);
  Tensor tOrV = thr.partition_fragment_B(sVt);
  Tensor tOrO = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<D>>{});
  Tensor tOcO = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<D>>{}));
  clear(tOrO);

  const int64_t bs = p.block_size;
  for (int64_t t0 = sm.range_lo; t0 <= sm.range_hi; t0 += kBlockN) {
    if (tid < kBlockN) {
      const int64_t key = t0 + tid;
      int64_t row = -1;
      if (key <= sm.range_hi) {
        const int64_t blk = p.kv_indices[p.kv_indptr[0] + key / bs];  // key < a valid row's length
        if (blk < 0 || blk >= p.num_cache_blocks) {
          sm.bad = 1;  // benign race: every writer stores 1
        } else {
          row = ((blk * bs + key % bs) * p.num_kv_heads + kv_head) * D;
        }
      }
      sm.key_row[tid] = row;
    }
    __syncthreads();
    gather_rows<D>(sm.k, p.key_cache, kBlockN, [&](int r) { return sm.key_row[r]; });
    gather_rows<D>(sm.v, p.value_cache, kBlockN, [&](int r) { return sm.key_row[r]; });
    __syncthreads();

    clear(tSrS);  // S = Q K^T
    copy(tSsK, tSrK);
    gemm(mma, tSrQ, tSrK, tSrS);
    copy(tSrS, tSsS);
    __syncthreads();

    {  // online softmax: two threads per row, 32 keys each
      const int r = tid / 2, half = tid % 2;
      const int64_t index = sm.row_index[r], lo = sm.row_lo[r];
      float x[kBlockN / 2];
      float tile_max = neg_inf();
#pragma unroll
      for (int j = 0; j < kBlockN / 2; ++j) {
        const int c = half * (kBlockN / 2) + j;
        const int64_t key = t0 + c;
        float v = sm.s[r * kBlockN + c] * p.scale;
        if (p.logit_cap > 0.f) v = p.logit_cap * tanhf(v / p.logit_cap);
        const bool visible = sm.key_row[c] >= 0 && index >= 0 && key >= lo && key <= index;
        x[j] = visible ? v : neg_inf();
        tile_max = fmaxf(tile_max, x[j]);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      const float m_old = sm.m[r];
      const float m_new = fmaxf(m_old, tile_max);
      const bool none = m_new == neg_inf();
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kBlockN / 2; ++j) {
        const float pr = none ? 0.f : __expf(x[j] - m_new);
        sum += pr;
        sm.p[r * kBlockN + half * (kBlockN / 2) + j] = Elem(pr);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      __syncwarp();
      if (half == 0) {
        const float alpha = none ? 1.f : __expf(m_old - m_new);
        sm.alpha[r] = alpha;
        sm.l[r] = sm.l[r] * alpha + sum;
        sm.m[r] = m_new;
      }
    }
    __syncthreads();

#pragma unroll
    for (int i = 0; i < size(tOrO); ++i) tOrO(i) *= sm.alpha[get<0>(tOcO(i))];
    copy(tOsP, tOrP);  // O += P V
    copy(tOsV, tOrV);
    gemm(mma, tOrP, tOrV, tOrO);
    __syncthreads();  // the next tile overwrites K, V, S and P
  }

  const float nan = __int_as_float(0x7fffffff);
#pragma unroll
  for (int i = 0; i < size(tOrO); ++i) {
    const int r = get<0>(tOcO(i)), d = get<1>(tOcO(i));
    const int64_t query = sm.row_query[r];
    if (query < 0) continue;
    const int64_t head = sm.row_head[r];
    const bool bad = sm.bad || sm.row_index[r] < 0;
    const float L = sm.l[r], M = sm.m[r];
    if (p.num_splits == 1) {
      T* out = static_cast<T*>(p.out) + (query * p.num_q_heads + head) * D;
      out[d] = from_float<T>(bad || L == 0.f ? nan : tOrO(i) / L);
      if (d == 0) p.lse[query * p.num_q_heads + head] = bad || L == 0.f ? nan : M + __logf(L);
    } else {
      const int64_t slot = (split * p.num_queries + query) * p.num_q_heads + head;
      p.partial_o[slot * D + d] = tOrO(i);
      if (d == 0) {
        p.partial_ml[2 * slot] = bad ? nan : (M == neg_inf() ? -FLT_MAX : M);
        p.partial_ml[2 * slot + 1] = L;
      }
    }
  }
}

template <typename T, int D>
cudaError_t launch_tc(const SparseAttentionParams& p, cudaStream_t stream) {
  const int64_t rows = p.num_queries * (p.num_q_heads / p.num_kv_heads);
  const dim3 grid(static_cast<unsigned>((rows + kBlockM - 1) / kBlockM), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(p.num_splits));
  const int smem = static_cast<int>(sizeof(TcSmem<typename TcTypes<T>::Elem, D>));
  cudaError_t e = cudaFuncSetAttribute(tc_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  tc_kernel<T, D><<<grid, kTcThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool sparse_attention_tc_supported(int64_t head_dim, AttnDType dtype) {
  return (head_dim == 64 || head_dim == 128) && dtype != AttnDType::kFloat32;
}

int sparse_attention_tc_num_splits(int64_t num_queries, int64_t num_kv_heads, int64_t num_q_heads, int64_t max_keys,
                                   int num_sms) {
  if (num_kv_heads <= 0 || num_queries <= 0) return 1;
  const int64_t rows = num_queries * (num_q_heads / num_kv_heads);
  const int64_t ctas = (rows + kBlockM - 1) / kBlockM * num_kv_heads;
  if (ctas <= 0) return 1;
  const int64_t want = (2 * static_cast<int64_t>(num_sms) + ctas - 1) / ctas;
  const int64_t most = (max_keys + 4 * kBlockN - 1) / (4 * kBlockN);  // >= 4 key tiles per split
  return static_cast<int>(max(int64_t{1}, min(min(want, most), int64_t{65535})));
}

cudaError_t sparse_attention_tc(const SparseAttentionParams& p, AttnDType dtype, cudaStream_t stream) {
  if (p.num_queries == 0 || p.num_q_heads == 0) return cudaSuccess;
  if (!sparse_attention_tc_supported(p.head_dim, dtype) || p.query_order == nullptr || p.num_kv_heads > 65535 ||
      p.num_splits < 1 || p.num_splits > 65535)
    return cudaErrorInvalidValue;
  cudaError_t e = cudaSuccess;
  if (dtype == AttnDType::kBFloat16)
    e = p.head_dim == 64 ? launch_tc<__nv_bfloat16, 64>(p, stream) : launch_tc<__nv_bfloat16, 128>(p, stream);
  else
    e = p.head_dim == 64 ? launch_tc<__half, 64>(p, stream) : launch_tc<__half, 128>(p, stream);
  if (e != cudaSuccess || p.num_splits == 1) return e;
  return sparse_attention_combine(p, dtype, stream);
}

}  // namespace samcache::cuda
