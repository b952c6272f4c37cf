// kv_quant CUDA kernels. Quantize: one thread block per scale group; each thread keeps up to
// kRegVecs 16-byte vectors in registers between the amax pass and the write pass, so a group of up
// to 8 * blockDim vectors is read from memory once (larger groups re-read, from L2). Dequantize:
// one thread block per 1024-vector tile of a block, 4 vectors per thread in flight, 16-byte
// stores. Any shape works: misaligned groups take the scalar path (VEC = 1).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "dtype.cuh"
#include "kv_quant.cuh"

namespace samcache::cuda {

namespace {

constexpr int kRegVecs = 8;
constexpr int kMaxQuantThreads = 512;  // with __launch_bounds__, keeps the register cache within the file

template <int VEC>
struct alignas(VEC) Bytes {
  uint8_t v[VEC];
};

template <int Q> __device__ __forceinline__ uint8_t encode(float v);
template <> __device__ __forceinline__ uint8_t encode<kQuantFp8E4M3>(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));  // round to nearest even
}
template <> __device__ __forceinline__ uint8_t encode<kQuantInt8>(float v) {
  return static_cast<uint8_t>(static_cast<int8_t>(__float2int_rn(v)));  // v already within [-127, 127]
}

template <int Q> __device__ __forceinline__ float decode(uint8_t b);
template <> __device__ __forceinline__ float decode<kQuantFp8E4M3>(uint8_t b) {
  __nv_fp8_e4m3 f;
  f.__x = b;
  return static_cast<float>(f);
}
template <> __device__ __forceinline__ float decode<kQuantInt8>(uint8_t b) {
  return static_cast<float>(static_cast<int8_t>(b));
}

template <int Q> __host__ __device__ constexpr float qmax() { return Q == kQuantFp8E4M3 ? 448.0f : 127.0f; }

__device__ float block_max(float v) {
  __shared__ float warp_max[32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>((blockDim.x + 31) >> 5) ? warp_max[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) warp_max[0] = v;
  }
  __syncthreads();
  return warp_max[0];
}

// Offset of vector `v` of a group, in elements (the same for the cache side and the q side).
__device__ __forceinline__ int64_t vec_offset(int64_t v, int64_t vecs_per_row, int64_t row_stride, int vec) {
  return (v / vecs_per_row) * row_stride + (v % vecs_per_row) * vec;
}

template <typename T, int Q, int VEC>
__device__ __forceinline__ void store_codes(const Pack<T, VEC>& x, float inv, float scale, bool divide, int8_t* dst) {
  Bytes<VEC> out;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    float v = divide ? to_float(x.v[j]) / scale : to_float(x.v[j]) * inv;
    v = fminf(fmaxf(v, -qmax<Q>()), qmax<Q>());
    out.v[j] = encode<Q>(v);
  }
  *reinterpret_cast<Bytes<VEC>*>(dst) = out;
}

template <typename T, int Q, int VEC>
__global__ __launch_bounds__(kMaxQuantThreads) void quantize_kernel(const T* __restrict__ cache, const int64_t* __restrict__ ids, KvQuantGeometry geo,
                                int8_t* __restrict__ q, float* __restrict__ scales) {
  using P = Pack<T, VEC>;
  const int64_t group = blockIdx.x;
  const int64_t k = group / geo.groups_per_block;
  const int64_t head_offset = (group % geo.groups_per_block) * geo.head_step;
  const int64_t vecs_per_row = geo.row_len / VEC;
  const int64_t total = geo.rows * vecs_per_row;
  int8_t* dst = q + k * geo.block_elems + head_offset;
  const int64_t id = ids[k];
  const bool skip = id < 0 || id >= geo.num_blocks;  // unvalidated device ids: never read out of bounds
  const T* src = cache + (skip ? 0 : id) * geo.block_stride + head_offset;
  const bool in_registers = total <= static_cast<int64_t>(kRegVecs) * blockDim.x;

  P regs[kRegVecs];
  float amax = 0.0f;
  bool non_finite = false;
  auto accumulate = [&](const P& x) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = to_float(x.v[j]);
      non_finite |= !isfinite(f);
      amax = fmaxf(amax, fabsf(f));
    }
  };
  if (!skip) {
    if (in_registers) {
#pragma unroll
      for (int it = 0; it < kRegVecs; ++it) {
        const int64_t v = threadIdx.x + static_cast<int64_t>(it) * blockDim.x;
        if (v < total) {
          regs[it] = *reinterpret_cast<const P*>(src + vec_offset(v, vecs_per_row, geo.row_stride, VEC));
          accumulate(regs[it]);
        }
      }
    } else {
      for (int64_t v = threadIdx.x; v < total; v += blockDim.x)
        accumulate(*reinterpret_cast<const P*>(src + vec_offset(v, vecs_per_row, geo.row_stride, VEC)));
    }
  }
  amax = block_max(amax);
  non_finite = __syncthreads_or(non_finite) != 0;

  if (skip || non_finite) {  // the group is marked invalid: scale NaN, codes 0
    if (threadIdx.x == 0) scales[group] = __int_as_float(0x7fc00000);
    for (int64_t v = threadIdx.x; v < total; v += blockDim.x)
      *reinterpret_cast<Bytes<VEC>*>(dst + vec_offset(v, vecs_per_row, geo.row_stride, VEC)) = Bytes<VEC>{};
    return;
  }
  const float scale = amax / qmax<Q>();
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;  // all-zero group: codes 0, scale 0
  const bool divide = isinf(inv);                         // subnormal scale: 1 / scale overflows
  if (threadIdx.x == 0) scales[group] = scale;
  if (in_registers) {
#pragma unroll
    for (int it = 0; it < kRegVecs; ++it) {
      const int64_t v = threadIdx.x + static_cast<int64_t>(it) * blockDim.x;
      if (v < total) store_codes<T, Q, VEC>(regs[it], inv, scale, divide, dst + vec_offset(v, vecs_per_row, geo.row_stride, VEC));
    }
  } else {
    for (int64_t v = threadIdx.x; v < total; v += blockDim.x) {
      const int64_t off = vec_offset(v, vecs_per_row, geo.row_stride, VEC);
      store_codes<T, Q, VEC>(*reinterpret_cast<const P*>(src + off), inv, scale, divide, dst + off);
    }
  }
}

constexpr int kDequantThreads = 256;
constexpr int kDequantUnroll = 4;  // vectors per thread, all loads issued before the stores
constexpr int64_t kDequantTile = int64_t{kDequantThreads} * kDequantUnroll;

// One thread block per tile of kDequantTile vectors of one block: the block id and its scales'
// row are read once per CTA, vector v of the tile is element range [v * VEC, v * VEC + VEC) of
// the dense [block_size, H, D] block (never across heads: D % VEC == 0 on the vector path), and
// the in-block index math is 32-bit (the launcher checks block_elems < 2^31).
template <typename T, int Q, int VEC>
__global__ void __launch_bounds__(kDequantThreads)
    dequantize_kernel(const int8_t* __restrict__ q, const float* __restrict__ scales, T* __restrict__ cache,
                      const int64_t* __restrict__ ids, KvQuantGeometry geo, int64_t tiles_per_block) {
  const int64_t k = blockIdx.x / tiles_per_block;
  const int64_t id = ids[k];
  if (id < 0 || id >= geo.num_blocks) return;  // unvalidated device ids: skipped
  const uint32_t vecs = static_cast<uint32_t>(geo.block_elems / VEC);
  const uint32_t first = static_cast<uint32_t>((blockIdx.x - k * tiles_per_block) * kDequantTile) + threadIdx.x;
  const int8_t* src = q + k * geo.block_elems;
  T* dst = cache + id * geo.block_stride;
  const float* s = scales + k * geo.groups_per_block;
  const uint32_t head_step = static_cast<uint32_t>(geo.head_step);  // D per head, 0 for one scale per block
  const uint32_t heads = static_cast<uint32_t>(geo.groups_per_block);
  Bytes<VEC> in[kDequantUnroll];
#pragma unroll
  for (int u = 0; u < kDequantUnroll; ++u) {
    const uint32_t v = first + u * kDequantThreads;
    if (v < vecs) in[u] = *reinterpret_cast<const Bytes<VEC>*>(src + static_cast<int64_t>(v) * VEC);
  }
#pragma unroll
  for (int u = 0; u < kDequantUnroll; ++u) {
    const uint32_t v = first + u * kDequantThreads;
    if (v >= vecs) continue;
    const uint32_t e = v * VEC;
    const float scale = s[head_step == 0 ? 0u : (e / head_step) % heads];
    Pack<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = from_float<T>(decode<Q>(in[u].v[j]) * scale);
    *reinterpret_cast<Pack<T, VEC>*>(dst + e) = out;
  }
}

// Whether every group run starts 16-byte aligned in the cache and VEC-byte aligned in q.
template <typename T>
bool vector_aligned(const void* cache, const void* q, const KvQuantGeometry& g) {
  constexpr int64_t vec = 16 / sizeof(T);
  return reinterpret_cast<uintptr_t>(cache) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % vec == 0 &&
         g.row_len % vec == 0 && g.row_stride % vec == 0 && g.block_stride % vec == 0 && g.head_step % vec == 0 &&
         g.block_elems % vec == 0;
}

template <typename T, int Q, int VEC>
cudaError_t launch_quantize(const T* cache, const int64_t* ids, const KvQuantGeometry& g, int8_t* q, float* scales,
                            cudaStream_t stream) {
  const int64_t groups = g.num_ids * g.groups_per_block;
  const int64_t vecs = g.rows * (g.row_len / VEC);
  // Enough threads that the group fits in registers (kRegVecs vectors each), within [64, 512].
  int64_t threads = (vecs + kRegVecs - 1) / kRegVecs;
  threads = threads < 64 ? 64 : (threads > kMaxQuantThreads ? kMaxQuantThreads : (threads + 31) / 32 * 32);
  quantize_kernel<T, Q, VEC><<<static_cast<unsigned>(groups), static_cast<unsigned>(threads), 0, stream>>>(
      cache, ids, g, q, scales);
  return cudaGetLastError();
}

template <typename T, int Q, int VEC>
cudaError_t launch_dequantize(const int8_t* q, const float* scales, T* cache, const int64_t* ids,
                              const KvQuantGeometry& g, cudaStream_t stream) {
  if (g.block_elems <= 0 || g.block_elems > 0x7fffffff - kDequantTile * VEC) return cudaErrorInvalidValue;
  const int64_t vecs = g.block_elems / VEC;
  const int64_t tiles = (vecs + kDequantTile - 1) / kDequantTile;
  if (g.num_ids * tiles > 0x7fffffff) return cudaErrorInvalidValue;
  dequantize_kernel<T, Q, VEC><<<static_cast<unsigned>(g.num_ids * tiles), kDequantThreads, 0, stream>>>(
      q, scales, cache, ids, g, tiles);
  return cudaGetLastError();
}

// Calls launch(std::integral_constant<int, Q>{}, std::integral_constant<int, VEC>{}) for the
// runtime qtype and the widest vector the addresses allow (16 bytes, else one element).
template <typename T, class Launch>
cudaError_t by_qtype_and_vector(int qtype, bool vec, Launch&& launch) {
  constexpr int kVec = 16 / sizeof(T);
  using Fp8 = std::integral_constant<int, kQuantFp8E4M3>;
  using Int8 = std::integral_constant<int, kQuantInt8>;
  using Wide = std::integral_constant<int, kVec>;
  using One = std::integral_constant<int, 1>;
  if (qtype == kQuantFp8E4M3) return vec ? launch(Fp8{}, Wide{}) : launch(Fp8{}, One{});
  return vec ? launch(Int8{}, Wide{}) : launch(Int8{}, One{});
}

template <typename T>
cudaError_t quantize_typed(const void* cache, const int64_t* ids, const KvQuantGeometry& g, int qtype, void* q,
                           float* scales, cudaStream_t stream) {
  const T* c = static_cast<const T*>(cache);
  int8_t* o = static_cast<int8_t*>(q);
  return by_qtype_and_vector<T>(qtype, vector_aligned<T>(cache, q, g), [&](auto qt, auto vec) {
    return launch_quantize<T, decltype(qt)::value, decltype(vec)::value>(c, ids, g, o, scales, stream);
  });
}

template <typename T>
cudaError_t dequantize_typed(const void* q, int qtype, const float* scales, void* cache, const int64_t* ids,
                             const KvQuantGeometry& g, cudaStream_t stream) {
  const int8_t* s = static_cast<const int8_t*>(q);
  T* c = static_cast<T*>(cache);
  return by_qtype_and_vector<T>(qtype, vector_aligned<T>(cache, q, g), [&](auto qt, auto vec) {
    return launch_dequantize<T, decltype(qt)::value, decltype(vec)::value>(s, scales, c, ids, g, stream);
  });
}

}  // namespace

cudaError_t quantize_kv_blocks(const void* cache, int cache_dtype, const int64_t* ids, const KvQuantGeometry& geo,
                               int qtype, void* q, float* scales, cudaStream_t stream) {
  if (geo.num_ids == 0 || geo.groups_per_block == 0) return cudaSuccess;
  if (geo.num_ids * geo.groups_per_block > 0x7fffffff) return cudaErrorInvalidValue;
  switch (cache_dtype) {
    case kCacheFloat32: return quantize_typed<float>(cache, ids, geo, qtype, q, scales, stream);
    case kCacheFloat16: return quantize_typed<__half>(cache, ids, geo, qtype, q, scales, stream);
    case kCacheBFloat16: return quantize_typed<__nv_bfloat16>(cache, ids, geo, qtype, q, scales, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t dequantize_kv_blocks(const void* q, int qtype, const float* scales, void* cache, int cache_dtype,
                                 const int64_t* ids, const KvQuantGeometry& geo, cudaStream_t stream) {
  if (geo.num_ids == 0 || geo.groups_per_block == 0 || geo.rows * geo.row_len == 0) return cudaSuccess;
  switch (cache_dtype) {
    case kCacheFloat32: return dequantize_typed<float>(q, qtype, scales, cache, ids, geo, stream);
    case kCacheFloat16: return dequantize_typed<__half>(q, qtype, scales, cache, ids, geo, stream);
    case kCacheBFloat16: return dequantize_typed<__nv_bfloat16>(q, qtype, scales, cache, ids, geo, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace samcache::cuda
