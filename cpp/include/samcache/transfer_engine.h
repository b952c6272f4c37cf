// The transfer engine of the memory tiers: copies a cached item's KV between tiers layer by layer
// in worker threads, so the model computes layer l while layers l+1.. are still loading. A job
// is a list of layers, each a list of byte ranges (source, destination, length); workers copy the
// layers of a job in order and publish its progress, and a caller waits for the one layer it
// needs (wait), never for the whole transfer. Raw pointers only (no torch here): the caller keeps
// the memory alive until the job is released. On CUDA the same interface runs on a side stream
// with one event per layer (the Python wrapper, samcache/cache/tiers/transfer.py).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace samcache {

struct CopySpan {
  const void* src;
  void* dst;
  std::size_t bytes;
};

struct TransferStats {
  std::uint64_t jobs = 0;
  std::uint64_t layers = 0;
  std::uint64_t bytes = 0;
  double copy_seconds = 0;  // worker time spent copying (off the caller's critical path)
  double wait_seconds = 0;  // time callers spent blocked in wait / wait_all
};

class TransferEngine {
 public:
  explicit TransferEngine(int num_threads);
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // Queue a job (copied in FIFO order with the others); returns its id. Overlapping destination
  // ranges inside a job are refused (std::invalid_argument): they would race between layers.
  std::uint64_t submit(std::vector<std::vector<CopySpan>> layers);
  // Block until layers [0, layer] of the job are copied.
  void wait(std::uint64_t job, int layer);
  void wait_all(std::uint64_t job);
  // Layers of the job copied so far.
  int progress(std::uint64_t job) const;
  int num_layers(std::uint64_t job) const;
  // Seconds the workers spent copying this job so far.
  double job_seconds(std::uint64_t job) const;
  // Forget a finished job (waits for it first). Unknown ids raise NotFound.
  void release(std::uint64_t job);
  TransferStats stats() const;
  int num_threads() const { return static_cast<int>(workers_.size()); }

 private:
  struct Job {
    std::vector<std::vector<CopySpan>> layers;
    int done = 0;
    double seconds = 0;
  };
  void run();
  std::shared_ptr<Job> find(std::uint64_t job) const;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;      // workers: a job was queued, or stop
  mutable std::condition_variable done_cv_;  // callers: a layer finished
  std::deque<std::shared_ptr<Job>> queue_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Job>> jobs_;
  std::uint64_t next_id_ = 1;
  bool stop_ = false;
  TransferStats stats_;
  std::vector<std::thread> workers_;
};

}  // namespace samcache
