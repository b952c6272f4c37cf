// The eviction order shared by the block pool and the content index: lowest priority first,
// then least recently used.
//
// Priorities come from a policy above us (LRU when every priority is 0; workflow-aware
// policies set them from Python in batches). The heap is lazy: an owner never searches it to
// update an entry. It pushes a new node when an entry's (priority, tick) changes, and when a
// node reaches the top the owner's `current` predicate says whether it still describes the
// entry; stale nodes are dropped then, or in bulk by `compact`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace samcache {

template <class Id>
class EvictionHeap {
 public:
  struct Node {
    int32_t priority;
    uint64_t tick;  // larger = used more recently
    Id id;
  };

  void push(int32_t priority, uint64_t tick, const Id& id) {
    heap_.push_back(Node{priority, tick, id});
    std::push_heap(heap_.begin(), heap_.end(), later);
  }

  // Pops until a node satisfies `classify(node)` == kCurrent and returns it. `classify` may
  // also answer kStale (drop it) or kRefresh (the entry is evictable but its node is outdated:
  // the caller re-pushes inside classify, and we keep looking).
  enum Verdict { kCurrent, kStale, kRefresh };
  template <class Classify>
  std::optional<Node> pop(Classify&& classify) {
    while (!heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), later);
      Node top = heap_.back();
      heap_.pop_back();
      if (classify(top) == kCurrent) return top;
    }
    return std::nullopt;
  }

  // Drops stale nodes once they outnumber live entries; `current(node)` tells which to keep.
  template <class Current>
  void compact_if_needed(size_t live_entries, Current&& current) {
    if (heap_.size() <= 2 * live_entries + 1024) return;
    std::erase_if(heap_, [&](const Node& n) { return !current(n); });
    std::make_heap(heap_.begin(), heap_.end(), later);
  }

  template <class F>
  void for_each(F&& f) const {
    for (const Node& n : heap_) f(n);
  }
  size_t size() const { return heap_.size(); }

 private:
  // std heap functions build a max-heap of `less`; "later" puts the next victim on top.
  static bool later(const Node& a, const Node& b) {
    if (a.priority != b.priority) return a.priority > b.priority;
    return a.tick > b.tick;
  }
  std::vector<Node> heap_;
};

}  // namespace samcache
