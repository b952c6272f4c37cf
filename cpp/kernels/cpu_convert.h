// Scalar conversions for the CPU kernels, written so that loops over them vectorise at the
// extension's baseline ISA without -ffast-math: integer selects and masks only (under the default
// -ftrapping-math GCC will not if-convert a select that guards a float operation).
#pragma once

#include <c10/util/Half.h>

#include <bit>
#include <cstdint>

// Hot loops also get an AVX2 clone, picked when the extension loads (a GCC ifunc): the extension's
// baseline is SSE2, and torch dispatches its own CPU kernels to AVX2 likewise. "avx2" enables no
// FMA, so both clones compute the same bits.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SAMCACHE_AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#else
#define SAMCACHE_AVX2_CLONE
#endif

namespace samcache::kernels {

// Round to nearest even of |v| < 2^22, as an integer: adding 1.5 * 2^23 leaves the rounded value
// in the low mantissa bits. No float -> int conversion and no libm call, so loops vectorise.
inline int32_t round_to_int(float v) { return std::bit_cast<int32_t>(v + 12582912.0f) - 0x4b400000; }

// float16 <-> float32 with integer selects only, so the loops vectorise (c10::Half's own
// conversions do not at the extension's baseline ISA). Other dtypes use their casts.
template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}
template <>
inline float to_float<c10::Half>(c10::Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.x & 0x8000u) << 16;
  const uint32_t em = h.x & 0x7fffu;
  // The half's exponent and mantissa read as float bits are the value times 2^-112, subnormals
  // included; multiplying by 2^112 rebiases (and normalises) exactly. Inf/NaN get exponent 255.
  const uint32_t scaled = std::bit_cast<uint32_t>(std::bit_cast<float>(em << 13) * 0x1p112f);
  const uint32_t inf_nan = (0u - static_cast<uint32_t>(em >= 0x7c00u)) & 0x7f800000u;
  return std::bit_cast<float>(sign | scaled | inf_nan);
}

template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);
}
template <>
inline c10::Half from_float<c10::Half>(float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int32_t mag = static_cast<int32_t>(bits & 0x7fffffffu);
  // Normal: round the mantissa to 10 bits (nearest even), rebias 127 -> 15, overflow to inf.
  int32_t normal = ((mag + 0xfff + ((mag >> 13) & 1)) >> 13) - (112 << 10);
  normal = normal < 0x7c00 ? normal : 0x7c00;
  // Subnormal (|v| < 2^-14): multiples of 2^-24; 1024 is the smallest normal's code.
  const int32_t sub = round_to_int(std::bit_cast<float>(mag) * 0x1p24f);
  // Masks, not selects: a select would move the float multiply above into a branch.
  const int32_t sub_mask = 0 - static_cast<int32_t>(mag < 0x38800000);
  const int32_t nan_mask = 0 - static_cast<int32_t>(mag > 0x7f800000);  // NaN stays NaN
  const int32_t code = (((sub & sub_mask) | (normal & ~sub_mask)) & ~nan_mask) | (0x7e00 & nan_mask);
  return c10::Half(static_cast<unsigned short>(sign | static_cast<uint32_t>(code)), c10::Half::from_bits());
}

}  // namespace samcache::kernels
