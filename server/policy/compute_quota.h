// A client's compute quota: a token bucket of compute units (models::ComputeUnits) on an injectable clock.
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/planning/clock.h"
#include "server/policy/client_policy.h"

namespace mita::server::policy {

// A token bucket that fills at `compute_units_per_second` up to `burst_compute_units`. A request is let in while
// the bucket holds at least one compute unit (TimeUntilAdmitted is zero); its cost, known only once its input is
// prepared, is charged then (Charge) and may take the bucket below zero: the debt delays the client's next requests,
// so over a long run the charged compute is at most rate x time + burst. Thread-safe.
class ComputeQuota {
 public:
  // Starts full. `clock` must outlive the quota; the quota's values must be > 0 (ClientPolicy::Parse checks them).
  ComputeQuota(ClientRules::Quota quota, const Clock* clock);

  // Zero when a request may enter now; else how long until the bucket holds one compute unit again.
  absl::Duration TimeUntilAdmitted() ABSL_LOCKS_EXCLUDED(mu_);
  // Takes `compute_units` (>= 0) out of the bucket (it may go below zero).
  void Charge(int64_t compute_units) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives back `compute_units` charged for work that was then refused (it never ran).
  void Refund(int64_t compute_units) ABSL_LOCKS_EXCLUDED(mu_);
  // A reloaded policy's values for the same client: the level is kept (at most the new burst).
  void Reconfigure(ClientRules::Quota quota) ABSL_LOCKS_EXCLUDED(mu_);

  // Compute units in the bucket now (negative: a debt).
  double level() ABSL_LOCKS_EXCLUDED(mu_);
  ClientRules::Quota quota() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Adds what the bucket gained since the last fill.
  void Fill(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock* const clock_;
  mutable absl::Mutex mu_;
  ClientRules::Quota quota_ ABSL_GUARDED_BY(mu_);
  double level_ ABSL_GUARDED_BY(mu_);
  absl::Time filled_at_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mita::server::policy
