#include "kernels/linear.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/record_function.h>

#include "kernels/blas_library.h"
#include "kernels/forward_scopes.h"

namespace mita::kernels {

namespace {

// Output rows per task of the parallel fills and adds: a few microseconds of copying each.
constexpr int64_t kRowsPerTask = 64;

bool RunsOnBlas(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                const at::Tensor& residual) {
  const at::ScalarType type = input.scalar_type();
  if (type != at::kFloat && type != at::kDouble) return false;
  if (!input.device().is_cpu() || !weight.device().is_cpu() || weight.scalar_type() != type) return false;
  if (bias.defined() && (!bias.device().is_cpu() || bias.scalar_type() != type)) return false;
  if (residual.defined() && (!residual.device().is_cpu() || residual.scalar_type() != type)) return false;
  if (input.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()) ||
      (residual.defined() && residual.requires_grad())) {
    return false;
  }
  if (input.dim() < 1 || weight.dim() != 2 || input.size(-1) != weight.size(1)) return false;
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0))) return false;
  // BLAS's LP64 interface: every dimension and leading dimension in an int.
  int64_t rows = 1;
  for (int64_t dim = 0; dim + 1 < input.dim(); ++dim) rows *= input.size(dim);
  return rows <= INT_MAX && weight.size(0) <= INT_MAX && weight.size(1) <= INT_MAX;
}

// Raw row-major buffers of one product y[rows, out] = residual + act(x[rows, in] W[out, in]^T + b).
template <typename T>
struct Product {
  const T* x;
  const T* w;
  const T* b;         // null: no bias
  const T* residual;  // null: none; else [rows, out]
  T* y;
  int64_t rows, in_features, out_features;
};

// y[begin, end) before the GEMM adds x W^T to it: the bias, plus the residual when `with_residual`.
template <typename T>
void FillRows(const Product<T>& p, bool with_residual, int64_t begin, int64_t end) {
  const int64_t out = p.out_features;
  if (with_residual && p.b != nullptr) {
    for (int64_t row = begin; row < end; ++row) {
      const T* r = p.residual + row * out;
      T* y = p.y + row * out;
      for (int64_t column = 0; column < out; ++column) y[column] = r[column] + p.b[column];
    }
  } else if (with_residual) {
    std::copy(p.residual + begin * out, p.residual + end * out, p.y + begin * out);
  } else if (p.b != nullptr) {
    for (int64_t row = begin; row < end; ++row) std::copy(p.b, p.b + out, p.y + row * out);
  }
}

template <typename T>
void AddResidualRows(const Product<T>& p, int64_t begin, int64_t end) {
  const int64_t count = (end - begin) * p.out_features;
  const T* r = p.residual + begin * p.out_features;
  T* y = p.y + begin * p.out_features;
  for (int64_t i = 0; i < count; ++i) y[i] += r[i];
}

// The fill in parallel over rows, one GEMM on the BLAS's own threads (which splits it better than rows handed to
// each thread, docs/kernels.md), then GELU and the residual add in place. `output` is p.y as a tensor, for GELU.
template <typename T>
void RunProduct(const Product<T>& p, bool gelu, at::Tensor& output) {
  // With GELU between, the residual comes after it; else it is filled with the bias, sparing a pass.
  const bool fill_residual = p.residual != nullptr && !gelu;
  const bool filled = fill_residual || p.b != nullptr;
  if (filled) {
    at::parallel_for(0, p.rows, kRowsPerTask,
                     [&](int64_t begin, int64_t end) { FillRows(p, fill_residual, begin, end); });
  }
  // Row-major y[rows, out] = x[rows, in] W[out, in]^T (+ y) is column-major y^T = W x^T: W read transposed.
  BlasLibrary::Get().Gemm('T', 'N', p.out_features, p.rows, p.in_features, T(1), p.w, p.in_features, p.x,
                          p.in_features, filled ? T(1) : T(0), p.y, p.out_features);
  if (!gelu) return;
  at::gelu_(output, "none");
  if (p.residual != nullptr) {
    at::parallel_for(0, p.rows, kRowsPerTask, [&](int64_t begin, int64_t end) { AddResidualRows(p, begin, end); });
  }
}

}  // namespace

at::Tensor Linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                  const LinearEpilogue& epilogue) {
  // The inputs (for a profiler's FLOP count) are only gathered when a callback asks for them.
  RECORD_FUNCTION(kLinearScope, std::vector<c10::IValue>({input, weight}));
  const at::Tensor& residual = epilogue.residual;
  if (!RunsOnBlas(input, weight, bias, residual)) {
    at::Tensor output = at::linear(input, weight, bias);
    if (epilogue.gelu) output = at::gelu(output, "none");
    if (!residual.defined()) return output;
    TORCH_CHECK(residual.sizes() == output.sizes(), "Linear: a residual of shape ", residual.sizes(),
                " for an output of shape ", output.sizes());
    return at::add(residual, output);
  }
  const int64_t in_features = weight.size(1), out_features = weight.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = out_features;
  TORCH_CHECK(!residual.defined() || residual.sizes() == at::IntArrayRef(shape), "Linear: a residual of shape ",
              residual.sizes(), " for an output of shape ", at::IntArrayRef(shape));
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  const at::Tensor b = bias.defined() ? bias.contiguous() : bias;
  const at::Tensor r = residual.defined() ? residual.contiguous() : residual;
  at::Tensor output = at::empty(shape, input.options());
  const int64_t rows = out_features > 0 ? output.numel() / out_features : 0;
  if (rows == 0 || out_features == 0) return output;
  if (in_features == 0) {
    // x W^T is zero: the epilogue of the bias alone.
    b.defined() ? output.copy_(b.expand_as(output)) : output.zero_();
    if (epilogue.gelu) at::gelu_(output, "none");
    return r.defined() ? output.add_(r) : output;
  }
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "mita::kernels::Linear", [&] {
    const Product<scalar_t> product{x.data_ptr<scalar_t>(),
                                    w.data_ptr<scalar_t>(),
                                    b.defined() ? b.data_ptr<scalar_t>() : nullptr,
                                    r.defined() ? r.data_ptr<scalar_t>() : nullptr,
                                    output.data_ptr<scalar_t>(),
                                    rows,
                                    in_features,
                                    out_features};
    RunProduct(product, epilogue.gelu, output);
  });
  return output;
}

}  // namespace mita::kernels
