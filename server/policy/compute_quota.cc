// A client's compute quota (see compute_quota.h).
#include "server/policy/compute_quota.h"

#include <algorithm>
#include <cmath>

namespace mita::server::policy {

ComputeQuota::ComputeQuota(ClientRules::Quota quota, const Clock* clock)
    : clock_(clock), quota_(quota), level_(quota.burst_compute_units), filled_at_(clock->Now()) {}

void ComputeQuota::Fill(absl::Time now) {
  if (now > filled_at_) {
    level_ = std::min(quota_.burst_compute_units,
                      level_ + quota_.compute_units_per_second * absl::ToDoubleSeconds(now - filled_at_));
    filled_at_ = now;
  }
}

absl::Duration ComputeQuota::TimeUntilAdmitted() {
  absl::MutexLock lock(&mu_);
  Fill(clock_->Now());
  if (level_ >= 1) return absl::ZeroDuration();
  return absl::Seconds((1 - level_) / quota_.compute_units_per_second);
}

void ComputeQuota::Charge(int64_t compute_units) {
  absl::MutexLock lock(&mu_);
  Fill(clock_->Now());
  level_ -= static_cast<double>(compute_units);
}

void ComputeQuota::Refund(int64_t compute_units) {
  absl::MutexLock lock(&mu_);
  Fill(clock_->Now());
  level_ = std::min(quota_.burst_compute_units, level_ + static_cast<double>(compute_units));
}

void ComputeQuota::Reconfigure(ClientRules::Quota quota) {
  absl::MutexLock lock(&mu_);
  Fill(clock_->Now());
  quota_ = quota;
  level_ = std::min(level_, quota_.burst_compute_units);
}

double ComputeQuota::level() {
  absl::MutexLock lock(&mu_);
  Fill(clock_->Now());
  return level_;
}

ClientRules::Quota ComputeQuota::quota() const {
  absl::MutexLock lock(&mu_);
  return quota_;
}

}  // namespace mita::server::policy
