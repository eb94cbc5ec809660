// The process's BLAS (kernels/blas_library.h) and the dense layer on it (kernels/linear.h), against float64 products
// computed here by plain loops.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kernels/blas_library.h"
#include "kernels/linear.h"

namespace mita::kernels {
namespace {

using ::testing::HasSubstr;

// y[r, o] = sum_i x[r, i] w[o, i] + b[o], in float64, from any float tensors.
at::Tensor ReferenceLinear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  const at::Tensor x = input.to(at::kDouble).reshape({-1, input.size(-1)}).contiguous();
  const at::Tensor w = weight.to(at::kDouble).contiguous();
  const int64_t rows = x.size(0), in = w.size(1), out = w.size(0);
  at::Tensor y = at::zeros({rows, out}, x.options());
  const double* xd = x.data_ptr<double>();
  const double* wd = w.data_ptr<double>();
  double* yd = y.data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double sum = bias.defined() ? bias[o].item<double>() : 0.0;
      for (int64_t i = 0; i < in; ++i) sum += xd[r * in + i] * wd[o * in + i];
      yd[r * out + o] = sum;
    }
  }
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = out;
  return y.reshape(shape);
}

// ReferenceLinear, then GELU (0.5 y (1 + erf(y / sqrt 2))) when `gelu`, then + residual when defined, in float64.
at::Tensor ReferenceLinearWithEpilogue(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                                       bool gelu, const at::Tensor& residual) {
  at::Tensor y = ReferenceLinear(input, weight, bias).contiguous();
  if (gelu) {
    double* values = y.data_ptr<double>();
    for (int64_t i = 0; i < y.numel(); ++i) values[i] = 0.5 * values[i] * (1.0 + std::erf(values[i] / std::sqrt(2.0)));
  }
  return residual.defined() ? y.add(residual.to(at::kDouble)) : y;
}

double MaxRelativeError(const at::Tensor& actual, const at::Tensor& expected) {
  const double scale = std::max(1.0, expected.abs().max().item<double>());
  return actual.to(at::kDouble).sub(expected).abs().max().item<double>() / scale;
}

TEST(BlasLibrary, LoadsTheBuildsOpenBlasWhenTheBuildNamesOne) {
  EXPECT_EQ(BlasLibrary::openblas_load_error(), "");
  if (std::string(BlasLibrary::configured_path()).empty()) GTEST_SKIP() << "the build names no OpenBLAS";
  const BlasLibrary* openblas = BlasLibrary::OpenBlas();
  ASSERT_NE(openblas, nullptr);
  EXPECT_TRUE(openblas->is_openblas());
  EXPECT_THAT(openblas->description(), HasSubstr("OpenBLAS"));
  EXPECT_THAT(openblas->description(), HasSubstr("(scipy-openblas32)"));
  // Its pthreads build has no per-thread setting (kernels/cpu_blas.h keeps the kernel's GEMMs small for it).
  EXPECT_FALSE(openblas->has_thread_local_threads());
  EXPECT_EQ(openblas->SetThreads(2), 2);
  EXPECT_EQ(openblas->SetThreads(0), 1) << "counts below 1 are taken as 1";
  // The process's choice is one of the two, with its reason.
  const BlasLibrary& chosen = BlasLibrary::Get();
  EXPECT_TRUE(&chosen == openblas || &chosen == &BlasLibrary::LibTorchBlas());
  EXPECT_THAT(BlasLibrary::choice_reason(), ::testing::AnyOf(HasSubstr("AVX-512"), HasSubstr("MITA_BLAS=")));
}

TEST(BlasLibrary, OpenBlasOnAmdCpusWithAvx512UnlessTheEnvironmentSaysOtherwise) {
  EXPECT_TRUE(BlasLibrary::Choose("", /*amd=*/true, /*avx512=*/true, /*openblas_loaded=*/true).openblas);
  EXPECT_FALSE(BlasLibrary::Choose("", true, false, true).openblas);
  EXPECT_FALSE(BlasLibrary::Choose("", false, true, true).openblas);
  EXPECT_EQ(BlasLibrary::Choose("", true, true, true).reason, "AMD CPU with AVX-512: OpenBLAS");
  EXPECT_EQ(BlasLibrary::Choose("", true, false, true).reason, "AMD CPU without AVX-512: LibTorch's BLAS");
  EXPECT_EQ(BlasLibrary::Choose("", false, true, true).reason, "non-AMD CPU with AVX-512: LibTorch's BLAS");
  // MITA_BLAS wins over the CPU; nothing picks an OpenBLAS that did not load.
  EXPECT_TRUE(BlasLibrary::Choose("openblas", false, false, true).openblas);
  EXPECT_FALSE(BlasLibrary::Choose("libtorch", true, true, true).openblas);
  EXPECT_EQ(BlasLibrary::Choose("libtorch", true, true, true).reason, "MITA_BLAS=libtorch: LibTorch's BLAS");
  const BlasLibrary::Choice missing = BlasLibrary::Choose("openblas", true, true, false);
  EXPECT_FALSE(missing.openblas);
  EXPECT_EQ(missing.reason, "MITA_BLAS=openblas, but no OpenBLAS loaded: LibTorch's BLAS");
  // Any other value is ignored, and the reason says so.
  EXPECT_EQ(BlasLibrary::Choose("mkl", true, true, true).reason,
            "AMD CPU with AVX-512 (MITA_BLAS=mkl is not a choice): OpenBLAS");
}

// Each candidate library (kernels/blas_library.h), so that the choice on another CPU is covered too.
std::vector<const BlasLibrary*> Candidates() {
  std::vector<const BlasLibrary*> libraries = {&BlasLibrary::LibTorchBlas()};
  if (BlasLibrary::OpenBlas() != nullptr) libraries.push_back(BlasLibrary::OpenBlas());
  return libraries;
}

TEST(BlasLibrary, GemmMatchesFloat64AtTheKernelsShapesAndTransposes) {
  for (const BlasLibrary* candidate : Candidates()) {
    const BlasLibrary& library = *candidate;
    SCOPED_TRACE(library.description());
    // Column-major C[m, n] = op(A) op(B) with op(A) [m, k], op(B) [k, n]; a row-major tensor [r, c] is the
    // column-major [c, r].
    for (const auto& [m, n, k] : std::vector<std::array<int64_t, 3>>{{64, 512, 32}, {197, 576, 192}, {7, 3, 5}}) {
      for (const char transa : {'N', 'T'}) {
        for (const char transb : {'N', 'T'}) {
          // Column-major A stored as: 'N' [m, k] (ld m) = row-major [k, m]; 'T' [k, m] (ld k) = row-major [m, k].
          const at::Tensor a = transa == 'N' ? at::randn({k, m}) : at::randn({m, k});
          const at::Tensor b = transb == 'N' ? at::randn({n, k}) : at::randn({k, n});
          at::Tensor c = at::randn({n, m});  // column-major [m, n]
          const at::Tensor c_before = c.clone();
          library.Gemm(transa, transb, m, n, k, 0.5f, a.data_ptr<float>(), transa == 'N' ? m : k, b.data_ptr<float>(),
                       transb == 'N' ? k : n, 2.0f, c.data_ptr<float>(), m);
          // Row-major views: op(A) as [m, k], op(B) as [k, n]; the product as row-major [n, m] is (op(A) op(B))^T.
          const at::Tensor op_a = (transa == 'N' ? a.t() : a).to(at::kDouble);
          const at::Tensor op_b = (transb == 'N' ? b.t() : b).to(at::kDouble);
          const at::Tensor expected = op_a.matmul(op_b).t().mul(0.5).add(c_before.to(at::kDouble).mul(2.0));
          EXPECT_LT(MaxRelativeError(c, expected), 1e-5) << m << " x " << n << " x " << k << " " << transa << transb;
        }
      }
    }
  }
}

TEST(Linear, TakesBatchedAndNonContiguousInputsAndFloat64) {
  const at::Tensor x = at::randn({5, 3, 24}).transpose(0, 1);     // [3, 5, 24], not contiguous
  const at::Tensor w = at::randn({40, 24}).t().contiguous().t();  // [40, 24], column-major storage
  const at::Tensor b = at::randn({40});
  const at::Tensor y = Linear(x, w, b);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 5, 40}));
  EXPECT_LT(MaxRelativeError(y, ReferenceLinear(x, w, b)), 1e-5);
  const at::Tensor xd = x.to(at::kDouble), wd = w.to(at::kDouble), bd = b.to(at::kDouble);
  const at::Tensor yd = Linear(xd, wd, bd);
  EXPECT_EQ(yd.scalar_type(), at::kDouble);
  EXPECT_LT(MaxRelativeError(yd, ReferenceLinear(xd, wd, bd)), 1e-12);
}

TEST(Linear, EmptyDimensionsGiveTheBiasOrNothing) {
  const at::Tensor b = at::randn({4});
  EXPECT_EQ(Linear(at::randn({0, 3}), at::randn({4, 3}), b).sizes(), (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(Linear(at::randn({2, 3}), at::randn({0, 3}), at::Tensor()).sizes(), (std::vector<int64_t>{2, 0}));
  const at::Tensor from_nothing = Linear(at::randn({2, 0}), at::randn({4, 0}), b);
  EXPECT_TRUE(from_nothing.equal(b.expand({2, 4}))) << "no input features: every row is the bias";
  EXPECT_TRUE(Linear(at::randn({2, 0}), at::randn({4, 0}), at::Tensor()).equal(at::zeros({2, 4})));
}

TEST(Linear, LeavesWhatBlasCannotTakeToAtLinear) {
  // A gradient to record: at::linear's result, with its graph.
  const at::Tensor w = at::randn({6, 5}).requires_grad_();
  const at::Tensor x = at::randn({2, 5});
  const at::Tensor y = Linear(x, w, at::Tensor());
  EXPECT_TRUE(y.requires_grad());
  EXPECT_LT(MaxRelativeError(y.detach(), ReferenceLinear(x, w.detach(), at::Tensor())), 1e-5);
  // Mixed dtypes and mismatched shapes are at::linear's to refuse, with its own error.
  EXPECT_THROW(Linear(at::randn({2, 5}), at::randn({6, 5}).to(at::kDouble), at::Tensor()), c10::Error);
  EXPECT_THROW(Linear(at::randn({2, 5}), at::randn({6, 4}), at::Tensor()), c10::Error);
  EXPECT_THROW(Linear(at::randn({2, 5}), at::randn({6, 5}), at::randn({7})), c10::Error);
}

TEST(Linear, MatchesFloat64WithAndWithoutBiasAndEachEpilogue) {
  // The models' shapes (DeiT-Tiny's qkv and fc1, the documents' qkv, the image model's), several fill tasks with a
  // remainder (1100 rows), fewer rows than threads.
  for (const auto& [rows, in, out] : std::vector<std::array<int64_t, 3>>{
           {197, 192, 576}, {197, 192, 768}, {4096, 64, 192}, {50, 96, 384}, {1100, 64, 128}, {1, 3, 1}, {1, 3, 2},
           {3, 8, 5}}) {
    const at::Tensor x = at::randn({rows, in});
    const at::Tensor w = at::randn({out, in});
    const at::Tensor b = at::randn({out});
    const at::Tensor residual = at::randn({out, rows}).t();  // [rows, out], not contiguous
    for (const bool gelu : {false, true}) {
      for (const bool with_residual : {false, true}) {
        for (const bool with_bias : {false, true}) {
          const at::Tensor bias = with_bias ? b : at::Tensor();
          const LinearEpilogue epilogue{gelu, with_residual ? residual : at::Tensor()};
          const at::Tensor y = Linear(x, w, bias, epilogue);
          EXPECT_EQ(y.sizes(), (std::vector<int64_t>{rows, out}));
          EXPECT_LT(MaxRelativeError(y, ReferenceLinearWithEpilogue(x, w, bias, gelu, epilogue.residual)), 1e-5)
              << rows << " x " << in << " x " << out << ", gelu " << gelu << ", residual " << with_residual
              << ", bias " << with_bias;
        }
      }
    }
  }
}

TEST(Linear, EpiloguesRunOnInferenceTensorsAndInFloat64) {
  // The models run under InferenceMode: the epilogue updates an inference tensor in place.
  const c10::InferenceMode inference;
  const at::Tensor x = at::randn({2, 600, 32});
  const at::Tensor w = at::randn({48, 32});
  const at::Tensor b = at::randn({48});
  const at::Tensor residual = at::randn({2, 600, 48});
  const at::Tensor y = Linear(x, w, b, LinearEpilogue::Gelu());
  EXPECT_LT(MaxRelativeError(y, ReferenceLinearWithEpilogue(x, w, b, true, at::Tensor())), 1e-5);
  const at::Tensor xd = x.to(at::kDouble), wd = w.to(at::kDouble), bd = b.to(at::kDouble);
  const at::Tensor rd = residual.to(at::kDouble);
  const at::Tensor yd = Linear(xd, wd, bd, LinearEpilogue{true, rd});
  EXPECT_EQ(yd.scalar_type(), at::kDouble);
  EXPECT_LT(MaxRelativeError(yd, ReferenceLinearWithEpilogue(xd, wd, bd, true, rd)), 1e-12);
}

TEST(Linear, EpiloguesOffTheBlasPathAndAResidualOfTheWrongShape) {
  // A gradient to record: at::linear, at::gelu and at::add, with their graph.
  const at::Tensor w = at::randn({6, 5}).requires_grad_();
  const at::Tensor x = at::randn({4, 5});
  const at::Tensor b = at::randn({6});
  const at::Tensor residual = at::randn({4, 6});
  const at::Tensor y = Linear(x, w, b, LinearEpilogue{true, residual});
  EXPECT_TRUE(y.requires_grad());
  EXPECT_LT(MaxRelativeError(y.detach(), ReferenceLinearWithEpilogue(x, w.detach(), b, true, residual)), 1e-5);
  // The residual is the output's shape, never broadcast, on either path.
  EXPECT_THROW(Linear(x, w, b, LinearEpilogue::AddResidual(at::randn({6}))), c10::Error);
  EXPECT_THROW(Linear(x, w.detach(), b, LinearEpilogue::AddResidual(at::randn({6}))), c10::Error);
  EXPECT_THROW(Linear(x, w.detach(), b, LinearEpilogue::AddResidual(at::randn({4, 7}))), c10::Error);
  // No input features: the epilogue of the bias alone.
  const at::Tensor from_bias = Linear(at::randn({4, 0}), at::randn({6, 0}), b, LinearEpilogue{true, residual});
  EXPECT_LT(MaxRelativeError(from_bias, ReferenceLinearWithEpilogue(at::zeros({4, 1}), at::zeros({6, 1}), b, true,
                                                                    residual)),
            1e-6);
}

}  // namespace
}  // namespace mita::kernels
