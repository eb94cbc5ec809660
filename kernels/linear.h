// The models' dense layers on the process's BLAS (kernels/blas_library.h): at::linear's contract, computed with one
// GEMM call on the library the process chose, where LibTorch's own product would always run on the BLAS it links
// (MKL in the PyPI wheel, which runs its AVX2 kernels on AMD CPUs with AVX-512: docs/kernels.md, "GEMM rates"),
// with what follows a transformer's dense layer (GELU, the residual add) applied in place: the bias and the residual
// written in parallel before the GEMM adds to them, GELU after (docs/kernels.md, "Dense layers with their epilogue").
#pragma once

#include <ATen/core/Tensor.h>

namespace mita::kernels {

// What Linear applies to x W^T + b before returning it, in this order.
struct LinearEpilogue {
  bool gelu = false;    // GELU in its exact (erf) form, as at::gelu(y, "none")
  at::Tensor residual;  // undefined, or a tensor of the output's shape added last (a transformer block's skip path)

  static LinearEpilogue Gelu() { return {true, at::Tensor()}; }
  static LinearEpilogue AddResidual(const at::Tensor& residual) { return {false, residual}; }
};

// y = residual + act(x W^T + b), as at::linear followed by `epilogue`: input [..., in_features], weight
// [out_features, in_features], bias [out_features] or an undefined tensor; returns [..., out_features], contiguous.
// On the BLAS for float32 and float64 CPU tensors of one dtype without autograd; at::linear, at::gelu and at::add
// for anything else (CUDA, other dtypes, a gradient to record), so the result never depends on which path ran beyond
// rounding. Throws, as at::linear does, when the shapes disagree (also the residual's).
at::Tensor Linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                  const LinearEpilogue& epilogue = {});

}  // namespace mita::kernels
