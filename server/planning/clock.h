// An injectable clock, so that time-dependent code (the dynamic batcher) can be tested without sleeping.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace mita::server {

// A source of the current time. Implementations are thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  // The current time.
  virtual absl::Time Now() const = 0;
};

// The wall clock (absl::Now()).
class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }

  // A process-wide instance; never destroyed.
  static const Clock* Get() {
    static const RealClock* const clock = new RealClock();
    return clock;
  }
};

// A clock that only moves when told to: for tests. Thread-safe.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(absl::Time start = absl::UnixEpoch()) : now_(start) {}

  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  // Moves the clock forward by `duration` (must be >= 0).
  void Advance(absl::Duration duration) {
    absl::MutexLock lock(&mu_);
    now_ += duration;
  }
  // Sets the clock to `time`.
  void Set(absl::Time time) {
    absl::MutexLock lock(&mu_);
    now_ = time;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mita::server
