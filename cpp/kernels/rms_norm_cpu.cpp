#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "cpu_convert.h"
#include "rms_norm.h"

namespace samcache::kernels {

namespace {

bool is_norm_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

constexpr int kLanes = 8;  // independent partial sums: the loop vectorises without reassociation flags

template <typename T>
SAMCACHE_AVX2_CLONE float sum_squares(const T* x, int64_t dim) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= dim; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float v = to_float(x[i + j]);
      lane[j] += v * v;
    }
  for (int j = 0; i < dim; ++i, ++j) {
    const float v = to_float(x[i]);
    lane[j] += v * v;
  }
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

template <typename T>
SAMCACHE_AVX2_CLONE void add_rows(T* x, const T* delta, int64_t dim) {
  for (int64_t i = 0; i < dim; ++i) x[i] = from_float<T>(to_float(x[i]) + to_float(delta[i]));
}

template <typename T>
SAMCACHE_AVX2_CLONE void scale_row(const T* x, const T* weight, float inv_rms, T* out, int64_t dim) {
  for (int64_t i = 0; i < dim; ++i)
    out[i] = from_float<T>(to_float(weight[i]) * to_float(from_float<T>(to_float(x[i]) * inv_rms)));
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t n = x.size(0), dim = x.size(1);
  T* xs = x.data_ptr<T>();
  const int64_t xst = x.stride(0);
  const T* ds = delta ? delta->const_data_ptr<T>() : nullptr;
  const int64_t dst = delta ? delta->stride(0) : 0;
  const T* w = weight.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(1, dim));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = xs + r * xst;
      if (ds) add_rows(row, ds + r * dst, dim);
      // mean = sum / dim in float32, then 1 / sqrt(mean + eps): the reference's steps.
      const float mean = sum_squares(row, dim) / static_cast<float>(dim);
      const float inv_rms = 1.0f / std::sqrt(mean + e);
      scale_row(row, w, inv_rms, o + r * dim, dim);
    }
  });
}

at::Tensor norm(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  const at::Tensor w = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_cpu",
                                  [&] { run<scalar_t>(x, delta, w, eps, out); });
  return out;
}

}  // namespace

RmsNormShape check_rms_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK_VALUE(x.defined() && weight.defined(), op, ": x and weight must be tensors");
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be [N, D], got ", x.sizes());
  TORCH_CHECK_TYPE(is_norm_dtype(x.scalar_type()), op, ": x must be float32, float16 or bfloat16, got ",
                   x.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), op, ": weight must be ", x.scalar_type(),
                   " like x, got ", weight.scalar_type());
  const int64_t dim = x.size(1);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == dim, op, ": weight must be [", dim, "], got ",
                    weight.sizes());
  TORCH_CHECK_VALUE(dim > 0, op, ": x has no columns");
  TORCH_CHECK_VALUE(weight.device() == x.device(), op, ": x is on ", x.device(), ", weight on ", weight.device());
  TORCH_CHECK_VALUE(x.stride(1) == 1, op, ": x's last dim must be contiguous, got strides ", x.strides());
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, op, ": eps must be finite and >= 0, got ", eps);
  return {x.size(0), dim};
}

RmsNormShape check_add_rms_norm_args(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                     double eps) {
  const RmsNormShape shape = check_rms_norm_args("add_rms_norm", x, weight, eps);
  TORCH_CHECK_VALUE(delta.defined(), "add_rms_norm: delta must be a tensor");
  TORCH_CHECK_VALUE(delta.sizes() == x.sizes(), "add_rms_norm: delta must be ", x.sizes(), " like x, got ",
                    delta.sizes());
  TORCH_CHECK_TYPE(delta.scalar_type() == x.scalar_type(), "add_rms_norm: delta must be ", x.scalar_type(),
                   " like x, got ", delta.scalar_type());
  TORCH_CHECK_VALUE(delta.device() == x.device(), "add_rms_norm: x is on ", x.device(), ", delta on ",
                    delta.device());
  TORCH_CHECK_VALUE(delta.stride(1) == 1 || shape.dim == 1, "add_rms_norm: delta's last dim must be contiguous, got strides ",
                    delta.strides());
  // x is written in place: rows that share memory would make the result depend on the order.
  TORCH_CHECK_VALUE(shape.num_rows <= 1 || x.stride(0) >= shape.dim, "add_rms_norm: x's rows overlap (strides ",
                    x.strides(), "); it is written in place");
  return shape;
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_args("rms_norm", x, weight, eps);
  return norm(x, nullptr, weight, eps);
}

at::Tensor add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_add_rms_norm_args(x, delta, weight, eps);
  return norm(x, &delta, weight, eps);
}

}  // namespace samcache::kernels
