// kv_quant: scaled 8-bit quantization of paged KV blocks ([num_blocks, block_size, H, D]) for the
// cold tiers, and the dequantization back into a cache. Shared by the CPU and CUDA paths.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string_view>
#include <tuple>
#include <vector>

namespace samcache::kernels {

// Values are the codes the raw CUDA launchers take (cuda/kv_quant.cuh): keep them in step.
enum class KvQuantType : int { kFp8E4M3 = 0, kInt8 = 1 };

// Largest magnitude of each code, the `amax / qmax` of the scale.
constexpr float kFp8E4M3Max = 448.0f;
constexpr float kInt8Max = 127.0f;

// One scale group is `rows` runs of `row_len` contiguous elements, `row_stride` apart: the whole
// block (rows = 1) or one head of the block (rows = block_size, row_len = D, stride = H * D).
struct KvQuantPlan {
  KvQuantType qtype = KvQuantType::kFp8E4M3;
  bool per_head = false;
  int64_t num_ids = 0;         // n: blocks to (de)quantize
  int64_t num_blocks = 0;      // cache.size(0)
  int64_t block_size = 0, heads = 0, head_dim = 0;
  int64_t block_stride = 0;    // elements between consecutive cache blocks (free; the rest is dense)
  int64_t groups_per_block = 0;
  int64_t rows = 0, row_len = 0, row_stride = 0;
  bool ids_on_host = false;    // validated here; device ids are range-checked by the kernel instead
  std::vector<int64_t> ids;    // the validated ids when ids_on_host
};

KvQuantType parse_kv_quant_type(std::string_view qtype);
at::ScalarType kv_quant_storage_dtype(KvQuantType qtype);

// Checks cache (4-D, float32/16/bf16, dense blocks), block_ids (int32/int64 [n], on the CPU or the
// cache's device; CPU ids in range) and qtype; raises ValueError / TypeError / IndexError.
KvQuantPlan plan_quantize_kv_blocks(const at::Tensor& cache, const at::Tensor& block_ids,
                                    std::string_view qtype, bool per_head);
// As above for the dequantization; the qtype and per_head come from q's dtype and scales' rank,
// and CPU ids must be distinct (each destination block is written once).
KvQuantPlan plan_dequantize_kv_blocks(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& cache,
                                      const at::Tensor& block_ids);

std::tuple<at::Tensor, at::Tensor> quantize_kv_blocks_cpu(const at::Tensor& cache, const at::Tensor& block_ids,
                                                          std::string_view qtype, bool per_head);
void dequantize_kv_blocks_cpu(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& cache,
                              const at::Tensor& block_ids);
#ifdef SAMCACHE_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> quantize_kv_blocks_cuda(const at::Tensor& cache, const at::Tensor& block_ids,
                                                           std::string_view qtype, bool per_head);
void dequantize_kv_blocks_cuda(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& cache,
                               const at::Tensor& block_ids);
#endif

}  // namespace samcache::kernels
