// Raw-pointer launchers of cuda/token_merge.cu (no torch types: the .cu compiles alone with nvcc).
// The torch-facing wrapper, which sorts and synchronises in between, is cpp/kernels/token_merge_cuda.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace samcache::cuda {

enum TokenMergeDtype : int { kMergeFloat32 = 0, kMergeFloat16 = 1, kMergeBFloat16 = 2 };

// Error key of the first problem: (code << kTokenMergeCodeShift) | token index, codes as in
// kernels::TokenMergeError; kTokenMergeNoError when the plan is valid.
constexpr int kTokenMergeCodeShift = 40;
constexpr unsigned long long kTokenMergeNoError = ~0ull;

// Validates target [n] / weight [n] and counts anchors, without a host round trip.
// Writes anchor_flag[i] = (target[i] == i) and status = {number of anchors, smallest error key};
// `has_weight` [n] must be zeroed by the caller (it marks anchors with a member of weight > 0).
cudaError_t token_merge_validate(const int64_t* target, const float* weight, int64_t n, int32_t* anchor_flag,
                                 int32_t* has_weight, unsigned long long* status, cudaStream_t stream);

// After the host has read a clean status: the fused reduce + normalise. `sorted_target` / `order`
// are target stably sorted (so each anchor's members are contiguous and ascending), `anchor_rank`
// the inclusive prefix count of anchor_flag. Writes kept [m], member offsets [m + 1] (scratch)
// and merged [m, dim] (row stride dim); hidden rows are `hidden_stride` elements apart.
cudaError_t token_merge_reduce(const void* hidden, int dtype, int64_t hidden_stride, int64_t n, int64_t dim,
                               const float* weight, const int64_t* sorted_target, const int64_t* order,
                               const int64_t* anchor_rank, int64_t m, int64_t* kept, int64_t* offsets, void* merged,
                               cudaStream_t stream);

}  // namespace samcache::cuda
