// paged_kv: move KV between token-major tensors and paged caches, and whole blocks between
// caches (tiering). A paged cache is one tensor per layer for K and one for V, shaped
// [num_blocks, block_size, num_kv_heads, head_dim]; slot id = block * block_size + offset.
// Validation is shared by the CPU and CUDA implementations and runs before anything is written.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace samcache::kernels {

// The geometry both caches of a layer share.
struct PagedCacheShape {
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t num_heads = 0;
  int64_t head_dim = 0;
  int64_t element_size = 0;

  int64_t head_bytes() const { return head_dim * element_size; }
  int64_t row_bytes() const { return num_heads * head_bytes(); }  // one token slot
  int64_t num_slots() const { return num_blocks * block_size; }
};

struct PagedWritePlan {
  PagedCacheShape cache;
  int64_t num_tokens = 0;
  // Read and validated (in range, no duplicates) only when slot_mapping is on the CPU.
  std::vector<int64_t> host_slots;
};

// key/value [N, H, D] with a contiguous last dim, same dtype and device as the caches;
// slot_mapping int32/int64 [N] on the caches' device, -1 = padding.
PagedWritePlan plan_paged_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& slot_mapping);

struct PagedGatherPlan {
  PagedCacheShape cache;
  int64_t num_tokens = 0;
  int64_t blocks_used = 0;  // ceil(num_tokens / block_size) leading table entries are read
  // The used entries, validated, only when block_table is on the CPU.
  std::vector<int64_t> host_blocks;
};

// block_table int32/int64 [num_table_blocks] on the CPU or the caches' device, with
// num_table_blocks * block_size >= num_tokens.
PagedGatherPlan plan_paged_gather(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_table, int64_t num_tokens);

// A maximal run of consecutive source blocks going to consecutive destination blocks.
struct BlockRun {
  int64_t src_block = 0;
  int64_t dst_block = 0;
  int64_t num_blocks = 0;
};

struct SwapBlocksPlan {
  std::vector<BlockRun> runs;  // the validated pairs sorted by source and merged into runs
  int64_t num_pairs = 0;       // = the total of the runs' blocks
  int64_t block_bytes = 0;
};

// src and dst: contiguous, same per-block shape and dtype, any of CPU/CUDA (two CUDA tensors on
// the same device); block_pairs CPU int32/int64 [n, 2], distinct destinations.
SwapBlocksPlan plan_swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_pairs);

void paged_write_cpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& slot_mapping);
std::tuple<at::Tensor, at::Tensor> paged_gather_cpu(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                    const at::Tensor& block_table, int64_t num_tokens);
void swap_blocks_cpu(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_pairs);

#ifdef SAMCACHE_WITH_CUDA
void paged_write_cuda(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& slot_mapping);
std::tuple<at::Tensor, at::Tensor> paged_gather_cuda(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                     const at::Tensor& block_table, int64_t num_tokens);
void swap_blocks_cuda(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_pairs);
#endif

}  // namespace samcache::kernels
