#include "copy_blocks.h"

#include "memory_checks.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <unordered_set>

namespace samcache::kernels {

CopyBlocksPlan plan_copy_blocks(at::TensorList caches, const at::Tensor& block_pairs) {
  TORCH_CHECK_VALUE(!caches.empty(), "copy_blocks: caches is empty");
  const at::Tensor& first = caches[0];
  TORCH_CHECK_VALUE(first.dim() >= 1, "copy_blocks: a cache needs a leading num_blocks dimension");
  for (size_t i = 0; i < caches.size(); ++i) {
    const at::Tensor& c = caches[i];
    TORCH_CHECK_VALUE(c.defined() && c.sizes() == first.sizes() && c.scalar_type() == first.scalar_type() &&
                          c.device() == first.device(),
                      "copy_blocks: cache ", i, " must match cache 0 in shape, dtype and device (",
                      first.sizes(), " ", first.scalar_type(), " ", first.device(), ")");
    TORCH_CHECK_VALUE(c.is_contiguous(), "copy_blocks: cache ", i, " must be contiguous");
  }
  // Caches must not overlap: the copies run in parallel and would race on shared bytes.
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const at::Tensor& c : caches)
    if (c.numel() > 0) spans.push_back(byte_range(c));
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    TORCH_CHECK_VALUE(spans[i].first >= spans[i - 1].second, "copy_blocks: two caches share memory");
  TORCH_CHECK_VALUE(block_pairs.device().is_cpu(), "copy_blocks: block_pairs must be a CPU tensor (as BlockPool returns it)");
  TORCH_CHECK_VALUE(block_pairs.scalar_type() == at::kInt || block_pairs.scalar_type() == at::kLong,
                    "copy_blocks: block_pairs must be int32 or int64, got ", block_pairs.scalar_type());
  TORCH_CHECK_VALUE(block_pairs.dim() == 2 && block_pairs.size(1) == 2,
                    "copy_blocks: block_pairs must have shape [n, 2], got ", block_pairs.sizes());
  const int64_t n = block_pairs.size(0);
  const int64_t num_blocks = first.size(0);
  at::Tensor pairs = block_pairs.to(at::kLong).contiguous();
  const int64_t* p = pairs.data_ptr<int64_t>();
  CopyBlocksPlan plan;
  plan.pairs.assign(p, p + 2 * n);
  std::unordered_set<int64_t> dsts, srcs;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t src = p[2 * i], dst = p[2 * i + 1];
    TORCH_CHECK_INDEX(src >= 0 && src < num_blocks && dst >= 0 && dst < num_blocks, "copy_blocks: pair ", i,
                      " = (", src, ", ", dst, ") is out of range for ", num_blocks, " blocks");
    TORCH_CHECK_VALUE(dsts.insert(dst).second, "copy_blocks: block ", dst, " is a destination twice");
    srcs.insert(src);
  }
  for (int64_t d : dsts)
    TORCH_CHECK_VALUE(!srcs.count(d), "copy_blocks: block ", d, " is both a source and a destination");
  plan.block_bytes = num_blocks == 0 ? 0 : first.numel() / num_blocks * static_cast<int64_t>(first.element_size());
  return plan;
}

void copy_blocks_cpu(at::TensorList caches, const at::Tensor& block_pairs) {
  const CopyBlocksPlan plan = plan_copy_blocks(caches, block_pairs);
  const int64_t n = static_cast<int64_t>(plan.pairs.size() / 2);
  const int64_t jobs = n * static_cast<int64_t>(caches.size());
  if (jobs == 0 || plan.block_bytes == 0) return;
  std::vector<uint8_t*> bases(caches.size());
  for (size_t i = 0; i < caches.size(); ++i) bases[i] = static_cast<uint8_t*>(caches[i].data_ptr());
  // One job = one block of one cache; parallel once a task moves ~256 KiB.
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / plan.block_bytes);
  at::parallel_for(0, jobs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t pair = j % n;
      uint8_t* base = bases[j / n];
      std::memcpy(base + plan.pairs[2 * pair + 1] * plan.block_bytes, base + plan.pairs[2 * pair] * plan.block_bytes,
                  static_cast<size_t>(plan.block_bytes));
    }
  });
}

}  // namespace samcache::kernels
