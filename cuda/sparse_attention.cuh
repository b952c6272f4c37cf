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
// The CUDA-core kernel serves a batch: row i belongs to sequence q_seq[i] at position q_pos[i];
// sequence b's pages are kv_indices[kv_indptr[b] .. kv_indptr[b+1]) and its last page holds
// kv_last_page_len[b] tokens (FlashInfer's layout). The tensor-core kernel serves one sequence
// (num_seqs == 1): q_index (int64 positions), block_table and num_kv_tokens describe it.
struct SparseAttentionParams {
  const void* q;
  const int32_t* q_pos;
  const int32_t* q_seq;
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  const int32_t* kv_last_page_len;
  const int64_t* q_index;      // tensor-core path only
  const int64_t* query_order;  // tensor-core path: queries sorted by index (nullptr otherwise)
  const void* key_cache;
  const void* value_cache;
  const void* block_table;  // tensor-core path only: int32 or int64 (block_table_int64)
  bool block_table_int64;
  void* out;
  float* lse;
  float* partial_o;
  float* partial_ml;
  int64_t num_queries, num_q_heads, num_kv_heads, head_dim, block_size;
  int64_t num_seqs, num_kv_tokens, num_cache_blocks;
  int64_t window;  // <= 0: none
  float scale;
  float logit_cap;  // <= 0: none
  int num_splits;
};

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
