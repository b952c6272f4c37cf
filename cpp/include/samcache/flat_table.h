// Open-addressing hash table keyed by 128-bit digests.
//
// Keys are already uniform xxh3-128 outputs, so the table indexes by their low bits and never
// rehashes them; one probe usually touches one cache line. Linear probing with backward-shift
// deletion keeps it free of tombstones, and the load factor stays at most 1/2.
// Pointers returned by find/try_emplace are valid until the next insert or erase.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "samcache/key128.h"

namespace samcache {

template <class Value>
class FlatTable {
 public:
  explicit FlatTable(size_t min_capacity = 16) { rebuild(round_up(min_capacity * 2)); }

  size_t size() const { return size_; }
  size_t capacity() const { return slots_.size(); }

  Value* find(const Key128& key) {
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (!s.used) return nullptr;
      if (s.key == key) return &s.value;
    }
  }
  const Value* find(const Key128& key) const { return const_cast<FlatTable*>(this)->find(key); }

  // Hints the CPU to load the home slot of `key`; batch lookups overlap their cache misses.
  void prefetch(const Key128& key) const { __builtin_prefetch(&slots_[home(key)]); }

  // Inserts (key, value) if the key is absent. Returns the stored value and whether it was inserted.
  std::pair<Value*, bool> try_emplace(const Key128& key, const Value& value) {
    if ((size_ + 1) * 2 > slots_.size()) rebuild(slots_.size() * 2);
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (!s.used) {
        s.key = key;
        s.value = value;
        s.used = true;
        ++size_;
        return {&s.value, true};
      }
      if (s.key == key) return {&s.value, false};
    }
  }

  bool erase(const Key128& key) {
    size_t i = home(key);
    for (;; i = (i + 1) & mask_) {
      if (!slots_[i].used) return false;
      if (slots_[i].key == key) break;
    }
    // Backward shift: pull later members of the probe run into the hole when their home slot
    // does not lie cyclically in (hole, j].
    for (size_t j = (i + 1) & mask_; slots_[j].used; j = (j + 1) & mask_) {
      size_t h = home(slots_[j].key);
      bool stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
      if (!stays) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].used = false;
    --size_;
    return true;
  }

  template <class F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_)
      if (s.used) f(s.key, s.value);
  }

  void clear() { rebuild(16); }

 private:
  // Aligned to a power of two (at most a cache line) so no slot straddles two lines: a hit
  // costs one memory access even when the table is far larger than the caches.
  static constexpr size_t kSlotAlign = std::bit_ceil(std::min<size_t>(sizeof(Key128) + sizeof(Value) + 1, 64));
  struct alignas(kSlotAlign) Slot {
    Key128 key;
    Value value;
    bool used = false;
  };

  static size_t round_up(size_t n) {
    size_t c = 16;
    while (c < n) c *= 2;
    return c;
  }
  size_t home(const Key128& key) const { return static_cast<size_t>(key.lo) & mask_; }

  void rebuild(size_t capacity) {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
    size_ = 0;
    for (const Slot& s : old)
      if (s.used) try_emplace(s.key, s.value);
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace samcache
