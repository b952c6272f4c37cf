// How many tasks the CPU kernels' parallel loops ran and on how many threads: what a test reads
// to know that a large input took the parallel path (equal values cannot tell). Two relaxed
// atomic updates per task, which copies at least tens of KiB.
#pragma once

#include <atomic>
#include <bit>
#include <cstdint>
#include <utility>

namespace samcache {

struct ParallelStats {
  std::atomic<int64_t> tasks{0};
  std::atomic<uint64_t> threads{0};  // bit t: thread t ran a task (threads past 63 share bit 63)
};

inline ParallelStats& parallel_stats() {
  static ParallelStats stats;  // one instance in the extension
  return stats;
}

inline void note_parallel_task(int thread) {
  ParallelStats& s = parallel_stats();
  s.tasks.fetch_add(1, std::memory_order_relaxed);
  s.threads.fetch_or(uint64_t{1} << (thread < 0 ? 0 : thread > 63 ? 63 : thread), std::memory_order_relaxed);
}

// (tasks, distinct threads) since the last reset.
inline std::pair<int64_t, int> take_parallel_stats(bool reset) {
  ParallelStats& s = parallel_stats();
  // With reset, read and clear in one step each: a task noted meanwhile is counted once.
  if (reset) return {s.tasks.exchange(0), std::popcount(s.threads.exchange(0))};
  return {s.tasks.load(), std::popcount(s.threads.load())};
}

}  // namespace samcache
