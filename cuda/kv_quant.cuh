// Raw-pointer launchers of cuda/kv_quant.cu (no torch types: the .cu compiles alone with nvcc).
// The torch-facing wrapper is cpp/kernels/kv_quant_cuda.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace samcache::cuda {

// Codes match samcache::kernels::KvQuantType and the cache dtype the wrapper dispatched on.
enum KvQuantCode : int { kQuantFp8E4M3 = 0, kQuantInt8 = 1 };
enum KvCacheDtype : int { kCacheFloat32 = 0, kCacheFloat16 = 1, kCacheBFloat16 = 2 };

// Element geometry of the scale groups (see kernels::KvQuantPlan). A group g covers block
// ids[g / groups_per_block], head offset (g % groups_per_block) * head_step, and consists of
// `rows` runs of `row_len` contiguous elements `row_stride` apart; q is dense
// [num_ids, block_elems] with the same inner layout.
struct KvQuantGeometry {
  int64_t num_ids;
  int64_t num_blocks;       // ids outside [0, num_blocks) are skipped
  int64_t groups_per_block;
  int64_t head_step;        // D when per head, else 0
  int64_t rows, row_len, row_stride;
  int64_t block_stride;     // elements between cache blocks
  int64_t block_elems;      // block_size * H * D
};

// q[g] = sat(round(x / scale)), scales[g] = amax / qmax; a group with a NaN or an infinity gets
// scale NaN and q = 0; an id out of range gets the same (nothing is read). `ids` is a device array.
cudaError_t quantize_kv_blocks(const void* cache, int cache_dtype, const int64_t* ids, const KvQuantGeometry& geo,
                               int qtype, void* q, float* scales, cudaStream_t stream);

// cache[ids[k]] = q[k] * scale, in the cache dtype; ids out of range are skipped.
cudaError_t dequantize_kv_blocks(const void* q, int qtype, const float* scales, void* cache, int cache_dtype,
                                 const int64_t* ids, const KvQuantGeometry& geo, cudaStream_t stream);

}  // namespace samcache::cuda
