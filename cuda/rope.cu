// rope CUDA kernels: re-rotate cached keys by delta * inv_freq, in place or straight into the
// paged cache. Memory-bound: each thread block takes a few tokens at a time, computes their
// cos/sin once into shared memory (shared by all heads), then threads stream 16-byte vectors of
// the heads (coalesced: consecutive threads take consecutive vectors of a head).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "dtype.cuh"
#include "rope.cuh"

namespace samcache::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxTokensPerIter = 16;
constexpr int64_t kMaxSharedBytes = 48 * 1024;

// 2*pi split so that k * kTwoPiHi + k * kTwoPiLo subtracts 2*pi*k to ~1e-16 relative.
constexpr double kTwoPiHi = 6.283185307179586;
constexpr double kTwoPiLo = 2.4492935982947064e-16;
constexpr double kInvTwoPi = 0.15915494309189535;

// cos/sin of delta * inv_freq: the angle is formed and reduced to [-pi, pi] in float64 (the
// product is exact for |delta| < 2^29), then float32 sincosf; a float32 angle alone is off by
// up to |angle| * 6e-8, 6e-3 rad at |delta| = 1e5. Same as the CPU path (rope_cpu.cpp).
__device__ __forceinline__ void rope_cos_sin(int64_t delta, float inv_freq, float* c, float* s) {
  const double angle = static_cast<double>(delta) * static_cast<double>(inv_freq);
  const double k = rint(angle * kInvTwoPi);
  const double reduced = fma(-k, kTwoPiLo, fma(-k, kTwoPiHi, angle));
  sincosf(static_cast<float>(reduced), s, c);
}


// N elements at p as floats, in N / VEC accesses of VEC elements (16 bytes when VEC > 1).
template <typename T, int VEC, int N>
__device__ __forceinline__ void load(const T* p, float (&out)[N]) {
  static_assert(N % VEC == 0 && (VEC == 1 || VEC * sizeof(T) == 16));
#pragma unroll
  for (int b = 0; b < N; b += VEC) {
    if constexpr (VEC == 1) {
      out[b] = to_float(p[b]);
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(p + b);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int v = 0; v < VEC; ++v) out[b + v] = to_float(e[v]);
    }
  }
}

template <typename T, int VEC, int N>
__device__ __forceinline__ void store(T* p, const float (&in)[N]) {
  static_assert(N % VEC == 0 && (VEC == 1 || VEC * sizeof(T) == 16));
#pragma unroll
  for (int b = 0; b < N; b += VEC) {
    if constexpr (VEC == 1) {
      p[b] = from_float<T>(in[b]);
    } else {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int v = 0; v < VEC; ++v) e[v] = from_float<T>(in[b + v]);
      *reinterpret_cast<uint4*>(p + b) = raw;
    }
  }
}

// Bit-exact copy of VEC elements (the pass-through tail of partial rotary).
template <typename T, int VEC>
__device__ __forceinline__ void copy_raw(T* dst, const T* src) {
  if constexpr (VEC == 1) {
    *dst = *src;
  } else {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  }
}

// Elements per work unit of the interleaved (gptj) style: whole pairs, at least one.
template <int VEC>
inline constexpr int kGptjUnit = VEC > 1 ? VEC : 2;

// Work units of one head: rotary units (VEC rotate-half pairs, or gptj_unit elements), then in
// the paged write the pass-through tail in VEC-element units.
__host__ __device__ __forceinline__ int64_t rotary_units(const RopeArgs& a, int vec) {
  return a.interleaved_pairs ? 2 * a.rotary_half / (vec > 1 ? vec : 2) : a.rotary_half / vec;
}

// Shared memory of one buffer: the destination row offset of each of its tokens (-1: skip),
// then per token [cos(half) | sin(half)]. Both sizes are multiples of 8 bytes.
__host__ __device__ __forceinline__ int64_t buffer_bytes(int tokens_per_iter, int64_t rotary_dim) {
  return tokens_per_iter * static_cast<int64_t>(sizeof(int64_t) + rotary_dim * sizeof(float));
}

template <typename T, int VEC, bool kPaged, typename SlotT>
__global__ void __launch_bounds__(kThreads) rope_kernel(const __grid_constant__ RopeArgs args, int tokens_per_iter) {
  extern __shared__ int64_t smem[];  // 2 buffers, see buffer_bytes
  constexpr int G = kGptjUnit<VEC>;
  // In-iteration indices are 32-bit (the launcher checks tokens_per_iter * units_token fits):
  // 64-bit division per vector would cost more than the memory traffic it serves.
  const int half = static_cast<int>(args.rotary_half);
  const int rotary_dim = 2 * half;
  const int units_rot = static_cast<int>(rotary_units(args, VEC));
  const int units_head = units_rot + (kPaged ? static_cast<int>(args.head_dim - rotary_dim) / VEC : 0);
  const int units_token = static_cast<int>(args.num_heads) * units_head;
  const T* src = static_cast<const T*>(args.src);
  T* dst = static_cast<T*>(args.dst);
  const int64_t step = static_cast<int64_t>(gridDim.x) * tokens_per_iter;
  const int64_t buffer_words = buffer_bytes(tokens_per_iter, rotary_dim) / static_cast<int64_t>(sizeof(int64_t));

  // Double-buffered: one barrier per iteration suffices, since a buffer is refilled only two
  // iterations later, after every thread has passed the next iteration's barrier.
  int buffer = 0;
  for (int64_t t0 = static_cast<int64_t>(blockIdx.x) * tokens_per_iter; t0 < args.num_tokens; t0 += step, buffer ^= 1) {
    int64_t* row_offset = smem + buffer * buffer_words;
    float* angles = reinterpret_cast<float*>(row_offset + tokens_per_iter);
    const int n = static_cast<int>(min(static_cast<int64_t>(tokens_per_iter), args.num_tokens - t0));
    for (int i = threadIdx.x; i < n * half; i += blockDim.x) {
      const int tt = i / half, j = i - tt * half;
      const int64_t row = args.multi_axis ? args.axis[j] : 0;
      const int64_t d = args.delta[row * args.delta_axis_stride + (t0 + tt) * args.delta_token_stride];
      rope_cos_sin(d, args.inv_freq[j], angles + tt * rotary_dim + j, angles + tt * rotary_dim + half + j);
    }
    for (int tt = threadIdx.x; tt < n; tt += blockDim.x) {
      const int64_t t = t0 + tt;
      if constexpr (kPaged) {
        // Slots are unchecked device data: anything outside the cache (and -1) is skipped.
        const int64_t slot = static_cast<int64_t>(static_cast<const SlotT*>(args.slots)[t]);
        row_offset[tt] = slot < 0 || slot >= args.num_slots
                             ? -1
                             : (slot / args.block_size) * args.dst_block_stride +
                                   (slot % args.block_size) * args.dst_offset_stride;
      } else {
        row_offset[tt] = t * args.dst_block_stride;
      }
    }
    __syncthreads();

    for (int i = threadIdx.x; i < n * units_token; i += blockDim.x) {
      const int tt = i / units_token, r = i - tt * units_token;
      const int h = r / units_head, u = r - h * units_head;
      if (kPaged && row_offset[tt] < 0) continue;
      T* out = dst + row_offset[tt] + h * args.dst_head_stride;
      const T* in = src + (t0 + tt) * args.src_token_stride + h * args.src_head_stride;
      const float* cos = angles + tt * rotary_dim;
      const float* sin = cos + half;

      if (u >= units_rot) {
        const int e = rotary_dim + (u - units_rot) * VEC;
        copy_raw<T, VEC>(out + e, in + e);
      } else if (args.interleaved_pairs) {
        const int e = u * G;
        float x[G];
        load<T, VEC>(in + e, x);
#pragma unroll
        for (int p = 0; p < G / 2; ++p) {
          const float c = cos[e / 2 + p], s = sin[e / 2 + p];
          const float a = x[2 * p], b = x[2 * p + 1];
          x[2 * p] = a * c - b * s;
          x[2 * p + 1] = b * c + a * s;
        }
        store<T, VEC>(out + e, x);
      } else {
        const int j = u * VEC;
        float lo[VEC], hi[VEC];
        load<T, VEC>(in + j, lo);
        load<T, VEC>(in + half + j, hi);
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const float c = cos[j + v], s = sin[j + v];
          const float a = lo[v], b = hi[v];
          lo[v] = a * c - b * s;
          hi[v] = b * c + a * s;
        }
        store<T, VEC>(out + j, lo);
        store<T, VEC>(out + half + j, hi);
      }
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <typename T, int VEC, bool kPaged>
cudaError_t launch_typed(const RopeArgs& args, cudaStream_t stream) {
  const int64_t rotary_dim = 2 * args.rotary_half;
  const int64_t units_head = rotary_units(args, VEC) + (kPaged ? (args.head_dim - rotary_dim) / VEC : 0);
  const int64_t units_token = args.num_heads * units_head;
  // 32-bit in-iteration indices (see rope_kernel); absurdly wide heads are refused.
  if (units_token > (int64_t{1} << 30) / kMaxTokensPerIter || args.head_dim > (int64_t{1} << 30)) {
    return cudaErrorInvalidValue;
  }
  // Enough tokens per iteration to occupy the block's threads, within the shared memory.
  int64_t tokens_per_iter = units_token >= kThreads ? 1 : kThreads / units_token;
  tokens_per_iter = std::min<int64_t>(tokens_per_iter, kMaxTokensPerIter);
  while (tokens_per_iter > 1 && 2 * buffer_bytes(static_cast<int>(tokens_per_iter), rotary_dim) > kMaxSharedBytes) {
    --tokens_per_iter;
  }
  const size_t smem = static_cast<size_t>(2 * buffer_bytes(static_cast<int>(tokens_per_iter), rotary_dim));

  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int64_t wanted = (args.num_tokens + tokens_per_iter - 1) / tokens_per_iter;
  const int64_t resident = static_cast<int64_t>(sms) * (2048 / kThreads);  // full occupancy, grid-stride beyond
  const unsigned blocks = static_cast<unsigned>(std::min(wanted, resident));

  if constexpr (kPaged) {
    if (args.slots_int64) {
      rope_kernel<T, VEC, true, int64_t><<<blocks, kThreads, smem, stream>>>(args, static_cast<int>(tokens_per_iter));
    } else {
      rope_kernel<T, VEC, true, int32_t><<<blocks, kThreads, smem, stream>>>(args, static_cast<int>(tokens_per_iter));
    }
  } else {
    rope_kernel<T, VEC, false, int64_t><<<blocks, kThreads, smem, stream>>>(args, static_cast<int>(tokens_per_iter));
  }
  return cudaGetLastError();
}

// 16-byte vectors when every address the kernel forms is 16-byte aligned, scalar otherwise.
template <typename T, bool kPaged>
cudaError_t launch_vectorized(const RopeArgs& a, cudaStream_t stream) {
  constexpr int64_t V = 16 / sizeof(T);
  const bool vec_ok = aligned16(a.src) && aligned16(a.dst) && a.rotary_half % V == 0 && a.head_dim % V == 0 &&
                      a.src_token_stride % V == 0 && a.src_head_stride % V == 0 && a.dst_block_stride % V == 0 &&
                      a.dst_offset_stride % V == 0 && a.dst_head_stride % V == 0;
  return vec_ok ? launch_typed<T, static_cast<int>(V), kPaged>(a, stream) : launch_typed<T, 1, kPaged>(a, stream);
}

template <bool kPaged>
cudaError_t launch(const RopeArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0 || args.num_heads == 0) return cudaSuccess;
  if (args.rotary_half < 1 || args.rotary_half > kRopeMaxRotaryHalfCuda || 2 * args.rotary_half > args.head_dim ||
      (kPaged && args.block_size < 1)) {
    return cudaErrorInvalidValue;
  }
  switch (args.dtype) {
    case RopeDtype::kFloat32: return launch_vectorized<float, kPaged>(args, stream);
    case RopeDtype::kFloat16: return launch_vectorized<__half, kPaged>(args, stream);
    case RopeDtype::kBFloat16: return launch_vectorized<__nv_bfloat16, kPaged>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t rope_rerotate(const RopeArgs& args, cudaStream_t stream) { return launch<false>(args, stream); }

cudaError_t rope_rerotate_write(const RopeArgs& args, cudaStream_t stream) { return launch<true>(args, stream); }

}  // namespace samcache::cuda
