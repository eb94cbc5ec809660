#include "kernels/blas_library.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"

// The BLAS LibTorch links (Fortran interface, column-major): MKL's, exported by the wheel's libtorch_cpu.so, or the
// system BLAS linked with Debian's LibTorch (cmake/libtorch.cmake).
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace mita::kernels {

namespace {

template <typename Function>
Function Symbol(void* handle, const char* name) {
  return reinterpret_cast<Function>(dlsym(handle, name));
}

struct Chosen {
  const BlasLibrary* library;
  std::string reason;
};

}  // namespace

const char* BlasLibrary::configured_path() {
#ifdef MITA_OPENBLAS_LIBRARY
  return MITA_OPENBLAS_LIBRARY;
#else
  return "";
#endif
}

BlasLibrary* BlasLibrary::LoadOpenBlas(std::string* error) {
  const char* path = configured_path();
  if (path[0] == '\0') return nullptr;
  // OpenBLAS's idle workers spin (sched_yield) for 2^28 cycles after each multi-threaded GEMM by default, taking the
  // cores from LibTorch's OpenMP threads that run next (measured: the document model's forward 1.6-1.8x slower); 4
  // (2^4 cycles) makes them sleep at once. Read when the library loads; an operator's value is kept.
  setenv("OPENBLAS_THREAD_TIMEOUT", "4", /*overwrite=*/0);
  // Never closed: its thread pool lives as long as the process.
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* text = dlerror();
    *error = absl::StrCat("OpenBLAS (", path, ") did not load: ", text != nullptr ? text : "unknown error");
    return nullptr;
  }
  auto* library = new BlasLibrary();
  library->float_gemm_ = Symbol<Sgemm>(handle, "scipy_sgemm_");
  library->double_gemm_ = Symbol<Dgemm>(handle, "scipy_dgemm_");
  library->set_threads_ = Symbol<SetThreadsFunction>(handle, "scipy_openblas_set_num_threads");
  library->get_threads_ = Symbol<GetThreadsFunction>(handle, "scipy_openblas_get_num_threads");
  if (library->float_gemm_ == nullptr || library->double_gemm_ == nullptr || library->set_threads_ == nullptr ||
      library->get_threads_ == nullptr) {
    *error = absl::StrCat("OpenBLAS (", path, ") lacks scipy_sgemm_, scipy_dgemm_ or its thread functions");
    delete library;
    return nullptr;
  }
  using Text = char* (*)();
  const auto config = Symbol<Text>(handle, "scipy_openblas_get_config");
  const auto core = Symbol<Text>(handle, "scipy_openblas_get_corename");
  library->is_openblas_ = true;
  library->description_ =
      absl::StrCat(config ? config() : "OpenBLAS", ", core ", core ? core() : "unknown", " (scipy-openblas32)");
  return library;
}

BlasLibrary* BlasLibrary::LinkedBlas() {
  auto* library = new BlasLibrary();
  library->float_gemm_ = &sgemm_;
  library->double_gemm_ = &dgemm_;
  // Debian's OpenBLAS (pthreads build): its own thread count, which at::set_num_threads does not reach.
  library->set_threads_ = Symbol<SetThreadsFunction>(RTLD_DEFAULT, "openblas_set_num_threads");
  library->get_threads_ = Symbol<GetThreadsFunction>(RTLD_DEFAULT, "openblas_get_num_threads");
  if (library->set_threads_ != nullptr && library->get_threads_ != nullptr) {
    library->is_openblas_ = true;
    using Text = char* (*)();
    const auto config = Symbol<Text>(RTLD_DEFAULT, "openblas_get_config");
    library->description_ = absl::StrCat(config ? config() : "OpenBLAS", " (LibTorch's BLAS)");
    return library;
  }
  library->set_threads_ = nullptr;
  // MKL (mkl_service.h): its count follows at::set_num_threads; MKL_Set_Num_Threads_Local sets the calling thread's.
  library->get_threads_ = Symbol<GetThreadsFunction>(RTLD_DEFAULT, "mkl_get_max_threads");
  library->set_local_threads_ = Symbol<SetLocalThreadsFunction>(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local");
  library->description_ = library->get_threads_ != nullptr ? "MKL (LibTorch's BLAS)" : "LibTorch's BLAS";
  return library;
}

const BlasLibrary::OpenBlasLoad& BlasLibrary::LoadedOpenBlas() {
  static const OpenBlasLoad* const load = [] {
    auto* result = new OpenBlasLoad{nullptr, ""};
    result->library = LoadOpenBlas(&result->error);
    return result;
  }();
  return *load;
}

const BlasLibrary* BlasLibrary::OpenBlas() { return LoadedOpenBlas().library; }

const std::string& BlasLibrary::openblas_load_error() { return LoadedOpenBlas().error; }

const BlasLibrary& BlasLibrary::LibTorchBlas() {
  static const BlasLibrary* const library = LinkedBlas();
  return *library;
}

BlasLibrary::Choice BlasLibrary::Choose(std::string_view setting, bool amd, bool avx512, bool openblas_loaded) {
  Choice choice;
  if (setting == "openblas" || setting == "libtorch") {
    choice.openblas = setting == "openblas";
    choice.reason = absl::StrCat("MITA_BLAS=", std::string(setting));
  } else {
    choice.openblas = amd && avx512;
    choice.reason = absl::StrCat(amd ? "AMD" : "non-AMD", " CPU ", avx512 ? "with" : "without", " AVX-512");
    if (!setting.empty()) absl::StrAppend(&choice.reason, " (MITA_BLAS=", std::string(setting), " is not a choice)");
  }
  if (choice.openblas && !openblas_loaded) {
    choice.openblas = false;
    absl::StrAppend(&choice.reason, ", but no OpenBLAS loaded");
  }
  absl::StrAppend(&choice.reason, ": ", choice.openblas ? "OpenBLAS" : "LibTorch's BLAS");
  return choice;
}

namespace {

const Chosen& ChosenLibrary() {
  static const Chosen* const chosen = [] {
    const char* variable = std::getenv("MITA_BLAS");
    const std::string setting = variable != nullptr ? variable : "";
    const bool amd = __builtin_cpu_is("amd"), avx512 = __builtin_cpu_supports("avx512f");
    // OpenBLAS is loaded (its thread pool started) only when the rule wants it.
    const bool wanted = BlasLibrary::Choose(setting, amd, avx512, /*openblas_loaded=*/true).openblas;
    const BlasLibrary* openblas = wanted ? BlasLibrary::OpenBlas() : nullptr;
    if (openblas != nullptr) openblas->SetThreads(at::get_num_threads());
    const BlasLibrary::Choice choice = BlasLibrary::Choose(setting, amd, avx512, openblas != nullptr);
    const std::string& error = wanted ? BlasLibrary::openblas_load_error() : "";
    return new Chosen{choice.openblas ? openblas : &BlasLibrary::LibTorchBlas(),
                      error.empty() ? choice.reason : absl::StrCat(choice.reason, "; ", error)};
  }();
  return *chosen;
}

}  // namespace

const BlasLibrary& BlasLibrary::Get() { return *ChosenLibrary().library; }

const std::string& BlasLibrary::choice_reason() { return ChosenLibrary().reason; }

void BlasLibrary::Gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                       int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) const {
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int ldai = static_cast<int>(lda), ldbi = static_cast<int>(ldb), ldci = static_cast<int>(ldc);
  float_gemm_(&transa, &transb, &mi, &ni, &ki, &alpha, a, &ldai, b, &ldbi, &beta, c, &ldci);
}

void BlasLibrary::Gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
                       int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) const {
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int ldai = static_cast<int>(lda), ldbi = static_cast<int>(ldb), ldci = static_cast<int>(ldc);
  double_gemm_(&transa, &transb, &mi, &ni, &ki, &alpha, a, &ldai, b, &ldbi, &beta, c, &ldci);
}

int BlasLibrary::SetThreads(int threads) const {
  threads = std::max(1, threads);
  if (set_threads_ != nullptr) set_threads_(threads);
  return get_threads_ != nullptr ? get_threads_() : 0;
}

int BlasLibrary::SetThreadLocalThreads(int threads) const {
  return set_local_threads_ != nullptr ? set_local_threads_(threads) : 0;
}

}  // namespace mita::kernels
