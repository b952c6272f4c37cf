// Raw-pointer launchers of cuda/paged_kv.cu (no torch types: the .cu compiles alone with nvcc).
// The torch-facing wrapper is cpp/kernels/paged_kv_cuda.cpp. Every size and stride is in bytes,
// so the kernels move any dtype; they pick the widest vector (16 bytes down to 1) that every
// pointer, stride and head size allows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace samcache::cuda {

enum class IndexType : int { kInt32 = 0, kInt64 = 1 };

// key/value: token t, head h starts at base + t * token_stride + h * head_stride (bytes), with
// head_bytes contiguous bytes. The caches are contiguous [num_slots, num_heads, head_bytes].
// Slots outside [0, num_slots) (padding -1, or bad indices) are skipped.
struct PagedWriteArgs {
  const void* key;
  const void* value;
  int64_t key_token_stride;
  int64_t key_head_stride;
  int64_t value_token_stride;
  int64_t value_head_stride;
  void* key_cache;
  void* value_cache;
  const void* slot_mapping;  // device array of num_tokens indices
  IndexType slot_type;
  int64_t num_tokens;
  int64_t num_heads;
  int64_t head_bytes;
  int64_t num_slots;
};
cudaError_t paged_write(const PagedWriteArgs& args, cudaStream_t stream);

// Token t of the output = slot block_table[t / block_size] * block_size + t % block_size of the
// cache; outputs are contiguous [num_tokens, row_bytes]. Tokens whose block id is outside
// [0, num_blocks) are written as zeros.
struct PagedGatherArgs {
  const void* key_cache;
  const void* value_cache;
  void* key_out;
  void* value_out;
  const void* block_table;  // device array
  IndexType table_type;
  int64_t num_tokens;
  int64_t block_size;
  int64_t num_blocks;
  int64_t row_bytes;
};
cudaError_t paged_gather(const PagedGatherArgs& args, cudaStream_t stream);

// Block src_block .. src_block + num_blocks - 1 of src go to dst_block .. of dst.
struct BlockRun {
  int64_t src_block;
  int64_t dst_block;
  int64_t num_blocks;
};
// One cudaMemcpyAsync (cudaMemcpyDefault: any of device/pinned/pageable host on either side) per
// run, in order, on `stream`. `runs` is a host array. Asynchronous with respect to the host only
// when the host side is pinned; the caller keeps both buffers alive until the stream gets there.
cudaError_t copy_block_runs(void* dst, const void* src, const BlockRun* runs, int64_t num_runs, int64_t block_bytes,
                            cudaStream_t stream);

// Up to kInlinePairs (src, dst) block pairs travel in the kernel's parameters, so a small swap
// needs no upload ahead of the kernel: int32, 3,840 bytes (with the other parameters within the
// classic 4 KiB limit).
constexpr int kInlinePairs = 480;
struct InlinePairs {
  int32_t v[2 * kInlinePairs];
};

// One kernel for any number of scattered blocks: for p < num_pairs, copies block_bytes bytes from
// src + pair[p].src * block_bytes to dst + pair[p].dst * block_bytes, the pairs taken from
// `inline_pairs` when given (num_pairs <= kInlinePairs), else from `pairs` (a device array, int64
// [num_pairs, 2]). src and dst are addresses the kernel can dereference: device memory, or the
// mapped device address of pinned host memory (see device_address). The pairs must not depend on
// their order (distinct destinations, no destination read by another pair). `max_ctas` caps the
// grid: 0 fills the GPU (device <-> device); a host side needs only enough requests in flight to
// cover the PCIe latency, so it gets a few CTAs and leaves the SMs to the compute.
cudaError_t copy_block_pairs(void* dst, const void* src, const int64_t* pairs, const InlinePairs* inline_pairs,
                             int64_t num_pairs, int64_t block_bytes, int max_ctas, cudaStream_t stream);

// The address a kernel on the current device uses for `ptr`: ptr itself for device memory, the
// mapped address for pinned (page-locked) host memory; nullptr for pageable host memory, which no
// kernel can read (and for anything the runtime does not know). Never leaves a CUDA error set.
void* device_address(const void* ptr);

}  // namespace samcache::cuda
