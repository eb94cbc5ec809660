// The preparation threads (see preparation_pool.h).
#include "server/preparation_pool.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace mita::server {

PreparationPool::PreparationPool(int threads, int64_t capacity, std::string capacity_source)
    : capacity_(std::max<int64_t>(capacity, 1)), capacity_source_(std::move(capacity_source)) {
  for (int i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { Run(); });
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

}  // namespace mita::server
