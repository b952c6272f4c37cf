#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>

#include "samcache/content_index.h"
#include "samcache/errors.h"

using namespace samcache;

namespace {
Key128 k(uint64_t i) { return Key128{i * 0x9E3779B97F4A7C15ull, ~i}; }
}  // namespace

TEST(ContentIndex, PutGetAndByteBound) {
  ContentIndex c(100);
  std::vector<EvictedEntry> ev;
  EXPECT_TRUE(c.put(k(1), 7, 40, Tier::kDevice, 0, &ev));
  EXPECT_FALSE(c.put(k(1), 8, 40, Tier::kDevice, 0, &ev));  // present: unchanged
  EXPECT_EQ(c.get(k(1))->handle, 7);
  EXPECT_FALSE(c.get(k(2)).has_value());
  EXPECT_TRUE(c.put(k(2), 8, 40, Tier::kHost, 0, &ev));
  EXPECT_TRUE(ev.empty());
  c.get(k(1));  // k(2) is now least recently used
  EXPECT_TRUE(c.put(k(3), 9, 40, Tier::kDevice, 0, &ev));
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].key, k(2));
  EXPECT_EQ(ev[0].entry.handle, 8);
  EXPECT_EQ(c.stats().used_bytes, 80);
  c.check_invariants();
}

TEST(ContentIndex, PinnedNeverEvictedAndPriorityOrders) {
  ContentIndex c(100);
  std::vector<EvictedEntry> ev;
  c.put(k(1), 1, 30, Tier::kDevice, 0, &ev);
  c.put(k(2), 2, 30, Tier::kDevice, 9, &ev);
  c.put(k(3), 3, 30, Tier::kDevice, 0, &ev);
  c.pin(k(1));
  auto out = c.evict_until(0);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].key, k(3));  // priority 0 before priority 9
  EXPECT_EQ(out[1].key, k(2));
  EXPECT_TRUE(c.peek(k(1)).has_value());
  EXPECT_THROW(c.put(k(4), 4, 71, Tier::kDevice, 0, &ev), CacheFull);
  EXPECT_THROW(c.remove(k(1)), std::invalid_argument);
  c.unpin(k(1));
  EXPECT_THROW(c.unpin(k(1)), std::invalid_argument);
  EXPECT_EQ(c.evict_until(0).size(), 1u);
  EXPECT_THROW(c.pin(k(1)), NotFound);
  EXPECT_THROW(c.evict_until(-1), std::invalid_argument);
  EXPECT_THROW(c.put(k(5), 5, -1, Tier::kDevice, 0, &ev), std::invalid_argument);
  c.check_invariants();
}

TEST(ContentIndex, LowerPriorityLaterStillEvictsFirst) {
  ContentIndex c(100);
  std::vector<EvictedEntry> ev;
  c.put(k(1), 1, 50, Tier::kDevice, 5, &ev);
  c.put(k(2), 2, 50, Tier::kDevice, 5, &ev);
  c.set_priority(k(2), -1);
  auto out = c.evict_until(50);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].key, k(2));
  c.check_invariants();
}

TEST(ContentIndex, ConcurrentStressKeepsInvariants) {
  ContentIndex c(1 << 16);
  std::atomic<int> errors{0};
  auto worker = [&](int seed) {
    std::mt19937_64 rng(seed);
    std::vector<EvictedEntry> ev;
    for (int step = 0; step < 50000; ++step) {
      Key128 key = k(rng() % 2000);
      try {
        switch (rng() % 7) {
          case 0: case 1: c.put(key, int64_t(step), 1 + int64_t(rng() % 512), Tier::kDevice, int32_t(rng() % 3), &ev); break;
          case 2: c.get(key); break;
          case 3: c.pin(key); c.unpin(key); break;
          case 4: c.set_priority(key, int32_t(rng() % 3)); break;
          case 5: c.remove(key); break;
          default: c.evict_until(1 << 15);
        }
      } catch (const NotFound&) {
      } catch (const std::invalid_argument&) {  // remove of an entry pinned by another thread
      } catch (...) {
        ++errors;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back(worker, i + 1);
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  c.check_invariants();
  EXPECT_LE(c.stats().used_bytes, 1 << 16);
}
