// The BLAS library that runs this process's float GEMMs on the CPU (the MiTA kernel's and the models' dense
// layers), chosen once, at first use, between two:
// - OpenBLAS from the pinned scipy-openblas32 wheel, at the path the build names (MITA_OPENBLAS_LIBRARY,
//   cmake/libtorch.cmake), loaded with RTLD_LOCAL: its symbols carry a scipy_ prefix and stay private, so it never
//   takes over the sgemm_ that the wheel's LibTorch binds its own products to;
// - the BLAS LibTorch links (MKL inside the PyPI wheel, the system OpenBLAS with Debian's LibTorch), through its
//   Fortran sgemm_/dgemm_.
// The rule: OpenBLAS on AMD CPUs with AVX-512, where the wheel's MKL runs its AVX2 ("zen") kernels and OpenBLAS's
// AVX-512 ones were measured at twice its rate; LibTorch's everywhere else (on this project's AVX2 Zen 3 host MKL
// was as fast or faster at every model shape). One rule per CPU, not a timing at start-up, so that every replica on
// the same CPU computes the same numbers. The environment variable MITA_BLAS ("openblas" or "libtorch") overrides
// it; mita-blas-bench measures both (docs/kernels.md, "GEMM rates").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace mita::kernels {

class BlasLibrary {
 public:
  // The process's library, chosen and loaded at the first call. Thread-safe.
  static const BlasLibrary& Get();
  // Each candidate: the build's OpenBLAS (null when the build names none or it did not load) and LibTorch's.
  static const BlasLibrary* OpenBlas();
  static const BlasLibrary& LibTorchBlas();
  // The OpenBLAS the build names (MITA_OPENBLAS_LIBRARY), or "" when it names none.
  static const char* configured_path();
  // Why that OpenBLAS did not load (the path and dlerror's text); "" when it did, or when the build names none.
  static const std::string& openblas_load_error();

  struct Choice {
    bool openblas = false;
    std::string reason;  // one line for the log, e.g. "AMD CPU with AVX-512: OpenBLAS"
  };
  // The rule Get() applies (pure): MITA_BLAS = `setting` ("" for unset, "openblas" or "libtorch"; anything else is
  // ignored and said in the reason), whether the CPU is AMD's, whether it has AVX-512F, and whether OpenBLAS loaded
  // (without it, always LibTorch's).
  static Choice Choose(std::string_view setting, bool amd, bool avx512, bool openblas_loaded);

  // Column-major C[m, n] = alpha op(A) op(B) + beta C, op 'N' (as is) or 'T' (transposed), as BLAS sgemm/dgemm.
  // Dimensions and leading dimensions must fit in an int (BLAS's LP64 interface).
  void Gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
            const float* b, int64_t ldb, float beta, float* c, int64_t ldc) const;
  void Gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
            const double* b, int64_t ldb, double beta, double* c, int64_t ldc) const;

  // Sets the process-wide thread count of the library's GEMMs, `threads` >= 1. Returns the count now in effect, or 0
  // when the library reports none.
  int SetThreads(int threads) const;

  // Whether the library can run the calling thread's GEMMs on that thread alone while others keep the process-wide
  // count (MKL's mkl_set_num_threads_local). OpenBLAS's pthreads builds have no such setting (its
  // openblas_set_num_threads_local sets a count that every thread sees), so a caller that runs GEMMs from several
  // threads at once keeps each one small enough for OpenBLAS to run it on the calling thread (kernels/cpu_blas.h).
  bool has_thread_local_threads() const { return set_local_threads_ != nullptr; }
  // Sets the calling thread's GEMM thread count (0: back to the process-wide one) and returns the previous setting;
  // a no-op returning 0 without has_thread_local_threads().
  int SetThreadLocalThreads(int threads) const;

  // What runs the GEMMs, e.g. "OpenBLAS 0.3.31.188.0 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64, core Haswell
  // (scipy-openblas32)" or "MKL (LibTorch's BLAS)".
  const std::string& description() const { return description_; }
  bool is_openblas() const { return is_openblas_; }
  // Why Get() is the library it is (Choice::reason, with why OpenBLAS did not load where it did not).
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
