// The single registration file of torch.ops.samcache: every op's schema is defined here once,
// with its CPU and (when built) CUDA implementations. Fake (meta) implementations for
// torch.compile are registered in Python (samcache/ops.py). Later issues only add lines here.
#include <torch/library.h>

#include "../kernels/copy_blocks.h"

TORCH_LIBRARY(samcache, m) {
  // Copies block src -> dst in every cache, for each (src, dst) row of block_pairs.
  m.def("copy_blocks(Tensor(a!)[] caches, Tensor block_pairs) -> ()");
}

TORCH_LIBRARY_IMPL(samcache, CPU, m) { m.impl("copy_blocks", &samcache::kernels::copy_blocks_cpu); }

#ifdef SAMCACHE_WITH_CUDA
TORCH_LIBRARY_IMPL(samcache, CUDA, m) { m.impl("copy_blocks", &samcache::kernels::copy_blocks_cuda); }
#endif
