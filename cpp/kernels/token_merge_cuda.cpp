// Torch-facing CUDA wrapper of token_merge. The number of anchors is data-dependent, so one
// device -> host copy is unavoidable: the validation kernel's status (anchor count, first error,
// largest weight) travels in that copy. The host waits for that copy only: the grouping (torch's
// stable sort, cumsums and the planning kernels of cuda/token_merge.cu) is queued behind it and
// runs during the round trip; then the reduce. Errors: when the status reports a problem, the
// host re-runs the CPU's checks on copies of target and weight, which raise exactly the CPU's
// error (one code path for the message, nothing decoded from device words).
#include <ATen/core/Tensor.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cfloat>
#include <cmath>
#include <cstring>

#include "token_merge.cuh"  // cuda/: the raw-pointer launchers
#include "token_merge.h"

namespace samcache::kernels {

namespace {

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "token_merge CUDA ", what, " failed: ", cudaGetErrorString(err));
}

// A timing-free event the host waits on; destroyed (even while pending) when it goes out of scope.
class HostWait {
 public:
  HostWait() { check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "event creation"); }
  ~HostWait() { (void)cudaEventDestroy(event_); }
  HostWait(const HostWait&) = delete;
  HostWait& operator=(const HostWait&) = delete;
  void record(cudaStream_t stream) { check_cuda(cudaEventRecord(event_, stream), "event record"); }
  void wait() { check_cuda(cudaEventSynchronize(event_), "status copy"); }

 private:
  cudaEvent_t event_ = nullptr;
};

// Whether some anchor's float32 weight total could overflow: every weight is <= max_weight, and a
// float32 running sum of n values exceeds the exact sum by at most a factor exp(n 2^-24).
bool weight_sum_may_overflow(float max_weight, int64_t n) {
  const double nd = static_cast<double>(n);
  return static_cast<double>(max_weight) * nd * std::exp(nd * 0x1p-24) * 1.01 >= static_cast<double>(FLT_MAX);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> token_merge_cuda(const at::Tensor& hidden_in, const at::Tensor& target_in,
                                                    const at::Tensor& weight_in) {
  check_token_merge_args(hidden_in, target_in, weight_in);
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const int64_t n = hidden_in.size(0), dim = hidden_in.size(1);
  if (n == 0) return {at::empty({0, dim}, hidden_in.options()), at::empty({0}, target_in.options())};
  TORCH_CHECK_VALUE(n <= 0x7fffffff, "token_merge: CUDA takes at most 2^31 - 1 tokens, got ", n);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor hidden = hidden_in.stride(1) == 1 ? hidden_in : hidden_in.contiguous();
  const at::Tensor target = target_in.contiguous(), weight = weight_in.contiguous();
  const auto long_opts = target.options();
  const auto int_opts = long_opts.dtype(at::kInt);

  // 1. Validation, then the status to the host. copy_ with non_blocking records the stream on
  // the pinned buffer, so it is not reused before the copy has run whatever happens below.
  at::Tensor flags = at::zeros({2, n}, int_opts);  // anchor_flag, has_weight
  at::Tensor status = at::empty({samcache::cuda::kTokenMergeStatusWords}, long_opts);
  auto* status_words = reinterpret_cast<unsigned long long*>(status.mutable_data_ptr<int64_t>());
  check_cuda(samcache::cuda::token_merge_validate(target.const_data_ptr<int64_t>(), weight.const_data_ptr<float>(), n,
                                                  flags[0].mutable_data_ptr<int32_t>(),
                                                  flags[1].mutable_data_ptr<int32_t>(), status_words, stream),
             "validation");
  at::Tensor host_status =
      at::empty({samcache::cuda::kTokenMergeStatusWords}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  host_status.copy_(status, /*non_blocking=*/true);
  HostWait status_ready;
  status_ready.record(stream);

  // 2. The grouping, queued behind the copy (its kernels do nothing on a bad plan).
  const auto [sorted_target, order] = at::sort(target.to(at::kInt), std::optional<bool>(true), /*dim=*/0);
  const at::Tensor anchor_rank = at::cumsum(flags[0], 0, at::kInt);
  at::Tensor offsets = at::empty({n + 1}, int_opts);
  at::Tensor marks = at::empty({n}, long_opts);
  check_cuda(samcache::cuda::token_merge_rows(sorted_target.const_data_ptr<int32_t>(),
                                              anchor_rank.const_data_ptr<int32_t>(), n, status_words,
                                              offsets.mutable_data_ptr<int32_t>(), marks.mutable_data_ptr<int64_t>(),
                                              stream),
             "row planning");
  const at::Tensor cum = at::cumsum(marks, 0);
  static_assert(sizeof(samcache::cuda::MergeChunk) == 4 * sizeof(int32_t));
  at::Tensor chunks = at::empty({n, 4}, int_opts);
  at::Tensor slot_chunk = at::empty({n}, int_opts);
  auto* chunk_list = reinterpret_cast<samcache::cuda::MergeChunk*>(chunks.mutable_data_ptr<int32_t>());
  check_cuda(samcache::cuda::token_merge_chunks(sorted_target.const_data_ptr<int32_t>(),
                                                anchor_rank.const_data_ptr<int32_t>(),
                                                offsets.const_data_ptr<int32_t>(), marks.const_data_ptr<int64_t>(),
                                                cum.const_data_ptr<int64_t>(), n, status_words, chunk_list,
                                                slot_chunk.mutable_data_ptr<int32_t>(), stream),
             "chunk planning");

  // 3. The host waits for the status only.
  status_ready.wait();
  const int64_t* words = host_status.const_data_ptr<int64_t>();
  const int64_t m = words[0];
  const auto key = static_cast<unsigned long long>(words[1]);
  uint32_t max_bits = static_cast<uint32_t>(words[2]);
  float max_weight = 0.0f;
  std::memcpy(&max_weight, &max_bits, sizeof(max_weight));
  const bool bad = key != samcache::cuda::kTokenMergeNoError;
  if (bad || weight_sum_may_overflow(max_weight, n)) {
    // The CPU's checks on host copies raise the CPU's exact error (and decide the rare sums that
    // may overflow float32 exactly as the CPU does).
    (void)plan_token_merge_values(target.to(at::kCPU), weight.to(at::kCPU));
    TORCH_CHECK(!bad, "token_merge: the CUDA validation reported problem ",
                static_cast<int>(key >> samcache::cuda::kTokenMergeCodeShift), " at token ",
                static_cast<int64_t>(key & ((1ull << samcache::cuda::kTokenMergeCodeShift) - 1)),
                " but the CPU checks accept the plan (internal error)");
  }
  TORCH_CHECK(m >= 1 && m <= n, "token_merge: the CUDA validation counted ", m, " anchors of ", n,
              " tokens (internal error)");

  // 4. The reduce.
  at::Tensor merged = at::empty({m, dim}, hidden.options());
  at::Tensor kept = at::empty({m}, long_opts);
  const int64_t max_slots = samcache::cuda::merge_max_slots(n, m);
  at::Tensor partial, partial_weight;
  if (max_slots > 0) {
    partial = at::empty({max_slots, dim > 0 ? dim : 1}, hidden.options().dtype(at::kFloat));
    partial_weight = at::empty({max_slots}, hidden.options().dtype(at::kFloat));
  }
  const int dtype = hidden.scalar_type() == at::kFloat  ? samcache::cuda::kMergeFloat32
                    : hidden.scalar_type() == at::kHalf ? samcache::cuda::kMergeFloat16
                                                        : samcache::cuda::kMergeBFloat16;
  check_cuda(samcache::cuda::token_merge_reduce(
                 hidden.const_data_ptr(), dtype, hidden.stride(0), n, dim, weight.const_data_ptr<float>(),
                 order.const_data_ptr<int64_t>(), sorted_target.const_data_ptr<int32_t>(),
                 offsets.const_data_ptr<int32_t>(), cum.const_data_ptr<int64_t>(), chunk_list,
                 slot_chunk.const_data_ptr<int32_t>(), m, max_slots > 0 ? partial.mutable_data_ptr<float>() : nullptr,
                 max_slots > 0 ? partial_weight.mutable_data_ptr<float>() : nullptr, kept.mutable_data_ptr<int64_t>(),
                 merged.mutable_data_ptr(), stream),
             "merge");
  return {merged, kept};
}

}  // namespace samcache::kernels
