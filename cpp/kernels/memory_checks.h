// Memory-aliasing checks shared by the kernels' plans (CPU and CUDA): an op that reads one
// tensor while writing another must not be handed two views of the same bytes, or the result
// depends on the order of the writes.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

namespace samcache::kernels {

// True when a and b are views of one storage (any overlap possible): the cheap, strict test.
inline bool shares_storage(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.has_storage() && b.has_storage() && a.storage().is_alias_of(b.storage());
}

// True when no two elements of t share memory, proven from its strides (each dimension, in
// stride order, steps past everything the smaller ones span). ATen's own test gives up
// ("too hard") on non-dense views such as a slice of a cache; this one decides those too and
// answers false only for layouts that may overlap.
inline bool provably_non_overlapping(const at::Tensor& t) {
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
