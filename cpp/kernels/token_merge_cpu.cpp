#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "cpu_convert.h"
#include "token_merge.h"

namespace samcache::kernels {

void raise_token_merge_error(TokenMergeError code, int64_t index, double value, int64_t num_tokens) {
  switch (code) {
    case TokenMergeError::kTargetOutOfRange:
      TORCH_CHECK_INDEX(false, "token_merge: target[", index, "] = ", static_cast<int64_t>(value),
                        " is out of range for ", num_tokens, " tokens");
    case TokenMergeError::kTargetNotAnchor:
      TORCH_CHECK_VALUE(false, "token_merge: target[", index, "] = ", static_cast<int64_t>(value),
                        " is not an anchor (target[", static_cast<int64_t>(value), "] != ",
                        static_cast<int64_t>(value), ")");
    case TokenMergeError::kBadWeight:
      TORCH_CHECK_VALUE(false, "token_merge: weight[", index, "] = ", value,
                        " must be finite and >= 0");
    case TokenMergeError::kZeroWeightAnchor:
      TORCH_CHECK_VALUE(false, "token_merge: anchor ", index,
                        " has total weight 0 (itself and every token merged into it weigh 0)");
    default:
      TORCH_CHECK(false, "token_merge: unknown error code ", static_cast<int>(code));
  }
}

void check_token_merge_args(const at::Tensor& hidden, const at::Tensor& target, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(hidden.dim() == 2, "token_merge: hidden must be [N, D], got ", hidden.sizes());
  const auto dt = hidden.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
                   "token_merge: hidden must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong, "token_merge: target must be int64, got ",
                   target.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kFloat, "token_merge: weight must be float32, got ",
                   weight.scalar_type());
  const int64_t n = hidden.size(0);
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == n, "token_merge: target must be [", n, "], got ",
                    target.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == n, "token_merge: weight must be [", n, "], got ",
                    weight.sizes());
  TORCH_CHECK_VALUE(target.device() == hidden.device() && weight.device() == hidden.device(),
                    "token_merge: hidden, target and weight must be on one device, got ", hidden.device(), ", ",
                    target.device(), ", ", weight.device());
}

TokenMergePlan plan_token_merge(const at::Tensor& hidden, const at::Tensor& target, const at::Tensor& weight) {
  check_token_merge_args(hidden, target, weight);
  return plan_token_merge_values(target, weight);
}

TokenMergePlan plan_token_merge_values(const at::Tensor& target, const at::Tensor& weight) {
  TORCH_CHECK(target.device().is_cpu() && weight.device().is_cpu() && target.scalar_type() == at::kLong &&
                  weight.scalar_type() == at::kFloat && target.dim() == 1 && weight.sizes() == target.sizes(),
              "token_merge: plan_token_merge_values takes CPU int64 target and float32 weight of one length");
  const int64_t n = target.size(0);
  const at::Tensor tc = target.contiguous(), wc = weight.contiguous();
  const int64_t* t = tc.const_data_ptr<int64_t>();
  const float* w = wc.const_data_ptr<float>();
  // Each check runs over all tokens before the next, so the error names the first token of the
  // first kind of problem, exactly as the CUDA path reports it.
  for (int64_t i = 0; i < n; ++i)
    if (t[i] < 0 || t[i] >= n) raise_token_merge_error(TokenMergeError::kTargetOutOfRange, i, double(t[i]), n);
  for (int64_t i = 0; i < n; ++i)
    if (t[t[i]] != t[i]) raise_token_merge_error(TokenMergeError::kTargetNotAnchor, i, double(t[i]), n);
  for (int64_t i = 0; i < n; ++i)
    if (!(w[i] >= 0.0f) || std::isinf(w[i])) raise_token_merge_error(TokenMergeError::kBadWeight, i, w[i], n);

  TokenMergePlan plan;
  std::vector<int64_t> row_of(n, -1);
  for (int64_t i = 0; i < n; ++i)
    if (t[i] == i) {
      row_of[i] = static_cast<int64_t>(plan.kept.size());
      plan.kept.push_back(i);
    }
  const int64_t m = static_cast<int64_t>(plan.kept.size());
  // Counting sort by anchor row; filling in token order keeps each row's members ascending.
  plan.offsets.assign(m + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++plan.offsets[row_of[t[i]] + 1];
  for (int64_t r = 0; r < m; ++r) plan.offsets[r + 1] += plan.offsets[r];
  std::vector<int64_t> cursor(plan.offsets.begin(), plan.offsets.end() - 1);
  plan.members.resize(n);
  for (int64_t i = 0; i < n; ++i) plan.members[cursor[row_of[t[i]]]++] = i;
  plan.weight_sums.assign(m, 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    float sum = 0.0f;
    for (int64_t j = plan.offsets[r]; j < plan.offsets[r + 1]; ++j) sum += w[plan.members[j]];
    if (sum == 0.0f) raise_token_merge_error(TokenMergeError::kZeroWeightAnchor, plan.kept[r], 0.0, n);
    TORCH_CHECK_VALUE(std::isfinite(sum), "token_merge: the weights merged into token ", plan.kept[r],
                      " sum past the float32 range; scale the weights down");
    plan.weight_sums[r] = sum;
  }
  return plan;
}

namespace {

constexpr int64_t kChunk = 256;  // columns one task accumulates at once (stays in L1)

// The hot loop: acc += w * x over one chunk of a member row.
template <typename T>
SAMCACHE_AVX2_CLONE void accumulate(float* acc, const T* x, float w, int64_t len) {
  for (int64_t c = 0; c < len; ++c) acc[c] += w * to_float(x[c]);
}

template <typename T>
void merge_rows(const TokenMergePlan& plan, const T* hidden, int64_t row_stride, int64_t dim, const float* weight,
                T* out) {
  const int64_t m = static_cast<int64_t>(plan.kept.size());
  const int64_t chunks = (dim + kChunk - 1) / kChunk;
  const int64_t n = static_cast<int64_t>(plan.members.size());
  const int64_t work_per_job = std::max<int64_t>(1, n / std::max<int64_t>(1, m) * std::min(dim, kChunk));
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / work_per_job);
  at::parallel_for(0, m * chunks, grain, [&](int64_t begin, int64_t end) {
    float acc[kChunk];
    for (int64_t job = begin; job < end; ++job) {
      const int64_t r = job / chunks, c0 = job % chunks * kChunk;
      const int64_t len = std::min(kChunk, dim - c0);
      std::fill(acc, acc + len, 0.0f);
      for (int64_t j = plan.offsets[r]; j < plan.offsets[r + 1]; ++j) {
        const int64_t token = plan.members[j];
        const float w = weight[token];
        const T* x = hidden + token * row_stride + c0;
        accumulate(acc, x, w, len);
      }
      const float sum = plan.weight_sums[r];
      T* o = out + r * dim + c0;
      for (int64_t c = 0; c < len; ++c) o[c] = from_float<T>(acc[c] / sum);
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> token_merge_cpu(const at::Tensor& hidden, const at::Tensor& target,
                                                   const at::Tensor& weight) {
  const TokenMergePlan plan = plan_token_merge(hidden, target, weight);
  const int64_t m = static_cast<int64_t>(plan.kept.size()), dim = hidden.size(1);
  at::Tensor merged = at::empty({m, dim}, hidden.options());
  at::Tensor kept = at::empty({m}, target.options());
  std::copy(plan.kept.begin(), plan.kept.end(), kept.mutable_data_ptr<int64_t>());
  if (m == 0 || dim == 0) return {merged, kept};
  const at::Tensor h = hidden.stride(1) == 1 ? hidden : hidden.contiguous();
  const at::Tensor wc = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "token_merge_cpu", [&] {
    merge_rows<scalar_t>(plan, h.const_data_ptr<scalar_t>(), h.stride(0), dim, wc.const_data_ptr<float>(),
                         merged.mutable_data_ptr<scalar_t>());
  });
  return {merged, kept};
}

}  // namespace samcache::kernels
