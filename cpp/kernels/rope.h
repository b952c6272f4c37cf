// rope: move cached keys to new positions by re-rotating RoPE. Keys were stored rotated at
// positions p; rotating every rotary pair j by delta * inv_freq[j] gives the keys at p + delta,
// because rotations compose. Shared by the CPU and CUDA implementations.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string_view>
#include <vector>

namespace samcache::kernels {

enum class RopeStyle : int {
  kNeox = 0,              // rotate-half: pair (j, j + rotary_dim/2)
  kGptj = 1,              // interleaved: pair (2j, 2j + 1)
  kMrope = 2,             // Qwen2/2.5-VL sectioned M-RoPE, rotate-half pairing
  kMropeInterleaved = 3,  // Qwen3-VL interleaved M-RoPE, rotate-half pairing
};

// The largest rotary_dim / 2 (bounds the CUDA kernel's shared memory and axis table).
constexpr int64_t kRopeMaxRotaryHalf = 2048;

struct RopePlan {
  RopeStyle style = RopeStyle::kNeox;
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_half = 0;  // len(inv_freq) = rotary_dim / 2
  // Per frequency j: which row of delta (0 = t, 1 = h, 2 = w) drives it; all 0 for 1-D styles.
  std::vector<uint8_t> axis;
  // The slot range of the paged cache (rope_rerotate_write only).
  int64_t num_slots = 0;
  int64_t block_size = 0;
};

// Which position axis drives frequency j of an M-RoPE style (0 for 1-D styles). Written from
// transformers' formulas (not their code):
//  - mrope: src/transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py,
//    apply_multimodal_rotary_pos_emb: cos/sin (= cat(freqs, freqs)) are split by
//    mrope_section * 2 and chunk i takes axis i % 3, so frequency j uses t below s0, h below
//    s0 + s1, w above (j and j + rotary_dim/2 alike).
//  - mrope_interleaved: src/transformers/models/qwen3_vl/modeling_qwen3_vl.py,
//    Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope: start from t everywhere, then
//    frequencies j = 1, 4, 7, ... below 3 * s1 take h and j = 2, 5, 8, ... below 3 * s2 take w.
std::vector<uint8_t> rope_frequency_axes(RopeStyle style, at::IntArrayRef mrope_section, int64_t rotary_half);

// Checks key [N, H, D] (float32/float16/bfloat16, last dim contiguous), delta (int64 [N], or
// [3, N] for M-RoPE styles, on key's device), inv_freq (float32 [rotary_dim/2] on key's device,
// rotary_dim <= D), style and mrope_section; raises ValueError / TypeError otherwise.
RopePlan plan_rope_rerotate(const at::Tensor& key, const at::Tensor& delta, const at::Tensor& inv_freq,
                            std::string_view style, at::IntArrayRef mrope_section);

// plan_rope_rerotate plus key_cache [num_blocks, block_size, H, D] (key's dtype and device, last
// dim contiguous) and slot_mapping (int32/int64 [N] on key's device). CPU slot mappings are
// also checked for range (IndexError) and for distinct non-negative slots (ValueError); CUDA
// ones cannot be read without a sync, so the kernel skips slots out of range instead.
RopePlan plan_rope_rerotate_write(const at::Tensor& key, const at::Tensor& delta, const at::Tensor& inv_freq,
                                  std::string_view style, at::IntArrayRef mrope_section,
                                  const at::Tensor& key_cache, const at::Tensor& slot_mapping);

void rope_rerotate_cpu(const at::Tensor& key, const at::Tensor& delta, const at::Tensor& inv_freq,
                       std::string_view style, at::IntArrayRef mrope_section);
void rope_rerotate_write_cpu(const at::Tensor& key, const at::Tensor& delta, const at::Tensor& inv_freq,
                             std::string_view style, at::IntArrayRef mrope_section, const at::Tensor& key_cache,
                             const at::Tensor& slot_mapping);
#ifdef SAMCACHE_WITH_CUDA
void rope_rerotate_cuda(const at::Tensor& key, const at::Tensor& delta, const at::Tensor& inv_freq,
                        std::string_view style, at::IntArrayRef mrope_section);
void rope_rerotate_write_cuda(const at::Tensor& key, const at::Tensor& delta, const at::Tensor& inv_freq,
                              std::string_view style, at::IntArrayRef mrope_section, const at::Tensor& key_cache,
                              const at::Tensor& slot_mapping);
#endif

}  // namespace samcache::kernels
