#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "cpu_convert.h"
#include "kv_quant.h"

namespace samcache::kernels {

// ---- validation, shared with the CUDA wrapper -------------------------------------------------

KvQuantType parse_kv_quant_type(std::string_view qtype) {
  if (qtype == "fp8_e4m3") return KvQuantType::kFp8E4M3;
  if (qtype == "int8") return KvQuantType::kInt8;
  TORCH_CHECK_VALUE(false, "kv_quant: unknown qtype '", qtype, "' (expected 'fp8_e4m3' or 'int8')");
}

at::ScalarType kv_quant_storage_dtype(KvQuantType qtype) {
  return qtype == KvQuantType::kFp8E4M3 ? at::kFloat8_e4m3fn : at::kChar;
}

namespace {

void check_cache(const char* op, const at::Tensor& cache, KvQuantPlan& plan) {
  TORCH_CHECK_VALUE(cache.defined() && cache.dim() == 4, op, ": cache must be [num_blocks, block_size, H, D], got ",
                    cache.defined() ? cache.sizes() : at::IntArrayRef{});
  const auto dt = cache.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op,
                   ": cache must be float32, float16 or bfloat16, got ", dt);
  plan.num_blocks = cache.size(0);
  plan.block_size = cache.size(1);
  plan.heads = cache.size(2);
  plan.head_dim = cache.size(3);
  // Each block must be dense; the distance between blocks is free (e.g. kv[:, 0] of a [B, 2, ...] cache).
  const int64_t expected[3] = {plan.heads * plan.head_dim, plan.head_dim, 1};
  for (int d = 1; d < 4 && cache.numel() > 0; ++d)  // an empty cache has no layout to check
    TORCH_CHECK_VALUE(cache.size(d) <= 1 || cache.stride(d) == expected[d - 1], op,
                      ": each cache block must be contiguous, got strides ", cache.strides());
  plan.block_stride = cache.stride(0);
  // Blocks must not share memory (an expanded or as_strided cache): writes to distinct ids
  // would race on the same bytes.
  const int64_t block_elems = plan.block_size * plan.heads * plan.head_dim;
  TORCH_CHECK_VALUE(plan.num_blocks <= 1 || block_elems == 0 || plan.block_stride >= block_elems, op,
                    ": cache blocks overlap in memory (block stride ", plan.block_stride, " < ", block_elems,
                    " elements per block)");
}

void check_block_ids(const char* op, const at::Tensor& block_ids, const at::Tensor& cache, KvQuantPlan& plan,
                     bool distinct) {
  TORCH_CHECK_TYPE(block_ids.scalar_type() == at::kInt || block_ids.scalar_type() == at::kLong, op,
                   ": block_ids must be int32 or int64, got ", block_ids.scalar_type());
  TORCH_CHECK_VALUE(block_ids.dim() == 1, op, ": block_ids must be 1-D [n], got ", block_ids.sizes());
  TORCH_CHECK_VALUE(block_ids.device().is_cpu() || block_ids.device() == cache.device(), op,
                    ": block_ids must be on the CPU or on the cache's device ", cache.device(), ", got ",
                    block_ids.device());
  plan.num_ids = block_ids.size(0);
  plan.ids_on_host = block_ids.device().is_cpu();
  if (!plan.ids_on_host) return;
  const at::Tensor ids = block_ids.to(at::kLong).contiguous();
  const int64_t* p = ids.data_ptr<int64_t>();
  plan.ids.assign(p, p + plan.num_ids);
  std::unordered_set<int64_t> seen;
  for (int64_t i = 0; i < plan.num_ids; ++i) {
    TORCH_CHECK_INDEX(p[i] >= 0 && p[i] < plan.num_blocks, op, ": block_ids[", i, "] = ", p[i],
                      " is out of range for ", plan.num_blocks, " blocks");
    if (distinct)
      TORCH_CHECK_VALUE(seen.insert(p[i]).second, op, ": block ", p[i], " appears twice in block_ids");
  }
}

void set_groups(KvQuantPlan& plan) {
  plan.groups_per_block = plan.per_head ? plan.heads : 1;
  if (plan.per_head) {
    plan.rows = plan.block_size;
    plan.row_len = plan.head_dim;
    plan.row_stride = plan.heads * plan.head_dim;
  } else {
    plan.rows = 1;
    plan.row_len = plan.block_size * plan.heads * plan.head_dim;
    plan.row_stride = plan.row_len;
  }
}

}  // namespace

KvQuantPlan plan_quantize_kv_blocks(const at::Tensor& cache, const at::Tensor& block_ids, std::string_view qtype,
                                    bool per_head) {
  KvQuantPlan plan;
  plan.qtype = parse_kv_quant_type(qtype);
  plan.per_head = per_head;
  check_cache("quantize_kv_blocks", cache, plan);
  check_block_ids("quantize_kv_blocks", block_ids, cache, plan, /*distinct=*/false);
  set_groups(plan);
  return plan;
}

KvQuantPlan plan_dequantize_kv_blocks(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& cache,
                                      const at::Tensor& block_ids) {
  const char* op = "dequantize_kv_blocks";
  KvQuantPlan plan;
  check_cache(op, cache, plan);
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat8_e4m3fn || q.scalar_type() == at::kChar, op,
                   ": q must be float8_e4m3fn or int8, got ", q.scalar_type());
  plan.qtype = q.scalar_type() == at::kChar ? KvQuantType::kInt8 : KvQuantType::kFp8E4M3;
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat, op, ": scales must be float32, got ", scales.scalar_type());
  TORCH_CHECK_VALUE(q.device() == cache.device() && scales.device() == cache.device(), op,
                    ": q and scales must be on the cache's device ", cache.device());
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(1) == plan.block_size && q.size(2) == plan.heads &&
                        q.size(3) == plan.head_dim,
                    op, ": q must be [n, ", plan.block_size, ", ", plan.heads, ", ", plan.head_dim, "], got ",
                    q.sizes());
  check_block_ids(op, block_ids, cache, plan, /*distinct=*/true);
  TORCH_CHECK_VALUE(q.size(0) == plan.num_ids, op, ": q has ", q.size(0), " blocks but block_ids has ",
                    plan.num_ids);
  plan.per_head = scales.dim() == 2;
  TORCH_CHECK_VALUE((scales.dim() == 1 && scales.size(0) == plan.num_ids) ||
                        (scales.dim() == 2 && scales.size(0) == plan.num_ids && scales.size(1) == plan.heads),
                    op, ": scales must be [", plan.num_ids, "] or [", plan.num_ids, ", ", plan.heads, "], got ",
                    scales.sizes());
  set_groups(plan);
  return plan;
}

// ---- CPU kernels ------------------------------------------------------------------------------

namespace {

// Saturating, round-to-nearest-even float -> e4m3fn code of a finite value. Branch-free and
// clamped in the integer domain (a float clamp blocks vectorisation under -ftrapping-math).
inline uint8_t encode_e4m3(float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const int32_t raw = static_cast<int32_t>(bits & 0x7fffffffu);
  const uint32_t mag = static_cast<uint32_t>(raw < 0x43e00000 ? raw : 0x43e00000);  // min(|v|, 448)
  // Normal codes (|v| >= 2^-6): round the float mantissa to 3 bits, then rebias the exponent 127 -> 7.
  const uint32_t rounded = mag + 0x7ffffu + ((mag >> 20) & 1u);
  const uint32_t normal_code = (rounded >> 20) - (120u << 3);
  // Subnormal codes are multiples of 2^-9: round |v| * 512 to an integer (8 is the smallest normal).
  const uint32_t sub_code = static_cast<uint32_t>(round_to_int(std::bit_cast<float>(mag) * 512.0f));
  const uint32_t normal_mask = 0u - static_cast<uint32_t>(mag >= 0x3c800000u);
  return static_cast<uint8_t>(sign | (normal_code & normal_mask) | (sub_code & ~normal_mask));
}

// Saturating, round-to-nearest-even code of v = x / scale (finite, |v| < 2^22).
template <KvQuantType Q>
inline int8_t encode(float v) {
  if constexpr (Q == KvQuantType::kFp8E4M3) {
    return static_cast<int8_t>(encode_e4m3(v));
  } else {
    const int32_t r = round_to_int(v);
    return static_cast<int8_t>(r < -127 ? -127 : (r > 127 ? 127 : r));
  }
}

std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 3) & 15, m = c & 7;
    float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
    if (e == 15 && m == 7) v = std::numeric_limits<float>::quiet_NaN();
    t[c] = (c & 0x80) ? -v : v;
  }
  return t;
}
const std::array<float, 256> kE4M3ToFloat = make_e4m3_table();

// max |x| over a run, as the bits of a float: the bits of non-negative floats order like their
// values, and every NaN lies above +inf (0x7f800000). An integer max reduction vectorises
// without -ffast-math, and finds NaN/inf in the same pass.
template <typename T>
SAMCACHE_AVX2_CLONE int32_t run_abs_max_bits(const T* x, int64_t len) {
  int32_t m = 0;
  for (int64_t i = 0; i < len; ++i) {
    const int32_t b = std::bit_cast<int32_t>(to_float(x[i])) & 0x7fffffff;
    m = b > m ? b : m;
  }
  return m;
}

template <KvQuantType Q, typename T>
SAMCACHE_AVX2_CLONE void quantize_run(const T* x, int8_t* out, int64_t len, float inv_scale) {
  for (int64_t i = 0; i < len; ++i) out[i] = encode<Q>(to_float(x[i]) * inv_scale);
}

// Rare path: the float32 scale is subnormal, so 1/scale overflows; divide instead.
template <KvQuantType Q, typename T>
void quantize_run_divide(const T* x, int8_t* out, int64_t len, float scale) {
  for (int64_t i = 0; i < len; ++i) out[i] = encode<Q>(to_float(x[i]) / scale);
}

template <KvQuantType Q, typename T>
void quantize_groups(const KvQuantPlan& plan, const T* cache, int8_t* q, float* scales) {
  constexpr float qmax = Q == KvQuantType::kFp8E4M3 ? kFp8E4M3Max : kInt8Max;
  const int64_t block_elems = plan.block_size * plan.heads * plan.head_dim;
  const int64_t group_elems = plan.rows * plan.row_len;
  const int64_t num_groups = plan.num_ids * plan.groups_per_block;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, group_elems));
  at::parallel_for(0, num_groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t k = g / plan.groups_per_block, h = g % plan.groups_per_block;
      const int64_t head_offset = plan.per_head ? h * plan.head_dim : 0;
      const T* src = cache + plan.ids[k] * plan.block_stride + head_offset;
      int8_t* dst = q + k * block_elems + head_offset;
      int32_t amax_bits = 0;
      for (int64_t r = 0; r < plan.rows; ++r)
        amax_bits = std::max(amax_bits, run_abs_max_bits(src + r * plan.row_stride, plan.row_len));
      if (amax_bits >= 0x7f800000) {  // a NaN or an infinity: the whole group is marked invalid
        scales[g] = std::numeric_limits<float>::quiet_NaN();
        for (int64_t r = 0; r < plan.rows; ++r) std::memset(dst + r * plan.row_stride, 0, plan.row_len);
        continue;
      }
      const float amax = std::bit_cast<float>(amax_bits);
      const float scale = amax / qmax;
      scales[g] = scale;
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;  // all-zero group: q = 0, scale = 0
      for (int64_t r = 0; r < plan.rows; ++r) {
        if (inv <= std::numeric_limits<float>::max())
          quantize_run<Q>(src + r * plan.row_stride, dst + r * plan.row_stride, plan.row_len, inv);
        else
          quantize_run_divide<Q>(src + r * plan.row_stride, dst + r * plan.row_stride, plan.row_len, scale);
      }
    }
  });
}

template <KvQuantType Q, typename T>
SAMCACHE_AVX2_CLONE void dequantize_run(const int8_t* q, T* out, int64_t len, float scale) {
  for (int64_t i = 0; i < len; ++i) {
    const float v = Q == KvQuantType::kFp8E4M3 ? kE4M3ToFloat[static_cast<uint8_t>(q[i])] : static_cast<float>(q[i]);
    out[i] = from_float<T>(v * scale);
  }
}

template <KvQuantType Q, typename T>
void dequantize_groups(const KvQuantPlan& plan, const int8_t* q, const float* scales, T* cache) {
  const int64_t block_elems = plan.block_size * plan.heads * plan.head_dim;
  const int64_t num_groups = plan.num_ids * plan.groups_per_block;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, plan.rows * plan.row_len));
  at::parallel_for(0, num_groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t k = g / plan.groups_per_block, h = g % plan.groups_per_block;
      const int64_t head_offset = plan.per_head ? h * plan.head_dim : 0;
      const int8_t* src = q + k * block_elems + head_offset;
      T* dst = cache + plan.ids[k] * plan.block_stride + head_offset;
      const float scale = scales[g];
      for (int64_t r = 0; r < plan.rows; ++r)
        dequantize_run<Q>(src + r * plan.row_stride, dst + r * plan.row_stride, plan.row_len, scale);
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_kv_blocks_cpu(const at::Tensor& cache, const at::Tensor& block_ids,
                                                          std::string_view qtype, bool per_head) {
  const KvQuantPlan plan = plan_quantize_kv_blocks(cache, block_ids, qtype, per_head);
  at::Tensor q = at::empty({plan.num_ids, plan.block_size, plan.heads, plan.head_dim},
                           cache.options().dtype(kv_quant_storage_dtype(plan.qtype)));
  at::Tensor scales = per_head ? at::empty({plan.num_ids, plan.heads}, cache.options().dtype(at::kFloat))
                               : at::empty({plan.num_ids}, cache.options().dtype(at::kFloat));
  if (q.numel() == 0) {
    scales.zero_();  // empty blocks: nothing to scale
    return {q, scales};
  }
  int8_t* qp = static_cast<int8_t*>(q.data_ptr());
  float* sp = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, cache.scalar_type(), "quantize_kv_blocks_cpu", [&] {
    const scalar_t* cp = cache.const_data_ptr<scalar_t>();
    if (plan.qtype == KvQuantType::kFp8E4M3)
      quantize_groups<KvQuantType::kFp8E4M3>(plan, cp, qp, sp);
    else
      quantize_groups<KvQuantType::kInt8>(plan, cp, qp, sp);
  });
  return {q, scales};
}

void dequantize_kv_blocks_cpu(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& cache,
                              const at::Tensor& block_ids) {
  const KvQuantPlan plan = plan_dequantize_kv_blocks(q, scales, cache, block_ids);
  if (q.numel() == 0) return;
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  const int8_t* qp = static_cast<const int8_t*>(qc.const_data_ptr());
  const float* sp = sc.const_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, cache.scalar_type(), "dequantize_kv_blocks_cpu", [&] {
    scalar_t* cp = cache.mutable_data_ptr<scalar_t>();
    if (plan.qtype == KvQuantType::kFp8E4M3)
      dequantize_groups<KvQuantType::kFp8E4M3>(plan, qp, sp, cp);
    else
      dequantize_groups<KvQuantType::kInt8>(plan, qp, sp, cp);
  });
}

}  // namespace samcache::kernels
