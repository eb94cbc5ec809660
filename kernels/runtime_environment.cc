#include "kernels/runtime_environment.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>

namespace mita::kernels {

void ReexecWithPassiveOpenMpWaitIfUnset(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "passive", /*overwrite=*/1) != 0) return;
  // The binary's real path, not /proc/self/exe itself: the kernel names a process after the file it executes,
  // and a process named "exe" is not found by pgrep, pidof or pkill mita-server. /proc/self/exe when the path
  // cannot be read or the file is gone (a deleted binary reads "... (deleted)").
  const char* program = "/proc/self/exe";
  char path[PATH_MAX];
  const ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (length > 0) {
    path[length] = '\0';
    if (access(path, X_OK) == 0) program = path;
  }
  execv(program, argv);
  std::perror("re-executing with OMP_WAIT_POLICY=passive failed; continuing with the default policy");
}

int SetIntraOpThreads(int threads) {
  threads = std::max(1, threads);
  at::set_num_threads(threads);
  // OpenBLAS's C API (cblas.h): void openblas_set_num_threads(int); int openblas_get_num_threads(void).
  using SetThreads = void (*)(int);
  using GetThreads = int (*)();
  auto set_threads = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  auto get_threads = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (set_threads != nullptr && get_threads != nullptr) {
    set_threads(threads);
    return get_threads();
  }
  // MKL's C API (mkl_service.h): int mkl_get_max_threads(void).
  auto mkl_threads = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "mkl_get_max_threads"));
  return mkl_threads != nullptr ? mkl_threads() : 0;
}

bool KeepFreedMemoryForReuse() {
  const bool no_mmap = mallopt(M_MMAP_MAX, 0) == 1;
  const bool no_trim = mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  return no_mmap && no_trim;
}

}  // namespace mita::kernels
