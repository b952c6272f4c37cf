#include "samcache/transfer_engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "samcache/errors.h"

namespace samcache {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

TransferEngine::TransferEngine(int num_threads) {
  if (num_threads < 1 || num_threads > 64)
    throw std::invalid_argument("num_threads must be in [1, 64], got " + std::to_string(num_threads));
  workers_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) workers_.emplace_back([this] { run(); });
}

TransferEngine::~TransferEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;  // workers finish the queued jobs first: callers may still wait on them
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

std::uint64_t TransferEngine::submit(std::vector<std::vector<CopySpan>> layers) {
  if (layers.empty()) throw std::invalid_argument("a transfer job needs at least one layer");
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> ranges;
  for (const auto& layer : layers)
    for (const auto& s : layer) {
      if (s.bytes == 0) continue;
      if (s.src == nullptr || s.dst == nullptr) throw std::invalid_argument("a copy span has a null pointer");
      auto d = reinterpret_cast<std::uintptr_t>(s.dst);
      ranges.emplace_back(d, d + s.bytes);
    }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second)
      throw std::invalid_argument("the destination ranges of a transfer job overlap");
  auto job = std::make_shared<Job>();
  job->layers = std::move(layers);
  std::uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw std::runtime_error("the transfer engine is shutting down");
    id = next_id_++;
    jobs_.emplace(id, job);
    queue_.push_back(std::move(job));
    stats_.jobs += 1;
  }
  work_cv_.notify_one();
  return id;
}

void TransferEngine::run() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    for (const auto& layer : job->layers) {
      auto t0 = std::chrono::steady_clock::now();
      std::size_t bytes = 0;
      for (const auto& s : layer) {
        if (s.bytes) std::memcpy(s.dst, s.src, s.bytes);
        bytes += s.bytes;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        double s = seconds_since(t0);
        job->done += 1;
        job->seconds += s;
        stats_.layers += 1;
        stats_.bytes += bytes;
        stats_.copy_seconds += s;
      }
      done_cv_.notify_all();
    }
  }
}

std::shared_ptr<TransferEngine::Job> TransferEngine::find(std::uint64_t job) const {
  auto it = jobs_.find(job);
  if (it == jobs_.end()) throw NotFound("unknown transfer job " + std::to_string(job));
  return it->second;
}

void TransferEngine::wait(std::uint64_t job, int layer) {
  std::unique_lock<std::mutex> lock(mu_);
  auto j = find(job);
  int n = static_cast<int>(j->layers.size());
  if (layer < 0 || layer >= n)
    throw std::invalid_argument("layer " + std::to_string(layer) + " is outside the job's " + std::to_string(n));
  if (j->done > layer) return;
  auto t0 = std::chrono::steady_clock::now();
  done_cv_.wait(lock, [&] { return j->done > layer; });
  stats_.wait_seconds += seconds_since(t0);
}

void TransferEngine::wait_all(std::uint64_t job) {
  int n;
  {
    std::lock_guard<std::mutex> lock(mu_);
    n = static_cast<int>(find(job)->layers.size());
  }
  wait(job, n - 1);
}

int TransferEngine::progress(std::uint64_t job) const {
  std::lock_guard<std::mutex> lock(mu_);
  return find(job)->done;
}

int TransferEngine::num_layers(std::uint64_t job) const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(find(job)->layers.size());
}

double TransferEngine::job_seconds(std::uint64_t job) const {
  std::lock_guard<std::mutex> lock(mu_);
  return find(job)->seconds;
}

void TransferEngine::release(std::uint64_t job) {
  wait_all(job);
  std::lock_guard<std::mutex> lock(mu_);
  jobs_.erase(job);
}

TransferStats TransferEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace samcache
