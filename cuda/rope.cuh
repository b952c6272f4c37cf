// Raw-pointer launchers of cuda/rope.cu (no torch types: the .cu compiles alone with nvcc). The
// torch-facing wrapper is cpp/kernels/rope_cuda.cpp; the contract is docs/ops/rope.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace samcache::cuda {

enum class RopeDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr int kRopeMaxRotaryHalfCuda = 2048;

// Everything a launch needs, strides in elements. The rotation reads `src` and writes `dst`:
// in place (rope_rerotate) `dst == src` and token t goes to dst + t * dst_block_stride; for the
// paged write token t goes to slot s = slots[t] (skipped unless 0 <= s < num_slots), i.e. to
// dst + (s / block_size) * dst_block_stride + (s % block_size) * dst_offset_stride.
struct RopeArgs {
  RopeDtype dtype = RopeDtype::kFloat32;
  bool interleaved_pairs = false;  // gptj: pair (2j, 2j+1); otherwise rotate-half (j, j + half)
  bool multi_axis = false;         // delta is [3, N] and axis[] picks the row per frequency
  int64_t num_tokens = 0, num_heads = 0, head_dim = 0, rotary_half = 0;
  const float* inv_freq = nullptr;  // [rotary_half], contiguous
  const int64_t* delta = nullptr;
  int64_t delta_axis_stride = 0, delta_token_stride = 0;
  const void* src = nullptr;
  int64_t src_token_stride = 0, src_head_stride = 0;
  void* dst = nullptr;
  int64_t dst_block_stride = 0, dst_offset_stride = 0, dst_head_stride = 0;
  const void* slots = nullptr;  // int32 or int64 [N]; paged write only
  bool slots_int64 = true;
  int64_t block_size = 1, num_slots = 0;
  uint8_t axis[kRopeMaxRotaryHalfCuda] = {};  // per frequency: delta row 0 (t), 1 (h) or 2 (w)
};

// In place: key (args.src == args.dst) rotated by delta * inv_freq.
cudaError_t rope_rerotate(const RopeArgs& args, cudaStream_t stream);

// Fused: rotated copies of src written to the paged cache at args.slots, tail dims copied.
cudaError_t rope_rerotate_write(const RopeArgs& args, cudaStream_t stream);

}  // namespace samcache::cuda
