// The batch cost model (see cost_model.h).
#include "server/planning/cost_model.h"

#include <algorithm>
#include <cmath>

namespace mita::server {
namespace {

constexpr double kCorrectionWeight = 0.1;
constexpr double kMaxCorrection = 16;

}  // namespace

absl::StatusOr<CostFeatures> FitCostCoefficients(absl::Span<const CostSample> samples) {
  if (samples.empty()) return absl::InvalidArgumentError("no timed batches to fit the cost model to");
  // Rows weighted by 1 / seconds (relative error); columns scaled to a largest weighted value of 1, so that
  // coordinate descent sees a well-conditioned problem whatever the features' magnitudes.
  CostFeatures scale{};
  for (const CostSample& sample : samples) {
    if (!(sample.seconds > 0)) return absl::InvalidArgumentError("a timed batch has a time <= 0");
    for (int i = 0; i < kNumCostFeatures; ++i) scale[i] = std::max(scale[i], sample.features[i] / sample.seconds);
  }
  // Normal equations A c = b of the weighted, scaled problem (target: 1 per row).
  std::array<CostFeatures, kNumCostFeatures> a{};
  CostFeatures b{};
  for (const CostSample& sample : samples) {
    CostFeatures x{};
    for (int i = 0; i < kNumCostFeatures; ++i) {
      x[i] = scale[i] > 0 ? sample.features[i] / sample.seconds / scale[i] : 0;
    }
    for (int i = 0; i < kNumCostFeatures; ++i) {
      b[i] += x[i];
      for (int j = 0; j < kNumCostFeatures; ++j) a[i][j] += x[i] * x[j];
    }
  }
  CostFeatures c{};
  for (int sweep = 0; sweep < 5000; ++sweep) {
    double largest_step = 0;
    for (int i = 0; i < kNumCostFeatures; ++i) {
      if (a[i][i] <= 0) continue;  // a feature that is 0 in every sample keeps coefficient 0
      double residual = b[i];
      for (int j = 0; j < kNumCostFeatures; ++j) {
        if (j != i) residual -= a[i][j] * c[j];
      }
      const double next = std::max(0.0, residual / a[i][i]);
      largest_step = std::max(largest_step, std::abs(next - c[i]));
      c[i] = next;
    }
    if (largest_step < 1e-12) break;
  }
  CostFeatures coefficients{};
  for (int i = 0; i < kNumCostFeatures; ++i) coefficients[i] = scale[i] > 0 ? c[i] / scale[i] : 0;
  return coefficients;
}

double CostSeconds(const CostFeatures& coefficients, const CostFeatures& features) {
  double seconds = 0;
  for (int i = 0; i < kNumCostFeatures; ++i) seconds += coefficients[i] * features[i];
  return seconds;
}

double CostModel::UncorrectedSeconds(absl::Span<const CostItem> items) const {
  return CostSeconds(coefficients_, features_(items));
}

absl::Duration CostModel::Predict(absl::Span<const CostItem> items) const {
  return absl::Seconds(correction() * UncorrectedSeconds(items));
}

absl::Duration CostModel::BatchOverhead() const { return absl::Seconds(correction() * coefficients_[0]); }

double CostModel::correction() const {
  absl::MutexLock lock(&mu_);
  return correction_;
}

double CostModel::Observe(absl::Span<const CostItem> items, absl::Duration measured) {
  const double uncorrected = UncorrectedSeconds(items);
  const double seconds = absl::ToDoubleSeconds(measured);
  if (!(uncorrected > 0) || !(seconds > 0)) return 0;
  absl::MutexLock lock(&mu_);
  const double ratio = seconds / (correction_ * uncorrected);
  const double log_correction =
      (1 - kCorrectionWeight) * std::log(correction_) + kCorrectionWeight * std::log(seconds / uncorrected);
  correction_ = std::clamp(std::exp(log_correction), 1 / kMaxCorrection, kMaxCorrection);
  return ratio;
}

}  // namespace mita::server
