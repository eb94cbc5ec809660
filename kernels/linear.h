// The models' dense layers on the process's BLAS (kernels/blas_library.h): at::linear's contract, computed with one
// GEMM call on the library the process chose, where LibTorch's own product would always run on the BLAS it links
// (MKL in the PyPI wheel, which runs its AVX2 kernels on AMD CPUs with AVX-512: docs/kernels.md, "GEMM rates").
#pragma once

#include <ATen/core/Tensor.h>

namespace mita::kernels {

// y = x W^T + b, as at::linear: input [..., in_features], weight [out_features, in_features], bias [out_features]
// or an undefined tensor; returns [..., out_features], contiguous. One GEMM on BlasLibrary for float32 and float64
// CPU tensors of one dtype without autograd; at::linear for anything else (CUDA, other dtypes, a gradient to
// record), so the result never depends on which path ran beyond rounding. Throws, as at::linear does, when the
// shapes disagree.
at::Tensor Linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias);

}  // namespace mita::kernels
