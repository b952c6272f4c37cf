#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "cpu_convert.h"
#include "rope_qkv.h"

namespace samcache::kernels {

namespace {

bool is_rope_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// One head: out = x * cos + swap_halves(x) * sin, every step rounded to T (torch's bits).
template <typename T>
SAMCACHE_AVX2_CLONE void rotate_head(const T* x, const T* cos, const T* sin, T* out, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const T a = from_float<T>(to_float(x[i]) * to_float(cos[i]));
    const T b = from_float<T>(to_float(x[i + half]) * to_float(sin[i]));
    out[i] = from_float<T>(to_float(a) + to_float(b));
  }
  for (int64_t i = half; i < 2 * half; ++i) {
    const T a = from_float<T>(to_float(x[i]) * to_float(cos[i]));
    const T b = from_float<T>(to_float(x[i - half]) * to_float(sin[i]));
    out[i] = from_float<T>(to_float(a) + to_float(b));
  }
}

template <typename T>
void run(const RopeQkvPlan& plan, const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
         const at::Tensor& key_cache, const at::Tensor& value_cache, at::Tensor& q_out) {
  const int64_t h = plan.num_heads, kv = plan.num_kv_heads, d = plan.head_dim, half = d / 2;
  const T* src = qkv.const_data_ptr<T>();
  const T* c = cos.const_data_ptr<T>();
  const T* s = sin.const_data_ptr<T>();
  T* q = q_out.mutable_data_ptr<T>();
  T* kc = key_cache.data_ptr<T>();
  T* vc = value_cache.data_ptr<T>();
  const int64_t st = qkv.stride(0), cst = cos.stride(0), sst = sin.stride(0);
  const int64_t kb = key_cache.stride(0), ko = key_cache.stride(1), kh = key_cache.stride(2);
  const int64_t vb = value_cache.stride(0), vo = value_cache.stride(1), vh = value_cache.stride(2);
  const int64_t block_size = plan.write.cache.block_size;
  const int64_t* slots = plan.write.host_slots.data();
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, (h + 2 * kv) * d));
  at::parallel_for(0, plan.num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = src + t * st;
      const T* ct = c + t * cst;
      const T* stt = s + t * sst;
      for (int64_t i = 0; i < h; ++i) rotate_head(row + i * d, ct, stt, q + (t * h + i) * d, half);
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding
      T* k_out = kc + (slot / block_size) * kb + (slot % block_size) * ko;
      T* v_out = vc + (slot / block_size) * vb + (slot % block_size) * vo;
      for (int64_t i = 0; i < kv; ++i) {
        rotate_head(row + (h + i) * d, ct, stt, k_out + i * kh, half);
        std::copy_n(row + (h + kv + i) * d, d, v_out + i * vh);
      }
    }
  });
}

}  // namespace

RopeQkvPlan plan_rope_qkv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                int64_t num_heads, int64_t num_kv_heads, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  for (const auto& [name, t] : {std::pair{"qkv", &qkv}, {"cos", &cos}, {"sin", &sin}})
    TORCH_CHECK_VALUE(t->defined(), "rope_qkv_write: ", name, " must be a tensor");
  TORCH_CHECK_VALUE(qkv.dim() == 2, "rope_qkv_write: qkv must be [N, (heads + 2 kv_heads) * head_dim], got ",
                    qkv.sizes());
  TORCH_CHECK_TYPE(is_rope_dtype(qkv.scalar_type()), "rope_qkv_write: qkv must be float32, float16 or bfloat16, got ",
                   qkv.scalar_type());
  TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0, "rope_qkv_write: num_heads and num_kv_heads must be > 0, got ",
                    num_heads, " and ", num_kv_heads);
  const int64_t n = qkv.size(0);
  for (const auto& [name, t] : {std::pair{"cos", &cos}, {"sin", &sin}}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == n, "rope_qkv_write: ", name, " must be [", n,
                      ", head_dim] (one row per qkv row), got ", t->sizes());
    TORCH_CHECK_TYPE(t->scalar_type() == qkv.scalar_type(), "rope_qkv_write: ", name, " must be ",
                     qkv.scalar_type(), " like qkv, got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->device() == qkv.device(), "rope_qkv_write: qkv is on ", qkv.device(), ", ", name, " on ",
                      t->device());
    TORCH_CHECK_VALUE(t->stride(1) == 1, "rope_qkv_write: ", name, "'s last dim must be contiguous, got strides ",
                      t->strides());
  }
  const int64_t d = cos.size(1);
  TORCH_CHECK_VALUE(sin.size(1) == d, "rope_qkv_write: sin must be [", n, ", ", d, "] like cos, got ", sin.sizes());
  TORCH_CHECK_VALUE(d > 0 && d % 2 == 0, "rope_qkv_write: head_dim (cos's last dim) must be even and > 0, got ", d);
  TORCH_CHECK_VALUE(qkv.size(1) == (num_heads + 2 * num_kv_heads) * d, "rope_qkv_write: qkv must have (",
                    num_heads, " + 2 x ", num_kv_heads, ") x ", d, " = ", (num_heads + 2 * num_kv_heads) * d,
                    " columns, got ", qkv.size(1));
  TORCH_CHECK_VALUE(qkv.stride(1) == 1, "rope_qkv_write: qkv's last dim must be contiguous, got strides ",
                    qkv.strides());
  // The key and value columns as [N, KV, D] views: paged_write's checks of the caches and slots.
  const at::Tensor k = qkv.narrow(1, num_heads * d, num_kv_heads * d).view({n, num_kv_heads, d});
  const at::Tensor v = qkv.narrow(1, (num_heads + num_kv_heads) * d, num_kv_heads * d).view({n, num_kv_heads, d});
  RopeQkvPlan plan;
  plan.num_tokens = n;
  plan.num_heads = num_heads;
  plan.num_kv_heads = num_kv_heads;
  plan.head_dim = d;
  plan.write = plan_paged_write(k, v, key_cache, value_cache, slot_mapping);
  return plan;
}

at::Tensor rope_qkv_write_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                              int64_t num_heads, int64_t num_kv_heads, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const RopeQkvPlan plan =
      plan_rope_qkv_write(qkv, cos, sin, num_heads, num_kv_heads, key_cache, value_cache, slot_mapping);
  at::Tensor q = at::empty({plan.num_tokens, num_heads, plan.head_dim}, qkv.options());
  if (plan.num_tokens == 0) return q;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, qkv.scalar_type(), "rope_qkv_write_cpu",
                                  [&] { run<scalar_t>(plan, qkv, cos, sin, key_cache, value_cache, q); });
  return q;
}

}  // namespace samcache::kernels
