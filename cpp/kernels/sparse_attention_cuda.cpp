// Torch-facing CUDA wrapper of sparse_attention: validate, pick the split count, allocate the
// outputs (and split workspace), launch on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sort.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "sparse_attention.cuh"  // cuda/: the raw-pointer launcher
#include "sparse_attention.h"

namespace samcache::kernels {

std::tuple<at::Tensor, at::Tensor> sparse_attention_cuda(const at::Tensor& q, const at::Tensor& q_pos,
                                                         const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
                                                         const at::Tensor& kv_indices,
                                                         const at::Tensor& kv_last_page_len,
                                                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                         double scale, int64_t window, double logit_cap,
                                                         int64_t max_kv_len) {
  const SparseAttentionPlan s = plan_sparse_attention(q, q_pos, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                                      key_cache, value_cache, scale, logit_cap, max_kv_len);
  TORCH_CHECK_VALUE(s.head_dim % 8 == 0 && s.head_dim <= samcache::cuda::kSparseAttentionMaxHeadDim,
                    "sparse_attention on CUDA needs head_dim to be a multiple of 8 up to ",
                    samcache::cuda::kSparseAttentionMaxHeadDim, ", got ", s.head_dim);
  for (const at::Tensor* t : {&key_cache, &value_cache})
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                      "sparse_attention on CUDA needs 16-byte aligned caches (a view with an odd storage offset?)");
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  at::Tensor lse = at::empty({s.num_rows, s.num_q_heads}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  // int64 on the device as given (a no-op for int64 metadata): never narrowed, so a bad value
  // cannot wrap into a valid one; the kernels check every value they read (row_keys).
  const at::Tensor pos = q_pos.to(at::kLong).contiguous();
  const at::Tensor qo = qo_indptr.to(at::kLong).contiguous();
  const at::Tensor kvp = kv_indptr.to(at::kLong).contiguous();
  const at::Tensor pages = kv_indices.to(at::kLong).contiguous();
  const at::Tensor last = kv_last_page_len.to(at::kLong).contiguous();

  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.device().index()));
  using samcache::cuda::AttnDType;
  const AttnDType dtype = q.scalar_type() == at::kFloat ? AttnDType::kFloat32
                          : q.scalar_type() == at::kHalf ? AttnDType::kFloat16
                                                         : AttnDType::kBFloat16;
  // The tensor-core kernel serves one sequence and is opt-in until it has been validated on a GPU.
  const char* tc_env = std::getenv("SAMCACHE_SPARSE_ATTENTION_TC");
  const bool tensor_cores = tc_env != nullptr && std::strcmp(tc_env, "1") == 0 && s.num_seqs == 1 &&
                            samcache::cuda::sparse_attention_tc_supported(s.head_dim, dtype);
  samcache::cuda::SparseAttentionParams p{};
  const int64_t max_keys = window > 0 ? std::min(window, max_kv_len) : max_kv_len;
  p.num_splits = tensor_cores
                     ? samcache::cuda::sparse_attention_tc_num_splits(s.num_rows, s.num_kv_heads, s.num_q_heads, max_keys, sms)
                     : samcache::cuda::sparse_attention_num_splits(s.num_rows, s.num_kv_heads, s.num_q_heads, max_keys, sms);
  at::Tensor order;
  if (tensor_cores) {  // rows sorted by position: a 64-row tile then spans a tight key range
    order = std::get<1>(pos.sort());
    p.query_order = order.data_ptr<int64_t>();
  }
  at::Tensor partial_o, partial_ml;
  if (p.num_splits > 1) {
    partial_o = at::empty({p.num_splits, s.num_rows, s.num_q_heads, s.head_dim}, lse.options());
    partial_ml = at::empty({p.num_splits, s.num_rows, s.num_q_heads, 2}, lse.options());
    p.partial_o = partial_o.data_ptr<float>();
    p.partial_ml = partial_ml.data_ptr<float>();
  }
  p.q = qc.data_ptr();
  p.q_pos = pos.data_ptr<int64_t>();
  p.qo_indptr = qo.data_ptr<int64_t>();
  p.kv_indptr = kvp.data_ptr<int64_t>();
  p.kv_indices = pages.data_ptr<int64_t>();
  p.kv_last_page_len = last.data_ptr<int64_t>();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.num_queries = s.num_rows;
  p.num_q_heads = s.num_q_heads;
  p.num_kv_heads = s.num_kv_heads;
  p.head_dim = s.head_dim;
  p.block_size = s.block_size;
  p.num_seqs = s.num_seqs;
  p.num_kv_indices = kv_indices.numel();
  p.num_cache_blocks = key_cache.size(0);
  p.window = window;
  p.scale = static_cast<float>(scale);
  p.logit_cap = static_cast<float>(logit_cap);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = tensor_cores ? samcache::cuda::sparse_attention_tc(p, dtype, stream)
                                       : samcache::cuda::sparse_attention(p, dtype, stream);
  TORCH_CHECK(err == cudaSuccess, "sparse_attention CUDA launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

}  // namespace samcache::kernels
