// Reading small int32/int64 index tensors (slot mappings, block tables, batch metadata) on the
// host; shared by the ops' plan_* functions.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace samcache::kernels {

inline bool is_index_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong;
}

// Reads `count` leading entries of a 1-D int32/int64 CPU tensor of any stride.
inline std::vector<int64_t> read_indices(const at::Tensor& t, int64_t count) {
  std::vector<int64_t> out(static_cast<size_t>(count));
  const int64_t stride = t.dim() == 0 ? 0 : t.stride(0);
  if (t.scalar_type() == at::kInt) {
    const int32_t* p = t.const_data_ptr<int32_t>();
    for (int64_t i = 0; i < count; ++i) out[i] = p[i * stride];
  } else {
    const int64_t* p = t.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i) out[i] = p[i * stride];
  }
  return out;
}

// All entries of a 1-D int32/int64 CPU tensor.
inline std::vector<int64_t> read_indices(const at::Tensor& t) { return read_indices(t, t.numel()); }

}  // namespace samcache::kernels
