#include "samcache/content_index.h"

#include <stdexcept>
#include <string>

#include "samcache/errors.h"

namespace samcache {

namespace {
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

ContentIndex::ContentIndex(int64_t capacity_bytes) : capacity_(capacity_bytes) {
  if (capacity_bytes < 0) throw std::invalid_argument("capacity_bytes must be >= 0, got " + str(capacity_bytes));
}

ContentEntry& ContentIndex::must_find(const Key128& key) {
  ContentEntry* e = table_.find(key);
  if (e == nullptr) throw NotFound("key is not in the content index");
  return *e;
}

std::optional<ContentEntry> ContentIndex::get(const Key128& key) {
  std::lock_guard lock(mu_);
  ContentEntry* e = table_.find(key);
  if (e == nullptr) {
    ++misses_;
    return std::nullopt;
  }
  ++hits_;
  e->last_use = ++clock_;  // its heap node is now stale; corrected when it surfaces
  return *e;
}

int64_t ContentIndex::get_many(const Key128* keys, size_t n, int64_t* handles_out) {
  constexpr size_t kAhead = 8;  // prefetch distance: overlaps the cache misses of a batch
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < n && i < kAhead; ++i) table_.prefetch(keys[i]);
  int64_t found = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) table_.prefetch(keys[i + kAhead]);
    ContentEntry* e = table_.find(keys[i]);
    if (e == nullptr) {
      handles_out[i] = -1;
      continue;
    }
    e->last_use = ++clock_;
    handles_out[i] = e->handle;
    ++found;
  }
  hits_ += found;
  misses_ += static_cast<int64_t>(n) - found;
  return found;
}

std::optional<ContentEntry> ContentIndex::peek(const Key128& key) const {
  std::lock_guard lock(mu_);
  const ContentEntry* e = table_.find(key);
  if (e == nullptr) return std::nullopt;
  return *e;
}

void ContentIndex::push_node(const Key128& key, const ContentEntry& e) {
  heap_.push(e.priority, e.last_use, key);
  heap_.rebuild_if_needed(table_.size(), [this](auto&& push) {
    table_.for_each([&](const Key128& k, const ContentEntry& x) {
      if (x.pins == 0) push(x.priority, x.last_use, k);
    });
  });
}

bool ContentIndex::evict_one(std::vector<EvictedEntry>* evicted) {
  using Heap = EvictionHeap<Key128>;
  auto node = heap_.pop([this](const Heap::Node& n) {
    const ContentEntry* e = table_.find(n.id);
    if (e == nullptr || e->pins > 0) return Heap::kStale;  // gone, or re-pushed on unpin
    // set_priority always pushes a node with the new priority, so an old priority is stale.
    if (e->priority != n.priority) return Heap::kStale;
    if (e->last_use != n.tick) {  // used since this node was pushed: requeue at its last use
      heap_.push(e->priority, e->last_use, n.id);
      return Heap::kRefresh;
    }
    return Heap::kCurrent;
  });
  if (!node) return false;
  ContentEntry e = *table_.find(node->id);
  table_.erase(node->id);
  used_ -= e.size_bytes;
  ++evictions_;
  evicted->push_back({node->id, e});
  return true;
}

bool ContentIndex::put(const Key128& key, int64_t handle, int64_t size_bytes, Tier tier, int32_t priority,
                       std::vector<EvictedEntry>* evicted) {
  // Zero-byte entries would never be evicted by a byte bound, so the index could grow forever.
  if (size_bytes <= 0) throw std::invalid_argument("size_bytes must be > 0, got " + str(size_bytes));
  if (static_cast<int>(tier) < 0 || static_cast<int>(tier) >= kNumTiers)
    throw std::invalid_argument("tier must be 0 (device), 1 (host) or 2 (disk)");
  std::lock_guard lock(mu_);
  if (table_.find(key) != nullptr) return false;
  if (size_bytes > capacity_ - pinned_bytes_)  // subtraction: no signed overflow for huge sizes
    throw CacheFull("entry of " + str(size_bytes) + " bytes cannot fit: capacity " + str(capacity_) +
                    ", pinned " + str(pinned_bytes_));
  while (size_bytes > capacity_ - used_)
    if (!evict_one(evicted)) throw std::logic_error("content index: unpinned bytes not found in heap");
  ContentEntry e;
  e.handle = handle;
  e.size_bytes = size_bytes;
  e.tier = tier;
  e.priority = priority;
  e.last_use = ++clock_;
  table_.try_emplace(key, e);
  used_ += size_bytes;
  ++inserts_;
  push_node(key, e);
  return true;
}

ContentEntry ContentIndex::remove(const Key128& key) {
  std::lock_guard lock(mu_);
  ContentEntry e = must_find(key);
  if (e.pins > 0) throw std::invalid_argument("cannot remove a pinned entry (pins=" + str(e.pins) + ")");
  table_.erase(key);  // its heap node goes stale
  used_ -= e.size_bytes;
  return e;
}

void ContentIndex::pin(const Key128& key) {
  std::lock_guard lock(mu_);
  ContentEntry& e = must_find(key);
  if (e.pins++ == 0) pinned_bytes_ += e.size_bytes;
}

void ContentIndex::unpin(const Key128& key) {
  std::lock_guard lock(mu_);
  ContentEntry& e = must_find(key);
  if (e.pins == 0) throw std::invalid_argument("unpin of an entry that is not pinned");
  if (--e.pins == 0) {
    pinned_bytes_ -= e.size_bytes;
    const ContentEntry copy = e;  // push_node may compact, but never moves table slots
    push_node(key, copy);
  }
}

void ContentIndex::set_priority(const Key128& key, int32_t priority) {
  std::lock_guard lock(mu_);
  ContentEntry& e = must_find(key);
  if (e.priority == priority) return;
  e.priority = priority;
  const ContentEntry copy = e;
  if (copy.pins == 0) push_node(key, copy);
}

void ContentIndex::set_tier(const Key128& key, Tier tier) {
  if (static_cast<int>(tier) < 0 || static_cast<int>(tier) >= kNumTiers)
    throw std::invalid_argument("tier must be 0 (device), 1 (host) or 2 (disk)");
  std::lock_guard lock(mu_);
  must_find(key).tier = tier;
}

std::vector<EvictedEntry> ContentIndex::evict_until(int64_t target_bytes) {
  if (target_bytes < 0) throw std::invalid_argument("target_bytes must be >= 0, got " + str(target_bytes));
  std::lock_guard lock(mu_);
  std::vector<EvictedEntry> out;
  while (used_ > target_bytes && evict_one(&out)) {
  }
  return out;
}

ContentIndexStats ContentIndex::stats() const {
  std::lock_guard lock(mu_);
  return ContentIndexStats{static_cast<int64_t>(table_.size()), used_, pinned_bytes_, capacity_,
                           hits_, misses_, inserts_, evictions_, static_cast<int64_t>(heap_.size())};
}

void ContentIndex::check_invariants() const {
  std::lock_guard lock(mu_);
  auto fail = [](const std::string& what) { throw InvariantViolation("ContentIndex invariant: " + what); };
  int64_t used = 0, pinned = 0, unpinned_entries = 0;
  table_.for_each([&](const Key128&, const ContentEntry& e) {
    if (e.size_bytes < 0 || e.pins < 0) fail("negative size or pin count");
    used += e.size_bytes;
    if (e.pins > 0) pinned += e.size_bytes; else ++unpinned_entries;
  });
  if (used != used_) fail("used bytes " + str(used_) + " != sum of entries " + str(used));
  if (pinned != pinned_bytes_) fail("pinned bytes " + str(pinned_bytes_) + " != " + str(pinned));
  if (used_ > capacity_) fail("used bytes " + str(used_) + " exceed capacity " + str(capacity_));
  // Every unpinned entry must be reachable by eviction: some node for it with the current
  // priority and a tick no newer than its last use.
  FlatTable<uint8_t> reachable;
  heap_.for_each([&](const auto& n) {
    const ContentEntry* e = table_.find(n.id);
    if (e != nullptr && e->pins == 0 && e->priority == n.priority && n.tick <= e->last_use)
      reachable.try_emplace(n.id, 1);
  });
  if (static_cast<int64_t>(reachable.size()) != unpinned_entries)
    fail(str(unpinned_entries - static_cast<int64_t>(reachable.size())) + " unpinned entries are unreachable by eviction");
}

}  // namespace samcache
