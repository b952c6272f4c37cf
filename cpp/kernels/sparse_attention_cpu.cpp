#include "sparse_attention.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace samcache::kernels {

SparseAttentionShape plan_sparse_attention(const at::Tensor& q, const at::Tensor& q_index, const at::Tensor& key_cache,
                                           const at::Tensor& value_cache, const at::Tensor& block_table,
                                           int64_t num_kv_tokens, double scale, int64_t window, double logit_cap) {
  TORCH_CHECK_VALUE(q.dim() == 3, "sparse_attention: q must be [num_queries, num_q_heads, head_dim], got ", q.sizes());
  TORCH_CHECK_VALUE(key_cache.dim() == 4,
                    "sparse_attention: key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got ",
                    key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), "sparse_attention: value_cache ", value_cache.sizes(),
                    " must match key_cache ", key_cache.sizes());
  const auto dtype = q.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                    "sparse_attention: q must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
                    "sparse_attention: q, key_cache and value_cache must share a dtype");
  TORCH_CHECK_VALUE(key_cache.device() == q.device() && value_cache.device() == q.device() &&
                        q_index.device() == q.device() && block_table.device() == q.device(),
                    "sparse_attention: all tensors must be on q's device ", q.device());
  TORCH_CHECK_VALUE(key_cache.is_contiguous() && value_cache.is_contiguous(), "sparse_attention: caches must be contiguous");
  TORCH_CHECK_VALUE(q_index.dim() == 1 && q_index.size(0) == q.size(0) &&
                        (q_index.scalar_type() == at::kInt || q_index.scalar_type() == at::kLong),
                    "sparse_attention: q_index must be int32/int64 [num_queries]");
  TORCH_CHECK_VALUE(block_table.dim() == 1 &&
                        (block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong),
                    "sparse_attention: block_table must be int32/int64 [num_table_blocks]");
  SparseAttentionShape s{};
  s.num_queries = q.size(0);
  s.num_q_heads = q.size(1);
  s.num_kv_heads = key_cache.size(2);
  s.head_dim = key_cache.size(3);
  s.block_size = key_cache.size(1);
  s.num_kv_tokens = num_kv_tokens;
  s.window = window;
  s.scale = scale;
  s.logit_cap = logit_cap;
  TORCH_CHECK_VALUE(q.size(2) == s.head_dim, "sparse_attention: q head_dim ", q.size(2), " != cache head_dim ", s.head_dim);
  TORCH_CHECK_VALUE(s.num_kv_heads > 0 && s.num_q_heads % s.num_kv_heads == 0, "sparse_attention: num_q_heads ",
                    s.num_q_heads, " must be a multiple of num_kv_heads ", s.num_kv_heads);
  TORCH_CHECK_VALUE(num_kv_tokens >= 1 && num_kv_tokens <= block_table.size(0) * s.block_size,
                    "sparse_attention: num_kv_tokens ", num_kv_tokens, " must be in [1, ",
                    block_table.size(0) * s.block_size, "] (block table length x block size)");
  // The kernels compute in float32: check the values they will see, not the doubles passed in.
  const float scale_f = static_cast<float>(scale), cap_f = static_cast<float>(logit_cap);
  TORCH_CHECK_VALUE(std::isfinite(scale_f) && scale_f > 0, "sparse_attention: scale must be finite and > 0 in float32, got ",
                    scale);
  TORCH_CHECK_VALUE(logit_cap == 0 || (std::isfinite(cap_f) && cap_f > 0),
                    "sparse_attention: logit_cap must be 0 (off) or finite and > 0 in float32, got ", logit_cap);
  if (q.device().is_cpu()) {  // device tensors cannot be read without a sync: the kernel guards instead
    const at::Tensor qi = q_index.to(at::kLong).contiguous();  // a strided view must be read as such
    const int64_t* p = qi.data_ptr<int64_t>();
    for (int64_t i = 0; i < s.num_queries; ++i)
      TORCH_CHECK_INDEX(p[i] >= 0 && p[i] < num_kv_tokens, "sparse_attention: q_index[", i, "] = ", p[i],
                        " is outside [0, num_kv_tokens=", num_kv_tokens, ")");
    const at::Tensor bt = block_table.to(at::kLong).contiguous();
    const int64_t* b = bt.data_ptr<int64_t>();
    const int64_t used = (num_kv_tokens + s.block_size - 1) / s.block_size;
    for (int64_t i = 0; i < used; ++i)
      TORCH_CHECK_INDEX(b[i] >= 0 && b[i] < key_cache.size(0), "sparse_attention: block_table[", i, "] = ", b[i],
                        " is outside [0, ", key_cache.size(0), ")");
  }
  return s;
}

namespace {

constexpr int64_t kQueryTile = 64;  // queries per task: their G heads form the rows of a GEMM
constexpr int64_t kKeyChunk = 1024;  // keys gathered from the paged cache per step
constexpr float kInf = std::numeric_limits<float>::infinity();

// Which key chunks some query of the tile can see (causal, optional window): the chunks the
// task computes. Everything else is skipped: this is what makes the op block-sparse.
std::vector<int64_t> needed_chunks(const int64_t* rows_index, int64_t n, int64_t window) {
  const int64_t hi = *std::max_element(rows_index, rows_index + n);
  std::vector<char> need(hi / kKeyChunk + 1, window <= 0 ? 1 : 0);
  if (window > 0)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t lo = std::max<int64_t>(0, rows_index[i] - window + 1);
      for (int64_t c = lo / kKeyChunk; c <= rows_index[i] / kKeyChunk; ++c) need[c] = 1;
    }
  std::vector<int64_t> out;
  for (int64_t c = 0; c < static_cast<int64_t>(need.size()); ++c)
    if (need[c]) out.push_back(c);
  return out;
}

template <typename scalar_t>
void attend_cpu(const SparseAttentionShape& s, const at::Tensor& qf, const std::vector<int64_t>& qidx,
                const std::vector<int64_t>& order, const std::vector<int64_t>& table, const scalar_t* kc,
                const scalar_t* vc, float* out, float* lse) {
  const int64_t Hkv = s.num_kv_heads, G = s.num_q_heads / s.num_kv_heads, D = s.head_dim, bs = s.block_size;
  const int64_t tiles = (s.num_queries + kQueryTile - 1) / kQueryTile;
  const float scale = static_cast<float>(s.scale), cap = static_cast<float>(s.logit_cap);
  const float* q = qf.data_ptr<float>();
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::parallel_for(0, Hkv * tiles, 1, [&](int64_t begin, int64_t end) {
    at::Tensor Q = at::empty({kQueryTile * G, D}, f32), K = at::empty({kKeyChunk, D}, f32),
               V = at::empty({kKeyChunk, D}, f32), O = at::empty({kQueryTile * G, D}, f32);
    at::Tensor shift_buf = at::empty({kQueryTile * G}, f32), alpha_buf = at::empty({kQueryTile * G}, f32);
    std::vector<float> m(kQueryTile * G), l(kQueryTile * G);
    std::vector<int64_t> rows_index(kQueryTile);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % Hkv, t = task / Hkv;
      const int64_t first = t * kQueryTile, nq = std::min(kQueryTile, s.num_queries - first), rows = nq * G;
      float* Qp = Q.data_ptr<float>();
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t qi = order[first + i];
        rows_index[i] = qidx[qi];
        std::copy_n(q + (qi * s.num_q_heads + h * G) * D, G * D, Qp + i * G * D);
      }
      std::fill(m.begin(), m.end(), -kInf);
      std::fill(l.begin(), l.end(), 0.f);
      O.zero_();
      const at::Tensor Qrows = Q.narrow(0, 0, rows);
      for (int64_t c : needed_chunks(rows_index.data(), nq, s.window)) {
        const int64_t c0 = c * kKeyChunk, n = std::min(kKeyChunk, s.num_kv_tokens - c0);
        if (n <= 0) break;
        float* Kp = K.data_ptr<float>();
        float* Vp = V.data_ptr<float>();
        for (int64_t j = 0; j < n; ++j) {  // gather this head's rows from the paged cache
          const int64_t tok = c0 + j, off = ((table[tok / bs] * bs + tok % bs) * Hkv + h) * D;
          for (int64_t d = 0; d < D; ++d) {
            Kp[j * D + d] = static_cast<float>(kc[off + d]);
            Vp[j * D + d] = static_cast<float>(vc[off + d]);
          }
        }
        // Logits, then the softmax update, on whole [rows, n] tensors: ATen's vectorised
        // exp/tanh/amax/sum (scalar loops over every logit dominated small problems).
        at::Tensor S = Qrows.mm(K.narrow(0, 0, n).t());  // [rows, n]
        if (cap > 0) {
          S.mul_(scale / cap).tanh_().mul_(cap);
        } else {
          S.mul_(scale);
        }
        float* Sp = S.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r) {  // keys outside [lo, qi] are two contiguous runs
          const int64_t qi = rows_index[r / G];
          const int64_t lo = s.window > 0 ? qi - s.window + 1 : 0;
          const int64_t first = std::clamp<int64_t>(lo - c0, 0, n), last = std::clamp<int64_t>(qi - c0 + 1, 0, n);
          float* srow = Sp + r * n;
          std::fill(srow, srow + first, -kInf);
          std::fill(srow + std::max(first, last), srow + n, -kInf);
        }
        const at::Tensor chunk_max = S.amax(1);
        const float* cm = chunk_max.data_ptr<float>();
        float* shift = shift_buf.data_ptr<float>();
        float* alpha = alpha_buf.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r) {
          const float m_new = std::max(m[r], cm[r]);
          alpha[r] = m_new == -kInf ? 1.f : std::exp(m[r] - m_new);  // exp(-inf) = 0 on first sight
          shift[r] = m_new == -kInf ? 0.f : m_new;  // all-masked rows: exp(-inf - 0) = 0, not NaN
          m[r] = m_new;
        }
        S.sub_(shift_buf.narrow(0, 0, rows).unsqueeze(1)).exp_();  // P, unnormalised
        const at::Tensor row_sum = S.sum(1);
        const float* rs = row_sum.data_ptr<float>();
        float* Op = O.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r) {
          l[r] = l[r] * alpha[r] + rs[r];
          if (alpha[r] != 1.f)
            for (int64_t d = 0; d < D; ++d) Op[r * D + d] *= alpha[r];
        }
        O.narrow(0, 0, rows).addmm_(S, V.narrow(0, 0, n));  // O += P @ V
      }
      const float* Op = O.data_ptr<float>();
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t qi = order[first + i];
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g, head = h * G + g;
          const float inv = 1.f / l[r];
          float* dst = out + (qi * s.num_q_heads + head) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = Op[r * D + d] * inv;
          lse[qi * s.num_q_heads + head] = m[r] + std::log(l[r]);
        }
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sparse_attention_cpu(const at::Tensor& q, const at::Tensor& q_index,
                                                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                        const at::Tensor& block_table, int64_t num_kv_tokens,
                                                        double scale, int64_t window, double logit_cap) {
  const SparseAttentionShape s =
      plan_sparse_attention(q, q_index, key_cache, value_cache, block_table, num_kv_tokens, scale, window, logit_cap);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor out = at::empty({s.num_queries, s.num_q_heads, s.head_dim}, f32);
  at::Tensor lse = at::empty({s.num_queries, s.num_q_heads}, f32);
  if (s.num_queries > 0) {
    const at::Tensor qi = q_index.to(at::kLong).contiguous();
    std::vector<int64_t> qidx(qi.data_ptr<int64_t>(), qi.data_ptr<int64_t>() + s.num_queries);
    // Neighbouring queries share a tile, so a tile's chunk set stays tight.
    std::vector<int64_t> order(s.num_queries);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return qidx[a] < qidx[b]; });
    const at::Tensor bt = block_table.to(at::kLong).contiguous();
    std::vector<int64_t> table(bt.data_ptr<int64_t>(), bt.data_ptr<int64_t>() + bt.numel());
    const at::Tensor qf = q.to(at::kFloat).contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key_cache.scalar_type(), "sparse_attention_cpu", [&] {
      attend_cpu<scalar_t>(s, qf, qidx, order, table, key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                           out.data_ptr<float>(), lse.data_ptr<float>());
    });
  }
  return {out.to(q.scalar_type()), lse};
}

}  // namespace samcache::kernels
