#include <gtest/gtest.h>

#include <map>
#include <random>

#include "samcache/flat_table.h"

using samcache::FlatTable;
using samcache::Key128;

TEST(FlatTable, MatchesStdMapUnderRandomOps) {
  std::mt19937_64 rng(7);
  FlatTable<int> table;
  std::map<Key128, int> ref;
  // Few distinct low bits force long probe runs and wrap-around, the cases backward shift must get right.
  auto key = [&] { return Key128{rng() % 64 | (rng() % 4) << 62, rng() % 8}; };
  for (int step = 0; step < 200000; ++step) {
    Key128 k = key();
    switch (rng() % 3) {
      case 0: {
        int v = static_cast<int>(rng() % 1000);
        auto [p, inserted] = table.try_emplace(k, v);
        auto [it, ref_inserted] = ref.try_emplace(k, v);
        ASSERT_EQ(inserted, ref_inserted);
        ASSERT_EQ(*p, it->second);
        break;
      }
      case 1:
        ASSERT_EQ(table.erase(k), ref.erase(k) == 1);
        break;
      default: {
        const int* p = table.find(k);
        auto it = ref.find(k);
        ASSERT_EQ(p != nullptr, it != ref.end());
        if (p) ASSERT_EQ(*p, it->second);
      }
    }
    ASSERT_EQ(table.size(), ref.size());
  }
  size_t seen = 0;
  table.for_each([&](const Key128& k, int v) {
    ++seen;
    ASSERT_EQ(ref.at(k), v);
  });
  EXPECT_EQ(seen, ref.size());
}

TEST(FlatTable, GrowsAndKeepsLoadAtMostHalf) {
  FlatTable<int> table;
  for (uint64_t i = 0; i < 10000; ++i) table.try_emplace(Key128{i * 0x9E3779B97F4A7C15ull, i}, int(i));
  EXPECT_EQ(table.size(), 10000u);
  EXPECT_LE(table.size() * 2, table.capacity());
  for (uint64_t i = 0; i < 10000; ++i) ASSERT_EQ(*table.find(Key128{i * 0x9E3779B97F4A7C15ull, i}), int(i));
}
