// Raw-pointer launchers of cuda/token_merge.cu (no torch types: the .cu compiles alone with nvcc).
// The torch-facing wrapper, which sorts and synchronises in between, is cpp/kernels/token_merge_cuda.cpp.
//
// Pipeline (one stream; n < 2^31 tokens):
//   1. token_merge_validate: status = {anchor count, first error key, largest weight's bits}.
//   2. the wrapper copies the status to the host (asynchronously) and queues, without waiting:
//      a stable sort of target (int32 keys), the row of each anchor (inclusive cumsum of the
//      anchor flags), token_merge_rows (row offsets and chunk marks), an inclusive cumsum of the
//      marks, token_merge_chunks (the chunk list). These kernels return at once when the status
//      holds an error, so a bad target is never used as an index.
//   3. the host waits for the status only; with a clean one, token_merge_reduce.
//
// Rows are cut into chunks of at most merge_chunk_len(len) members: a row of up to 32 members is
// one chunk, longer rows are cut into at most 64 chunks of >= 32 members each. A one-chunk row
// is reduced, normalised and written by its chunk; the chunks of a longer row write float32
// partial sums to slots (consecutive per row) that a second kernel adds in slot order.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace samcache::cuda {

enum TokenMergeDtype : int { kMergeFloat32 = 0, kMergeFloat16 = 1, kMergeBFloat16 = 2 };

// Status words (int64 [kTokenMergeStatusWords] on the device): [0] number of anchors, [1] error
// key of the first problem, (code << kTokenMergeCodeShift) | token index with the codes of
// kernels::TokenMergeError, kTokenMergeNoError when the plan is valid; [2] the float32 bits of the
// largest valid weight (to bound the weight sums on the host).
constexpr int kTokenMergeStatusWords = 3;
constexpr int kTokenMergeCodeShift = 40;
constexpr unsigned long long kTokenMergeNoError = ~0ull;

// Chunking (see above).
constexpr int kMergeMinChunk = 32;
constexpr int kMergeMaxChunks = 64;
// Upper bounds the host sizes the launches and the scratch with: chunks <= min(n, m + n / 16),
// partial slots <= n / 16 (and 0 when no row can exceed kMergeMinChunk members).
inline int64_t merge_max_chunks(int64_t n, int64_t m) {
  const int64_t bound = m + (n + 15) / 16;
  return bound < n ? bound : n;
}
inline int64_t merge_max_slots(int64_t n, int64_t m) { return n - m + 1 > kMergeMinChunk ? (n + 15) / 16 : 0; }

// One chunk of a row: members [start, end) of the sorted order; slot < 0 for a whole row.
struct alignas(16) MergeChunk {
  int32_t start, end, row, slot;
};

// Validates target [n] / weight [n] and counts anchors, without a host round trip.
// Writes anchor_flag[i] = (target[i] == i) and the status; `has_weight` [n] must be zeroed by the
// caller (it marks anchors with a member of weight > 0).
cudaError_t token_merge_validate(const int64_t* target, const float* weight, int64_t n, int32_t* anchor_flag,
                                 int32_t* has_weight, unsigned long long* status, cudaStream_t stream);

// sorted_target: target stably sorted (int32); anchor_rank: inclusive prefix count of anchor_flag.
// Writes offsets [n + 1] (row r's members are sorted positions offsets[r] .. offsets[r + 1] - 1;
// entries past the row count are left alone) and marks [n]: bit 0 = a chunk starts here, bit 32 =
// a chunk of a multi-chunk row starts here.
cudaError_t token_merge_rows(const int32_t* sorted_target, const int32_t* anchor_rank, int64_t n,
                             const unsigned long long* status, int32_t* offsets, int64_t* marks, cudaStream_t stream);

// cum: inclusive prefix sum of marks (low 32 bits: chunks so far, high: partial slots so far).
// Writes chunks [number of chunks] and slot_chunk [number of slots] (the chunk of each slot).
cudaError_t token_merge_chunks(const int32_t* sorted_target, const int32_t* anchor_rank, const int32_t* offsets,
                               const int64_t* marks, const int64_t* cum, int64_t n, const unsigned long long* status,
                               MergeChunk* chunks, int32_t* slot_chunk, cudaStream_t stream);

// After the host has read a clean status: m anchors, the reduce + normalise. Writes kept [m] and
// merged [m, dim] (row stride dim); hidden rows are `hidden_stride` elements apart. partial
// [max_slots, max(dim, 1)] and partial_weight [max_slots] are scratch (nullptr when max_slots == 0).
cudaError_t token_merge_reduce(const void* hidden, int dtype, int64_t hidden_stride, int64_t n, int64_t dim,
                               const float* weight, const int64_t* order, const int32_t* sorted_target,
                               const int32_t* offsets, const int64_t* cum, const MergeChunk* chunks,
                               const int32_t* slot_chunk, int64_t m, float* partial, float* partial_weight,
                               int64_t* kept, void* merged, cudaStream_t stream);

}  // namespace samcache::cuda
