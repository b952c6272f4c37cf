// token_merge: visual-token compression by weighted averaging of every token into its anchor.
// Shared by the CPU and CUDA implementations.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace samcache::kernels {

// What a bad merge plan can get wrong, in the order the checks run; a CUDA kernel reports the same
// codes (cuda/token_merge.cuh), so both devices raise the same error for the same input.
enum class TokenMergeError : int {
  kNone = 0,
  kTargetOutOfRange = 1,   // IndexError
  kTargetNotAnchor = 2,    // target[i] = j with target[j] != j
  kBadWeight = 3,          // negative, NaN or infinite weight
  kZeroWeightAnchor = 4,   // all of an anchor's members (itself included) have weight 0
};

// Raises the error of `code` for token (or anchor) `index`; `value` is target[index] or weight[index].
[[noreturn]] void raise_token_merge_error(TokenMergeError code, int64_t index, double value, int64_t num_tokens);

// Shape, dtype and device checks that need no data: hidden [N, D] float32/16/bf16, target int64
// [N], weight float32 [N], all on one device.
void check_token_merge_args(const at::Tensor& hidden, const at::Tensor& target, const at::Tensor& weight);

// The grouping of a validated CPU plan: anchors ascending, members of each anchor ascending (CSR).
struct TokenMergePlan {
  std::vector<int64_t> kept;         // [M] anchors' original indices, ascending
  std::vector<int64_t> offsets;      // [M + 1] member range of row r: members[offsets[r], offsets[r+1])
  std::vector<int64_t> members;      // [N] token indices grouped by anchor row
  std::vector<float> weight_sums;    // [M] sum of the members' weights, float32 in member order
};

// All checks, then the grouping. CPU tensors only.
TokenMergePlan plan_token_merge(const at::Tensor& hidden, const at::Tensor& target, const at::Tensor& weight);
// The value checks and the grouping alone, for CPU target (int64 [N]) and weight (float32 [N])
// whose shapes and dtypes are already checked: the CUDA path runs it on host copies when its
// device validation finds a problem, so both devices raise the very same error.
TokenMergePlan plan_token_merge_values(const at::Tensor& target, const at::Tensor& weight);

std::tuple<at::Tensor, at::Tensor> token_merge_cpu(const at::Tensor& hidden, const at::Tensor& target,
                                                   const at::Tensor& weight);
#ifdef SAMCACHE_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> token_merge_cuda(const at::Tensor& hidden, const at::Tensor& target,
                                                    const at::Tensor& weight);
#endif

}  // namespace samcache::kernels
