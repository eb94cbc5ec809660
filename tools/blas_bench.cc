// mita-blas-bench: the float32 GEMM rate of each BLAS this process can use (kernels/blas_library.h: the build's
// OpenBLAS and LibTorch's BLAS) at the shapes the models' dense layers and the CPU kernel run, y = x W^T as
// kernels::Linear computes it, on LibTorch-allocated (64-byte aligned) buffers; and which one the process chose.
// On a CPU with bfloat16 dot products (kernels::CpuHasBfloat16DotProducts) also the bfloat16 product the models run
// with --weights_dtype=bfloat16 (at::linear on bfloat16 tensors: LibTorch's oneDNN), checked against the float64
// product of the bfloat16-rounded inputs.
//
//   mita-blas-bench [--threads=2] [--repeats=20]
//
// Per shape the candidates alternate, each timed as the best of --repeats calls after two untimed ones. Each
// product is checked against the float64 product of the same inputs (relative Frobenius error <= 1e-5, else the
// row says WRONG). GFLOP/s counts 2 rows in out per product. Exit status: 0, or 1 when a product was wrong.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <c10/core/InferenceMode.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "kernels/blas_library.h"
#include "kernels/device.h"
#include "kernels/runtime_environment.h"

ABSL_FLAG(int32_t, threads, 2, "intra-op threads of LibTorch and of each BLAS");
ABSL_FLAG(int32_t, repeats, 20, "timed calls per shape and library (the best is reported)");

namespace {

struct Shape {
  const char* label;
  int64_t rows, in, out;
};

// The models' dense layers (qkv C -> 3C, MLP C -> 4C -> C) and the kernel's expert-sized products.
const Shape kShapes[] = {
    {"image model qkv, batch 1 (50 tokens, C 96)", 50, 96, 288},
    {"image model qkv, batch 16", 800, 96, 288},
    {"DeiT-Tiny qkv, batch 1", 197, 192, 576},
    {"DeiT-Tiny mlp down, batch 1", 197, 768, 192},
    {"DeiT-Tiny qkv, batch 32", 6304, 192, 576},
    {"DeiT-Small qkv, batch 1", 197, 384, 1152},
    {"DeiT-Small mlp up, batch 32", 6304, 384, 1536},
    {"document model qkv, 16K tokens (C 64)", 16384, 64, 192},
    {"document model mlp down, 16K tokens", 16384, 256, 64},
    {"kernel expert block", 512, 64, 64},
    {"cube 2048", 2048, 2048, 2048},
};

double BestSeconds(const mita::kernels::BlasLibrary& library, const at::Tensor& x, const at::Tensor& w, at::Tensor& y,
                   int repeats) {
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  double best = 1e30;
  for (int call = 0; call < repeats + 2; ++call) {
    const auto start = std::chrono::steady_clock::now();
    library.Gemm('T', 'N', out, rows, in, 1.0f, w.data_ptr<float>(), in, x.data_ptr<float>(), in, 0.0f,
                 y.data_ptr<float>(), out);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (call >= 2) best = std::min(best, seconds);
  }
  return best;
}

// Best seconds of at::linear(x, w) over `repeats` calls after two untimed ones; `*y` gets the last product.
double BestLinearSeconds(const at::Tensor& x, const at::Tensor& w, at::Tensor* y, int repeats) {
  double best = 1e30;
  for (int call = 0; call < repeats + 2; ++call) {
    const auto start = std::chrono::steady_clock::now();
    *y = at::linear(x, w);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (call >= 2) best = std::min(best, seconds);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("GEMM rate of each BLAS this process can use at the models' shapes. Flags below.");
  absl::ParseCommandLine(argc, argv);
  c10::InferenceMode inference;
  const int threads = absl::GetFlag(FLAGS_threads);
  mita::kernels::SetIntraOpThreads(threads);
  using mita::kernels::BlasLibrary;
  std::vector<const BlasLibrary*> libraries = {&BlasLibrary::LibTorchBlas()};
  if (BlasLibrary::OpenBlas() != nullptr) {
    BlasLibrary::OpenBlas()->SetThreads(threads);
    libraries.push_back(BlasLibrary::OpenBlas());
  }
  std::printf("threads %d; chosen: %s (%s)\n", threads, BlasLibrary::Get().description().c_str(),
              BlasLibrary::choice_reason().c_str());
  const bool bfloat16 = mita::kernels::CpuHasBfloat16DotProducts();
  std::printf("| shape (rows x in -> out) |");
  for (const BlasLibrary* library : libraries) std::printf(" %s GFLOP/s |", library->description().c_str());
  std::printf(" fastest float32 |%s\n|---|", bfloat16 ? " bfloat16, LibTorch's oneDNN GFLOP/s |" : "");
  for (size_t i = 0; i <= libraries.size() + (bfloat16 ? 1 : 0); ++i) std::printf("---|");
  std::printf("\n");
  bool wrong = false;
  for (const Shape& shape : kShapes) {
    const at::Tensor x = at::randn({shape.rows, shape.in});
    const at::Tensor w = at::randn({shape.out, shape.in});
    at::Tensor y = at::empty({shape.rows, shape.out});
    const at::Tensor exact = x.to(at::kDouble).matmul(w.to(at::kDouble).t());
    const double flops = 2.0 * shape.rows * shape.in * shape.out;
    std::vector<double> best(libraries.size(), 1e30);
    std::vector<std::string> errors(libraries.size());
    for (int round = 0; round < 2; ++round) {
      for (size_t i = 0; i < libraries.size(); ++i) {
        best[i] = std::min(best[i], BestSeconds(*libraries[i], x, w, y, absl::GetFlag(FLAGS_repeats)));
        const double error = y.to(at::kDouble).sub(exact).norm().item<double>() / exact.norm().item<double>();
        if (error > 1e-5) errors[i] = absl::StrFormat(" WRONG (error %.1e)", error);
      }
    }
    std::printf("| %s (%lld x %lld -> %lld) |", shape.label, static_cast<long long>(shape.rows),
                static_cast<long long>(shape.in), static_cast<long long>(shape.out));
    size_t fastest = 0;
    for (size_t i = 0; i < libraries.size(); ++i) {
      std::printf(" %.0f%s |", flops / best[i] / 1e9, errors[i].c_str());
      wrong = wrong || !errors[i].empty();
      if (best[i] < best[fastest]) fastest = i;
    }
    std::printf(" %s (%.2fx) |", libraries[fastest]->is_openblas() ? "OpenBLAS" : "LibTorch's",
                best.size() > 1 ? std::max(best[0], best[1]) / std::min(best[0], best[1]) : 1.0);
    if (bfloat16) {
      const at::Tensor x16 = x.to(at::kBFloat16), w16 = w.to(at::kBFloat16);
      const at::Tensor exact16 = x16.to(at::kDouble).matmul(w16.to(at::kDouble).t());
      at::Tensor y16;
      const double seconds = BestLinearSeconds(x16, w16, &y16, absl::GetFlag(FLAGS_repeats));
      // The output is rounded to bfloat16 (8 significant bits): relative error up to 2^-8 per element.
      const double error = y16.to(at::kDouble).sub(exact16).norm().item<double>() / exact16.norm().item<double>();
      const bool bad = error > 4e-3;
      wrong = wrong || bad;
      std::printf(" %.0f%s |", flops / seconds / 1e9, bad ? absl::StrFormat(" WRONG (error %.1e)", error).c_str() : "");
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  return wrong ? 1 : 0;
}
