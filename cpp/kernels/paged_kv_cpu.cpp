// paged_kv: shared validation (plan_*) and the CPU implementations. All three ops move bytes
// without converting them, so they work for any dtype; every copy is a memcpy of whole token
// rows or blocks, parallel over tokens or blocks.
#include "paged_kv.h"

#include "index_tensors.h"
#include "memory_checks.h"
#include "samcache/parallel_stats.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <unordered_set>

namespace samcache::kernels {

namespace {

PagedCacheShape check_paged_caches(const char* op, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK_VALUE(key_cache.defined() && value_cache.defined(), op, ": key_cache and value_cache must be tensors");
  TORCH_CHECK_VALUE(key_cache.dim() == 4, op, ": key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got ",
                    key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes() && value_cache.scalar_type() == key_cache.scalar_type() &&
                        value_cache.device() == key_cache.device(),
                    op, ": value_cache must match key_cache in shape, dtype and device (", key_cache.sizes(), " ",
                    key_cache.scalar_type(), " ", key_cache.device(), "), got ", value_cache.sizes(), " ",
                    value_cache.scalar_type(), " ", value_cache.device());
  TORCH_CHECK_VALUE(key_cache.is_contiguous() && value_cache.is_contiguous(), op,
                    ": key_cache and value_cache must be contiguous");
  TORCH_CHECK_VALUE(key_cache.size(1) >= 1, op, ": block_size (key_cache.size(1)) must be >= 1");
  PagedCacheShape shape;
  shape.num_blocks = key_cache.size(0);
  shape.block_size = key_cache.size(1);
  shape.num_heads = key_cache.size(2);
  shape.head_dim = key_cache.size(3);
  shape.element_size = static_cast<int64_t>(key_cache.element_size());
  return shape;
}

void check_token_major(const char* name, const at::Tensor& t, const at::Tensor& key_cache, const PagedCacheShape& c) {
  TORCH_CHECK_VALUE(t.defined(), "paged_write: ", name, " must be a tensor");
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(1) == c.num_heads && t.size(2) == c.head_dim, "paged_write: ", name,
                    " must be [num_tokens, ", c.num_heads, ", ", c.head_dim, "] like the caches' heads, got ", t.sizes());
  TORCH_CHECK_VALUE(t.scalar_type() == key_cache.scalar_type(), "paged_write: ", name, " has dtype ", t.scalar_type(),
                    ", the caches ", key_cache.scalar_type());
  TORCH_CHECK_VALUE(t.device() == key_cache.device(), "paged_write: ", name, " is on ", t.device(),
                    ", the caches on ", key_cache.device());
  TORCH_CHECK_VALUE(t.size(2) <= 1 || t.stride(2) == 1, "paged_write: ", name,
                    " must be contiguous in its last dim (stride ", t.stride(2), ")");
}

}  // namespace

PagedWritePlan plan_paged_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  PagedWritePlan plan;
  plan.cache = check_paged_caches("paged_write", key_cache, value_cache);
  check_token_major("key", key, key_cache, plan.cache);
  check_token_major("value", value, key_cache, plan.cache);
  TORCH_CHECK_VALUE(value.size(0) == key.size(0), "paged_write: key has ", key.size(0), " tokens, value ",
                    value.size(0));
  // Separate caches, and sources that are not views of them (a write could overwrite a row
  // before it is read): refused whatever the strides; pass copies instead.
  TORCH_CHECK_VALUE(!may_share_memory(key_cache, value_cache), "paged_write: key_cache and value_cache must not share memory");
  for (const at::Tensor* src : {&key, &value})
    TORCH_CHECK_VALUE(!may_share_memory(*src, key_cache) && !may_share_memory(*src, value_cache), "paged_write: ",
                      src == &key ? "key" : "value", " must not share memory with the caches (pass a copy)");
  plan.num_tokens = key.size(0);
  TORCH_CHECK_VALUE(slot_mapping.defined() && is_index_dtype(slot_mapping), "paged_write: slot_mapping must be int32 or int64, got ",
                    slot_mapping.defined() ? c10::toString(slot_mapping.scalar_type()) : "undefined");
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == plan.num_tokens,
                    "paged_write: slot_mapping must be [", plan.num_tokens, "] (one slot per token), got ",
                    slot_mapping.sizes());
  TORCH_CHECK_VALUE(slot_mapping.device() == key_cache.device(), "paged_write: slot_mapping is on ",
                    slot_mapping.device(), ", the caches on ", key_cache.device());
  if (!slot_mapping.device().is_cpu()) return plan;  // device indices: the kernel skips bad slots

  plan.host_slots = read_indices(slot_mapping, plan.num_tokens);
  const int64_t num_slots = plan.cache.num_slots();
  std::vector<int64_t> written;
  written.reserve(plan.host_slots.size());
  for (int64_t i = 0; i < plan.num_tokens; ++i) {
    const int64_t s = plan.host_slots[i];
    TORCH_CHECK_INDEX(s >= -1 && s < num_slots, "paged_write: slot_mapping[", i, "] = ", s,
                      " is out of range for ", num_slots, " slots (-1 marks padding)");
    if (s >= 0) written.push_back(s);
  }
  // Two tokens into one slot would make the result depend on the write order.
  std::sort(written.begin(), written.end());
  const auto dup = std::adjacent_find(written.begin(), written.end());
  TORCH_CHECK_VALUE(dup == written.end(), "paged_write: slot ", dup == written.end() ? 0 : *dup,
                    " appears twice in slot_mapping");
  return plan;
}

PagedGatherPlan plan_paged_gather(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_table, int64_t num_tokens) {
  PagedGatherPlan plan;
  plan.cache = check_paged_caches("paged_gather", key_cache, value_cache);
  TORCH_CHECK_VALUE(block_table.defined() && is_index_dtype(block_table),
                    "paged_gather: block_table must be int32 or int64, got ",
                    block_table.defined() ? c10::toString(block_table.scalar_type()) : "undefined");
  TORCH_CHECK_VALUE(block_table.dim() == 1, "paged_gather: block_table must be 1-D, got ", block_table.sizes());
  TORCH_CHECK_VALUE(block_table.device().is_cpu() || block_table.device() == key_cache.device(),
                    "paged_gather: block_table must be on the CPU or on the caches' device ", key_cache.device(),
                    ", got ", block_table.device());
  TORCH_CHECK_VALUE(num_tokens >= 0, "paged_gather: num_tokens must be >= 0, got ", num_tokens);
  const int64_t bs = plan.cache.block_size;
  TORCH_CHECK_VALUE(num_tokens <= block_table.size(0) * bs, "paged_gather: num_tokens = ", num_tokens,
                    " needs more than the ", block_table.size(0), " blocks of block_table (block_size ", bs, ")");
  plan.num_tokens = num_tokens;
  plan.blocks_used = (num_tokens + bs - 1) / bs;
  if (!block_table.device().is_cpu()) return plan;  // device table: the kernel zero-fills bad blocks

  plan.host_blocks = read_indices(block_table, plan.blocks_used);
  for (int64_t i = 0; i < plan.blocks_used; ++i) {
    const int64_t b = plan.host_blocks[i];
    TORCH_CHECK_INDEX(b >= 0 && b < plan.cache.num_blocks, "paged_gather: block_table[", i, "] = ", b,
                      " is out of range for ", plan.cache.num_blocks, " blocks");
  }
  return plan;
}

SwapBlocksPlan plan_swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_pairs) {
  TORCH_CHECK_VALUE(src.defined() && dst.defined(), "swap_blocks: src and dst must be tensors");
  TORCH_CHECK_VALUE(src.dim() >= 1 && dst.dim() >= 1, "swap_blocks: src and dst need a leading num_blocks dimension");
  TORCH_CHECK_VALUE(src.sizes().slice(1) == dst.sizes().slice(1) && src.scalar_type() == dst.scalar_type(),
                    "swap_blocks: src and dst must have the same per-block shape and dtype, got ", src.sizes(), " ",
                    src.scalar_type(), " and ", dst.sizes(), " ", dst.scalar_type());
  TORCH_CHECK_VALUE(src.is_contiguous() && dst.is_contiguous(), "swap_blocks: src and dst must be contiguous");
  for (const at::Tensor* t : {&src, &dst})
    TORCH_CHECK_VALUE(t->device().is_cpu() || t->device().is_cuda(), "swap_blocks: caches must be on the CPU or a CUDA device, got ",
                      t->device());
  TORCH_CHECK_VALUE(!(src.device().is_cuda() && dst.device().is_cuda()) || src.device() == dst.device(),
                    "swap_blocks: src (", src.device(), ") and dst (", dst.device(), ") must be on the same GPU");
  TORCH_CHECK_VALUE(block_pairs.defined() && block_pairs.device().is_cpu(), "swap_blocks: block_pairs must be a CPU tensor");
  TORCH_CHECK_VALUE(is_index_dtype(block_pairs), "swap_blocks: block_pairs must be int32 or int64, got ",
                    block_pairs.scalar_type());
  TORCH_CHECK_VALUE(block_pairs.dim() == 2 && block_pairs.size(1) == 2, "swap_blocks: block_pairs must have shape [n, 2], got ",
                    block_pairs.sizes());

  const int64_t n = block_pairs.size(0);
  SwapBlocksPlan plan;
  plan.num_pairs = n;
  const std::vector<int64_t> pairs = read_indices(block_pairs.flatten(), 2 * n);
  std::unordered_set<int64_t> dsts;
  dsts.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = pairs[2 * i], d = pairs[2 * i + 1];
    TORCH_CHECK_INDEX(s >= 0 && s < src.size(0), "swap_blocks: pair ", i, " reads block ", s, " of src, which has ",
                      src.size(0), " blocks");
    TORCH_CHECK_INDEX(d >= 0 && d < dst.size(0), "swap_blocks: pair ", i, " writes block ", d, " of dst, which has ",
                      dst.size(0), " blocks");
    TORCH_CHECK_VALUE(dsts.insert(d).second, "swap_blocks: block ", d, " of dst is written twice");
  }
  // Copies must not depend on their order: within one tensor no destination may be a source.
  const at::MemOverlapStatus overlap = at::get_overlap_status(src, dst);
  TORCH_CHECK_VALUE(overlap == at::MemOverlapStatus::No || overlap == at::MemOverlapStatus::Full,
                    "swap_blocks: src and dst overlap partially");
  if (overlap == at::MemOverlapStatus::Full) {
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK_VALUE(!dsts.count(pairs[2 * i]), "swap_blocks: src and dst are the same tensor and block ",
                        pairs[2 * i], " is both a source and a destination");
  }

  int64_t per_block = 1;
  for (int64_t d = 1; d < src.dim(); ++d) per_block *= src.size(d);
  plan.block_bytes = per_block * static_cast<int64_t>(src.element_size());

  // Sorted by source, consecutive (src, dst) steps merge into one copy.
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return pairs[2 * a] != pairs[2 * b] ? pairs[2 * a] < pairs[2 * b] : pairs[2 * a + 1] < pairs[2 * b + 1];
  });
  for (int64_t i : order) {
    const int64_t s = pairs[2 * i], d = pairs[2 * i + 1];
    if (!plan.runs.empty()) {
      BlockRun& last = plan.runs.back();
      if (s == last.src_block + last.num_blocks && d == last.dst_block + last.num_blocks) {
        ++last.num_blocks;
        continue;
      }
    }
    plan.runs.push_back({s, d, 1});
  }
  return plan;
}

namespace {

// One token's [H, D] row: a single memcpy when its heads are packed, else one per head.
inline void copy_token_row(uint8_t* dst, const uint8_t* src, int64_t src_head_stride_bytes, const PagedCacheShape& c) {
  const int64_t head_bytes = c.head_bytes();
  if (src_head_stride_bytes == head_bytes || c.num_heads <= 1) {
    std::memcpy(dst, src, static_cast<size_t>(c.row_bytes()));
    return;
  }
  for (int64_t h = 0; h < c.num_heads; ++h)
    std::memcpy(dst + h * head_bytes, src + h * src_head_stride_bytes, static_cast<size_t>(head_bytes));
}

// Tasks of at least ~64 KiB so thread start-up stays small against the copying.
int64_t grain_for(int64_t bytes_per_item) { return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, bytes_per_item)); }

}  // namespace

void paged_write_cpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const PagedWritePlan plan = plan_paged_write(key, value, key_cache, value_cache, slot_mapping);
  const PagedCacheShape& c = plan.cache;
  if (plan.num_tokens == 0 || c.row_bytes() == 0) return;
  const int64_t es = c.element_size;
  const auto* k = static_cast<const uint8_t*>(key.const_data_ptr());
  const auto* v = static_cast<const uint8_t*>(value.const_data_ptr());
  auto* kc = static_cast<uint8_t*>(key_cache.data_ptr());
  auto* vc = static_cast<uint8_t*>(value_cache.data_ptr());
  const int64_t k_tok = key.stride(0) * es, k_head = key.stride(1) * es;
  const int64_t v_tok = value.stride(0) * es, v_head = value.stride(1) * es;
  const int64_t row = c.row_bytes();
  at::parallel_for(0, plan.num_tokens, grain_for(2 * row), [&](int64_t begin, int64_t end) {
    note_parallel_task(at::get_thread_num());
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = plan.host_slots[t];
      if (slot < 0) continue;  // padding
      copy_token_row(kc + slot * row, k + t * k_tok, k_head, c);
      copy_token_row(vc + slot * row, v + t * v_tok, v_head, c);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> paged_gather_cpu(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                    const at::Tensor& block_table, int64_t num_tokens) {
  const PagedGatherPlan plan = plan_paged_gather(key_cache, value_cache, block_table, num_tokens);
  const PagedCacheShape& c = plan.cache;
  at::Tensor key = at::empty({num_tokens, c.num_heads, c.head_dim}, key_cache.options());
  at::Tensor value = at::empty({num_tokens, c.num_heads, c.head_dim}, value_cache.options());
  const int64_t row = c.row_bytes();
  if (num_tokens == 0 || row == 0) return {key, value};
  const auto* kc = static_cast<const uint8_t*>(key_cache.const_data_ptr());
  const auto* vc = static_cast<const uint8_t*>(value_cache.const_data_ptr());
  auto* ko = static_cast<uint8_t*>(key.data_ptr());
  auto* vo = static_cast<uint8_t*>(value.data_ptr());
  const int64_t bs = c.block_size, block_bytes = bs * row;
  // A block's tokens are contiguous in the cache and in the output: one memcpy per block.
  at::parallel_for(0, plan.blocks_used, grain_for(2 * block_bytes), [&](int64_t begin, int64_t end) {
    note_parallel_task(at::get_thread_num());
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tokens = std::min(bs, num_tokens - i * bs);
      const int64_t from = plan.host_blocks[i] * block_bytes, to = i * block_bytes;
      std::memcpy(ko + to, kc + from, static_cast<size_t>(tokens * row));
      std::memcpy(vo + to, vc + from, static_cast<size_t>(tokens * row));
    }
  });
  return {key, value};
}

void swap_blocks_cpu(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_pairs) {
  const SwapBlocksPlan plan = plan_swap_blocks(src, dst, block_pairs);
  const int64_t bb = plan.block_bytes;
  if (plan.runs.empty() || bb == 0) return;
  const auto* s = static_cast<const uint8_t*>(src.const_data_ptr());
  auto* d = static_cast<uint8_t*>(dst.data_ptr());
  // Parallel over the blocks of all runs laid end to end (so one long run does not serialise
  // the copy); each task copies its share of every run it touches with one memcpy.
  std::vector<int64_t> run_start(plan.runs.size() + 1, 0);
  for (size_t r = 0; r < plan.runs.size(); ++r) run_start[r + 1] = run_start[r] + plan.runs[r].num_blocks;
  at::parallel_for(0, plan.num_pairs, grain_for(bb), [&](int64_t begin, int64_t end) {
    note_parallel_task(at::get_thread_num());
    auto r = static_cast<size_t>(std::upper_bound(run_start.begin(), run_start.end(), begin) - run_start.begin() - 1);
    for (int64_t i = begin; i < end; ++r) {
      const BlockRun& run = plan.runs[r];
      const int64_t within = i - run_start[r];
      const int64_t take = std::min(end, run_start[r + 1]) - i;
      std::memcpy(d + (run.dst_block + within) * bb, s + (run.src_block + within) * bb, static_cast<size_t>(take * bb));
      i += take;
    }
  });
}

}  // namespace samcache::kernels
