#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <set>
#include <thread>

#include "samcache/block_pool.h"
#include "samcache/errors.h"

using namespace samcache;

namespace {
std::vector<int32_t> append(BlockPool& p, SeqId s, int64_t n, std::vector<CopyPair>* copies = nullptr) {
  std::vector<int32_t> slots(n);
  std::vector<CopyPair> local;
  p.append_slots(s, n, slots.data(), copies ? copies : &local);
  return slots;
}
std::vector<int32_t> append_tokens(BlockPool& p, SeqId s, const std::vector<int32_t>& t,
                                   const std::vector<ExtraKeySpan>& spans = {}) {
  std::vector<int32_t> slots(t.size());
  std::vector<CopyPair> copies;
  p.append_tokens(s, t.data(), int64_t(t.size()), spans.data(), spans.size(), slots.data(), &copies);
  return slots;
}
std::vector<int32_t> iota(int n, int from = 0) {
  std::vector<int32_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = from + i;
  return v;
}
}  // namespace

TEST(BlockPool, SlotsFollowTheBlockTable) {
  BlockPool p(8, 4);
  SeqId s = p.new_sequence();
  auto slots = append(p, s, 6);
  auto table = p.block_table(s);
  ASSERT_EQ(table.size(), 2u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(slots[i], table[i / 4] * 4 + i % 4);
  EXPECT_EQ(p.num_free_blocks(), 6);
  p.free_sequence(s);
  EXPECT_EQ(p.num_free_blocks(), 8);
  p.check_invariants();
}

TEST(BlockPool, ShareBlocksHoldsPartOfASequenceAfterItIsFreed) {
  BlockPool p(8, 4);
  SeqId a = p.new_sequence();
  append_tokens(p, a, iota(14));  // blocks 0..3, the last partial; three hashed
  auto ta = p.block_table(a);
  SeqId h = p.share_blocks(a, 1, 2);
  EXPECT_EQ(p.block_table(h), (std::vector<BlockId>{ta[1], ta[2]}));
  EXPECT_EQ(p.num_tokens(h), 8);
  EXPECT_EQ(p.refcount(ta[1]), 2);
  EXPECT_EQ(p.refcount(ta[0]), 1);
  p.free_sequence(a);
  EXPECT_EQ(p.refcount(ta[1]), 1);  // still held: never evicted nor reallocated
  EXPECT_EQ(p.refcount(ta[0]), 0);
  EXPECT_EQ(p.evict(8), 1);  // only ta[0] was cached and unheld (ta[3] was partial: freed)
  std::vector<int32_t> more(6 * 4 + 1);
  std::vector<CopyPair> copies;
  SeqId b = p.new_sequence();
  EXPECT_THROW(p.append_slots(b, 6 * 4 + 1, more.data(), &copies), OutOfBlocks);  // 6 blocks are not held
  p.append_slots(b, 6 * 4, more.data(), &copies);
  p.check_invariants();
  EXPECT_THROW(p.share_blocks(h, 1, 2), std::invalid_argument);
  EXPECT_THROW(p.share_blocks(h, 0, 0), std::invalid_argument);
  p.free_sequence(h);
  p.free_sequence(b);
  p.check_invariants();
  EXPECT_EQ(p.num_free_blocks(), 8);
}

TEST(BlockPool, ForkSharesAndAppendCopiesOnWrite) {
  BlockPool p(8, 4);
  SeqId a = p.new_sequence();
  append(p, a, 6);  // one full block, one partial
  SeqId b = p.fork(a);
  auto ta = p.block_table(a);
  EXPECT_EQ(p.block_table(b), ta);
  EXPECT_EQ(p.refcount(ta[0]), 2);
  EXPECT_EQ(p.refcount(ta[1]), 2);
  std::vector<CopyPair> copies;
  auto slots = append(p, b, 1, &copies);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, ta[1]);
  auto tb = p.block_table(b);
  EXPECT_EQ(copies[0].dst, tb[1]);
  EXPECT_NE(tb[1], ta[1]);
  EXPECT_EQ(slots[0], tb[1] * 4 + 2);
  EXPECT_EQ(p.refcount(ta[1]), 1);
  EXPECT_EQ(p.refcount(ta[0]), 2);  // full blocks stay shared
  copies.clear();
  append(p, a, 1, &copies);  // a now owns its tail alone: no copy
  EXPECT_TRUE(copies.empty());
  p.check_invariants();
  p.free_sequence(a);
  p.free_sequence(b);
  EXPECT_EQ(p.num_free_blocks(), 8);
  p.check_invariants();
}

TEST(BlockPool, PrefixCacheSurvivesFreeAndIsNamespaced) {
  BlockPool p(16, 4);
  const Key128 tenant_a{1, 2}, tenant_b{3, 4};
  SeqId s = p.new_sequence(tenant_a);
  auto tokens = iota(10);
  append_tokens(p, s, tokens);
  auto table = p.block_table(s);
  p.free_sequence(s);
  auto hit = p.match_prefix(tenant_a, tokens.data(), 10, nullptr, 0);
  ASSERT_EQ(hit.size(), 2u);  // two full blocks; the partial third is never cached
  EXPECT_EQ(hit[0], table[0]);
  EXPECT_EQ(hit[1], table[1]);
  EXPECT_TRUE(p.match_prefix(tenant_b, tokens.data(), 10, nullptr, 0).empty());
  auto other = iota(10, 100);
  EXPECT_TRUE(p.match_prefix(tenant_a, other.data(), 10, nullptr, 0).empty());
  SeqId t = p.new_sequence(tenant_a);
  EXPECT_EQ(p.adopt_prefix(t, tokens.data(), 10, nullptr, 0), 8);
  EXPECT_EQ(p.refcount(table[0]), 1);
  append_tokens(p, t, {8, 9});
  EXPECT_EQ(p.num_tokens(t), 10);
  p.check_invariants();
}

TEST(BlockPool, ExtraKeysSeparateImagesWithEqualPlaceholderTokens) {
  BlockPool p(16, 4);
  std::vector<int32_t> tokens(8, 151655);  // all <|image_pad|>
  std::vector<ExtraKeySpan> img1{{0, 8, Key128{11, 11}}}, img2{{0, 8, Key128{22, 22}}};
  SeqId s = p.new_sequence();
  append_tokens(p, s, tokens, img1);
  p.free_sequence(s);
  EXPECT_EQ(p.match_prefix({}, tokens.data(), 8, img1.data(), 1).size(), 2u);
  EXPECT_TRUE(p.match_prefix({}, tokens.data(), 8, img2.data(), 1).empty());
  EXPECT_TRUE(p.match_prefix({}, tokens.data(), 8, nullptr, 0).empty());
}

TEST(BlockPool, EvictsLowestPriorityThenLeastRecentlyFreed) {
  BlockPool p(4, 2);
  std::vector<SeqId> seqs;
  for (int i = 0; i < 4; ++i) {
    SeqId s = p.new_sequence();
    append_tokens(p, s, {10 * i, 10 * i + 1});
    seqs.push_back(s);
  }
  auto block_of = [&](int i) { return p.block_table(seqs[i])[0]; };
  std::vector<BlockId> b;
  for (int i = 0; i < 4; ++i) b.push_back(block_of(i));
  for (SeqId s : seqs) p.free_sequence(s);  // freed in order 0,1,2,3
  BlockId keep = b[0];
  p.set_block_priority(&keep, 1, 5);  // block 0 is the oldest but high priority
  EXPECT_EQ(p.evict(1), 1);
  EXPECT_EQ(p.block_hash(b[1]), std::nullopt);  // next-oldest at priority 0 went first
  EXPECT_TRUE(p.block_hash(b[0]).has_value());
  EXPECT_EQ(p.evict(2), 2);
  EXPECT_TRUE(p.block_hash(b[0]).has_value());
  EXPECT_EQ(p.evict(1), 1);
  EXPECT_FALSE(p.block_hash(b[0]).has_value());
  p.check_invariants();
}

TEST(BlockPool, BadInputRaisesAndChangesNothing) {
  BlockPool p(4, 4);
  SeqId s = p.new_sequence();
  std::vector<int32_t> slots(100);
  std::vector<CopyPair> copies;
  EXPECT_THROW(p.append_slots(s, -1, slots.data(), &copies), std::invalid_argument);
  EXPECT_THROW(p.append_slots(s, 17, slots.data(), &copies), OutOfBlocks);
  EXPECT_EQ(p.num_tokens(s), 0);
  EXPECT_EQ(p.num_free_blocks(), 4);
  p.free_sequence(s);
  EXPECT_THROW(p.free_sequence(s), NotFound);
  EXPECT_THROW(p.fork(s), NotFound);
  EXPECT_THROW(p.block_table(12345), NotFound);
  EXPECT_THROW(p.refcount(4), std::out_of_range);
  EXPECT_THROW(BlockPool(0, 4), std::invalid_argument);
  EXPECT_THROW(BlockPool(4, -1), std::invalid_argument);
  EXPECT_THROW(BlockPool(1 << 30, 1 << 10), std::invalid_argument);
  ExtraKeySpan bad{5, 5, {}};
  SeqId t = p.new_sequence();
  std::vector<int32_t> tok(4, 1);
  EXPECT_THROW(p.append_tokens(t, tok.data(), 4, &bad, 1, slots.data(), &copies), std::invalid_argument);
  EXPECT_EQ(p.num_tokens(t), 0);
  p.check_invariants();
}

TEST(BlockPool, ConcurrentStressKeepsInvariants) {
  BlockPool p(512, 8);
  std::atomic<int> errors{0};
  auto worker = [&](int seed) {
    std::mt19937 rng(seed);
    std::vector<SeqId> mine;
    std::vector<int32_t> slots(64);
    std::vector<CopyPair> copies;
    for (int step = 0; step < 20000; ++step) {
      try {
        int op = rng() % 6;
        if (op == 0 || mine.empty()) {
          mine.push_back(p.new_sequence());
        } else {
          SeqId s = mine[rng() % mine.size()];
          if (op == 1) {
            mine.push_back(p.fork(s));
          } else if (op == 2) {
            p.free_sequence(s);
            mine.erase(std::find(mine.begin(), mine.end(), s));
          } else if (op == 3) {
            std::vector<int32_t> t(rng() % 20);
            for (auto& x : t) x = rng() % 3;  // few distinct tokens: lots of prefix sharing
            p.append_tokens(s, t.data(), int64_t(t.size()), nullptr, 0, slots.data(), &copies);
          } else if (op == 4) {
            p.append_slots(s, rng() % 20, slots.data(), &copies);
          } else {
            std::vector<int32_t> t(16, 0);
            p.match_prefix({}, t.data(), 16, nullptr, 0);
          }
        }
      } catch (const OutOfBlocks&) {
        for (SeqId s : mine) p.free_sequence(s);
        mine.clear();
      } catch (...) {
        ++errors;
      }
    }
    for (SeqId s : mine) p.free_sequence(s);
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back(worker, i);
  std::thread checker([&] {
    for (int i = 0; i < 200; ++i) {
      try {
        p.check_invariants();
      } catch (...) {
        ++errors;
      }
    }
  });
  for (auto& t : threads) t.join();
  checker.join();
  EXPECT_EQ(errors.load(), 0);
  p.check_invariants();
  EXPECT_EQ(p.num_free_blocks(), 512);
}
