#include "kernels/linear.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/record_function.h>

#include "kernels/blas_library.h"
#include "kernels/forward_scopes.h"

namespace mita::kernels {

namespace {

bool RunsOnBlas(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  const at::ScalarType type = input.scalar_type();
  if (type != at::kFloat && type != at::kDouble) return false;
  if (!input.device().is_cpu() || !weight.device().is_cpu() || weight.scalar_type() != type) return false;
  if (bias.defined() && (!bias.device().is_cpu() || bias.scalar_type() != type)) return false;
  if (input.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad())) return false;
  if (input.dim() < 1 || weight.dim() != 2 || input.size(-1) != weight.size(1)) return false;
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0))) return false;
  // BLAS's LP64 interface: every dimension and leading dimension in an int.
  int64_t rows = 1;
  for (int64_t dim = 0; dim + 1 < input.dim(); ++dim) rows *= input.size(dim);
  return rows <= INT_MAX && weight.size(0) <= INT_MAX && weight.size(1) <= INT_MAX;
}

template <typename T>
void LinearRows(const T* x, const T* w, const T* b, T* y, int64_t rows, int64_t in_features, int64_t out_features) {
  if (b != nullptr) {
    for (int64_t row = 0; row < rows; ++row) std::copy(b, b + out_features, y + row * out_features);
  }
  // Row-major y[rows, out] = x[rows, in] W[out, in]^T is column-major y^T = W x^T: W read transposed.
  BlasLibrary::Get().Gemm('T', 'N', out_features, rows, in_features, T(1), w, in_features, x, in_features,
                          b != nullptr ? T(1) : T(0), y, out_features);
}

}  // namespace

at::Tensor Linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  // The inputs (for a profiler's FLOP count) are only gathered when a callback asks for them.
  RECORD_FUNCTION(kLinearScope, std::vector<c10::IValue>({input, weight}));
  if (!RunsOnBlas(input, weight, bias)) return at::linear(input, weight, bias);
  const int64_t in_features = weight.size(1), out_features = weight.size(0);
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  const at::Tensor b = bias.defined() ? bias.contiguous() : bias;
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = out_features;
  at::Tensor output = at::empty(shape, input.options());
  const int64_t rows = out_features > 0 ? output.numel() / out_features : 0;
  if (rows == 0 || out_features == 0) return output;
  if (in_features == 0) return b.defined() ? output.copy_(b.expand_as(output)) : output.zero_();
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "mita::kernels::Linear", [&] {
    LinearRows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), b.defined() ? b.data_ptr<scalar_t>() : nullptr,
                         output.data_ptr<scalar_t>(), rows, in_features, out_features);
  });
  return output;
}

}  // namespace mita::kernels
