// The single registration file of torch.ops.samcache: every op's schema is defined here once,
// with its CPU and (when built) CUDA implementations. Fake (meta) implementations for
// torch.compile are registered in Python (samcache/ops.py). Later issues only add lines here.
#include <torch/library.h>

#include "../kernels/copy_blocks.h"
#include "../kernels/rope.h"

TORCH_LIBRARY(samcache, m) {
  // Copies block src -> dst in every cache, for each (src, dst) row of block_pairs.
  m.def("copy_blocks(Tensor(a!)[] caches, Tensor block_pairs) -> ()");
  // Moves cached keys [N, H, D] from positions p to p + delta by re-rotating RoPE, in place.
  m.def("rope_rerotate(Tensor(a!) key, Tensor delta, Tensor inv_freq, str style, int[] mrope_section) -> ()");
  // The same rotation, written straight into the paged key cache at slot_mapping (key unchanged).
  m.def(
      "rope_rerotate_write(Tensor key, Tensor delta, Tensor inv_freq, str style, int[] mrope_section, "
      "Tensor(a!) key_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(samcache, CPU, m) {
  m.impl("copy_blocks", &samcache::kernels::copy_blocks_cpu);
  m.impl("rope_rerotate", &samcache::kernels::rope_rerotate_cpu);
  m.impl("rope_rerotate_write", &samcache::kernels::rope_rerotate_write_cpu);
}

#ifdef SAMCACHE_WITH_CUDA
TORCH_LIBRARY_IMPL(samcache, CUDA, m) {
  m.impl("copy_blocks", &samcache::kernels::copy_blocks_cuda);
  m.impl("rope_rerotate", &samcache::kernels::rope_rerotate_cuda);
  m.impl("rope_rerotate_write", &samcache::kernels::rope_rerotate_write_cuda);
}
#endif
