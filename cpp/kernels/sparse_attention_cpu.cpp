// CPU sparse_attention over a batch of sequences.
//
// Work is split into tasks of one sequence x one KV head x a tile of that sequence's query rows
// (sorted by position, so a tile's key range stays tight), run by at::parallel_for. Two paths:
//
// - GEMM path (many rows: prefill, recompute): each key chunk of the sequence is gathered from the
//   paged cache into a transposed K buffer and a V buffer (float), then S = Q K^T and O += P V are
//   ATen's cpublas::brgemm calls (oneDNN's JIT micro-kernels where the CPU has them: AVX-512 runs
//   at ~2x MKL's sgemm rate on AMD), with a flash-style online softmax between them.
// - Direct path (a few rows: decode): no gather; one task per sequence, every head: each token's
//   K and V rows (all KV heads) are read once, in order and prefetched, and dotted with every row.
//
// Softmax, dot products and row updates are written with GCC vector extensions in functions
// compiled three times (target_clones: AVX-512, AVX2+FMA, baseline) and picked at load time.
// Only key chunks some row of a task can see (causal, window) are touched.
#include "sparse_attention.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "cpu_convert.h"
#include "index_tensors.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SAMCACHE_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SAMCACHE_SIMD_CLONES
#endif
// The vector helpers are always inlined into the cloned callers, so each clone computes them with
// its own ISA (a helper GCC chose not to inline would run at the extension's SSE2 baseline).
#define SAMCACHE_VEC inline __attribute__((always_inline))

namespace samcache::kernels {

namespace {

void check_index_tensor(const at::Tensor& t, const char* name, int64_t size) {
  TORCH_CHECK_VALUE(t.dim() == 1 && is_index_dtype(t), "sparse_attention: ", name,
                    " must be a 1-D int32/int64 tensor, got ", t.scalar_type(), " ", t.sizes());
  if (size >= 0)
    TORCH_CHECK_VALUE(t.size(0) == size, "sparse_attention: ", name, " must have ", size, " entries, got ", t.size(0));
}

}  // namespace

SparseAttentionPlan plan_sparse_attention(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& qo_indptr,
                                          const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                                          const at::Tensor& kv_last_page_len, const at::Tensor& key_cache,
                                          const at::Tensor& value_cache, double scale, double logit_cap,
                                          int64_t max_kv_len) {
  TORCH_CHECK_VALUE(q.dim() == 3, "sparse_attention: q must be [num_rows, num_q_heads, head_dim], got ", q.sizes());
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
  for (const at::Tensor* t : {&q_pos, &qo_indptr, &kv_indptr, &kv_indices, &kv_last_page_len, &key_cache, &value_cache})
    TORCH_CHECK_VALUE(t->device() == q.device(), "sparse_attention: all tensors must be on q's device ", q.device(),
                      ", got one on ", t->device());
  TORCH_CHECK_VALUE(key_cache.is_contiguous() && value_cache.is_contiguous(), "sparse_attention: caches must be contiguous");
  check_index_tensor(qo_indptr, "qo_indptr", -1);
  TORCH_CHECK_VALUE(qo_indptr.size(0) >= 1, "sparse_attention: qo_indptr needs num_seqs + 1 >= 1 entries");
  const int64_t B = qo_indptr.size(0) - 1;
  TORCH_CHECK_VALUE(B >= 1 || q.size(0) == 0, "sparse_attention: ", q.size(0), " query rows but no sequences");
  check_index_tensor(q_pos, "q_pos", q.size(0));
  check_index_tensor(kv_indptr, "kv_indptr", B + 1);
  check_index_tensor(kv_last_page_len, "kv_last_page_len", B);
  check_index_tensor(kv_indices, "kv_indices", -1);
  SparseAttentionPlan s{};
  s.num_rows = q.size(0);
  s.num_seqs = B;
  s.num_q_heads = q.size(1);
  s.num_kv_heads = key_cache.size(2);
  s.head_dim = key_cache.size(3);
  s.block_size = key_cache.size(1);
  s.num_cache_blocks = key_cache.size(0);
  TORCH_CHECK_VALUE(q.size(2) == s.head_dim, "sparse_attention: q head_dim ", q.size(2), " != cache head_dim ", s.head_dim);
  TORCH_CHECK_VALUE(s.num_kv_heads > 0 && s.num_q_heads % s.num_kv_heads == 0, "sparse_attention: num_q_heads ",
                    s.num_q_heads, " must be a multiple of num_kv_heads ", s.num_kv_heads);
  TORCH_CHECK_VALUE(s.block_size > 0, "sparse_attention: block_size must be > 0");
  // The kernels compute in float32: check the values they will see, not the doubles passed in.
  const float scale_f = static_cast<float>(scale), cap_f = static_cast<float>(logit_cap);
  TORCH_CHECK_VALUE(std::isfinite(scale_f) && scale_f > 0, "sparse_attention: scale must be finite and > 0 in float32, got ",
                    scale);
  TORCH_CHECK_VALUE(logit_cap == 0 || (std::isfinite(cap_f) && cap_f > 0),
                    "sparse_attention: logit_cap must be 0 (off) or finite and > 0 in float32, got ", logit_cap);
  if (!q.device().is_cpu()) {  // device tensors cannot be read without a sync: the kernel guards instead
    TORCH_CHECK_VALUE(max_kv_len >= 1 || s.num_rows == 0,
                      "sparse_attention: on a GPU pass max_kv_len (the longest sequence), got ", max_kv_len);
    return s;
  }
  SparseAttentionHostMetadata& h = s.host;
  h.qo_indptr = read_indices(qo_indptr);
  h.kv_indptr = read_indices(kv_indptr);
  h.kv_last_page_len = read_indices(kv_last_page_len);
  h.q_pos = read_indices(q_pos);
  h.kv_indices = read_indices(kv_indices);
  const std::vector<int64_t>&qo = h.qo_indptr, &kvp = h.kv_indptr, &last = h.kv_last_page_len, &pos = h.q_pos,
                        &pages = h.kv_indices;
  TORCH_CHECK_VALUE(qo[0] == 0 && qo[B] == s.num_rows, "sparse_attention: qo_indptr must run from 0 to num_rows=",
                    s.num_rows, ", got ", qo[0], " .. ", qo[B]);
  TORCH_CHECK_VALUE(kvp[0] == 0 && kvp[B] <= static_cast<int64_t>(pages.size()),
                    "sparse_attention: kv_indptr must start at 0 and end within kv_indices (", pages.size(), "), got ",
                    kvp[0], " .. ", kvp[B]);
  for (int64_t b = 0; b < B; ++b)  // all of them before any range is read
    TORCH_CHECK_VALUE(qo[b + 1] >= qo[b] && kvp[b + 1] >= kvp[b], "sparse_attention: qo_indptr and kv_indptr must not ",
                      "decrease (sequence ", b, ")");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t num_pages = kvp[b + 1] - kvp[b];
    if (num_pages == 0) {
      TORCH_CHECK_VALUE(qo[b + 1] == qo[b], "sparse_attention: sequence ", b, " has query rows but no KV pages");
      continue;
    }
    TORCH_CHECK_VALUE(last[b] >= 1 && last[b] <= s.block_size, "sparse_attention: kv_last_page_len[", b, "] = ", last[b],
                      " must be in [1, block_size=", s.block_size, "]");
    const int64_t kv_len = (num_pages - 1) * s.block_size + last[b];
    for (int64_t i = qo[b]; i < qo[b + 1]; ++i)
      TORCH_CHECK_INDEX(pos[i] >= 0 && pos[i] < kv_len, "sparse_attention: q_pos[", i, "] = ", pos[i],
                        " is outside sequence ", b, "'s ", kv_len, " KV tokens");
    for (int64_t p = kvp[b]; p < kvp[b + 1]; ++p)
      TORCH_CHECK_INDEX(pages[p] >= 0 && pages[p] < s.num_cache_blocks, "sparse_attention: kv_indices[", p, "] = ",
                        pages[p], " is outside the cache's ", s.num_cache_blocks, " blocks");
  }
  return s;
}

namespace {

constexpr int64_t kKeyChunk = 256;     // keys per step (S buffer: rows x 256 floats)
constexpr int64_t kGemmRows = 256;     // (query, head) rows per GEMM tile
constexpr int64_t kTaskTiles = 8;      // tiles per GEMM task (they share each gathered key chunk)
constexpr int64_t kRowAlign = 16;      // GEMM rows and key columns padded to multiples of these, so
constexpr int64_t kKeyAlign = 32;      // brgemm sees few distinct shapes (each is JIT-compiled once)
constexpr int64_t kDirectRows = 32;    // up to this many (query, head) rows per sequence: direct path
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- SIMD building blocks (GCC vector extensions; the callers are target_clones) -----------
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
constexpr int64_t kW = 16;

SAMCACHE_VEC vf16 load(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
SAMCACHE_VEC void store(float* p, vf16 v) { std::memcpy(p, &v, sizeof v); }
SAMCACHE_VEC vf16 splat(float x) { return vf16{} + x; }
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
SAMCACHE_VEC float hmax(vf16 v) {
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf8 c = a > b ? a : b;
  const vf4 d = __builtin_shufflevector(c, c, 0, 1, 2, 3), e = __builtin_shufflevector(c, c, 4, 5, 6, 7);
  const vf4 f = d > e ? d : e;
  return std::max(std::max(f[0], f[1]), std::max(f[2], f[3]));
}
SAMCACHE_VEC float hsum(vf16 v) {  // a tree: four vector adds instead of fifteen dependent scalar ones
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[1]) + (b[2] + b[3]);
}

// exp(x) for x <= 0 (Cephes' expf: 2^k * p(r), |rel err| ~ 1e-7); x < -87.3 (and -inf) -> 0.
SAMCACHE_VEC vf16 vexp(vf16 x) {
  const vi16 underflow = x < splat(-87.3f);
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  const vf16 shifted = x * splat(1.44269504088896341f) + splat(12582912.0f);  // round to nearest
  const vf16 k = shifted - splat(12582912.0f);
  const vf16 r = x - k * splat(0.693359375f) - k * splat(-2.12194440e-4f);
  vf16 y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * r * r + r + splat(1.0f);
  vi16 ki;
  std::memcpy(&ki, &shifted, sizeof ki);
  const vi16 bits = ((ki - 0x4b400000) + 127) << 23;
  vf16 pow2;
  std::memcpy(&pow2, &bits, sizeof pow2);
  const vf16 out = y * pow2;
  return underflow ? splat(0.f) : out;
}

SAMCACHE_VEC float row_max(const float* s, int64_t n) {
  vf16 m = splat(-kInf);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const vf16 v = load(s + j);
    m = v > m ? v : m;
  }
  float r = hmax(m);
  for (; j < n; ++j) r = std::max(r, s[j]);
  return r;
}

// s[j] = exp(s[j] - shift); returns the sum.
SAMCACHE_VEC float exp_sum(float* s, int64_t n, float shift) {
  vf16 acc = splat(0.f);
  const vf16 sh = splat(shift);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const vf16 e = vexp(load(s + j) - sh);
    store(s + j, e);
    acc += e;
  }
  float sum = hsum(acc);
  for (; j < n; ++j) {
    s[j] = s[j] == -kInf ? 0.f : std::exp(s[j] - shift);
    sum += s[j];
  }
  return sum;
}

SAMCACHE_VEC void scale_row(float* o, int64_t d, float a) {
  int64_t i = 0;
  for (; i + kW <= d; i += kW) store(o + i, load(o + i) * splat(a));
  for (; i < d; ++i) o[i] *= a;
}

SAMCACHE_VEC float dot(const float* a, const float* b, int64_t d) {
  vf16 acc = splat(0.f);
  int64_t i = 0;
  for (; i + kW <= d; i += kW) acc += load(a + i) * load(b + i);
  float s = hsum(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

SAMCACHE_VEC void axpy(float* o, float p, const float* v, int64_t d) {
  int64_t i = 0;
  const vf16 pv = splat(p);
  for (; i + kW <= d; i += kW) store(o + i, load(o + i) + pv * load(v + i));
  for (; i < d; ++i) o[i] += p * v[i];
}

// ---- the batch: sequences, rows in position order, tasks -----------------------------------
struct Batch {
  int64_t G, D, Hq, Hkv, bs, window;
  float scale, cap;
  std::vector<int64_t> qo, kvp, pages, pos;
  std::vector<int64_t> order;  // row ids, each sequence's rows sorted by position
  // off[j] = element offset of token c0 + j of sequence b (KV head 0) in a cache, for j < n, one division per block instead of one per token (an
  // integer division by a runtime block size costs more than a token's dot products).
  void row_offsets(int64_t b, int64_t c0, int64_t n, int64_t* off) const {
    const int64_t row = Hkv * D;
    for (int64_t j = 0; j < n;) {
      const int64_t tok = c0 + j, block = tok / bs, in_block = tok - block * bs;
      const int64_t run = std::min(bs - in_block, n - j);
      const int64_t base = (pages[kvp[b] + block] * bs + in_block) * row;
      for (int64_t u = 0; u < run; ++u) off[j + u] = base + u * row;
      j += run;
    }
  }
};

struct Task {
  int64_t seq, head, first, count;  // rows order[first .. first + count) of sequence seq; KV head (GEMM path)
  bool direct;
};

// Queries per GEMM tile: about kGemmRows (query, head) rows.
inline int64_t gemm_tile_queries(int64_t G) { return std::max<int64_t>(1, kGemmRows / G); }

// Rows of a GEMM task's buffers: its tiles, each padded to kRowAlign.
inline int64_t gemm_task_rows(int64_t G) {
  return kTaskTiles * ((gemm_tile_queries(G) * G + kRowAlign - 1) / kRowAlign * kRowAlign);
}

// Per-thread work buffers.
struct Scratch {
  std::vector<float> q, kt, v, s, o, m, l, row;
  std::vector<int64_t> offsets = std::vector<int64_t>(kKeyChunk);  // a chunk's token rows (Batch::row_offsets)
  Scratch(int64_t D, int64_t Hkv, int64_t G) : kt(D * kKeyChunk), v(kKeyChunk * D), row(Hkv * D) {
    const int64_t rows = std::max(gemm_task_rows(G), kDirectRows);
    q.resize(rows * D);
    s.resize(std::max(gemm_tile_queries(G) * G + kRowAlign, kDirectRows) * kKeyChunk);
    o.resize(rows * D);
    m.resize(rows);
    l.resize(rows);
  }
};

// Keys [lo, hi] some row of the task sees, and the mask of row r within a chunk [c0, c0 + n).
struct KeyRange {
  int64_t lo, hi;
};

KeyRange task_range(const Batch& bt, const Task& t) {
  const int64_t pmin = bt.pos[bt.order[t.first]], pmax = bt.pos[bt.order[t.first + t.count - 1]];
  return {bt.window > 0 ? std::max<int64_t>(0, pmin - bt.window + 1) : 0, pmax};
}

// Masks keys outside row r's range [pos - window + 1, pos] (and the padding columns n .. width),
// applies the logit cap, and runs the online-softmax update of that row: row r's logits,
// s[r * ld .. + width), become its probabilities.
SAMCACHE_SIMD_CLONES
void softmax_rows(const Batch& bt, const Task& t, int64_t c0, int64_t n, int64_t width, int64_t ld, float* s, float* o,
                  float* m, float* l) {
  const int64_t per_query = t.direct ? bt.Hq : bt.G;  // (query, head) rows: all heads, or one KV head's
  const int64_t rows = t.count * per_query;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t p = bt.pos[bt.order[t.first + r / per_query]];
    float* sr = s + r * ld;
    const int64_t first = bt.window > 0 ? std::clamp<int64_t>(p - bt.window + 1 - c0, 0, n) : 0;
    const int64_t last = std::clamp<int64_t>(p - c0 + 1, 0, n);
    if (bt.cap > 0)
      for (int64_t j = first; j < last; ++j) sr[j] = bt.cap * std::tanh(sr[j] / bt.cap);
    std::fill(sr, sr + first, -kInf);
    std::fill(sr + std::max(first, last), sr + width, -kInf);
    if (last <= first) {  // nothing visible in this chunk
      std::fill(sr, sr + width, 0.f);
      continue;
    }
    const float m_new = std::max(m[r], row_max(sr + first, last - first));
    const float alpha = m[r] == -kInf ? 0.f : std::exp(m[r] - m_new);
    const float sum = exp_sum(sr, width, m_new);
    l[r] = l[r] * alpha + sum;
    m[r] = m_new;
    if (alpha != 1.f) scale_row(o + r * bt.D, bt.D, alpha);
  }
}

// Gathers keys [c0, c0 + n) of (seq, head) as float: K transposed into kt [D x kKeyChunk] and V
// into v [np x D], the columns / rows from n to np zeroed.
template <typename T>
SAMCACHE_SIMD_CLONES void gather_chunk(const Batch& bt, const Task& t, const T* kc, const T* vc, int64_t c0, int64_t n,
                                       int64_t np, float* kt, float* v, int64_t* off) {
  const int64_t D = bt.D;
  bt.row_offsets(t.seq, c0, n, off);
  float tile[kW * 256];  // up to 16 keys x head_dim 256, then transposed into kt
  for (int64_t j0 = 0; j0 < np; j0 += kW) {
    const int64_t w = std::min(kW, np - j0);
    for (int64_t j = 0; j < w; ++j) {
      float* trow = tile + j * D;
      float* vrow = v + (j0 + j) * D;
      if (j0 + j < n) {
        const int64_t o = off[j0 + j] + t.head * D;
        for (int64_t d = 0; d < D; ++d) {
          trow[d] = to_float(kc[o + d]);
          vrow[d] = to_float(vc[o + d]);
        }
      } else {
        std::fill(trow, trow + D, 0.f);
        std::fill(vrow, vrow + D, 0.f);
      }
    }
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = 0; j < w; ++j) kt[d * kKeyChunk + j0 + j] = tile[j * D + d];
  }
}

// A task's queries in tiles of up to kGemmRows (query, head) rows; each key chunk is gathered
// once per task and used by every tile that sees it, so K and V are read once per (sequence, KV
// head, task), not once per tile. Tiles keep their own online-softmax state across chunks. In
// the Q / O / m / l buffers each tile starts at a multiple of kRowAlign rows, so a tile's
// padding rows (brgemm computes whole kRowAlign groups) never overlap the next tile.
template <typename T>
void gemm_task(const Batch& bt, const Task& t, const float* qf, const T* kc, const T* vc, Scratch& sc, float* out,
               float* lse) {
  const int64_t D = bt.D, G = bt.G;
  const int64_t tile = gemm_tile_queries(G), padded = (tile * G + kRowAlign - 1) / kRowAlign * kRowAlign;
  const int64_t tiles = (t.count + tile - 1) / tile;
  auto slot = [&](int64_t i) { return (i / tile) * padded + (i % tile) * G; };  // buffer row of query i, g = 0
  float* Q = sc.q.data();
  std::fill(Q, Q + tiles * padded * D, 0.f);
  std::fill(sc.o.begin(), sc.o.begin() + tiles * padded * D, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + tiles * padded, -kInf);
  std::fill(sc.l.begin(), sc.l.begin() + tiles * padded, 0.f);
  for (int64_t i = 0; i < t.count; ++i) {  // query i, head head * G + g (pre-scaled)
    const float* src = qf + (bt.order[t.first + i] * bt.Hq + t.head * G) * D;
    float* dst = Q + slot(i) * D;
    for (int64_t x = 0; x < G * D; ++x) dst[x] = src[x] * bt.scale;
  }
  const KeyRange range = task_range(bt, t);
  for (int64_t c0 = range.lo / kKeyChunk * kKeyChunk; c0 <= range.hi; c0 += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, range.hi + 1 - c0);
    const int64_t np = (n + kKeyAlign - 1) / kKeyAlign * kKeyAlign;
    gather_chunk(bt, t, kc, vc, c0, n, np, sc.kt.data(), sc.v.data(), sc.offsets.data());
    for (int64_t q0 = 0; q0 < t.count; q0 += tile) {
      const Task sub{t.seq, t.head, t.first + q0, std::min(tile, t.count - q0), false};
      const KeyRange seen = task_range(bt, sub);
      if (seen.hi < c0 || seen.lo >= c0 + n) continue;  // this tile sees none of the chunk
      const int64_t tn = std::min(n, seen.hi + 1 - c0), tnp = (tn + kKeyAlign - 1) / kKeyAlign * kKeyAlign;
      const int64_t r0 = slot(q0), mp = (sub.count * G + kRowAlign - 1) / kRowAlign * kRowAlign;
      at::native::cpublas::brgemm(mp, tnp, D, D, kKeyChunk, kKeyChunk, false, Q + r0 * D, sc.kt.data(), sc.s.data(),
                                  false);
      softmax_rows(bt, sub, c0, tn, tnp, kKeyChunk, sc.s.data(), sc.o.data() + r0 * D, sc.m.data() + r0,
                   sc.l.data() + r0);
      at::native::cpublas::brgemm(mp, D, tnp, kKeyChunk, D, D, true, sc.s.data(), sc.v.data(), sc.o.data() + r0 * D,
                                  false);
    }
  }
  for (int64_t i = 0; i < t.count; ++i) {
    const int64_t row = bt.order[t.first + i];
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = slot(i) + g, head = t.head * G + g;
      const float inv = 1.f / sc.l[r];
      float* dst = out + (row * bt.Hq + head) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = sc.o[r * D + d] * inv;
      lse[row * bt.Hq + head] = sc.m[r] + std::log(sc.l[r]);
    }
  }
}

// Prefetches the cache lines of one token's row (every KV head) ahead of its use: pages are
// scattered, so the hardware prefetcher loses the stream at every block boundary.
template <typename T>
SAMCACHE_VEC void prefetch_row(const T* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 0);
}

template <typename T>
SAMCACHE_VEC const float* as_float(const T* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t d = 0; d < n; ++d) buf[d] = to_float(src[d]);
    return buf;
  }
}

// One pass of a direct task over a chunk's n tokens, for rows [r0, r0 + R) held in registers (NV
// vectors of 16 floats per head row). K pass (kValues false): the rows are queries X, and
// S[row][j] = q . k_j. V pass: the rows are outputs X, and X[row] += S[row][j] v_j. The first group
// of a chunk reads the tokens' rows from memory (prefetched ahead); later groups find them in L2.
template <bool kValues, int R, int NV>
SAMCACHE_VEC void pass_rows(float* S, float* X, const float* cache, int64_t n, int64_t r0, int64_t Hq, int64_t G,
                            const int64_t* off, int64_t row_bytes, bool prefetch) {
  constexpr int64_t kAhead = 16, D = NV * kW;
  vf16 x[R][NV];
  int64_t head[R];
  for (int r = 0; r < R; ++r) {
    head[r] = ((r0 + r) % Hq) / G * D;
    for (int i = 0; i < NV; ++i) x[r][i] = load(X + (r0 + r) * D + i * kW);
  }
  for (int64_t j = 0; j < n; ++j) {
    if (prefetch && j + kAhead < n) prefetch_row(cache + off[j + kAhead], row_bytes);
    const float* row = cache + off[j];
    for (int r = 0; r < R; ++r) {
      if constexpr (kValues) {
        const vf16 pj = splat(S[(r0 + r) * kKeyChunk + j]);
        for (int i = 0; i < NV; ++i) x[r][i] += pj * load(row + head[r] + i * kW);
      } else {
        vf16 acc = x[r][0] * load(row + head[r]);
        for (int i = 1; i < NV; ++i) acc += x[r][i] * load(row + head[r] + i * kW);
        S[(r0 + r) * kKeyChunk + j] = hsum(acc);
      }
    }
  }
  if constexpr (kValues)
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NV; ++i) store(X + (r0 + r) * D + i * kW, x[r][i]);
}

// A pass over every row of a direct task, in groups of R rows (R x NV registers).
template <bool kValues, int NV>
SAMCACHE_VEC void pass_in_groups(float* S, float* X, const float* cache, int64_t n, int64_t rows, int64_t Hq,
                                 int64_t G, const int64_t* off, int64_t row_bytes) {
  constexpr int R = NV <= 4 ? 4 : 2;
  int64_t r0 = 0;
  for (; r0 + R <= rows; r0 += R) pass_rows<kValues, R, NV>(S, X, cache, n, r0, Hq, G, off, row_bytes, r0 == 0);
  for (; r0 < rows; ++r0) pass_rows<kValues, 1, NV>(S, X, cache, n, r0, Hq, G, off, row_bytes, r0 == 0);
}

// The register-held pass for the head dims that have one (float caches, D = 32, 64 or 128).
template <bool kValues>
SAMCACHE_VEC void pass_by_head_dim(int64_t D, float* S, float* X, const float* cache, int64_t n, int64_t rows,
                                   int64_t Hq, int64_t G, const int64_t* off, int64_t row_bytes) {
  if (D == 32) pass_in_groups<kValues, 2>(S, X, cache, n, rows, Hq, G, off, row_bytes);
  else if (D == 64) pass_in_groups<kValues, 4>(S, X, cache, n, rows, Hq, G, off, row_bytes);
  else pass_in_groups<kValues, 8>(S, X, cache, n, rows, Hq, G, off, row_bytes);
}

// One sequence, every query head at once: each token's K and V rows (all KV heads, contiguous)
// are read once, in order, prefetched a few tokens ahead, and dotted with every row.
template <typename T>
SAMCACHE_SIMD_CLONES void direct_task(const Batch& bt, const Task& t, const float* qf, const T* kc, const T* vc,
                                      Scratch& sc, float* out, float* lse) {
  constexpr int64_t kAhead = 32;  // tokens prefetched ahead
  const int64_t D = bt.D, Hq = bt.Hq, G = bt.G, rows = t.count * Hq, row_elems = bt.Hkv * D;
  float* Q = sc.q.data();
  for (int64_t i = 0; i < t.count; ++i) {
    const float* src = qf + bt.order[t.first + i] * Hq * D;
    for (int64_t x = 0; x < Hq * D; ++x) Q[i * Hq * D + x] = src[x] * bt.scale;
  }
  float* O = sc.o.data();
  std::fill(O, O + rows * D, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + rows, -kInf);
  std::fill(sc.l.begin(), sc.l.begin() + rows, 0.f);
  float* S = sc.s.data();
  float* buf = sc.row.data();
  const KeyRange range = task_range(bt, t);
  for (int64_t c0 = range.lo / kKeyChunk * kKeyChunk; c0 <= range.hi; c0 += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, range.hi + 1 - c0);
    int64_t* off = sc.offsets.data();
    bt.row_offsets(t.seq, c0, n, off);
    const bool fast = std::is_same_v<T, float> && (D == 32 || D == 64 || D == 128);
    const int64_t row_bytes = row_elems * static_cast<int64_t>(sizeof(T));
    if (fast) {
      pass_by_head_dim<false>(D, S, Q, reinterpret_cast<const float*>(kc), n, rows, Hq, G, off, row_bytes);
    } else {
      for (int64_t j = 0; j < n; ++j) {
        if (j + kAhead < n) prefetch_row(kc + off[j + kAhead], row_elems * sizeof(T));
        const float* k = as_float(kc + off[j], row_elems, buf);
        for (int64_t r = 0; r < rows; ++r) S[r * kKeyChunk + j] = dot(Q + r * D, k + (r % Hq) / G * D, D);
      }
    }
    softmax_rows(bt, t, c0, n, n, kKeyChunk, S, O, sc.m.data(), sc.l.data());
    if (fast) {
      pass_by_head_dim<true>(D, S, O, reinterpret_cast<const float*>(vc), n, rows, Hq, G, off, row_bytes);
      continue;
    }
    for (int64_t j = 0; j < n; ++j) {
      if (j + kAhead < n) prefetch_row(vc + off[j + kAhead], row_elems * sizeof(T));
      const float* v = as_float(vc + off[j], row_elems, buf);
      for (int64_t r = 0; r < rows; ++r) {
        const float p = S[r * kKeyChunk + j];
        if (p != 0.f) axpy(O + r * D, p, v + (r % Hq) / G * D, D);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = bt.order[t.first + r / Hq], head = r % Hq;
    const float inv = 1.f / sc.l[r];
    float* dst = out + (row * Hq + head) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = O[r * D + d] * inv;
    lse[row * Hq + head] = sc.m[r] + std::log(sc.l[r]);
  }
}

}  // namespace

void sparse_attention_check(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& qo_indptr,
                            const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                            const at::Tensor& key_cache, const at::Tensor& value_cache, double scale, double logit_cap,
                            int64_t max_kv_len) {
  plan_sparse_attention(q, q_pos, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, key_cache, value_cache, scale,
                        logit_cap, max_kv_len);
}

std::tuple<at::Tensor, at::Tensor> sparse_attention_cpu(const at::Tensor& q, const at::Tensor& q_pos,
                                                        const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
                                                        const at::Tensor& kv_indices,
                                                        const at::Tensor& kv_last_page_len,
                                                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                        double scale, int64_t window, double logit_cap,
                                                        int64_t max_kv_len) {
  SparseAttentionPlan s = plan_sparse_attention(q, q_pos, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                                key_cache, value_cache, scale, logit_cap, max_kv_len);
  TORCH_CHECK_VALUE(s.head_dim <= 256, "sparse_attention on the CPU supports head_dim up to 256, got ", s.head_dim);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor out = at::empty({s.num_rows, s.num_q_heads, s.head_dim}, f32);
  at::Tensor lse = at::empty({s.num_rows, s.num_q_heads}, f32);
  if (s.num_rows == 0 || s.num_q_heads == 0) return {out.to(q.scalar_type()), lse};

  Batch bt;
  bt.Hq = s.num_q_heads;
  bt.Hkv = s.num_kv_heads;
  bt.G = s.num_q_heads / s.num_kv_heads;
  bt.D = s.head_dim;
  bt.bs = s.block_size;
  bt.window = window;
  bt.scale = static_cast<float>(scale);
  bt.cap = static_cast<float>(logit_cap);
  bt.qo = std::move(s.host.qo_indptr);
  bt.kvp = std::move(s.host.kv_indptr);
  bt.pages = std::move(s.host.kv_indices);
  bt.pos = std::move(s.host.q_pos);
  bt.order.resize(s.num_rows);
  std::vector<Task> tasks;
  // GEMM tasks: up to kTaskTiles tiles of one (sequence, KV head), so a long prompt still splits
  // into several tasks for the threads while each key chunk serves many tiles.
  const int64_t task_queries = kTaskTiles * gemm_tile_queries(bt.G);
  for (int64_t b = 0; b < s.num_seqs; ++b) {
    const int64_t lo = bt.qo[b], hi = bt.qo[b + 1];
    if (hi == lo) continue;
    std::iota(bt.order.begin() + lo, bt.order.begin() + hi, lo);
    std::stable_sort(bt.order.begin() + lo, bt.order.begin() + hi,
                     [&](int64_t a, int64_t c) { return bt.pos[a] < bt.pos[c]; });
    if ((hi - lo) * bt.Hq <= kDirectRows) {  // few rows (decode): one task, every head
      tasks.push_back({b, 0, lo, hi - lo, true});
      continue;
    }
    for (int64_t h = 0; h < bt.Hkv; ++h)
      for (int64_t first = lo; first < hi; first += task_queries)
        tasks.push_back({b, h, first, std::min(task_queries, hi - first), false});
  }
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key_cache.scalar_type(), "sparse_attention_cpu", [&] {
    const scalar_t* kc = key_cache.data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      Scratch sc(bt.D, bt.Hkv, bt.G);
      for (int64_t i = begin; i < end; ++i) {
        const Task& t = tasks[i];
        if (t.direct)
          direct_task(bt, t, qf.data_ptr<float>(), kc, vc, sc, out.data_ptr<float>(), lse.data_ptr<float>());
        else
          gemm_task(bt, t, qf.data_ptr<float>(), kc, vc, sc, out.data_ptr<float>(), lse.data_ptr<float>());
      }
    });
  });
  return {out.to(q.scalar_type()), lse};
}

}  // namespace samcache::kernels
