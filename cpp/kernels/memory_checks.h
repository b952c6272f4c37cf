// Memory-aliasing checks shared by the kernels' plans (CPU and CUDA): an op that reads one
// tensor while writing another must not be handed two views of the same bytes, or the result
// depends on the order of the writes.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace samcache::kernels {

// The bytes [first, last) that t's elements can reach, from its data pointer and strides.
inline std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& t) {
  int64_t lo = 0, hi = 0;  // element offsets from the data pointer
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t reach = (t.size(d) - 1) * t.stride(d);
    (reach < 0 ? lo : hi) += reach;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const int64_t es = static_cast<int64_t>(t.element_size());
  return {base + lo * es, base + (hi + 1) * es};
}

// True when the bytes a and b can reach intersect: one may then be overwritten through the
// other. Disjoint parts of one allocation (K and V halves of a [2, blocks, ...] tensor) pass;
// interleaved views are refused, which errs on the safe side.
inline bool may_share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return false;
  const auto [a_lo, a_hi] = byte_range(a);
  const auto [b_lo, b_hi] = byte_range(b);
  return a_lo < b_hi && b_lo < a_hi;
}

// True when no two elements of t share memory, proven from its strides (each dimension, in
// stride order, steps past everything the smaller ones span). ATen's own test gives up
// ("too hard") on non-dense views such as a slice of a cache; this one decides those too and
// answers false only for layouts that may overlap.
inline bool provably_non_overlapping(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dimensions with size > 1
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // largest offset reachable with the dimensions so far
  for (const auto& [stride, size] : dims) {
    if (stride <= span) return false;
    span += stride * (size - 1);
  }
  return true;
}

}  // namespace samcache::kernels
