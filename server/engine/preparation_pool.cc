// The preparation threads (see preparation_pool.h).
#include "server/engine/preparation_pool.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/runtime_environment.h"

namespace mita::server {

PreparationPool::PreparationPool(int threads, int64_t capacity, std::string capacity_source)
    : capacity_(std::max<int64_t>(capacity, 1)), capacity_source_(std::move(capacity_source)) {
  for (int i = 0; i < std::max(threads, 1); ++i) {
    threads_.emplace_back([this] {
      // One intra-op thread: preparations run beside the forwards, and a team of their own would oversubscribe the
      // cores and keep libgomp's workers from spinning for the forwards (kernels/runtime_environment.h).
      kernels::SetCallingThreadIntraOpThreads(1);
      Run();
    });
  }
}

PreparationPool::~PreparationPool() { Shutdown(); }

absl::Status PreparationPool::Submit(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("shutting down: no new work is accepted");
  if (static_cast<int64_t>(jobs_.size()) >= capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat("too many requests waiting for their input to be prepared: ",
                                                     jobs_.size(), " of ", capacity_, " (", capacity_source_, ")"));
  }
  jobs_.push_back(std::move(job));
  return absl::OkStatus();
}

int64_t PreparationPool::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(jobs_.size());
}

void PreparationPool::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  absl::MutexLock join_lock(&join_mu_);
  for (std::thread& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
}

bool PreparationPool::HasJobOrStopping() const { return stopping_ || !jobs_.empty(); }

void PreparationPool::Run() {
  while (true) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &PreparationPool::HasJobOrStopping));
      if (jobs_.empty()) return;  // stopping, and everything queued has run
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

PreparationMemory::PreparationMemory(int64_t capacity_bytes, std::string capacity_source)
    : capacity_(std::max<int64_t>(1, capacity_bytes)), capacity_source_(std::move(capacity_source)) {}

absl::Status PreparationMemory::Acquire(int64_t bytes, const std::function<absl::Status()>& stop) {
  bytes = std::max<int64_t>(0, bytes);
  if (bytes > capacity_) {
    constexpr double kMiB = 1 << 20;
    return absl::ResourceExhaustedError(absl::StrFormat(
        "preparing this input needs about %.1f MiB of working memory, more than the %.1f MiB that preparation may "
        "use (%s)",
        bytes / kMiB, capacity_ / kMiB, capacity_source_));
  }
  int marker = 0;  // this waiter's identity in waiters_
  absl::MutexLock lock(&mu_);
  waiters_.push_back(&marker);
  auto my_turn = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return waiters_.front() == &marker && in_use_ + bytes <= capacity_;
  };
  while (!mu_.AwaitWithTimeout(absl::Condition(&my_turn), absl::Milliseconds(10))) {
    if (stop == nullptr) continue;
    mu_.Unlock();
    absl::Status stopped = stop();
    mu_.Lock();
    if (!stopped.ok() && !my_turn()) {
      waiters_.erase(std::find(waiters_.begin(), waiters_.end(), &marker));
      return stopped;
    }
  }
  waiters_.erase(std::find(waiters_.begin(), waiters_.end(), &marker));
  in_use_ += bytes;
  return absl::OkStatus();
}

void PreparationMemory::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  in_use_ -= std::max<int64_t>(0, bytes);
}

int64_t PreparationMemory::in_use() const {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

}  // namespace mita::server
