// The CPU kernel's BLAS plumbing (kernels/mita_attention_cpu.cc): row-major GEMMs on raw buffers through the
// process's BLAS (kernels/blas_library.h), one BLAS thread per thread of the kernel's parallel region, block sizes
// that keep each call single-threaded, and the optional count of calls (MitaForwardOptions::gemm_totals).
// MatmulTransposed and MatmulAccumulate are the single place to swap in a hand-written micro-kernel later.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "kernels/blas_library.h"
#include "kernels/mita_attention_internal.h"

namespace mita::kernels::internal {

// The BLAS must run each GEMM on the calling thread: the parallelism over (item, head) is the kernel's.
// - A BLAS with a per-thread setting (MKL's, when it is LibTorch's BLAS): one BLAS thread for the threads of the
//   parallel region (OneThreadBlas), so GEMMs may be as large as the blocks allow (kOneThreadGemmVolume).
// - OpenBLAS (pthreads builds: the scipy-openblas32 wheel's, Debian's) has none: it runs a GEMM on its own thread
//   pool once m * n * k exceeds 64^3 multiply-adds, which inside the region oversubscribes the cores (measured on
//   the 2-core machine: 3.5x slower with 2 threads), so every GEMM stays at or under kSingleThreadGemmVolume.
inline constexpr int64_t kSingleThreadGemmVolume = int64_t{64} * 64 * 64;
inline constexpr int64_t kOneThreadGemmVolume = 8 * kSingleThreadGemmVolume;
// Most rows (keys or queries) per block.
inline constexpr int64_t kMaxBlockRows = 512;

// One BLAS thread for the calling thread while in scope (where the BLAS has a per-thread setting).
class OneThreadBlas {
 public:
  OneThreadBlas() : library_(BlasLibrary::Get()) {
    if (library_.has_thread_local_threads()) previous_ = library_.SetThreadLocalThreads(1);
  }
  ~OneThreadBlas() {
    if (library_.has_thread_local_threads()) library_.SetThreadLocalThreads(previous_);
  }
  OneThreadBlas(const OneThreadBlas&) = delete;
  OneThreadBlas& operator=(const OneThreadBlas&) = delete;

 private:
  const BlasLibrary& library_;
  int previous_ = 0;
};

// Rows per block for GEMMs whose other two dimensions multiply to `other_dimensions`: as many as keep one call
// within the volume a single BLAS thread runs (at most kMaxBlockRows, at least 1).
inline int64_t BlockRows(int64_t other_dimensions) {
  const int64_t volume =
      BlasLibrary::Get().has_thread_local_threads() ? kOneThreadGemmVolume : kSingleThreadGemmVolume;
  return std::clamp<int64_t>(volume / other_dimensions, 1, kMaxBlockRows);
}

// The (item, head) whose BLAS calls the calling thread counts (MitaForwardOptions::gemm_totals), or null.
inline thread_local MitaGemmTotals* gemm_totals_of_thread = nullptr;

// Counts the BLAS calls of the calling thread into `totals` (null: none) while in scope.
class CountGemmsOfThread {
 public:
  explicit CountGemmsOfThread(MitaGemmTotals* totals) { gemm_totals_of_thread = totals; }
  ~CountGemmsOfThread() { gemm_totals_of_thread = nullptr; }
  CountGemmsOfThread(const CountGemmsOfThread&) = delete;
  CountGemmsOfThread& operator=(const CountGemmsOfThread&) = delete;
};

// Counts one BLAS call of m x n x k multiply-adds in gemm_totals_of_thread while in scope (when set).
class GemmTally {
 public:
  GemmTally(int64_t m, int64_t n, int64_t k) : totals_(gemm_totals_of_thread) {
    if (totals_ == nullptr) return;
    ++totals_->calls;
    totals_->flops += 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
    start_ = std::chrono::steady_clock::now();
  }
  ~GemmTally() {
    if (totals_ != nullptr) {
      totals_->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    }
  }
  GemmTally(const GemmTally&) = delete;
  GemmTally& operator=(const GemmTally&) = delete;

 private:
  MitaGemmTotals* totals_;
  std::chrono::steady_clock::time_point start_;
};

// The process's BLAS (kernels/blas_library.h), called directly on raw buffers: an at::mm_out on from_blob views
// costs several microseconds of tensor construction and dispatch per call, which at these GEMM sizes (<= 64^3
// multiply-adds) is comparable to the arithmetic (mita-kernel-bench, docs/kernels.md). Column-major
// C[m, n] = alpha op(A) op(B) + beta C, counted in gemm_totals_of_thread.
template <typename T>
void Gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  const GemmTally tally(m, n, k);
  BlasLibrary::Get().Gemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// out[rows, columns] = a[rows, inner] * b[columns, inner]^T. Row-major with the given row strides (a row-major
// X with row stride ld is the column-major X^T with leading dimension ld, so this is out^T = b a^T).
template <typename T>
void MatmulTransposed(const T* a, int64_t a_stride, const T* b, int64_t b_stride, T* out, int64_t out_stride,
                      int64_t rows, int64_t columns, int64_t inner) {
  if (rows == 0 || columns == 0) return;
  Gemm('T', 'N', columns, rows, inner, T(1), b, b_stride, a, a_stride, T(0), out, out_stride);
}

// out[rows, columns] (+)= a[rows, inner] * b[inner, columns]; accumulates into out when `accumulate`
// (out^T = b^T a^T in column-major terms).
template <typename T>
void MatmulAccumulate(const T* a, int64_t a_stride, const T* b, int64_t b_stride, T* out, int64_t out_stride,
                      int64_t rows, int64_t columns, int64_t inner, bool accumulate) {
  if (rows == 0 || columns == 0) return;
  Gemm('N', 'N', columns, rows, inner, T(1), b, b_stride, a, a_stride, accumulate ? T(1) : T(0), out, out_stride);
}

}  // namespace mita::kernels::internal
