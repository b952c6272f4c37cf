// Content-addressed index: 128-bit content key -> entry (payload handle, size, tier, pins,
// last use, priority), bounded in bytes.
//
// Keys are namespaced digests (the Python layer derives them from model id + tenant salt +
// content hash), so entries of different models or tenants can never collide by design.
// Eviction takes unpinned entries, lowest priority first, then least recently used; pinned
// entries are never evicted. Lookups touch only the table (one probe, one write of last_use);
// the eviction order is kept in a lazy heap that is corrected when a node surfaces.
//
// Threading: one mutex guards all state; every public method takes it.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "samcache/eviction_heap.h"
#include "samcache/flat_table.h"
#include "samcache/key128.h"

namespace samcache {

enum class Tier : uint8_t { kDevice = 0, kHost = 1, kDisk = 2 };
constexpr int kNumTiers = 3;

struct ContentEntry {
  int64_t handle = 0;      // the owner's payload id (a slot, an offset, a Python-side id)
  int64_t size_bytes = 0;  // counted against capacity
  Tier tier = Tier::kDevice;
  int32_t pins = 0;        // > 0: never evicted
  uint64_t last_use = 0;   // logical clock, larger = more recent
  int32_t priority = 0;    // higher = kept longer
};

struct EvictedEntry {
  Key128 key;
  ContentEntry entry;
};

struct ContentIndexStats {
  int64_t entries, used_bytes, pinned_bytes, capacity_bytes;
  int64_t hits, misses, inserts, evictions, eviction_heap_nodes;
};

class ContentIndex {
 public:
  explicit ContentIndex(int64_t capacity_bytes);

  // A hit refreshes last_use and counts in hits; a miss counts in misses.
  std::optional<ContentEntry> get(const Key128& key);
  // Like get for n keys: handles_out[i] = handle, or -1 on a miss. Returns the hit count.
  int64_t get_many(const Key128* keys, size_t n, int64_t* handles_out);
  // No side effects: no stats, no recency.
  std::optional<ContentEntry> peek(const Key128& key) const;

  // Inserts if the key is absent, first evicting unpinned entries until the new one fits (they
  // are appended to `evicted` so the caller can free their payloads). Returns false, changing
  // nothing, if the key is present. Throws CacheFull, changing nothing, if it cannot fit.
  bool put(const Key128& key, int64_t handle, int64_t size_bytes, Tier tier, int32_t priority,
           std::vector<EvictedEntry>* evicted);
  // Removes an unpinned entry; throws NotFound / std::invalid_argument (pinned).
  ContentEntry remove(const Key128& key);

  void pin(const Key128& key);
  void unpin(const Key128& key);
  void set_priority(const Key128& key, int32_t priority);
  void set_tier(const Key128& key, Tier tier);

  // Evicts unpinned entries in eviction order until used bytes <= target_bytes (or nothing
  // unpinned is left). Returns what was evicted, in order.
  std::vector<EvictedEntry> evict_until(int64_t target_bytes);

  int64_t capacity_bytes() const { return capacity_; }
  ContentIndexStats stats() const;
  void check_invariants() const;

 private:
  ContentEntry& must_find(const Key128& key);
  void push_node(const Key128& key, const ContentEntry& e);
  bool evict_one(std::vector<EvictedEntry>* evicted);

  const int64_t capacity_;
  mutable std::mutex mu_;
  FlatTable<ContentEntry> table_;
  EvictionHeap<Key128> heap_;
  int64_t used_ = 0, pinned_bytes_ = 0;
  uint64_t clock_ = 0;
  int64_t hits_ = 0, misses_ = 0, inserts_ = 0, evictions_ = 0;
};

}  // namespace samcache
