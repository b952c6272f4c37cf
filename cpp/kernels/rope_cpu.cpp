#include <ATen/Dispatch.h>
#include <ATen/ops/tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <unordered_set>

#include "rope.h"

#include "memory_checks.h"

namespace samcache::kernels {

namespace {

RopeStyle parse_style(std::string_view style) {
  if (style == "neox") return RopeStyle::kNeox;
  if (style == "gptj") return RopeStyle::kGptj;
  if (style == "mrope") return RopeStyle::kMrope;
  if (style == "mrope_interleaved") return RopeStyle::kMropeInterleaved;
  TORCH_CHECK_VALUE(false, "rope: style must be 'neox', 'gptj', 'mrope' or 'mrope_interleaved', got '", style, "'");
  return RopeStyle::kNeox;  // unreachable
}

bool is_multi_axis(RopeStyle s) { return s == RopeStyle::kMrope || s == RopeStyle::kMropeInterleaved; }

// 2*pi split so that k * kTwoPiHi + k * kTwoPiLo subtracts 2*pi*k to ~1e-16 relative.
constexpr double kTwoPiHi = 6.283185307179586;
constexpr double kTwoPiLo = 2.4492935982947064e-16;
constexpr double kInvTwoPi = 0.15915494309189535;
// Adding then subtracting 1.5 * 2^52 rounds a double to the nearest integer (|x| < 2^51) without
// a libm call (the baseline x86-64 build has no roundsd).
constexpr double kRoundShift = 6755399441055744.0;

// cos/sin of delta * inv_freq. In float32 the product alone is off by |angle| * 6e-8 (6e-3 rad at
// |delta| = 1e5), so the angle is formed and reduced to [-pi, pi] in float64 (d * f is exact
// there for |d| < 2^29; the reduction errs by ~1e-11 rad at |angle| = 1e5) and only the reduced
// angle goes through float32 cos/sin. The CUDA kernel does the same (with fma).
inline void rope_cos_sin(int64_t delta, float inv_freq, float& c, float& s) {
  const double angle = static_cast<double>(delta) * static_cast<double>(inv_freq);
  const double k = (angle * kInvTwoPi + kRoundShift) - kRoundShift;
  const float r = static_cast<float>((angle - k * kTwoPiHi) - k * kTwoPiLo);
  c = std::cos(r);
  s = std::sin(r);
}

// Rotates one head's rotary pairs src -> dst (dst may equal src) with per-frequency cos/sin;
// x' = x cos - y sin, y' = y cos + x sin for each pair (x, y).
template <typename T>
inline void rotate_head(const T* src, T* dst, const float* cos, const float* sin, int64_t half, bool interleaved) {
  if (interleaved) {
    for (int64_t j = 0; j < half; ++j) {
      const float x = static_cast<float>(src[2 * j]), y = static_cast<float>(src[2 * j + 1]);
      dst[2 * j] = static_cast<T>(x * cos[j] - y * sin[j]);
      dst[2 * j + 1] = static_cast<T>(y * cos[j] + x * sin[j]);
    }
  } else {
    for (int64_t j = 0; j < half; ++j) {
      const float x = static_cast<float>(src[j]), y = static_cast<float>(src[half + j]);
      dst[j] = static_cast<T>(x * cos[j] - y * sin[j]);
      dst[half + j] = static_cast<T>(y * cos[j] + x * sin[j]);
    }
  }
}

// The cos/sin of every token at once, from torch's vectorised ops (same float64 angle and
// reduction as rope_cos_sin, then float32 cos/sin): used when the deltas change from token to
// token, where one scalar cos/sin pair per (token, frequency) would dominate the run time.
struct AngleTables {
  at::Tensor cos, sin;  // float32 [N, rotary_half], contiguous
};

AngleTables angle_tables(const RopePlan& plan, const at::Tensor& delta, const at::Tensor& inv_freq) {
  at::Tensor d;  // [N, rotary_half] or [N, 1]: the delta driving each (token, frequency)
  if (delta.dim() == 2) {
    std::vector<int64_t> rows(plan.axis.begin(), plan.axis.end());
    d = delta.index_select(0, at::tensor(rows, at::TensorOptions().dtype(at::kLong))).t();
  } else {
    d = delta.unsqueeze(1);
  }
  const at::Tensor angle = d.to(at::kDouble).mul(inv_freq.to(at::kDouble));
  const at::Tensor k = angle.mul(kInvTwoPi).round();
  const at::Tensor r = angle.sub(k.mul(kTwoPiHi)).sub(k.mul(kTwoPiLo)).to(at::kFloat);
  return {r.cos().contiguous(), r.sin().contiguous()};
}

// True when the deltas change at more than 1 token in 8 (then angle_tables pays off).
bool deltas_vary(const at::Tensor& delta) {
  const bool multi = delta.dim() == 2;
  const int64_t n = multi ? delta.size(1) : delta.size(0);
  const int64_t ts = multi ? delta.stride(1) : delta.stride(0), as = multi ? delta.stride(0) : 0;
  const int64_t* d = delta.const_data_ptr<int64_t>();
  int64_t changes = 0;
  for (int64_t t = 1; t < n; ++t)
    for (int a = 0; a < (multi ? 3 : 1); ++a)
      if (d[a * as + t * ts] != d[a * as + (t - 1) * ts]) {
        ++changes;
        break;
      }
  return changes * 8 > n;
}

// The cos/sin of one token for one worker: rows of the tables when given, else computed per
// token and kept while the deltas stay the same (an image moved as a whole shares one delta, so
// this is nearly free in practice).
class TokenAngles {
 public:
  TokenAngles(const RopePlan& plan, const at::Tensor& delta, const float* inv_freq, const AngleTables& tables)
      : plan_(plan), inv_freq_(inv_freq) {
    if (tables.cos.defined()) {
      table_cos_ = tables.cos.const_data_ptr<float>();
      table_sin_ = tables.sin.const_data_ptr<float>();
      return;
    }
    cos_.resize(plan.rotary_half);
    sin_.resize(plan.rotary_half);
    cos_ptr_ = cos_.data();
    sin_ptr_ = sin_.data();
    d_ = delta.const_data_ptr<int64_t>();
    multi_ = delta.dim() == 2;
    axis_stride_ = multi_ ? delta.stride(0) : 0;
    token_stride_ = multi_ ? delta.stride(1) : delta.stride(0);
  }

  void load(int64_t token) {
    if (table_cos_ != nullptr) {
      cos_ptr_ = table_cos_ + token * plan_.rotary_half;
      sin_ptr_ = table_sin_ + token * plan_.rotary_half;
      return;
    }
    std::array<int64_t, 3> d{};
    for (int a = 0; a < (multi_ ? 3 : 1); ++a) d[a] = d_[a * axis_stride_ + token * token_stride_];
    if (valid_ && d == last_) return;
    for (int64_t j = 0; j < plan_.rotary_half; ++j) rope_cos_sin(d[plan_.axis[j]], inv_freq_[j], cos_[j], sin_[j]);
    last_ = d;
    valid_ = true;
  }
  const float* cos() const { return cos_ptr_; }
  const float* sin() const { return sin_ptr_; }

 private:
  const RopePlan& plan_;
  const float* inv_freq_;
  const float* table_cos_ = nullptr;
  const float* table_sin_ = nullptr;
  const float* cos_ptr_ = nullptr;
  const float* sin_ptr_ = nullptr;
  const int64_t* d_ = nullptr;
  bool multi_ = false;
  int64_t axis_stride_ = 0, token_stride_ = 0;
  std::vector<float> cos_, sin_;
  std::array<int64_t, 3> last_{};
  bool valid_ = false;
};

// Tokens per parallel task: ~64 KiB of keys, so small calls stay on one thread.
int64_t token_grain(const at::Tensor& key) {
  const int64_t bytes = std::max<int64_t>(1, key.size(1) * key.size(2) * key.element_size());
  return std::max<int64_t>(1, (64 << 10) / bytes);
}

}  // namespace

std::vector<uint8_t> rope_frequency_axes(RopeStyle style, at::IntArrayRef sec, int64_t rotary_half) {
  std::vector<uint8_t> axis(static_cast<size_t>(rotary_half), 0);
  for (int64_t j = 0; j < rotary_half; ++j) {
    if (style == RopeStyle::kMrope) {
      axis[j] = j < sec[0] ? 0 : (j < sec[0] + sec[1] ? 1 : 2);
    } else if (style == RopeStyle::kMropeInterleaved) {
      if (j % 3 == 1 && j < 3 * sec[1]) axis[j] = 1;
      else if (j % 3 == 2 && j < 3 * sec[2]) axis[j] = 2;
    }
  }
  return axis;
}

RopePlan plan_rope_rerotate(const at::Tensor& key, const at::Tensor& delta, const at::Tensor& inv_freq,
                            std::string_view style, at::IntArrayRef mrope_section) {
  RopePlan plan;
  plan.style = parse_style(style);
  TORCH_CHECK_VALUE(key.defined() && key.dim() == 3, "rope: key must be [N, H, D], got ",
                    key.defined() ? key.sizes() : at::IntArrayRef{});
  TORCH_CHECK_TYPE(key.scalar_type() == at::kFloat || key.scalar_type() == at::kHalf ||
                       key.scalar_type() == at::kBFloat16,
                   "rope: key must be float32, float16 or bfloat16, got ", key.scalar_type());
  TORCH_CHECK_VALUE(key.stride(2) == 1 || key.size(2) <= 1, "rope: key's last dimension must be contiguous");
  TORCH_CHECK_VALUE(provably_non_overlapping(key),
                    "rope: key has elements sharing memory (e.g. an expanded or as_strided tensor)");
  plan.num_tokens = key.size(0);
  plan.num_heads = key.size(1);
  plan.head_dim = key.size(2);

  TORCH_CHECK_VALUE(inv_freq.defined() && inv_freq.dim() == 1, "rope: inv_freq must be 1-D [rotary_dim / 2]");
  TORCH_CHECK_TYPE(inv_freq.scalar_type() == at::kFloat, "rope: inv_freq must be float32, got ", inv_freq.scalar_type());
  TORCH_CHECK_VALUE(inv_freq.device() == key.device(), "rope: inv_freq must be on key's device ", key.device(),
                    ", got ", inv_freq.device());
  plan.rotary_half = inv_freq.size(0);
  TORCH_CHECK_VALUE(plan.rotary_half >= 1 && 2 * plan.rotary_half <= plan.head_dim, "rope: rotary_dim = 2 * ",
                    plan.rotary_half, " must be in [2, head_dim = ", plan.head_dim, "]");
  TORCH_CHECK_VALUE(plan.rotary_half <= kRopeMaxRotaryHalf, "rope: rotary_dim / 2 = ", plan.rotary_half,
                    " exceeds ", kRopeMaxRotaryHalf);

  const bool multi = is_multi_axis(plan.style);
  TORCH_CHECK_TYPE(delta.defined() && delta.scalar_type() == at::kLong, "rope: delta must be int64, got ",
                   delta.defined() ? delta.scalar_type() : at::ScalarType::Undefined);
  TORCH_CHECK_VALUE(delta.device() == key.device(), "rope: delta must be on key's device ", key.device(), ", got ",
                    delta.device());
  if (multi) {
    TORCH_CHECK_VALUE(delta.dim() == 2 && delta.size(0) == 3 && delta.size(1) == plan.num_tokens, "rope: style '",
                      style, "' needs delta of shape [3, ", plan.num_tokens, "] (t, h, w), got ", delta.sizes());
    TORCH_CHECK_VALUE(mrope_section.size() == 3, "rope: style '", style, "' needs a 3-entry mrope_section, got ",
                      mrope_section);
    for (int64_t s : mrope_section) TORCH_CHECK_VALUE(s >= 0, "rope: mrope_section entries must be >= 0, got ", mrope_section);
    const int64_t total = std::accumulate(mrope_section.begin(), mrope_section.end(), int64_t{0});
    TORCH_CHECK_VALUE(total == plan.rotary_half, "rope: mrope_section ", mrope_section, " must sum to rotary_dim / 2 = ",
                      plan.rotary_half);
  } else {
    TORCH_CHECK_VALUE(delta.dim() == 1 && delta.size(0) == plan.num_tokens, "rope: style '", style,
                      "' needs delta of shape [", plan.num_tokens, "], got ", delta.sizes());
    TORCH_CHECK_VALUE(mrope_section.empty(), "rope: mrope_section must be [] for style '", style, "', got ",
                      mrope_section);
  }
  plan.axis = rope_frequency_axes(plan.style, mrope_section, plan.rotary_half);
  return plan;
}

RopePlan plan_rope_rerotate_write(const at::Tensor& key, const at::Tensor& delta, const at::Tensor& inv_freq,
                                  std::string_view style, at::IntArrayRef mrope_section,
                                  const at::Tensor& key_cache, const at::Tensor& slot_mapping) {
  RopePlan plan = plan_rope_rerotate(key, delta, inv_freq, style, mrope_section);
  TORCH_CHECK_VALUE(key_cache.defined() && key_cache.dim() == 4 && key_cache.size(2) == plan.num_heads &&
                        key_cache.size(3) == plan.head_dim,
                    "rope: key_cache must be [num_blocks, block_size, ", plan.num_heads, ", ", plan.head_dim,
                    "], got ", key_cache.defined() ? key_cache.sizes() : at::IntArrayRef{});
  TORCH_CHECK_TYPE(key_cache.scalar_type() == key.scalar_type(), "rope: key_cache dtype ", key_cache.scalar_type(),
                   " must match key's ", key.scalar_type());
  TORCH_CHECK_VALUE(key_cache.device() == key.device(), "rope: key_cache must be on key's device ", key.device(),
                    ", got ", key_cache.device());
  TORCH_CHECK_VALUE(key_cache.stride(3) == 1 || key_cache.size(3) <= 1,
                    "rope: key_cache's last dimension must be contiguous");
  TORCH_CHECK_VALUE(provably_non_overlapping(key_cache),
                    "rope: key_cache has elements sharing memory (e.g. an expanded or as_strided tensor)");
  // Any view of the cache as the source (e.g. moving tokens within it) could be overwritten
  // before it is read: refuse it, whatever its strides; pass a copy instead.
  TORCH_CHECK_VALUE(!may_share_memory(key, key_cache),
                    "rope: key and key_cache must not share memory (pass a copy of the cached keys)");
  plan.block_size = key_cache.size(1);
  plan.num_slots = key_cache.size(0) * key_cache.size(1);

  TORCH_CHECK_TYPE(slot_mapping.defined() && (slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong),
                   "rope: slot_mapping must be int32 or int64, got ",
                   slot_mapping.defined() ? slot_mapping.scalar_type() : at::ScalarType::Undefined);
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == plan.num_tokens,
                    "rope: slot_mapping must have shape [", plan.num_tokens, "], got ", slot_mapping.sizes());
  TORCH_CHECK_VALUE(slot_mapping.device() == key.device(), "rope: slot_mapping must be on key's device ",
                    key.device(), ", got ", slot_mapping.device());
  if (slot_mapping.device().is_cpu()) {
    const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
    const int64_t* slot = slots.const_data_ptr<int64_t>();
    std::unordered_set<int64_t> seen;
    for (int64_t i = 0; i < plan.num_tokens; ++i) {
      const int64_t s = slot[i];
      if (s == -1) continue;
      TORCH_CHECK_INDEX(s >= 0 && s < plan.num_slots, "rope: slot_mapping[", i, "] = ", s, " is out of range for ",
                        plan.num_slots, " slots (-1 skips a token)");
      TORCH_CHECK_VALUE(seen.insert(s).second, "rope: slot ", s, " appears twice in slot_mapping");
    }
  }
  return plan;
}

namespace {

// Rotates every head of key in place: float32 or bfloat16 (float16 goes through float32 below).
void rerotate_heads(const RopePlan& plan, const at::Tensor& key, const at::Tensor& delta, const float* freqs,
                    const AngleTables& tables) {
  const bool interleaved = plan.style == RopeStyle::kGptj;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, key.scalar_type(), "rope_rerotate_cpu", [&] {
    scalar_t* base = key.data_ptr<scalar_t>();
    const int64_t st = key.stride(0), sh = key.stride(1);
    at::parallel_for(0, plan.num_tokens, token_grain(key), [&](int64_t begin, int64_t end) {
      TokenAngles angles(plan, delta, freqs, tables);
      for (int64_t t = begin; t < end; ++t) {
        angles.load(t);
        for (int64_t h = 0; h < plan.num_heads; ++h) {
          scalar_t* head = base + t * st + h * sh;
          rotate_head(head, head, angles.cos(), angles.sin(), plan.rotary_half, interleaved);
        }
      }
    });
  });
}

// float16 <-> float32 element by element is scalar without F16C (which the portable build does
// not assume), 10x slower than the rest; torch's own conversions are vectorised with runtime
// CPU dispatch, so float16 rotates a float32 copy of the rotary dims and converts back.
void rerotate_in_place(const RopePlan& plan, const at::Tensor& key, const at::Tensor& delta, const at::Tensor& freqs) {
  const AngleTables tables = deltas_vary(delta) ? angle_tables(plan, delta, freqs) : AngleTables{};
  if (key.scalar_type() != at::kHalf) return rerotate_heads(plan, key, delta, freqs.const_data_ptr<float>(), tables);
  at::Tensor rotary = key.narrow(2, 0, 2 * plan.rotary_half);
  at::Tensor work = rotary.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
  rerotate_heads(plan, work, delta, freqs.const_data_ptr<float>(), tables);
  rotary.copy_(work);
}

}  // namespace

void rope_rerotate_cpu(const at::Tensor& key, const at::Tensor& delta, const at::Tensor& inv_freq,
                       std::string_view style, at::IntArrayRef mrope_section) {
  const RopePlan plan = plan_rope_rerotate(key, delta, inv_freq, style, mrope_section);
  if (plan.num_tokens == 0 || plan.num_heads == 0) return;
  const at::Tensor freqs = inv_freq.contiguous();
  rerotate_in_place(plan, key, delta, freqs);
}

void rope_rerotate_write_cpu(const at::Tensor& key, const at::Tensor& delta, const at::Tensor& inv_freq,
                             std::string_view style, at::IntArrayRef mrope_section, const at::Tensor& key_cache,
                             const at::Tensor& slot_mapping) {
  const RopePlan plan =
      plan_rope_rerotate_write(key, delta, inv_freq, style, mrope_section, key_cache, slot_mapping);
  if (plan.num_tokens == 0 || plan.num_heads == 0) return;
  const at::Tensor freqs = inv_freq.contiguous();
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  if (key.scalar_type() == at::kHalf) {
    // float16: rotate a copy (vectorised conversions, see rerotate_in_place), then scatter rows.
    const at::Tensor rotated = key.clone(at::MemoryFormat::Contiguous);
    rerotate_in_place(plan, rotated, delta, freqs);
    const auto* src = rotated.const_data_ptr<at::Half>();
    auto* dst = key_cache.data_ptr<at::Half>();
    const int64_t cb = key_cache.stride(0), co = key_cache.stride(1), ch = key_cache.stride(2);
    const int64_t row = plan.num_heads * plan.head_dim;
    at::parallel_for(0, plan.num_tokens, token_grain(key), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (slot[t] < 0) continue;
        at::Half* out = dst + (slot[t] / plan.block_size) * cb + (slot[t] % plan.block_size) * co;
        for (int64_t h = 0; h < plan.num_heads; ++h)
          std::copy_n(src + t * row + h * plan.head_dim, plan.head_dim, out + h * ch);
      }
    });
    return;
  }
  const bool interleaved = plan.style == RopeStyle::kGptj;
  const int64_t rotary_dim = 2 * plan.rotary_half;
  const AngleTables tables = deltas_vary(delta) ? angle_tables(plan, delta, freqs) : AngleTables{};
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, key.scalar_type(), "rope_rerotate_write_cpu", [&] {
    const scalar_t* src = key.const_data_ptr<scalar_t>();
    scalar_t* dst = key_cache.data_ptr<scalar_t>();
    const int64_t st = key.stride(0), sh = key.stride(1);
    const int64_t cb = key_cache.stride(0), co = key_cache.stride(1), ch = key_cache.stride(2);
    at::parallel_for(0, plan.num_tokens, token_grain(key), [&](int64_t begin, int64_t end) {
      TokenAngles angles(plan, delta, freqs.const_data_ptr<float>(), tables);
      for (int64_t t = begin; t < end; ++t) {
        if (slot[t] < 0) continue;
        angles.load(t);
        scalar_t* out = dst + (slot[t] / plan.block_size) * cb + (slot[t] % plan.block_size) * co;
        for (int64_t h = 0; h < plan.num_heads; ++h) {
          const scalar_t* in = src + t * st + h * sh;
          scalar_t* o = out + h * ch;
          rotate_head(in, o, angles.cos(), angles.sin(), plan.rotary_half, interleaved);
          std::copy(in + rotary_dim, in + plan.head_dim, o + rotary_dim);  // partial rotary: tail as is
        }
      }
    });
  });
}

}  // namespace samcache::kernels
