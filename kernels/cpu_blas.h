// The CPU kernel's BLAS plumbing (kernels/mita_attention_cpu.cc): row-major GEMMs on raw buffers through the
// system BLAS's Fortran interface (sgemm_/dgemm_, the BLAS LibTorch uses), one BLAS thread per thread of the
// kernel's parallel region, block sizes that keep each call single-threaded, and the optional count of calls
// (MitaForwardOptions::gemm_totals). MatmulTransposed and MatmulAccumulate are the single place to swap in a
// hand-written micro-kernel later.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

#include <dlfcn.h>

#include "kernels/mita_attention_internal.h"

namespace mita::kernels::internal {

// The BLAS must run each GEMM on the calling thread: the parallelism over (item, head) is the kernel's.
// - MKL (linked into the PyPI LibTorch): mkl_set_num_threads_local(1) for the threads of the parallel region
//   (OneThreadBlas), so GEMMs may be as large as the blocks allow (kOneThreadGemmVolume).
// - OpenBLAS (pthreads build, Debian's LibTorch) has no per-thread setting: it runs a GEMM on its own thread pool
//   once m * n * k exceeds 64^3 multiply-adds, which inside the region oversubscribes the cores (measured on the
//   2-core machine: 3.5x slower with 2 threads), so every GEMM stays at or under kSingleThreadGemmVolume.
inline constexpr int64_t kSingleThreadGemmVolume = int64_t{64} * 64 * 64;
inline constexpr int64_t kOneThreadGemmVolume = 8 * kSingleThreadGemmVolume;
// Most rows (keys or queries) per block.
inline constexpr int64_t kMaxBlockRows = 512;

// MKL's MKL_Set_Num_Threads_Local (the C name of mkl_service.h's mkl_set_num_threads_local: sets the calling
// thread's BLAS thread count, returns the previous one, 0 = the global setting), looked up once at run time;
// null with any other BLAS.
using SetLocalBlasThreads = int (*)(int);
inline SetLocalBlasThreads LocalBlasThreadSetter() {
  static const SetLocalBlasThreads setter =
      reinterpret_cast<SetLocalBlasThreads>(dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local"));
  return setter;
}

// One BLAS thread for the calling thread while in scope (where the BLAS has a per-thread setting).
class OneThreadBlas {
 public:
  OneThreadBlas() : setter_(LocalBlasThreadSetter()) {
    if (setter_ != nullptr) previous_ = setter_(1);
  }
  ~OneThreadBlas() {
    if (setter_ != nullptr) setter_(previous_);
  }
  OneThreadBlas(const OneThreadBlas&) = delete;
  OneThreadBlas& operator=(const OneThreadBlas&) = delete;

 private:
  SetLocalBlasThreads setter_;
  int previous_ = 0;
};

// Rows per block for GEMMs whose other two dimensions multiply to `other_dimensions`: as many as keep one call
// within the volume a single BLAS thread runs (at most kMaxBlockRows, at least 1).
inline int64_t BlockRows(int64_t other_dimensions) {
  const int64_t volume = LocalBlasThreadSetter() != nullptr ? kOneThreadGemmVolume : kSingleThreadGemmVolume;
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

// The system BLAS, called directly (Fortran interface, column-major): an at::mm_out on from_blob views costs
// several microseconds of tensor construction and dispatch per call, which at these GEMM sizes (<= 64^3
// multiply-adds) is comparable to the arithmetic (mita-kernel-bench, docs/kernels.md).
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

// Column-major C[m, n] = alpha op(A) op(B) + beta C.
inline void Gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                 const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int ldai = static_cast<int>(lda), ldbi = static_cast<int>(ldb), ldci = static_cast<int>(ldc);
  const GemmTally tally(m, n, k);
  sgemm_(&transa, &transb, &mi, &ni, &ki, &alpha, a, &ldai, b, &ldbi, &beta, c, &ldci);
}

inline void Gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
                 int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int ldai = static_cast<int>(lda), ldbi = static_cast<int>(ldb), ldci = static_cast<int>(ldc);
  const GemmTally tally(m, n, k);
  dgemm_(&transa, &transb, &mi, &ni, &ki, &alpha, a, &ldai, b, &ldbi, &beta, c, &ldci);
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
