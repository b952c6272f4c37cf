// The eviction order shared by the block pool and the content index: lowest priority first,
// then least recently used.
//
// Priorities come from a policy above us (LRU when every priority is 0; workflow-aware
// policies set them from Python in batches). The heap is lazy: an owner never searches it to
// update an entry. It pushes a new node when an entry's (priority, tick) changes, and when a
// node reaches the top the owner says whether it still describes the entry; stale nodes are
// dropped then, or all at once when the owner rebuilds the heap from its entries.
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

  // Once nodes outnumber live entries 2:1, rebuilds the heap from the owner's truth:
  // `emit_live(push)` calls push(priority, tick, id) once per evictable entry.
  template <class EmitLive>
  void rebuild_if_needed(size_t live_entries, EmitLive&& emit_live) {
    if (heap_.size() <= 2 * live_entries + 1024) return;
    heap_.clear();
    emit_live([this](int32_t priority, uint64_t tick, const Id& id) { heap_.push_back(Node{priority, tick, id}); });
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
