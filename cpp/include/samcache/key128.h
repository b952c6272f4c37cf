// A 128-bit content digest (xxh3-128) used as a key by every native structure.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL  // header-only: the extension does not depend on libxxhash.so
#include <xxhash.h>

namespace samcache {

// Byte order seen from Python: lo then hi, little-endian, i.e. the 16 bytes of
// xxhash.xxh3_128_intdigest(data).to_bytes(16, "little").
struct Key128 {
  uint64_t lo = 0;
  uint64_t hi = 0;
  friend bool operator==(const Key128&, const Key128&) = default;
  friend auto operator<=>(const Key128&, const Key128&) = default;
};
static_assert(sizeof(Key128) == 16);

inline Key128 xxh3_128(const void* data, size_t len) {
  XXH128_hash_t h = XXH3_128bits(data, len);
  return {h.low64, h.high64};
}

}  // namespace samcache
