// Predicted compute time of a packed batch (latency targets and deadline-aware admission, docs/serving.md): a
// linear model over a few features of the batch's items, fitted by non-negative least squares to batches timed
// at start-up (server/cost_calibration.h) and corrected online from every batch the server runs.
//
// Features of a batch for a model of hidden size d and L layers (summed over the batch's items):
//   batch            1 per batch (the forward's fixed cost)
//   items            L per item (attention runs per item)
//   projections      L N d^2 per item (q/k/v/output projections and the MLP)
//   mita attention   L N (m + k) d per MiTA item (m shared-expert outputs + the k keys of the routed expert)
//   landmarks        L N m d per MiTA item (landmark pooling, the routing gate and the top-k selection)
//   full attention   L N^2 d per full-attention item
// N: the item's tokens; m, k: its applied expert count and width (docs/design.md section 2 for the costs).
// predicted seconds = correction x sum_i coefficient_i x feature_i.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "models/budget.h"

namespace mita::server {

inline constexpr int kNumCostFeatures = 6;
using CostFeatures = std::array<double, kNumCostFeatures>;

// One item of a batch as the cost model sees it: its tokens and applied budget (models::ApplyBudget).
struct CostItem {
  int64_t tokens = 0;
  models::AttentionBudget budget;
};

// The shape of a model the features need: hidden size d (embed_dim) and attention layers L.
struct CostShape {
  int64_t embed_dim = 0;
  int64_t layers = 0;
};

// The features of a batch of `items` (see the file comment), in that order. Empty `items`: all zero.
CostFeatures BatchCostFeatures(const CostShape& shape, absl::Span<const CostItem> items);

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

// Coefficients to use before any calibration (seconds per feature unit, from a CPU core's rough rates); the
// online correction scales them to the machine.
CostFeatures PriorCostCoefficients();

// A cost model with an online multiplicative correction. Thread-safe.
class CostModel {
 public:
  CostModel(CostShape shape, CostFeatures coefficients, double correction = 1.0)
      : shape_(shape), coefficients_(coefficients), correction_(correction) {}

  // Predicted compute time of a batch of `items` (zero for an empty batch).
  absl::Duration Predict(absl::Span<const CostItem> items) const;
  // The fixed cost of one batch (the `batch` feature's share of Predict).
  absl::Duration BatchOverhead() const;

  // Folds one measured batch into the correction (a moving average of log(measured / uncorrected prediction),
  // weight 0.1, kept within [1/16, 16]). Returns measured / predicted with the correction before this update
  // (the prediction-ratio metric), or 0 when the batch was predicted at zero (ignored).
  double Observe(absl::Span<const CostItem> items, absl::Duration measured);

  double correction() const;
  const CostFeatures& coefficients() const { return coefficients_; }
  const CostShape& shape() const { return shape_; }

 private:
  double UncorrectedSeconds(absl::Span<const CostItem> items) const;

  const CostShape shape_;
  const CostFeatures coefficients_;
  mutable absl::Mutex mu_;
  double correction_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mita::server
