#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "samcache/errors.h"
#include "samcache/transfer_engine.h"

using samcache::CopySpan;
using samcache::TransferEngine;

// Random scatter copies in many jobs and threads land exactly where a plain copy puts them, and a
// layer is complete whenever wait(layer) returns (checked before the later layers are waited for).
TEST(TransferEngine, CopiesEveryLayerAndWaitsPerLayer) {
  std::mt19937_64 rng(3);
  for (int threads : {1, 3}) {
    TransferEngine engine(threads);
    for (int round = 0; round < 20; ++round) {
      const int layers = 1 + static_cast<int>(rng() % 6), rows = 1 + static_cast<int>(rng() % 40), width = 16;
      std::vector<std::vector<std::uint8_t>> src(layers, std::vector<std::uint8_t>(rows * width));
      std::vector<std::vector<std::uint8_t>> dst(layers, std::vector<std::uint8_t>(rows * 2 * width, 0xAB));
      std::vector<std::vector<CopySpan>> spans(layers);
      std::vector<int> where(rows);
      for (int r = 0; r < rows; ++r) where[r] = 2 * r + static_cast<int>(rng() % 2);  // scattered, disjoint
      for (int l = 0; l < layers; ++l) {
        for (auto& b : src[l]) b = static_cast<std::uint8_t>(rng());
        for (int r = 0; r < rows; ++r)
          spans[l].push_back({src[l].data() + r * width, dst[l].data() + where[r] * width, std::size_t(width)});
      }
      auto job = engine.submit(spans);
      for (int l = 0; l < layers; ++l) {
        engine.wait(job, l);
        EXPECT_GT(engine.progress(job), l);
        for (int r = 0; r < rows; ++r)
          for (int b = 0; b < width; ++b) ASSERT_EQ(dst[l][where[r] * width + b], src[l][r * width + b]);
      }
      engine.release(job);
      EXPECT_THROW(engine.progress(job), samcache::NotFound);
    }
    auto s = engine.stats();
    EXPECT_EQ(s.jobs, 20u);
    EXPECT_GT(s.bytes, 0u);
  }
}

TEST(TransferEngine, RefusesBadJobs) {
  TransferEngine engine(1);
  std::vector<std::uint8_t> a(64), b(64);
  EXPECT_THROW(engine.submit({}), std::invalid_argument);
  EXPECT_THROW(engine.submit({{{a.data(), b.data(), 32}, {a.data(), b.data() + 16, 32}}}), std::invalid_argument);
  EXPECT_THROW(engine.submit({{{nullptr, b.data(), 8}}}), std::invalid_argument);
  auto job = engine.submit({{{a.data(), b.data(), 8}}});
  EXPECT_THROW(engine.wait(job, 1), std::invalid_argument);
  EXPECT_THROW(engine.wait(job + 100, 0), samcache::NotFound);
  EXPECT_THROW(TransferEngine(0), std::invalid_argument);
  engine.release(job);
}
