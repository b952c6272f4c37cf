// Paged KV block pool: sequences own block tables, blocks are shared copy-on-write by
// reference count, and full blocks are content-addressed for prefix reuse.
//
// Prefix caching follows vLLM's block pool: a full block's hash chains its parent's hash, its
// token ids and the extra keys (e.g. image content hashes) of every span overlapping it, so a
// hash names the whole prefix up to and including that block. A sequence's root hash carries
// its namespace (model id + tenant salt): two tenants never share a block. When a cached
// block's last reference goes, it stays reusable (evictable) until the allocator needs it.
//
// Threading: one mutex per pool guards all state; every public method takes it, so the pool
// may be called from several threads. Calls are short and the Python bindings release the GIL
// around them.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "samcache/eviction_heap.h"
#include "samcache/flat_table.h"
#include "samcache/key128.h"

namespace samcache {

using BlockId = int32_t;
using SeqId = int64_t;

// Extra key over token positions [start, end) of a sequence (absolute positions).
struct ExtraKeySpan {
  int64_t start = 0;
  int64_t end = 0;
  Key128 key;
  friend bool operator==(const ExtraKeySpan&, const ExtraKeySpan&) = default;
  friend auto operator<=>(const ExtraKeySpan&, const ExtraKeySpan&) = default;
};

// The caller must copy block `src` to `dst` before writing the slots of an append.
struct CopyPair {
  BlockId src;
  BlockId dst;
};

struct BlockPoolStats {
  int64_t num_blocks, block_size, free_blocks, evictable_blocks, cached_blocks, live_sequences;
  int64_t prefix_queries, prefix_hit_blocks, evictions, cow_copies, eviction_heap_nodes;
};

class BlockPool {
 public:
  BlockPool(int32_t num_blocks, int32_t block_size);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t block_size() const { return block_size_; }

  // A new empty sequence whose block hashes chain from `root` (its namespace digest).
  SeqId new_sequence(const Key128& root = {});
  // A new sequence sharing every block of `seq` (refcounts + 1, nothing copied).
  SeqId fork(SeqId seq);
  // A new sequence holding blocks [first, first + count) of `seq`'s table (refcounts + 1, nothing
  // copied): keeps part of a sequence's KV alive, e.g. one image's span after its turn ends. It
  // counts count * block_size tokens and is not cacheable (nothing it appends is hashed).
  SeqId share_blocks(SeqId seq, int64_t first, int64_t count);
  // Drops the sequence's references. Cached blocks stay reusable until evicted.
  void free_sequence(SeqId seq);

  // Reserves n token slots at the end of `seq` and writes their slot ids (block * block_size +
  // offset) to slots_out[0..n). If the partial last block is shared, it is first replaced by a
  // private copy: the pair is appended to `copies` and the caller must copy the data.
  // Token contents are unknown here, so the sequence's later blocks are not prefix-cached.
  // All-or-nothing: throws OutOfBlocks without changing anything.
  void append_slots(SeqId seq, int64_t n, int32_t* slots_out, std::vector<CopyPair>* copies);
  // As append_slots for tokens[0..n), and registers every block that becomes full in the
  // prefix cache. `spans` are extra keys at absolute positions (may reach past this append).
  void append_tokens(SeqId seq, const int32_t* tokens, int64_t n, const ExtraKeySpan* spans,
                     size_t num_spans, int32_t* slots_out, std::vector<CopyPair>* copies);

  // The cached blocks holding the longest full-block prefix of tokens (read-only).
  std::vector<BlockId> match_prefix(const Key128& root, const int32_t* tokens, int64_t n,
                                    const ExtraKeySpan* spans, size_t num_spans) const;
  // Atomically matches the prefix and adopts the matched blocks into `seq`, which must be
  // empty. Returns the number of tokens adopted (a multiple of block_size).
  int64_t adopt_prefix(SeqId seq, const int32_t* tokens, int64_t n, const ExtraKeySpan* spans,
                       size_t num_spans);

  std::vector<BlockId> block_table(SeqId seq) const;
  int64_t num_tokens(SeqId seq) const;
  // Blocks an allocation can take now: free plus evictable cached blocks.
  int32_t num_free_blocks() const;
  int32_t refcount(BlockId block) const;
  std::optional<Key128> block_hash(BlockId block) const;

  // Eviction priority (higher = kept longer; equal priorities evict least recently freed
  // first). A sequence's priority also applies to the blocks it allocates from then on.
  void set_block_priority(const BlockId* blocks, size_t n, int32_t priority);
  void set_sequence_priority(SeqId seq, int32_t priority);
  // Evicts up to n unreferenced cached blocks now; returns how many.
  int32_t evict(int32_t n);
  // evict(n), reporting each evicted block and the prefix hash it held: its KV is still in the
  // cache until the block is handed out again, so a lower tier can copy it first.
  int32_t evict_reporting(int32_t n, std::vector<BlockId>* ids, std::vector<Key128>* hashes);
  // The prefix hash of every full block of tokens[0, n), chained from `root` (no lookup): what a
  // lower tier holding evicted blocks is asked for.
  std::vector<Key128> prefix_hashes(const Key128& root, const int32_t* tokens, int64_t n,
                                    const ExtraKeySpan* spans, size_t num_spans) const;

  BlockPoolStats stats() const;
  // Throws InvariantViolation describing the first contradiction found.
  void check_invariants() const;

 private:
  enum class State : uint8_t { kFree, kUsed, kEvictable };
  struct Block {
    int32_t ref = 0;
    int32_t priority = 0;
    uint64_t tick = 0;  // when it last became evictable
    Key128 hash;
    bool has_hash = false;  // full block of a cacheable sequence
    bool cached = false;    // the prefix table maps `hash` to this block
    State state = State::kFree;
  };
  struct Sequence {
    uint32_t generation = 0;  // 1 .. 2^31-1: the high half of the sequence id
    bool live = false;
    std::vector<BlockId> table;
    int64_t num_tokens = 0;
    int32_t priority = 0;
    Key128 root;
    Key128 last_hash;            // hash of the last full block, or root
    bool cacheable = true;       // every token so far is known, so hashes can chain
    std::vector<int32_t> tail;   // tokens of the partial last block
    std::vector<ExtraKeySpan> spans;  // extra keys still overlapping unhashed positions
  };

  SeqId create_locked(const Key128& root);
  // A new sequence with src's root and priority, holding blocks [first, first + count) of its
  // table (one more reference each); the caller sets the rest.
  SeqId create_sharing_locked(SeqId src, int64_t first, int64_t count);
  void set_priority_locked(const BlockId* blocks, size_t n, int32_t priority);
  Sequence& lookup(SeqId id);
  const Sequence& lookup(SeqId id) const;
  void check_block(BlockId block) const;
  void check_spans(const ExtraKeySpan* spans, size_t n) const;
  // Checked, sorted and deduplicated: the spans as hash_block reads them.
  std::vector<ExtraKeySpan> sorted_spans(const ExtraKeySpan* spans, size_t n) const;
  // Reserves blocks for n more tokens (CoW of the shared partial tail included).
  void grow(Sequence& s, int64_t n, int32_t* slots_out, std::vector<CopyPair>* copies);
  BlockId allocate(int32_t priority);
  void release(BlockId block);
  void make_evictable(BlockId block);
  bool evict_one(BlockId* id = nullptr, Key128* hash = nullptr);
  Key128 hash_block(const Key128& parent, int64_t block_start, const int32_t* tokens,
                    const std::vector<ExtraKeySpan>& spans) const;
  // Walks the prefix cache; returns matched blocks (and their last hash).
  std::vector<BlockId> match_locked(const Key128& root, const int32_t* tokens, int64_t n,
                                    const ExtraKeySpan* spans, size_t num_spans,
                                    Key128* last_hash) const;
  void register_full_block(Sequence& s, int64_t block_index);
  bool heap_node_current(const EvictionHeap<BlockId>::Node& node) const;
  void rebuild_heap_if_needed();

  int32_t num_blocks_;
  int32_t block_size_;
  mutable std::mutex mu_;
  std::vector<Block> blocks_;
  std::vector<BlockId> free_;  // stack: most recently freed first (warm memory)
  int32_t num_evictable_ = 0;
  EvictionHeap<BlockId> evictable_;
  FlatTable<BlockId> prefix_;  // block hash -> cached block
  std::vector<Sequence> seqs_;
  std::vector<uint32_t> free_seq_slots_;
  int64_t live_seqs_ = 0;
  uint64_t clock_ = 0;
  mutable int64_t prefix_queries_ = 0, prefix_hit_blocks_ = 0;
  int64_t evictions_ = 0, cow_copies_ = 0;
  mutable std::vector<uint8_t> hash_buf_;
};

}  // namespace samcache
