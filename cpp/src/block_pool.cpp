#include "samcache/block_pool.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>

#include "samcache/errors.h"

namespace samcache {

namespace {
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

BlockPool::BlockPool(int32_t num_blocks, int32_t block_size)
    : num_blocks_(num_blocks), block_size_(block_size) {
  if (num_blocks <= 0) throw std::invalid_argument("num_blocks must be positive, got " + str(num_blocks));
  if (block_size <= 0) throw std::invalid_argument("block_size must be positive, got " + str(block_size));
  if (int64_t(num_blocks) * block_size > std::numeric_limits<int32_t>::max())
    throw std::invalid_argument("num_blocks * block_size must fit in int32 slot ids, got " +
                                str(int64_t(num_blocks) * block_size));
  blocks_.resize(num_blocks);
  free_.reserve(num_blocks);
  // Stack order: block 0 is handed out first.
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

// ---- sequences ---------------------------------------------------------------------------------

BlockPool::Sequence& BlockPool::lookup(SeqId id) {
  return const_cast<Sequence&>(static_cast<const BlockPool*>(this)->lookup(id));
}

const BlockPool::Sequence& BlockPool::lookup(SeqId id) const {
  uint64_t u = static_cast<uint64_t>(id);
  size_t index = u & 0xffffffffu;
  uint32_t generation = static_cast<uint32_t>(u >> 32);
  if (id < 0 || index >= seqs_.size() || !seqs_[index].live || seqs_[index].generation != generation)
    throw NotFound("sequence " + str(id) + " is not live (never created, or already freed)");
  return seqs_[index];
}

SeqId BlockPool::new_sequence(const Key128& root) {
  std::lock_guard lock(mu_);
  return create_locked(root);
}

SeqId BlockPool::create_locked(const Key128& root) {
  uint32_t index;
  if (!free_seq_slots_.empty()) {
    index = free_seq_slots_.back();
    free_seq_slots_.pop_back();
  } else {
    if (seqs_.size() >= 0xffffffffu) throw std::runtime_error("too many live sequences");
    index = static_cast<uint32_t>(seqs_.size());
    seqs_.emplace_back();
    seqs_.back().generation = 1;
  }
  Sequence& s = seqs_[index];
  s.live = true;
  s.table.clear();
  s.num_tokens = 0;
  s.priority = 0;
  s.root = root;
  s.last_hash = root;
  s.cacheable = true;
  s.tail.clear();
  s.spans.clear();
  ++live_seqs_;
  return (static_cast<SeqId>(s.generation) << 32) | index;
}

SeqId BlockPool::create_sharing_locked(SeqId src, int64_t first, int64_t count) {
  const Key128 root = lookup(src).root;
  const SeqId id = create_locked(root);  // may grow seqs_: look both up again
  const Sequence& s = lookup(src);
  Sequence& c = lookup(id);
  c.table.assign(s.table.begin() + first, s.table.begin() + first + count);
  c.priority = s.priority;
  for (BlockId b : c.table) ++blocks_[b].ref;
  return id;
}

SeqId BlockPool::fork(SeqId parent) {
  std::lock_guard lock(mu_);
  const auto size = static_cast<int64_t>(lookup(parent).table.size());  // validates before any change
  const SeqId child = create_sharing_locked(parent, 0, size);
  const Sequence& p = lookup(parent);
  Sequence& c = lookup(child);
  c.num_tokens = p.num_tokens;
  c.last_hash = p.last_hash;
  c.cacheable = p.cacheable;
  c.tail = p.tail;
  c.spans = p.spans;
  return child;
}

SeqId BlockPool::share_blocks(SeqId seq, int64_t first, int64_t count) {
  std::lock_guard lock(mu_);
  const auto size = static_cast<int64_t>(lookup(seq).table.size());  // validates before any change
  if (first < 0 || count < 1 || count > size - first)
    throw std::invalid_argument("share_blocks: blocks [" + str(first) + ", " + str(first) + " + " + str(count) +
                                ") are not within the sequence's " + str(size) + " blocks");
  const SeqId holder = create_sharing_locked(seq, first, count);
  Sequence& h = lookup(holder);
  h.num_tokens = count * block_size_;
  h.cacheable = false;
  return holder;
}

void BlockPool::free_sequence(SeqId id) {
  std::lock_guard lock(mu_);
  Sequence& s = lookup(id);
  // Tail blocks first: they get the oldest ticks and are evicted before shared prefixes.
  for (auto it = s.table.rbegin(); it != s.table.rend(); ++it) release(*it);
  s.live = false;
  // 31-bit generations keep ids positive. A slot whose generation is spent is retired, never
  // reused, so no stale id can ever name a new sequence (one small entry per 2^31 requests).
  const bool spent = s.generation == 0x7fffffffu;
  if (!spent) ++s.generation;
  // Keep small buffers for the next sequence in this slot (no malloc per request); give back
  // the memory of long ones.
  auto reset = [](auto& v) {
    if (v.capacity() > 4096) std::decay_t<decltype(v)>().swap(v); else v.clear();
  };
  reset(s.table);
  reset(s.tail);
  reset(s.spans);
  if (!spent) free_seq_slots_.push_back(static_cast<uint32_t>(static_cast<uint64_t>(id) & 0xffffffffu));
  --live_seqs_;
}

// ---- blocks ------------------------------------------------------------------------------------

void BlockPool::check_block(BlockId block) const {
  if (block < 0 || block >= num_blocks_)
    throw std::out_of_range("block " + str(block) + " is out of range [0, " + str(num_blocks_) + ")");
}

BlockId BlockPool::allocate(int32_t priority) {
  if (free_.empty() && !evict_one())
    throw InvariantViolation("allocate() found no block after the capacity check");
  BlockId b = free_.back();
  free_.pop_back();
  Block& m = blocks_[b];
  m.ref = 1;
  m.priority = priority;
  m.has_hash = false;
  m.cached = false;
  m.state = State::kUsed;
  return b;
}

void BlockPool::release(BlockId b) {
  Block& m = blocks_[b];
  if (--m.ref > 0) return;
  if (m.cached) {
    make_evictable(b);
  } else {
    m.has_hash = false;
    m.state = State::kFree;
    free_.push_back(b);
  }
}

void BlockPool::make_evictable(BlockId b) {
  Block& m = blocks_[b];
  m.state = State::kEvictable;
  m.tick = ++clock_;
  ++num_evictable_;
  evictable_.push(m.priority, m.tick, b);
  rebuild_heap_if_needed();
}

void BlockPool::rebuild_heap_if_needed() {
  evictable_.rebuild_if_needed(static_cast<size_t>(num_evictable_), [this](auto&& push) {
    for (BlockId b = 0; b < num_blocks_; ++b)
      if (blocks_[b].state == State::kEvictable) push(blocks_[b].priority, blocks_[b].tick, b);
  });
}

bool BlockPool::heap_node_current(const EvictionHeap<BlockId>::Node& node) const {
  const Block& m = blocks_[node.id];
  return m.state == State::kEvictable && m.tick == node.tick && m.priority == node.priority;
}

bool BlockPool::evict_one(BlockId* id, Key128* hash) {
  auto node = evictable_.pop([this](const auto& n) {
    return heap_node_current(n) ? EvictionHeap<BlockId>::kCurrent : EvictionHeap<BlockId>::kStale;
  });
  if (!node) return false;
  Block& m = blocks_[node->id];
  if (id) *id = node->id;
  if (hash) *hash = m.hash;
  prefix_.erase(m.hash);
  m.cached = false;
  m.has_hash = false;
  m.state = State::kFree;
  --num_evictable_;
  ++evictions_;
  free_.push_back(node->id);
  return true;
}

int32_t BlockPool::evict(int32_t n) {
  if (n < 0) throw std::invalid_argument("evict(n) needs n >= 0, got " + str(n));
  std::lock_guard lock(mu_);
  int32_t done = 0;
  while (done < n && evict_one()) ++done;
  return done;
}

int32_t BlockPool::evict_reporting(int32_t n, std::vector<BlockId>* ids, std::vector<Key128>* hashes) {
  if (n < 0) throw std::invalid_argument("evict(n) needs n >= 0, got " + str(n));
  std::lock_guard lock(mu_);
  int32_t done = 0;
  BlockId id;
  Key128 h;
  while (done < n && evict_one(&id, &h)) {
    ids->push_back(id);
    hashes->push_back(h);
    ++done;
  }
  return done;
}

std::vector<ExtraKeySpan> BlockPool::sorted_spans(const ExtraKeySpan* spans, size_t n) const {
  check_spans(spans, n);
  std::vector<ExtraKeySpan> sorted(spans, spans + n);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  return sorted;
}

std::vector<Key128> BlockPool::prefix_hashes(const Key128& root, const int32_t* tokens, int64_t n,
                                             const ExtraKeySpan* spans, size_t num_spans) const {
  if (n < 0) throw std::invalid_argument("token count must be >= 0, got " + str(n));
  std::lock_guard lock(mu_);
  const std::vector<ExtraKeySpan> sorted = sorted_spans(spans, num_spans);
  std::vector<Key128> out;
  Key128 h = root;
  for (int64_t bi = 0; bi < n / block_size_; ++bi) {
    h = hash_block(h, bi * block_size_, tokens + bi * block_size_, sorted);
    out.push_back(h);
  }
  return out;
}

// ---- appends -----------------------------------------------------------------------------------

void BlockPool::grow(Sequence& s, int64_t n, int32_t* slots_out, std::vector<CopyPair>* copies) {
  if (n < 0) throw std::invalid_argument("cannot append a negative number of slots (" + str(n) + ")");
  if (n == 0) return;
  const int64_t bs = block_size_;
  const int64_t start = s.num_tokens;
  const int64_t end = start + n;
  const int64_t new_blocks = (end + bs - 1) / bs - static_cast<int64_t>(s.table.size());
  const bool cow = start % bs != 0 && blocks_[s.table.back()].ref > 1;
  const int64_t need = new_blocks + (cow ? 1 : 0);
  const int64_t available = static_cast<int64_t>(free_.size()) + num_evictable_;
  if (need > available)
    throw OutOfBlocks("appending " + str(n) + " slots needs " + str(need) + " blocks but only " +
                      str(available) + " of " + str(num_blocks_) + " are free or evictable");
  if (cow) {
    BlockId src = s.table.back();
    BlockId dst = allocate(s.priority);
    --blocks_[src].ref;  // still >= 1: another table holds it
    s.table.back() = dst;
    copies->push_back({src, dst});
    ++cow_copies_;
  }
  for (int64_t i = 0; i < new_blocks; ++i) s.table.push_back(allocate(s.priority));
  int64_t pos = start;
  while (pos < end) {
    const int64_t bi = pos / bs;
    const int64_t off = pos % bs;
    const int64_t take = std::min(bs - off, end - pos);
    const int32_t base = static_cast<int32_t>(s.table[bi] * bs + off);
    int32_t* out = slots_out + (pos - start);
    for (int64_t i = 0; i < take; ++i) out[i] = base + static_cast<int32_t>(i);
    pos += take;
  }
  s.num_tokens = end;
}

void BlockPool::append_slots(SeqId id, int64_t n, int32_t* slots_out, std::vector<CopyPair>* copies) {
  std::lock_guard lock(mu_);
  Sequence& s = lookup(id);
  grow(s, n, slots_out, copies);
  if (n > 0 && s.cacheable) {
    // Unknown token contents: later hashes cannot chain, so the sequence stops caching.
    s.cacheable = false;
    s.tail.clear();
    s.spans.clear();
  }
}

void BlockPool::check_spans(const ExtraKeySpan* spans, size_t n) const {
  for (size_t i = 0; i < n; ++i)
    if (spans[i].start < 0 || spans[i].end <= spans[i].start)
      throw std::invalid_argument("extra key span " + str(int64_t(i)) + " is [" + str(spans[i].start) +
                                  ", " + str(spans[i].end) + "): need 0 <= start < end");
}

void BlockPool::append_tokens(SeqId id, const int32_t* tokens, int64_t n, const ExtraKeySpan* spans,
                              size_t num_spans, int32_t* slots_out, std::vector<CopyPair>* copies) {
  std::lock_guard lock(mu_);
  Sequence& s = lookup(id);
  check_spans(spans, num_spans);
  const int64_t start = s.num_tokens;
  grow(s, n, slots_out, copies);  // throws before any change
  if (!s.cacheable || n == 0) return;
  const int64_t bs = block_size_;
  const int64_t hashed_upto = start - start % bs;
  for (size_t i = 0; i < num_spans; ++i)
    if (spans[i].end > hashed_upto) s.spans.push_back(spans[i]);
  std::sort(s.spans.begin(), s.spans.end());
  s.spans.erase(std::unique(s.spans.begin(), s.spans.end()), s.spans.end());
  int64_t pos = start;
  const int64_t end = start + n;
  while (pos < end) {
    const int64_t take = std::min<int64_t>(bs - static_cast<int64_t>(s.tail.size()), end - pos);
    s.tail.insert(s.tail.end(), tokens + (pos - start), tokens + (pos - start) + take);
    pos += take;
    if (static_cast<int64_t>(s.tail.size()) == bs) register_full_block(s, pos / bs - 1);
  }
}

// ---- prefix hashing ----------------------------------------------------------------------------

// hash(block) = xxh3_128(parent (16 B) || token ids (int32 LE) ||
//                        for each span overlapping the block, in (start, end, key) order:
//                        key (16 B) || int64 (start - block_start) || int64 (end - block_start))
Key128 BlockPool::hash_block(const Key128& parent, int64_t block_start, const int32_t* tokens,
                             const std::vector<ExtraKeySpan>& spans) const {
  const int64_t block_end = block_start + block_size_;
  std::vector<uint8_t>& buf = hash_buf_;
  buf.resize(sizeof(Key128) + sizeof(int32_t) * block_size_);
  std::memcpy(buf.data(), &parent, sizeof(Key128));
  std::memcpy(buf.data() + sizeof(Key128), tokens, sizeof(int32_t) * block_size_);
  for (const ExtraKeySpan& sp : spans) {
    if (sp.start >= block_end || sp.end <= block_start) continue;
    const int64_t rel[2] = {sp.start - block_start, sp.end - block_start};
    const size_t at = buf.size();
    buf.resize(at + sizeof(Key128) + sizeof(rel));
    std::memcpy(buf.data() + at, &sp.key, sizeof(Key128));
    std::memcpy(buf.data() + at + sizeof(Key128), rel, sizeof(rel));
  }
  return xxh3_128(buf.data(), buf.size());
}

void BlockPool::register_full_block(Sequence& s, int64_t block_index) {
  const int64_t block_start = block_index * block_size_;
  const Key128 h = hash_block(s.last_hash, block_start, s.tail.data(), s.spans);
  const BlockId b = s.table[block_index];
  Block& m = blocks_[b];
  m.hash = h;
  m.has_hash = true;
  // Another block may already hold the same content; the first one stays the cached copy.
  m.cached = prefix_.try_emplace(h, b).second;
  s.last_hash = h;
  s.tail.clear();
  const int64_t block_end = block_start + block_size_;
  std::erase_if(s.spans, [&](const ExtraKeySpan& sp) { return sp.end <= block_end; });
}

std::vector<BlockId> BlockPool::match_locked(const Key128& root, const int32_t* tokens, int64_t n,
                                             const ExtraKeySpan* spans, size_t num_spans,
                                             Key128* last_hash) const {
  if (n < 0) throw std::invalid_argument("token count must be >= 0, got " + str(n));
  const std::vector<ExtraKeySpan> sorted = sorted_spans(spans, num_spans);
  std::vector<BlockId> out;
  Key128 h = root;
  for (int64_t bi = 0; bi < n / block_size_; ++bi) {
    const Key128 next = hash_block(h, bi * block_size_, tokens + bi * block_size_, sorted);
    const BlockId* b = prefix_.find(next);
    if (b == nullptr) break;
    out.push_back(*b);
    h = next;
  }
  ++prefix_queries_;
  prefix_hit_blocks_ += static_cast<int64_t>(out.size());
  *last_hash = h;
  return out;
}

std::vector<BlockId> BlockPool::match_prefix(const Key128& root, const int32_t* tokens, int64_t n,
                                             const ExtraKeySpan* spans, size_t num_spans) const {
  std::lock_guard lock(mu_);
  Key128 last;
  return match_locked(root, tokens, n, spans, num_spans, &last);
}

int64_t BlockPool::adopt_prefix(SeqId id, const int32_t* tokens, int64_t n, const ExtraKeySpan* spans,
                                size_t num_spans) {
  std::lock_guard lock(mu_);
  Sequence& s = lookup(id);
  if (s.num_tokens != 0)
    throw std::invalid_argument("adopt_prefix needs an empty sequence; sequence " + str(id) + " holds " +
                                str(s.num_tokens) + " tokens");
  Key128 last;
  std::vector<BlockId> matched = match_locked(s.root, tokens, n, spans, num_spans, &last);
  for (BlockId b : matched) {
    Block& m = blocks_[b];
    if (m.state == State::kEvictable) {  // its heap node goes stale by the state change
      m.state = State::kUsed;
      --num_evictable_;
    }
    ++m.ref;
  }
  s.table = std::move(matched);
  s.num_tokens = static_cast<int64_t>(s.table.size()) * block_size_;
  s.last_hash = last;
  s.cacheable = true;
  s.tail.clear();
  s.spans.clear();
  for (size_t i = 0; i < num_spans; ++i)
    if (spans[i].end > s.num_tokens) s.spans.push_back(spans[i]);
  std::sort(s.spans.begin(), s.spans.end());
  s.spans.erase(std::unique(s.spans.begin(), s.spans.end()), s.spans.end());
  return s.num_tokens;
}

// ---- queries and priorities --------------------------------------------------------------------

std::vector<BlockId> BlockPool::block_table(SeqId id) const {
  std::lock_guard lock(mu_);
  return lookup(id).table;
}

int64_t BlockPool::num_tokens(SeqId id) const {
  std::lock_guard lock(mu_);
  return lookup(id).num_tokens;
}

int32_t BlockPool::num_free_blocks() const {
  std::lock_guard lock(mu_);
  return static_cast<int32_t>(free_.size()) + num_evictable_;
}

int32_t BlockPool::refcount(BlockId block) const {
  std::lock_guard lock(mu_);
  check_block(block);
  return blocks_[block].ref;
}

std::optional<Key128> BlockPool::block_hash(BlockId block) const {
  std::lock_guard lock(mu_);
  check_block(block);
  const Block& m = blocks_[block];
  if (!m.has_hash) return std::nullopt;
  return m.hash;
}

void BlockPool::set_block_priority(const BlockId* ids, size_t n, int32_t priority) {
  std::lock_guard lock(mu_);
  set_priority_locked(ids, n, priority);
}

void BlockPool::set_priority_locked(const BlockId* ids, size_t n, int32_t priority) {
  for (size_t i = 0; i < n; ++i) check_block(ids[i]);  // all or nothing
  for (size_t i = 0; i < n; ++i) {
    Block& m = blocks_[ids[i]];
    if (m.priority == priority) continue;
    m.priority = priority;
    if (m.state == State::kEvictable) evictable_.push(priority, m.tick, ids[i]);
  }
  rebuild_heap_if_needed();  // repeated priority changes must not grow the heap without bound
}

void BlockPool::set_sequence_priority(SeqId id, int32_t priority) {
  std::lock_guard lock(mu_);
  Sequence& s = lookup(id);
  s.priority = priority;
  set_priority_locked(s.table.data(), s.table.size(), priority);
}

BlockPoolStats BlockPool::stats() const {
  std::lock_guard lock(mu_);
  return BlockPoolStats{num_blocks_,
                        block_size_,
                        static_cast<int64_t>(free_.size()),
                        num_evictable_,
                        static_cast<int64_t>(prefix_.size()),
                        live_seqs_,
                        prefix_queries_,
                        prefix_hit_blocks_,
                        evictions_,
                        cow_copies_,
                        static_cast<int64_t>(evictable_.size())};
}

// ---- invariants --------------------------------------------------------------------------------

void BlockPool::check_invariants() const {
  std::lock_guard lock(mu_);
  auto fail = [](const std::string& what) { throw InvariantViolation("BlockPool invariant: " + what); };
  std::vector<int32_t> refs(num_blocks_, 0);
  int64_t live = 0;
  for (const Sequence& s : seqs_) {
    if (!s.live) continue;
    ++live;
    const int64_t want = (s.num_tokens + block_size_ - 1) / block_size_;
    if (static_cast<int64_t>(s.table.size()) != want)
      fail("a sequence of " + str(s.num_tokens) + " tokens has " + str(int64_t(s.table.size())) + " blocks");
    if (s.cacheable && static_cast<int64_t>(s.tail.size()) != s.num_tokens % block_size_)
      fail("a cacheable sequence's tail has " + str(int64_t(s.tail.size())) + " tokens");
    for (BlockId b : s.table) {
      if (b < 0 || b >= num_blocks_) fail("a table holds block " + str(b));
      ++refs[b];
    }
  }
  if (live != live_seqs_) fail("live sequence count " + str(live_seqs_) + " != " + str(live));
  std::vector<uint8_t> in_free(num_blocks_, 0);
  for (BlockId b : free_) {
    if (b < 0 || b >= num_blocks_) fail("free list holds block " + str(b));
    if (in_free[b]++) fail("block " + str(b) + " is twice in the free list");
  }
  std::vector<uint8_t> has_node(num_blocks_, 0);
  evictable_.for_each([&](const auto& node) {
    if (node.id >= 0 && node.id < num_blocks_ && heap_node_current(node)) has_node[node.id] = 1;
  });
  int64_t evictable = 0, cached = 0;
  for (BlockId b = 0; b < num_blocks_; ++b) {
    const Block& m = blocks_[b];
    const std::string name = "block " + str(b);
    if (m.ref != refs[b]) fail(name + " has refcount " + str(m.ref) + " but " + str(refs[b]) + " tables hold it");
    switch (m.state) {
      case State::kFree:
        if (!in_free[b]) fail(name + " is free but not in the free list");
        if (m.ref != 0 || m.cached) fail(name + " is free but referenced or cached");
        break;
      case State::kUsed:
        if (in_free[b] || m.ref <= 0) fail(name + " is in use but free or unreferenced");
        break;
      case State::kEvictable:
        ++evictable;
        if (in_free[b] || m.ref != 0 || !m.cached) fail(name + " is evictable but free, referenced or uncached");
        if (!has_node[b]) fail(name + " is evictable but has no current eviction node");
        break;
    }
    if (m.cached) {
      ++cached;
      const BlockId* owner = prefix_.find(m.hash);
      if (owner == nullptr || *owner != b) fail(name + " is marked cached but the prefix table disagrees");
    }
  }
  if (evictable != num_evictable_) fail("evictable count " + str(num_evictable_) + " != " + str(evictable));
  if (cached != static_cast<int64_t>(prefix_.size())) fail("prefix table size != cached blocks");
}

}  // namespace samcache
