// Raw-pointer launcher of cuda/sparse_attention.cu (no torch types: the .cu compiles alone with
// nvcc). The torch-facing wrapper is cpp/kernels/sparse_attention_cuda.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace samcache::cuda {

enum class AttnDType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// All tensors contiguous: q [T, Hq, D], caches [num_blocks, block_size, Hkv, D], out like q,
// lse [T, Hq]. With num_splits > 1, partial_o [splits, T, Hq, D] and partial_ml [splits, T, Hq, 2]
// hold per-split results that a second kernel merges.
//
// A batch in FlashInfer's layout (all metadata int64, never narrowed): rows
// [qo_indptr[b], qo_indptr[b+1]) belong to sequence b, row i at position q_pos[i]; sequence b's
// pages are kv_indices[kv_indptr[b] .. kv_indptr[b+1]) and its last page holds kv_last_page_len[b]
// tokens. The tensor-core kernel serves one sequence (num_seqs == 1).
struct SparseAttentionParams {
  const void* q;
  const int64_t* q_pos;
  const int64_t* qo_indptr;
  const int64_t* kv_indptr;
  const int64_t* kv_indices;
  const int64_t* kv_last_page_len;
  const int64_t* query_order;  // tensor-core path: queries sorted by position (nullptr otherwise)
  const void* key_cache;
  const void* value_cache;
  void* out;
  float* lse;
  float* partial_o;
  float* partial_ml;
  int64_t num_queries, num_q_heads, num_kv_heads, head_dim, block_size;
  int64_t num_seqs, num_kv_indices, num_cache_blocks;
  int64_t window;  // <= 0: none
  float scale;
  float logit_cap;  // <= 0: none
  int num_splits;
};

#ifdef __CUDACC__
// Where query row `query` reads its keys. Device metadata cannot be checked on the host without a
// sync, so every value is checked here: a row whose sequence, pages or position are inconsistent
// gets ok == false (the kernels then write NaN), and no index outside the tensors is ever read.
struct RowKeys {
  bool ok;
  int64_t position;  // the row's position: keys [.., position] are visible
  int64_t page0;     // the sequence's pages start at kv_indices[page0]
};

__device__ __forceinline__ RowKeys row_keys(const SparseAttentionParams& p, int64_t query) {
  RowKeys r{false, -1, 0};
  if (p.num_seqs < 1) return r;
  int64_t lo = 0, hi = p.num_seqs;  // the last sequence b with qo_indptr[b] <= query
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (p.qo_indptr[mid] <= query) lo = mid;
    else hi = mid;
  }
  if (query < p.qo_indptr[lo] || query >= p.qo_indptr[lo + 1]) return r;  // indptr inconsistent
  const int64_t page0 = p.kv_indptr[lo], num_pages = p.kv_indptr[lo + 1] - page0;
  const int64_t last = p.kv_last_page_len[lo];
  if (page0 < 0 || num_pages < 1 || page0 + num_pages > p.num_kv_indices || last < 1 || last > p.block_size) return r;
  const int64_t position = p.q_pos[query];
  if (position < 0 || position >= (num_pages - 1) * p.block_size + last) return r;
  return {true, position, page0};
}
#endif

// Head dims the kernel supports: multiples of 8 up to 256 (one 16-byte load per 8 elements).
constexpr int64_t kSparseAttentionMaxHeadDim = 256;

// Splits of the key range so that the grid fills the device (>= 2 CTAs per SM) while each
// split keeps >= 512 keys.
// `max_keys`: the most keys one query sees (the longest sequence, or the window when smaller).
int sparse_attention_num_splits(int64_t num_queries, int64_t num_kv_heads, int64_t num_q_heads, int64_t max_keys,
                                int num_sms);

cudaError_t sparse_attention(const SparseAttentionParams& p, AttnDType dtype, cudaStream_t stream);

// Merges per-split partial results (partial_o, partial_ml) into out and lse.
cudaError_t sparse_attention_combine(const SparseAttentionParams& p, AttnDType dtype, cudaStream_t stream);

// Tensor-core path (cuda/sparse_attention_tc.cu): bf16/fp16, head_dim 64 or 128, needs
// query_order. Splits are counted for its 64-row tiles.
bool sparse_attention_tc_supported(int64_t head_dim, AttnDType dtype);
int sparse_attention_tc_num_splits(int64_t num_queries, int64_t num_kv_heads, int64_t num_q_heads, int64_t max_keys,
                                   int num_sms);
cudaError_t sparse_attention_tc(const SparseAttentionParams& p, AttnDType dtype, cudaStream_t stream);

}  // namespace samcache::cuda
