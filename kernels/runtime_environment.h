// Runtime environment of serving and benchmark processes: OpenMP's wait policy, the intra-op thread count
// shared by LibTorch and the BLAS library, and how the C heap keeps freed memory, up to a bound.
//
// LibTorch's OpenMP runtime here (libgomp) reads OMP_WAIT_POLICY and GOMP_SPINCOUNT only once, when the library is
// loaded; by default its idle worker threads spin for milliseconds before they sleep, and with OpenBLAS's own
// threads also active, spinning threads fight for the cores and batch-1 latency suffers (measured:
// docs/image_model.md). The settings the server uses instead: kernels/openmp_wait.h.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mita::kernels {

// If OMP_WAIT_POLICY or GOMP_SPINCOUNT is not set, sets it (kernels/openmp_wait.h: passive, a short spin) and
// re-executes the current program (the file /proc/self/exe points to, so that the process keeps its name) with the
// same arguments, so that libgomp starts with them; an operator's explicit choice is kept. Call first thing in
// main(). Returns only when no re-execution was needed or it failed (then the process goes on with libgomp's
// defaults for what was unset).
void ReexecWithOpenMpWaitSettingsIfUnset(char** argv);

// Sets the intra-op thread count, `threads` >= 1 (below 1 is taken as 1), of LibTorch (at::set_num_threads) and of
// the process's BLAS (kernels/blas_library.h). Returns the BLAS thread count now in effect, or 0 when the BLAS
// reports none.
//
// Why both: LibTorch's setting does not reach OpenBLAS, whose pthread builds start one worker per core and let it
// spin in sched_yield after every multi-threaded GEMM, taking CPU from the batch thread (measured:
// docs/serving.md, "Threads"). MKL's count follows at::set_num_threads.
int SetIntraOpThreads(int threads);

// Ends the calling thread's OpenMP team: its worker threads exit (omp_pause_resource_all, soft); the next parallel
// region it runs starts new ones. A thread that ran parallel regions keeps its team's workers until it exits, and
// libgomp counts them all: once it manages more threads than the process has CPUs, every idle worker of every team
// sleeps at once instead of spinning (its "throttled" spin count), so a batch-1 forward ran at the passive policy's
// speed as soon as two threads of the process had run forwards (docs/kernels.md, "Why the server did not move, and the
// fix"). Call when a thread stops running forwards for a while (an idle batch thread, the end of a calibration). Not
// from inside a parallel region.
void ReleaseCallingThreadIntraOpTeam();

// Sets the intra-op threads of the ops the calling thread runs from now on (LibTorch's OpenMP team size and MKL's
// thread-local count), `threads` >= 1 (smaller: 1), leaving other threads' as they are; so that several threads
// can each run forwards on a share of the cores. OpenBLAS's count is process-wide (SetIntraOpThreads) and stays.
void SetCallingThreadIntraOpThreads(int threads);

// Makes glibc's malloc keep freed memory for reuse: no allocation is served by its own mmap
// (mallopt(M_MMAP_MAX, 0)), the heap is never trimmed (mallopt(M_TRIM_THRESHOLD, INT_MAX)), and every thread
// allocates from the main arena (mallopt(M_ARENA_MAX, 1)), the one whose free top ReturnFreedMemory can return:
// malloc_trim leaves the free top of a thread's arena resident, so an unloaded model's memory stayed in the
// arenas of the threads that had used it (docs/serving.md "Model repository"). Process-wide; call before any
// thread allocates. Returns false when glibc refused a setting.
//
// Why: LibTorch's CPU tensors come from malloc, and glibc maps every block over 32 MiB (its largest mmap
// threshold) afresh and unmaps it when freed, so a long document's multi-MiB activations are page-faulted in again
// at every layer of every request. The process keeps its high-water heap instead, which it reuses for the next
// request (measured: docs/long_documents.md). With nothing else, the heap never shrinks: pair it with
// FreedMemoryLimit.
bool KeepFreedMemoryForReuse();

// The process's memory as the C heap and the kernel see it.
struct HeapMemory {
  int64_t in_use_bytes = 0;              // allocated by malloc and not freed (mallinfo2: uordblks + hblkhd)
  int64_t resident_anonymous_bytes = 0;  // resident memory not backed by a file (/proc/self/statm: resident - shared)
};
HeapMemory ReadHeapMemory();

// Returns every free page of the C heap to the system (malloc_trim(0): the free pages inside every arena, and the
// top of the main heap; a thread arena's free top stays, hence KeepFreedMemoryForReuse's one arena). Returns by how much the resident anonymous memory went down, bytes (0 when it did not).
int64_t ReturnFreedMemory();

// The bound of KeepFreedMemoryForReuse: a thread that, every `interval`, estimates the resident memory the C heap
// holds free (resident anonymous memory less the heap's bytes in use, less that same difference right after the
// last return: what no return gives back, thread stacks and libraries' data among it) and returns it all
// (ReturnFreedMemory) when it is over `limit_bytes`. Memory freed by one request and reused by the next stays
// resident as long as the heap holds at most the limit free; a burst, a fragmented heap or a one-off large
// request (e.g. a packed batch of long documents) no longer keeps the process at its high-water mark. Starts by
// returning what the heap holds free then (e.g. the start-up's calibration batches). Thread-safe.
class FreedMemoryLimit {
 public:
  struct Stats {
    int64_t kept_bytes = 0;      // the estimate at the last check (after its return, if any)
    int64_t returns = 0;         // returns made (the one at start included)
    int64_t returned_bytes = 0;  // resident memory those returns gave back
  };

  // `limit_bytes` >= 0; `on_check` (optional) is called after every check, on the limit's thread.
  FreedMemoryLimit(int64_t limit_bytes, absl::Duration interval, std::function<void(const Stats&)> on_check = {});
  // Stops the thread.
  ~FreedMemoryLimit();
  FreedMemoryLimit(const FreedMemoryLimit&) = delete;
  FreedMemoryLimit& operator=(const FreedMemoryLimit&) = delete;

  // One check now (the thread's; for tests): returns the freed memory when the estimate is over the limit.
  Stats Check();
  Stats stats() const;

 private:
  void Run();

  const int64_t limit_bytes_;
  const absl::Duration interval_;
  const std::function<void(const Stats&)> on_check_;
  mutable absl::Mutex mu_;
  int64_t baseline_ ABSL_GUARDED_BY(mu_) = 0;  // resident anonymous - in use, right after the last return
  Stats stats_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace mita::kernels
