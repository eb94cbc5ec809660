// Predicted compute time of a packed batch (latency targets and deadline-aware admission, docs/serving.md): a
// linear model over the cost features the model gives of the batch's items (models::Classifier::BatchCostFeatures;
// feature 0 is 1 per batch, its fixed cost), fitted by non-negative least squares to batches timed at start-up
// (server/planning/cost_calibration.h) and corrected online from every batch the server runs:
// predicted seconds = correction x sum_i coefficient_i x feature_i. It knows nothing of how a model computes.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "models/cost_features.h"

namespace mita::server {

using models::CostFeatures;
using models::CostItem;
using models::kNumCostFeatures;

// sum_i coefficients_i x features_i: the uncorrected predicted seconds of a batch with `features`.
double CostSeconds(const CostFeatures& coefficients, const CostFeatures& features);

// One timed batch: its features and its compute time, seconds.
struct CostSample {
  CostFeatures features{};
  double seconds = 0;
};

// Non-negative least squares in relative error: the coefficients c >= 0 minimising
// sum_s ((c . features_s - seconds_s) / seconds_s)^2 (short and long batches count alike), by cyclic coordinate
// descent on the column-scaled normal equations (each step the exact minimiser along one coordinate, clamped
// at 0). A feature that is 0 in every sample gets coefficient 0. Errors: INVALID_ARGUMENT for no samples or a
// sample with seconds <= 0.
absl::StatusOr<CostFeatures> FitCostCoefficients(absl::Span<const CostSample> samples);

// The cost features of a batch of items (a model's Classifier::BatchCostFeatures).
using BatchFeatures = std::function<CostFeatures(absl::Span<const CostItem> items)>;

// A cost model with an online multiplicative correction. Thread-safe.
class CostModel {
 public:
  // `features` gives a batch's features; `coefficients` are seconds per feature unit.
  CostModel(BatchFeatures features, CostFeatures coefficients, double correction = 1.0)
      : features_(std::move(features)), coefficients_(coefficients), correction_(correction) {}

  // Predicted compute time of a batch of `items` (zero for an empty batch).
  absl::Duration Predict(absl::Span<const CostItem> items) const;
  // The fixed cost of one batch (feature 0's share of Predict).
  absl::Duration BatchOverhead() const;

  // Folds one measured batch into the correction (a moving average of log(measured / uncorrected prediction),
  // weight 0.1, kept within [1/16, 16]). Returns measured / predicted with the correction before this update
  // (the prediction-ratio metric), or 0 when the batch was predicted at zero (ignored).
  double Observe(absl::Span<const CostItem> items, absl::Duration measured);

  double correction() const;
  const CostFeatures& coefficients() const { return coefficients_; }

 private:
  double UncorrectedSeconds(absl::Span<const CostItem> items) const;

  const BatchFeatures features_;
  const CostFeatures coefficients_;
  mutable absl::Mutex mu_;
  double correction_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mita::server
