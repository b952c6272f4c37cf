// paged_kv CUDA kernels. paged_write and paged_gather copy one token row ([heads, head_bytes])
// per group of threads with the widest vector all addresses allow (16 bytes for fp16/bf16 with
// head_dim % 8 == 0): loads of consecutive threads are consecutive, so accesses coalesce. The
// group size follows the row length so short rows (few heads) still fill whole warps.
// swap_blocks: one kernel for any number of scattered blocks (copy_block_pairs: 16-byte vectors,
// 4 in flight per thread, a grid-stride loop over 16 KiB tiles), also for pinned host memory
// through its mapped address; cudaMemcpyAsync per run of consecutive blocks (copy_block_runs) for
// pageable host memory, which a kernel cannot read, and for long host runs (the wrapper decides).
#include <climits>
#include <cstdint>
#include <initializer_list>

#include "paged_kv.cuh"

namespace samcache::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// This thread's token and its position in the token's group of `warps_per_token` warps.
struct TokenGroup {
  int64_t token;
  int lane;
  int width;
};

__device__ __forceinline__ TokenGroup token_group(int warps_per_token) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  TokenGroup g;
  g.token = static_cast<int64_t>(blockIdx.x) * (kWarps / warps_per_token) + warp / warps_per_token;
  g.lane = (warp % warps_per_token) * 32 + static_cast<int>(threadIdx.x) % 32;
  g.width = warps_per_token * 32;
  return g;
}

template <typename Index>
__device__ __forceinline__ int64_t load_index(const void* indices, int64_t i) {
  return static_cast<int64_t>(static_cast<const Index*>(indices)[i]);
}

template <typename Vec, typename Index>
__global__ void __launch_bounds__(kThreads) paged_write_kernel(PagedWriteArgs a, int warps_per_token) {
  const TokenGroup g = token_group(warps_per_token);
  if (g.token >= a.num_tokens) return;
  const int64_t slot = load_index<Index>(a.slot_mapping, g.token);
  if (slot < 0 || slot >= a.num_slots) return;  // padding, or an index we cannot trust
  const int vecs_per_head = static_cast<int>(a.head_bytes / static_cast<int64_t>(sizeof(Vec)));
  const int vecs = static_cast<int>(a.num_heads) * vecs_per_head;
  const int64_t row_bytes = a.num_heads * a.head_bytes;
  const char* k = static_cast<const char*>(a.key) + g.token * a.key_token_stride;
  const char* v = static_cast<const char*>(a.value) + g.token * a.value_token_stride;
  Vec* kc = reinterpret_cast<Vec*>(static_cast<char*>(a.key_cache) + slot * row_bytes);
  Vec* vc = reinterpret_cast<Vec*>(static_cast<char*>(a.value_cache) + slot * row_bytes);
  for (int i = g.lane; i < vecs; i += g.width) {
    const int head = i / vecs_per_head;
    const int64_t within = static_cast<int64_t>(i - head * vecs_per_head) * static_cast<int64_t>(sizeof(Vec));
    // Both loads before both stores: two independent requests in flight per thread.
    const Vec kv = *reinterpret_cast<const Vec*>(k + head * a.key_head_stride + within);
    const Vec vv = *reinterpret_cast<const Vec*>(v + head * a.value_head_stride + within);
    kc[i] = kv;
    vc[i] = vv;
  }
}

template <typename Vec, typename Index>
__global__ void __launch_bounds__(kThreads) paged_gather_kernel(PagedGatherArgs a, int warps_per_token) {
  const TokenGroup g = token_group(warps_per_token);
  if (g.token >= a.num_tokens) return;
  const int64_t table_index = g.token / a.block_size;
  const int64_t offset = g.token - table_index * a.block_size;
  const int64_t block = load_index<Index>(a.block_table, table_index);
  const int vecs = static_cast<int>(a.row_bytes / static_cast<int64_t>(sizeof(Vec)));
  Vec* ko = reinterpret_cast<Vec*>(static_cast<char*>(a.key_out) + g.token * a.row_bytes);
  Vec* vo = reinterpret_cast<Vec*>(static_cast<char*>(a.value_out) + g.token * a.row_bytes);
  if (block < 0 || block >= a.num_blocks) {  // an index we cannot trust: defined output, no read
    const Vec zero{};
    for (int i = g.lane; i < vecs; i += g.width) {
      ko[i] = zero;
      vo[i] = zero;
    }
    return;
  }
  const int64_t row = (block * a.block_size + offset) * a.row_bytes;
  const Vec* kc = reinterpret_cast<const Vec*>(static_cast<const char*>(a.key_cache) + row);
  const Vec* vc = reinterpret_cast<const Vec*>(static_cast<const char*>(a.value_cache) + row);
  for (int i = g.lane; i < vecs; i += g.width) {
    const Vec kv = kc[i];
    const Vec vv = vc[i];
    ko[i] = kv;
    vo[i] = vv;
  }
}

// The widest power-of-two vector (<= 16 bytes) dividing every address, stride and size given.
int vector_bytes(std::initializer_list<uint64_t> values) {
  uint64_t bits = 16;
  for (uint64_t v : values) bits |= v;
  return static_cast<int>(bits & (~bits + 1));  // lowest set bit
}

// Calls fn with a value of the unsigned vector type of `bytes` bytes.
template <typename Fn>
cudaError_t with_vector(int bytes, Fn&& fn) {
  switch (bytes) {
    case 16: return fn(uint4{});
    case 8: return fn(uint2{});
    case 4: return fn(uint32_t{});
    case 2: return fn(uint16_t{});
    default: return fn(uint8_t{});
  }
}

template <typename Fn>
cudaError_t with_index(IndexType type, Fn&& fn) {
  return type == IndexType::kInt32 ? fn(int32_t{}) : fn(int64_t{});
}

// Warps per token: enough for one vector per thread on short rows, at most the whole block.
int warps_per_token(int64_t vecs_per_row) {
  int warps = 1;
  while (warps < kWarps && static_cast<int64_t>(warps) * 32 < vecs_per_row) warps *= 2;
  return warps;
}

// Grid covering num_tokens tokens; false when it would not fit a launch.
bool token_grid(int64_t num_tokens, int warps, unsigned* blocks) {
  const int64_t tokens_per_block = kWarps / warps;
  const int64_t n = (num_tokens + tokens_per_block - 1) / tokens_per_block;
  if (n > INT_MAX) return false;
  *blocks = static_cast<unsigned>(n);
  return true;
}

}  // namespace

cudaError_t paged_write(const PagedWriteArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0 || a.num_heads == 0 || a.head_bytes == 0) return cudaSuccess;
  const int width = vector_bytes({reinterpret_cast<uintptr_t>(a.key), reinterpret_cast<uintptr_t>(a.value),
                                  reinterpret_cast<uintptr_t>(a.key_cache), reinterpret_cast<uintptr_t>(a.value_cache),
                                  static_cast<uint64_t>(a.key_token_stride), static_cast<uint64_t>(a.key_head_stride),
                                  static_cast<uint64_t>(a.value_token_stride), static_cast<uint64_t>(a.value_head_stride),
                                  static_cast<uint64_t>(a.head_bytes)});
  const int64_t vecs = a.num_heads * (a.head_bytes / width);
  if (vecs > INT_MAX) return cudaErrorInvalidValue;
  const int warps = warps_per_token(vecs);
  unsigned blocks = 0;
  if (!token_grid(a.num_tokens, warps, &blocks)) return cudaErrorInvalidValue;
  return with_vector(width, [&](auto vec) {
    return with_index(a.slot_type, [&](auto index) {
      paged_write_kernel<decltype(vec), decltype(index)><<<blocks, kThreads, 0, stream>>>(a, warps);
      return cudaGetLastError();
    });
  });
}

cudaError_t paged_gather(const PagedGatherArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0 || a.row_bytes == 0) return cudaSuccess;
  if (a.block_size <= 0) return cudaErrorInvalidValue;
  const int width = vector_bytes({reinterpret_cast<uintptr_t>(a.key_cache), reinterpret_cast<uintptr_t>(a.value_cache),
                                  reinterpret_cast<uintptr_t>(a.key_out), reinterpret_cast<uintptr_t>(a.value_out),
                                  static_cast<uint64_t>(a.row_bytes)});
  const int64_t vecs = a.row_bytes / width;
  if (vecs > INT_MAX) return cudaErrorInvalidValue;
  const int warps = warps_per_token(vecs);
  unsigned blocks = 0;
  if (!token_grid(a.num_tokens, warps, &blocks)) return cudaErrorInvalidValue;
  return with_vector(width, [&](auto vec) {
    return with_index(a.table_type, [&](auto index) {
      paged_gather_kernel<decltype(vec), decltype(index)><<<blocks, kThreads, 0, stream>>>(a, warps);
      return cudaGetLastError();
    });
  });
}

cudaError_t copy_block_runs(void* dst, const void* src, const BlockRun* runs, int64_t num_runs, int64_t block_bytes,
                            cudaStream_t stream) {
  for (int64_t i = 0; i < num_runs; ++i) {
    const BlockRun& r = runs[i];
    const cudaError_t err = cudaMemcpyAsync(static_cast<char*>(dst) + r.dst_block * block_bytes,
                                            static_cast<const char*>(src) + r.src_block * block_bytes,
                                            static_cast<size_t>(r.num_blocks * block_bytes), cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;                                  // vectors in flight per thread
constexpr int64_t kTileVecs = int64_t{kCopyThreads} * kCopyUnroll;  // one tile: 16 KiB with uint4
constexpr int kCopyCtasPerSm = 2048 / kCopyThreads;              // a full SM

// Tile t is part t % tiles_per_block of pair t / tiles_per_block. Every thread issues all its
// loads before its stores, so kCopyUnroll requests per thread are in flight. The pairs come from
// `pairs` (device memory) or, for up to kInlinePairs of them, from the kernel's parameters
// (__grid_constant__: read in place from the constant bank, one broadcast per CTA and tile).
template <typename Vec, bool kInline>
__global__ void __launch_bounds__(kCopyThreads)
    block_pairs_kernel(char* __restrict__ dst, const char* __restrict__ src, const int64_t* __restrict__ pairs,
                       const __grid_constant__ InlinePairs inline_pairs, int64_t num_tiles, int64_t tiles_per_block,
                       int64_t block_bytes) {
  const int64_t vecs_per_block = block_bytes / static_cast<int64_t>(sizeof(Vec));
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t pair = tile / tiles_per_block;
    const int64_t first = (tile - pair * tiles_per_block) * kTileVecs + threadIdx.x;
    const int64_t from = kInline ? inline_pairs.v[2 * pair] : pairs[2 * pair];
    const int64_t to = kInline ? inline_pairs.v[2 * pair + 1] : pairs[2 * pair + 1];
    const Vec* s = reinterpret_cast<const Vec*>(src + from * block_bytes);
    Vec* d = reinterpret_cast<Vec*>(dst + to * block_bytes);
    Vec v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = first + u * kCopyThreads;
      if (i < vecs_per_block) v[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = first + u * kCopyThreads;
      if (i < vecs_per_block) d[i] = v[u];
    }
  }
}

}  // namespace

cudaError_t copy_block_pairs(void* dst, const void* src, const int64_t* pairs, const InlinePairs* inline_pairs,
                             int64_t num_pairs, int64_t block_bytes, int max_ctas, cudaStream_t stream) {
  if (num_pairs == 0 || block_bytes == 0) return cudaSuccess;
  if (num_pairs < 0 || block_bytes < 0 || dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
  if (inline_pairs != nullptr ? num_pairs > kInlinePairs : pairs == nullptr) return cudaErrorInvalidValue;
  const int width = vector_bytes({reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src),
                                  static_cast<uint64_t>(block_bytes)});
  const int64_t tiles_per_block = (block_bytes / width + kTileVecs - 1) / kTileVecs;
  if (num_pairs > INT64_MAX / tiles_per_block) return cudaErrorInvalidValue;
  const int64_t num_tiles = num_pairs * tiles_per_block;
  int64_t ctas = max_ctas;
  if (ctas <= 0) {
    int device = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    ctas = static_cast<int64_t>(sms) * kCopyCtasPerSm;
  }
  if (ctas > num_tiles) ctas = num_tiles;
  if (ctas < 1) ctas = 1;
  if (ctas > INT_MAX) ctas = INT_MAX;
  static const InlinePairs kNoPairs{};
  return with_vector(width, [&](auto vec) {
    using Vec = decltype(vec);
    const dim3 grid(static_cast<unsigned>(ctas));
    if (inline_pairs != nullptr)
      block_pairs_kernel<Vec, true><<<grid, kCopyThreads, 0, stream>>>(static_cast<char*>(dst),
                                                                      static_cast<const char*>(src), nullptr,
                                                                      *inline_pairs, num_tiles, tiles_per_block,
                                                                      block_bytes);
    else
      block_pairs_kernel<Vec, false><<<grid, kCopyThreads, 0, stream>>>(static_cast<char*>(dst),
                                                                       static_cast<const char*>(src), pairs, kNoPairs,
                                                                       num_tiles, tiles_per_block, block_bytes);
    return cudaGetLastError();
  });
}

void* device_address(const void* ptr) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    (void)cudaGetLastError();  // not a pointer the runtime knows: clear the error, take the memcpy path
    return nullptr;
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged:
    case cudaMemoryTypeHost: return attr.devicePointer;  // nullptr for pinned memory that is not mapped
    default: return nullptr;                             // pageable host memory
  }
}

}  // namespace samcache::cuda
