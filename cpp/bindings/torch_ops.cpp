// The single registration file of torch.ops.samcache: every op's schema is defined here once,
// with its CPU and (when built) CUDA implementations. Fake (meta) implementations for
// torch.compile are registered in Python (samcache/ops.py). Later issues only add lines here.
#include <torch/library.h>

#include "../kernels/copy_blocks.h"
#include "../kernels/sparse_attention.h"

TORCH_LIBRARY(samcache, m) {
  // Copies block src -> dst in every cache, for each (src, dst) row of block_pairs.
  m.def("copy_blocks(Tensor(a!)[] caches, Tensor block_pairs) -> ()");
  // Attention of sparse queries (at sequence indices q_index) against one sequence's paged KV:
  // causal by index, GQA, optional window and logit cap. Returns (out, lse).
  m.def(
      "sparse_attention(Tensor q, Tensor q_index, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "int num_kv_tokens, float scale, int window=-1, float logit_cap=0.0) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(samcache, CPU, m) {
  m.impl("copy_blocks", &samcache::kernels::copy_blocks_cpu);
  m.impl("sparse_attention", &samcache::kernels::sparse_attention_cpu);
}

#ifdef SAMCACHE_WITH_CUDA
TORCH_LIBRARY_IMPL(samcache, CUDA, m) {
  m.impl("copy_blocks", &samcache::kernels::copy_blocks_cuda);
  m.impl("sparse_attention", &samcache::kernels::sparse_attention_cuda);
}
#endif
