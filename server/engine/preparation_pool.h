// The threads that prepare request inputs (decode images, tokenize text) before admission to a model's batcher.
// gRPC's callback API runs handlers on its own event threads, which must not block; this pool takes the
// blocking, CPU-bound preparation off them. Its queue is bounded and fails fast.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace mita::server {

// A fixed set of threads running jobs in FIFO order, each on one intra-op thread (LibTorch ops in a job run serially).
// Thread-safe.
class PreparationPool {
 public:
  // Starts `threads` (>= 1) threads; at most `capacity` (>= 1) jobs wait at once, named by `capacity_source`
  // in the error (e.g. "flag --preparation_queue_capacity").
  PreparationPool(int threads, int64_t capacity, std::string capacity_source);
  // Shutdown().
  ~PreparationPool();

  PreparationPool(const PreparationPool&) = delete;
  PreparationPool& operator=(const PreparationPool&) = delete;

  // Queues `job`. Errors: RESOURCE_EXHAUSTED when `capacity` jobs are waiting (names the limit);
  // UNAVAILABLE after Shutdown began. A job must not throw.
  absl::Status Submit(std::function<void()> job) ABSL_LOCKS_EXCLUDED(mu_);

  // Jobs waiting, not yet started.
  int64_t waiting() const ABSL_LOCKS_EXCLUDED(mu_);

  // Stops accepting jobs, runs those already queued and joins the threads. Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  bool HasJobOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t capacity_;
  const std::string capacity_source_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
  absl::Mutex join_mu_;
};

// Working memory shared by the preparations (decoding, tokenizing), in bytes: each takes its estimate
// (Classifier::PreparationBytes) before it starts and gives it back when done, so that concurrent decodes of
// large images stay within the capacity whatever their number. Waiters are served in arrival order (a large
// image is not overtaken forever by small ones). Thread-safe.
class PreparationMemory {
 public:
  // `capacity_bytes` >= 1, named by `capacity_source` in errors (e.g. "flag --preparation_memory_bytes").
  PreparationMemory(int64_t capacity_bytes, std::string capacity_source);

  // Waits until `bytes` are free and takes them. While waiting, `stop` (optional) is asked every 10 ms; its
  // first non-OK answer is returned (nothing taken). Errors: RESOURCE_EXHAUSTED when `bytes` exceed the whole
  // capacity (the message gives both in MiB and the source).
  absl::Status Acquire(int64_t bytes, const std::function<absl::Status()>& stop) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives back what one Acquire took.
  void Release(int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  int64_t in_use() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t capacity() const { return capacity_; }

 private:
  const int64_t capacity_;
  const std::string capacity_source_;
  mutable absl::Mutex mu_;
  int64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<const void*> waiters_ ABSL_GUARDED_BY(mu_);  // arrival order
};

}  // namespace mita::server
