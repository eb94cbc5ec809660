#include "kernels/runtime_environment.h"

#include <ATen/Parallel.h>
#include <malloc.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "kernels/blas_library.h"
#include "kernels/openmp_wait.h"

namespace mita::kernels {

void ReexecWithOpenMpWaitSettingsIfUnset(char** argv) {
  bool changed = false;
  for (const auto& [name, value] : {std::pair<const char*, const char*>{"OMP_WAIT_POLICY", kOpenMpWaitPolicy},
                                    {"GOMP_SPINCOUNT", kOpenMpSpinCount}}) {
    if (std::getenv(name) != nullptr) continue;
    if (setenv(name, value, /*overwrite=*/1) != 0) return;
    changed = true;
  }
  if (!changed) return;
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
  std::perror("re-executing with the OpenMP wait settings failed; continuing with libgomp's defaults");
}

void ReleaseCallingThreadIntraOpTeam() { omp_pause_resource_all(omp_pause_soft); }

int SetIntraOpThreads(int threads) {
  threads = std::max(1, threads);
  at::set_num_threads(threads);
  return BlasLibrary::Get().SetThreads(threads);
}

void SetCallingThreadIntraOpThreads(int threads) {
  threads = std::max(1, threads);
  // at::get_num_threads first: LibTorch sets a thread's count from the process-wide one at its first parallel op,
  // which would undo a count set before.
  if (at::get_num_threads() == threads) return;
  omp_set_num_threads(threads);
  BlasLibrary::Get().SetThreadLocalThreads(threads);
}

bool KeepFreedMemoryForReuse() {
  const bool no_mmap = mallopt(M_MMAP_MAX, 0) == 1;
  const bool no_trim = mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  const bool one_arena = mallopt(M_ARENA_MAX, 1) == 1;
  return no_mmap && no_trim && one_arena;
}

HeapMemory ReadHeapMemory() {
  HeapMemory memory;
  const struct mallinfo2 info = mallinfo2();
  memory.in_use_bytes = static_cast<int64_t>(info.uordblks + info.hblkhd);
  // /proc/self/statm: size resident shared text lib data dt, in pages; "shared" is the file-backed part.
  if (FILE* statm = std::fopen("/proc/self/statm", "r")) {
    long long size = 0, resident = 0, shared = 0;
    if (std::fscanf(statm, "%lld %lld %lld", &size, &resident, &shared) == 3) {
      memory.resident_anonymous_bytes = (resident - shared) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
    }
    std::fclose(statm);
  }
  return memory;
}

int64_t ReturnFreedMemory() {
  const int64_t before = ReadHeapMemory().resident_anonymous_bytes;
  malloc_trim(0);
  return std::max<int64_t>(0, before - ReadHeapMemory().resident_anonymous_bytes);
}

FreedMemoryLimit::FreedMemoryLimit(int64_t limit_bytes, absl::Duration interval,
                                   std::function<void(const Stats&)> on_check)
    : limit_bytes_(std::max<int64_t>(0, limit_bytes)), interval_(interval), on_check_(std::move(on_check)) {
  const int64_t returned = ReturnFreedMemory();
  const HeapMemory memory = ReadHeapMemory();
  {
    absl::MutexLock lock(&mu_);
    baseline_ = memory.resident_anonymous_bytes - memory.in_use_bytes;
    stats_.returns = 1;
    stats_.returned_bytes = returned;
  }
  thread_ = std::thread([this] { Run(); });
}

FreedMemoryLimit::~FreedMemoryLimit() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

FreedMemoryLimit::Stats FreedMemoryLimit::Check() {
  const HeapMemory memory = ReadHeapMemory();
  absl::MutexLock lock(&mu_);
  stats_.kept_bytes = std::max<int64_t>(0, memory.resident_anonymous_bytes - memory.in_use_bytes - baseline_);
  if (stats_.kept_bytes > limit_bytes_) {
    stats_.returned_bytes += ReturnFreedMemory();
    ++stats_.returns;
    const HeapMemory after = ReadHeapMemory();
    baseline_ = after.resident_anonymous_bytes - after.in_use_bytes;
    stats_.kept_bytes = 0;
  }
  return stats_;
}

FreedMemoryLimit::Stats FreedMemoryLimit::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void FreedMemoryLimit::Run() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      const auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), interval_)) return;
    }
    const Stats stats = Check();
    if (on_check_) on_check_(stats);
  }
}

}  // namespace mita::kernels
