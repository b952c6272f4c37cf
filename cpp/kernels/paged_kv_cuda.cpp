// Torch-facing CUDA wrappers of paged_kv: validate (the same plan functions as the CPU), take the
// current stream of the caches' GPU, call the raw launchers in cuda/. Compiled only when the CUDA
// kernels are built.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <climits>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "paged_kv.cuh"  // cuda/: the raw-pointer launchers
#include "paged_kv.h"

namespace samcache::kernels {

namespace {

samcache::cuda::IndexType index_type(const at::Tensor& t) {
  return t.scalar_type() == at::kInt ? samcache::cuda::IndexType::kInt32 : samcache::cuda::IndexType::kInt64;
}

void check_cuda(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, " CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace

void paged_write_cuda(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const PagedWritePlan plan = plan_paged_write(key, value, key_cache, value_cache, slot_mapping);
  const PagedCacheShape& c = plan.cache;
  if (plan.num_tokens == 0 || c.row_bytes() == 0) return;
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const at::Tensor slots = slot_mapping.contiguous();  // on the GPU already: no sync
  const int64_t es = c.element_size;
  // A single head's stride is never followed: report it as packed so it cannot narrow the vectors.
  const auto head_stride = [&](const at::Tensor& t) { return c.num_heads == 1 ? c.head_bytes() : t.stride(1) * es; };
  samcache::cuda::PagedWriteArgs args{};
  args.key = key.const_data_ptr();
  args.value = value.const_data_ptr();
  args.key_token_stride = key.stride(0) * es;
  args.key_head_stride = head_stride(key);
  args.value_token_stride = value.stride(0) * es;
  args.value_head_stride = head_stride(value);
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.slot_mapping = slots.const_data_ptr();
  args.slot_type = index_type(slots);
  args.num_tokens = plan.num_tokens;
  args.num_heads = c.num_heads;
  args.head_bytes = c.head_bytes();
  args.num_slots = c.num_slots();
  check_cuda(samcache::cuda::paged_write(args, c10::cuda::getCurrentCUDAStream()), "paged_write");
}

std::tuple<at::Tensor, at::Tensor> paged_gather_cuda(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                     const at::Tensor& block_table, int64_t num_tokens) {
  const PagedGatherPlan plan = plan_paged_gather(key_cache, value_cache, block_table, num_tokens);
  const PagedCacheShape& c = plan.cache;
  const c10::cuda::CUDAGuard guard(key_cache.device());
  at::Tensor key = at::empty({num_tokens, c.num_heads, c.head_dim}, key_cache.options());
  at::Tensor value = at::empty({num_tokens, c.num_heads, c.head_dim}, value_cache.options());
  if (num_tokens == 0 || c.row_bytes() == 0) return {key, value};
  at::Tensor table;
  if (block_table.device().is_cpu()) {
    // Validated on the host; upload only the entries the kernel reads, asynchronously from a
    // pinned buffer (torch's caching host allocator keeps it until the copy has run).
    at::Tensor host = at::empty({plan.blocks_used}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::copy(plan.host_blocks.begin(), plan.host_blocks.end(), host.mutable_data_ptr<int64_t>());
    table = host.to(key_cache.device(), /*non_blocking=*/true);
  } else {
    table = block_table.contiguous();
  }
  samcache::cuda::PagedGatherArgs args{};
  args.key_cache = key_cache.const_data_ptr();
  args.value_cache = value_cache.const_data_ptr();
  args.key_out = key.data_ptr();
  args.value_out = value.data_ptr();
  args.block_table = table.const_data_ptr();
  args.table_type = index_type(table);
  args.num_tokens = num_tokens;
  args.block_size = c.block_size;
  args.num_blocks = c.num_blocks;
  args.row_bytes = c.row_bytes();
  check_cuda(samcache::cuda::paged_gather(args, c10::cuda::getCurrentCUDAStream()), "paged_gather");
  return {key, value};
}

namespace {

enum class SwapPath { kAuto, kKernel, kMemcpy };

// SAMCACHE_SWAP_BLOCKS=kernel|memcpy forces one path (benchmarks compare them; tests cover both);
// unset or anything else: the rule in swap_blocks_cuda.
SwapPath forced_swap_path() {
  const char* v = std::getenv("SAMCACHE_SWAP_BLOCKS");
  if (v == nullptr) return SwapPath::kAuto;
  const std::string_view s(v);
  return s == "kernel" ? SwapPath::kKernel : (s == "memcpy" ? SwapPath::kMemcpy : SwapPath::kAuto);
}

// A host run this long keeps the copy engines near their peak (76-82% of the pinned ceiling at
// 512 KiB runs, more beyond), so at or above it the SMs are left to the compute.
constexpr int64_t kLongHostRunBytes = int64_t{1} << 20;

}  // namespace

void swap_blocks_cuda(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_pairs) {
  const SwapBlocksPlan plan = plan_swap_blocks(src, dst, block_pairs);
  TORCH_CHECK_VALUE(src.device().is_cuda() || dst.device().is_cuda(), "swap_blocks: no CUDA tensor among src and dst");
  if (plan.runs.empty() || plan.block_bytes == 0) return;
  const at::Device gpu = src.device().is_cuda() ? src.device() : dst.device();
  const c10::cuda::CUDAGuard guard(gpu);
  // The current stream of the GPU involved: callers pick it with `with torch.cuda.stream(s):`.
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(gpu.index());
  const bool host_side = src.device().is_cpu() || dst.device().is_cpu();
  // Addresses a kernel can use: device memory as is, pinned host memory through its mapping;
  // nullptr for pageable host memory.
  void* const dst_dev = samcache::cuda::device_address(dst.data_ptr());
  void* const src_dev = samcache::cuda::device_address(src.const_data_ptr());
  const bool reachable = dst_dev != nullptr && src_dev != nullptr;

  // The rule: one kernel whenever it can read both sides (device <-> device always; pinned host
  // too, unless the runs are long, where the copy engines are as fast and leave the SMs free);
  // cudaMemcpyAsync per run of consecutive blocks otherwise (pageable host memory).
  const int64_t total_bytes = plan.num_pairs * plan.block_bytes;
  const int64_t mean_run_bytes = total_bytes / static_cast<int64_t>(plan.runs.size());
  bool use_kernel = reachable && (!host_side || mean_run_bytes < kLongHostRunBytes);
  const SwapPath forced = forced_swap_path();
  if (forced == SwapPath::kKernel) use_kernel = reachable;  // no kernel reads pageable memory
  if (forced == SwapPath::kMemcpy) use_kernel = false;

  if (!use_kernel) {
    std::vector<samcache::cuda::BlockRun> runs;
    runs.reserve(plan.runs.size());
    for (const BlockRun& r : plan.runs) runs.push_back({r.src_block, r.dst_block, r.num_blocks});
    check_cuda(samcache::cuda::copy_block_runs(dst.data_ptr(), src.const_data_ptr(), runs.data(),
                                               static_cast<int64_t>(runs.size()), plan.block_bytes, stream),
               "swap_blocks");
    return;
  }
  // The pairs in source order (from the validated runs): in the kernel's parameters when few and
  // int32-sized, else uploaded in one asynchronous copy from a pinned buffer (torch's caching host
  // allocator keeps that buffer until the copy has run).
  const bool fits_inline = plan.num_pairs <= samcache::cuda::kInlinePairs && src.size(0) <= INT32_MAX &&
                           dst.size(0) <= INT32_MAX;
  samcache::cuda::InlinePairs inline_pairs{};
  at::Tensor pairs;
  if (fits_inline) {
    int32_t* h = inline_pairs.v;
    for (const BlockRun& r : plan.runs)
      for (int64_t b = 0; b < r.num_blocks; ++b) {
        *h++ = static_cast<int32_t>(r.src_block + b);
        *h++ = static_cast<int32_t>(r.dst_block + b);
      }
  } else {
    at::Tensor host = at::empty({plan.num_pairs, 2}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    int64_t* h = host.mutable_data_ptr<int64_t>();
    for (const BlockRun& r : plan.runs)
      for (int64_t b = 0; b < r.num_blocks; ++b) {
        *h++ = r.src_block + b;
        *h++ = r.dst_block + b;
      }
    pairs = host.to(gpu, /*non_blocking=*/true);
  }
  // A host side is limited by PCIe, not by the SMs: 64 CTAs keep ~1 MiB of requests in flight.
  const int max_ctas = host_side ? 64 : 0;
  check_cuda(samcache::cuda::copy_block_pairs(dst_dev, src_dev, fits_inline ? nullptr : pairs.const_data_ptr<int64_t>(),
                                              fits_inline ? &inline_pairs : nullptr, plan.num_pairs, plan.block_bytes,
                                              max_ctas, stream),
             "swap_blocks");
}

}  // namespace samcache::kernels
