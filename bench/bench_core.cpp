// samcache_bench_core: single-threaded microbenchmark of the native data structures, against
// the bars of the native-core issue. Usage: samcache_bench_core [--quick]
//
//   alloc+free    blocks allocated and freed per second through the sequence API
//   lookups       ContentIndex hits per second (get, and get_many batches), by table size
//   fork          time to fork a 1,000-block sequence
// Baselines in the same run: a bare free-list (the floor of any allocator) for alloc+free, and
// std::unordered_map behind a mutex for lookups.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <random>
#include <string>
#include <vector>

#include "samcache/block_pool.h"
#include "samcache/content_index.h"

using namespace samcache;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void report(const char* what, double value, const char* unit, double bar, bool higher_is_better) {
  const bool ok = higher_is_better ? value >= bar : value <= bar;
  if (bar <= 0) {  // a baseline or an unbarred figure
    std::printf("%-46s %10.2f %s\n", what, value, unit);
    return;
  }
  std::printf("%-46s %10.2f %-6s bar %s %5.1f  %s\n", what, value, unit, higher_is_better ? ">=" : "<=", bar,
              ok ? "OK" : "BELOW BAR");
}

// Best of `reps` runs of fn(), which returns operations done; result in operations/second.
template <class F>
double best_rate(int reps, F&& fn) {
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    double ops = fn();
    best = std::max(best, ops / seconds_since(t0));
  }
  return best;
}

void bench_alloc_free(int scale) {
  const int32_t bs = 16;
  BlockPool pool(4096, bs);
  std::vector<int32_t> slots(int64_t(bs) * 64);
  std::vector<CopyPair> copies;
  for (int blocks_per_append : {1, 64}) {
    const int iters = scale * 2'000'000 / blocks_per_append;
    double rate = best_rate(3, [&] {
      for (int i = 0; i < iters; ++i) {
        SeqId s = pool.new_sequence();
        pool.append_slots(s, int64_t(bs) * blocks_per_append, slots.data(), &copies);
        pool.free_sequence(s);
      }
      return double(iters) * blocks_per_append;
    });
    std::string what = "alloc+free block pairs, " + std::to_string(blocks_per_append) + "-block sequences";
    report(what.c_str(), rate / 1e6, "M/s", 10.0, true);
  }
  {
    std::vector<int32_t> free_list(4096), table;
    for (int i = 0; i < 4096; ++i) free_list[i] = i;
    const int iters = scale * 2'000'000 / 64;
    double floor_rate = best_rate(3, [&] {
      for (int i = 0; i < iters; ++i) {
        for (int b = 0; b < 64; ++b) {
          table.push_back(free_list.back());
          free_list.pop_back();
        }
        for (int b = 0; b < 64; ++b) {
          free_list.push_back(table.back());
          table.pop_back();
        }
      }
      return double(iters) * 64;
    });
    report("  baseline: bare free-list pop/push", floor_rate / 1e6, "M/s", 0, true);
  }
  // Prefix-cached churn: hashed blocks stay cached, so every allocation evicts one (heap path).
  BlockPool cached(1024, bs);
  std::vector<int32_t> tokens(int64_t(bs) * 64);
  uint32_t salt = 0;
  const int iters = scale * 20'000;
  double rate = best_rate(3, [&] {
    for (int i = 0; i < iters; ++i) {
      for (auto& t : tokens) t = int32_t(++salt);  // new content every time: always a miss
      SeqId s = cached.new_sequence();
      cached.append_tokens(s, tokens.data(), int64_t(tokens.size()), nullptr, 0, slots.data(), &copies);
      cached.free_sequence(s);
    }
    return double(iters) * 64;
  });
  report("hashed append+free+evict, 64-block sequences", rate / 1e6, "M/s", 0, true);
}

void bench_lookups(int scale) {
  std::mt19937_64 rng(1);
  for (size_t n : {size_t(10'000), size_t(100'000), size_t(1'000'000)}) {
    ContentIndex index(int64_t(1) << 50);
    std::vector<Key128> keys(n);
    std::vector<EvictedEntry> ev;
    for (size_t i = 0; i < n; ++i) {
      keys[i] = Key128{rng(), rng()};
      index.put(keys[i], int64_t(i), 1 << 20, Tier::kDevice, 0, &ev);
    }
    const size_t q = size_t(scale) * 4'000'000;
    std::vector<Key128> queries(q);
    for (auto& k : queries) k = keys[rng() % n];
    int64_t sink = 0;
    double single = best_rate(3, [&] {
      for (const Key128& k : queries) sink += index.get(k)->handle;
      return double(q);
    });
    std::vector<int64_t> handles(1024);
    double batch = best_rate(3, [&] {
      for (size_t i = 0; i + 1024 <= q; i += 1024) sink += index.get_many(&queries[i], 1024, handles.data());
      return double(q / 1024 * 1024);
    });
    struct KeyHash {
      size_t operator()(const Key128& k) const { return k.lo ^ (k.hi * 0x9E3779B97F4A7C15ull); }
    };
    std::unordered_map<Key128, ContentEntry, KeyHash> std_map;
    std::mutex mu;
    for (size_t i = 0; i < n; ++i) std_map[keys[i]].handle = int64_t(i);
    double baseline = best_rate(3, [&] {
      for (const Key128& k : queries) {
        std::lock_guard lock(mu);
        auto it = std_map.find(k);
        it->second.last_use++;
        sink += it->second.handle;
      }
      return double(q);
    });
    std::string a = "index get, " + std::to_string(n) + " entries";
    std::string b = "index get_many(1024), " + std::to_string(n) + " entries";
    report(a.c_str(), single / 1e6, "M/s", 10.0, true);
    report(b.c_str(), batch / 1e6, "M/s", 10.0, true);
    report("  baseline: std::unordered_map + mutex", baseline / 1e6, "M/s", 0, true);
    std::printf("  get vs baseline %.2fx, get_many vs baseline %.2fx\n", single / baseline, batch / baseline);
    if (sink == 42) std::puts("");  // keep the loops alive
  }
}

void bench_fork(int scale) {
  const int32_t bs = 16;
  BlockPool pool(2048, bs);
  SeqId parent = pool.new_sequence();
  std::vector<int32_t> slots(int64_t(bs) * 1000);
  std::vector<CopyPair> copies;
  pool.append_slots(parent, int64_t(bs) * 1000, slots.data(), &copies);
  const int n = scale * 2000;
  std::vector<SeqId> children(n);
  double best_us = 1e9;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) children[i] = pool.fork(parent);
    best_us = std::min(best_us, seconds_since(t0) * 1e6 / n);
    for (SeqId c : children) pool.free_sequence(c);
  }
  report("fork of a 1,000-block sequence", best_us, "us", 20.0, false);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int scale = quick ? 1 : 5;
  std::printf("samcache_bench_core (%s, single thread)\n", quick ? "quick" : "full");
  bench_alloc_free(scale);
  bench_lookups(scale);
  bench_fork(scale);
  return 0;
}
