// The single registration file of torch.ops.samcache: every op's schema is defined here once,
// with its CPU and (when built) CUDA implementations. Fake (meta) implementations for
// torch.compile are registered in Python (samcache/ops.py). Later issues only add lines here.
#include <torch/library.h>

#include "../kernels/copy_blocks.h"
#include "../kernels/kv_quant.h"
#include "../kernels/token_merge.h"

TORCH_LIBRARY(samcache, m) {
  // Copies block src -> dst in every cache, for each (src, dst) row of block_pairs.
  m.def("copy_blocks(Tensor(a!)[] caches, Tensor block_pairs) -> ()");
  // Quantizes cache blocks to fp8 e4m3 or int8 with one float32 scale per block (or per block and head).
  m.def("quantize_kv_blocks(Tensor cache, Tensor block_ids, str qtype, bool per_head) -> (Tensor, Tensor)");
  // Writes q * scale back into the given cache blocks, in the cache's dtype.
  m.def("dequantize_kv_blocks(Tensor q, Tensor scales, Tensor(a!) cache, Tensor block_ids) -> ()");
  // Merges every token into its anchor by weighted average; returns (merged, kept_index).
  m.def("token_merge(Tensor hidden, Tensor target, Tensor weight) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(samcache, CPU, m) {
  m.impl("copy_blocks", &samcache::kernels::copy_blocks_cpu);
  m.impl("quantize_kv_blocks", &samcache::kernels::quantize_kv_blocks_cpu);
  m.impl("dequantize_kv_blocks", &samcache::kernels::dequantize_kv_blocks_cpu);
  m.impl("token_merge", &samcache::kernels::token_merge_cpu);
}

#ifdef SAMCACHE_WITH_CUDA
TORCH_LIBRARY_IMPL(samcache, CUDA, m) {
  m.impl("copy_blocks", &samcache::kernels::copy_blocks_cuda);
  m.impl("quantize_kv_blocks", &samcache::kernels::quantize_kv_blocks_cuda);
  m.impl("dequantize_kv_blocks", &samcache::kernels::dequantize_kv_blocks_cuda);
  m.impl("token_merge", &samcache::kernels::token_merge_cuda);
}
#endif
