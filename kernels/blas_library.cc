#include "kernels/blas_library.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

// The BLAS LibTorch links (Fortran interface, column-major): MKL's, exported by
// the wheel's libtorch_cpu.so, or the system BLAS linked with Debian's LibTorch
// (cmake/libtorch.cmake).
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

// The GEMM "auto" times: one dense layer of the embedded document model's width
// class, rows x in -> out (y = x W^T).
constexpr int64_t kTimedRows = 4096, kTimedIn = 256, kTimedOut = 256;

// Best of `rounds` timed calls of y = x W^T on `library`, seconds, after one
// untimed call.
double TimeDenseLayer(const BlasLibrary& library, const std::vector<float>& x, const std::vector<float>& w,
                      std::vector<float>& y, int rounds) {
  double best = 1e30;
  for (int round = 0; round <= rounds; ++round) {
    const auto start = std::chrono::steady_clock::now();
    library.Gemm('T', 'N', kTimedOut, kTimedRows, kTimedIn, 1.0f, w.data(), kTimedIn, x.data(), kTimedIn, 0.0f,
                 y.data(), kTimedOut);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (round > 0) best = std::min(best, seconds);
  }
  return best;
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
  // OpenBLAS's idle workers spin (sched_yield) for 2^28 cycles after each
  // multi-threaded GEMM by default, taking the cores from LibTorch's OpenMP
  // threads that run next (measured: the document model's forward 1.6-1.8x
  // slower); 4 (2^4 cycles) makes them sleep at once. Read when the library
  // loads; an operator's value is kept.
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
  // Debian's OpenBLAS (pthreads build): its own thread count, which
  // at::set_num_threads does not reach.
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
  // MKL (mkl_service.h): its count follows at::set_num_threads;
  // MKL_Set_Num_Threads_Local sets the calling thread's.
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

BlasLibrary::Choice BlasLibrary::Choose(std::string_view setting, std::optional<double> openblas_seconds,
                                        double libtorch_seconds, std::string_view shape) {
  Choice choice;
  if (!openblas_seconds.has_value()) {
    choice.reason = "LibTorch's (no OpenBLAS loaded)";
    return choice;
  }
  if (setting == "openblas" || setting == "libtorch") {
    choice.openblas = setting == "openblas";
    choice.reason = absl::StrCat("MITA_BLAS=", std::string(setting));
    return choice;
  }
  choice.openblas = *openblas_seconds * kAutoMargin <= libtorch_seconds;
  choice.reason = absl::StrFormat("%s: OpenBLAS %.2f ms, LibTorch's %.2f ms on %s: %s (OpenBLAS needs %.2fx)",
                                  setting.empty() || setting == "auto"
                                      ? "auto"
                                      : absl::StrCat("auto (MITA_BLAS=", std::string(setting), " is not a choice)"),
                                  *openblas_seconds * 1e3, libtorch_seconds * 1e3, shape,
                                  choice.openblas ? "OpenBLAS" : "LibTorch's", kAutoMargin);
  return choice;
}

namespace {

const Chosen& ChosenLibrary() {
  static const Chosen* const chosen = [] {
    const char* variable = std::getenv("MITA_BLAS");
    const std::string setting = variable != nullptr ? variable : "";
    const BlasLibrary* openblas = BlasLibrary::OpenBlas();
    const BlasLibrary& libtorch = BlasLibrary::LibTorchBlas();
    std::optional<double> openblas_seconds;
    double libtorch_seconds = 0;
    if (openblas != nullptr && setting != "openblas" && setting != "libtorch") {
      openblas->SetThreads(at::get_num_threads());
      std::vector<float> x(kTimedRows * kTimedIn), w(kTimedOut * kTimedIn), y(kTimedRows * kTimedOut);
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 17) * 0.125f - 1.0f;
      for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 13) * 0.0625f - 0.375f;
      // Alternated, so that a burst of load from elsewhere falls on both.
      double best_openblas = 1e30, best_libtorch = 1e30;
      for (int round = 0; round < 3; ++round) {
        best_openblas = std::min(best_openblas, TimeDenseLayer(*openblas, x, w, y, 1));
        best_libtorch = std::min(best_libtorch, TimeDenseLayer(libtorch, x, w, y, 1));
      }
      openblas_seconds = best_openblas;
      libtorch_seconds = best_libtorch;
    } else if (openblas != nullptr) {
      openblas_seconds = 0;  // not timed: the setting decides
    }
    const BlasLibrary::Choice choice = BlasLibrary::Choose(
        setting, openblas_seconds, libtorch_seconds,
        absl::StrCat(kTimedRows, " x ", kTimedIn, " -> ", kTimedOut, ", ", at::get_num_threads(), " threads"));
    const std::string& error = BlasLibrary::openblas_load_error();
    return new Chosen{choice.openblas ? openblas : &libtorch,
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
