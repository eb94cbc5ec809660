// The BLAS library that runs this process's float GEMMs on the CPU (the MiTA
// kernel's and the models' dense layers), chosen once, at first use, between
// two:
// - OpenBLAS from the pinned scipy-openblas32 wheel, at the path the build
// names (MITA_OPENBLAS_LIBRARY,
//   cmake/libtorch.cmake), loaded with RTLD_LOCAL: its symbols carry a scipy_
//   prefix and stay private, so it never takes over the sgemm_ that the wheel's
//   LibTorch binds its own products to;
// - the BLAS LibTorch links (MKL inside the PyPI wheel, the system OpenBLAS
// with Debian's LibTorch), through its
//   Fortran sgemm_/dgemm_.
// The environment variable MITA_BLAS picks: "openblas", "libtorch", or "auto"
// (unset: auto), which times one dense layer's GEMM on each and takes OpenBLAS
// only when it is kAutoMargin times faster. Why by measurement: which one wins
// depends on the CPU (the wheel's MKL runs its AVX2 kernels on AMD CPUs with
// AVX-512, where OpenBLAS's AVX-512 kernels reach twice its rate; on AVX2-only
// hosts MKL is as fast or faster: docs/kernels.md, "GEMM rates").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace mita::kernels {

class BlasLibrary {
 public:
  // The process's library, chosen and loaded at the first call. Thread-safe.
  static const BlasLibrary& Get();
  // Each candidate: the build's OpenBLAS (null when the build names none or it
  // did not load) and LibTorch's.
  static const BlasLibrary* OpenBlas();
  static const BlasLibrary& LibTorchBlas();
  // The OpenBLAS the build names (MITA_OPENBLAS_LIBRARY), or "" when it names
  // none.
  static const char* configured_path();
  // Why that OpenBLAS did not load (the path and dlerror's text); "" when it
  // did, or when the build names none.
  static const std::string& openblas_load_error();

  // The rule of "auto": OpenBLAS only when its time is at most 1 / kAutoMargin
  // of LibTorch's (a small difference is not worth a second thread pool in the
  // process).
  static constexpr double kAutoMargin = 1.15;
  struct Choice {
    bool openblas = false;
    std::string reason;  // one line for the log, e.g. "auto: OpenBLAS 3.27 ms,
                         // LibTorch's 2.29 ms on ..."
  };
  // The choice for MITA_BLAS = `setting` ("", "auto", "openblas" or "libtorch";
  // anything else is taken as auto and said in the reason), given the timed
  // GEMM of each (OpenBLAS's absent when it did not load: then always
  // LibTorch's). Pure: the rule Get() applies.
  static Choice Choose(std::string_view setting, std::optional<double> openblas_seconds, double libtorch_seconds,
                       std::string_view shape);

  // Column-major C[m, n] = alpha op(A) op(B) + beta C, op 'N' (as is) or 'T'
  // (transposed), as BLAS sgemm/dgemm. Dimensions and leading dimensions must
  // fit in an int (BLAS's LP64 interface).
  void Gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
            const float* b, int64_t ldb, float beta, float* c, int64_t ldc) const;
  void Gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
            const double* b, int64_t ldb, double beta, double* c, int64_t ldc) const;

  // Sets the process-wide thread count of the library's GEMMs, `threads` >= 1.
  // Returns the count now in effect, or 0 when the library reports none.
  int SetThreads(int threads) const;

  // Whether the library can run the calling thread's GEMMs on that thread alone
  // while others keep the process-wide count (MKL's mkl_set_num_threads_local).
  // OpenBLAS's pthreads builds have no such setting (its
  // openblas_set_num_threads_local sets a count that every thread sees), so a
  // caller that runs GEMMs from several threads at once keeps each one small
  // enough for OpenBLAS to run it on the calling thread (kernels/cpu_blas.h).
  bool has_thread_local_threads() const { return set_local_threads_ != nullptr; }
  // Sets the calling thread's GEMM thread count (0: back to the process-wide
  // one) and returns the previous setting; a no-op returning 0 without
  // has_thread_local_threads().
  int SetThreadLocalThreads(int threads) const;

  // What runs the GEMMs, e.g. "OpenBLAS 0.3.31.188.0 DYNAMIC_ARCH NO_AFFINITY
  // Haswell MAX_THREADS=64, core Haswell (scipy-openblas32)" or "MKL
  // (LibTorch's BLAS)".
  const std::string& description() const { return description_; }
  bool is_openblas() const { return is_openblas_; }
  // Why Get() is the library it is (Choice::reason, with why OpenBLAS did not
  // load where it did not).
  static const std::string& choice_reason();

  BlasLibrary(const BlasLibrary&) = delete;
  BlasLibrary& operator=(const BlasLibrary&) = delete;

 private:
  BlasLibrary() = default;
  static BlasLibrary* LoadOpenBlas(std::string* error);
  struct OpenBlasLoad {
    const BlasLibrary* library;
    std::string error;
  };
  static const OpenBlasLoad& LoadedOpenBlas();
  static BlasLibrary* LinkedBlas();

  using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);
  using Dgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
                         const int*, const double*, const int*, const double*, double*, const int*);
  using SetThreadsFunction = void (*)(int);
  using GetThreadsFunction = int (*)();
  using SetLocalThreadsFunction = int (*)(int);

  Sgemm float_gemm_ = nullptr;
  Dgemm double_gemm_ = nullptr;
  SetThreadsFunction set_threads_ = nullptr;  // null: the library's count follows at::set_num_threads (MKL)
  GetThreadsFunction get_threads_ = nullptr;
  SetLocalThreadsFunction set_local_threads_ = nullptr;
  std::string description_;
  bool is_openblas_ = false;
};

}  // namespace mita::kernels
