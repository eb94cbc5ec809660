// Where a model's cost model comes from (server/planning/cost_model.h): a warm-up sweep at start-up that times
// batches of the model's synthetic inputs (Classifier::SyntheticItem) at its declared budgets (bounded by
// --cost_calibration_ms), a profile saved by an earlier server (--save_cost_profile / --cost_profile), or the
// model's prior coefficients (Classifier::PriorCostCoefficients).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "models/classifier.h"
#include "server/planning/cost_model.h"

namespace mita::server {

// One model's cost profile: what a CostModel is built from, and where it came from.
struct CostProfile {
  CostFeatures coefficients{};
  double correction = 1.0;
  // "calibrated", "loaded" or "prior" (mita.v1 CostProfile.source).
  std::string source = "prior";
  int calibration_batches = 0;
  absl::Duration calibration_time = absl::ZeroDuration();
  // Median over the timed batches of |predicted / measured - 1| after the fit (0 when not calibrated).
  double fit_error = 0;
};

// The profile of `classifier` before any calibration: its prior coefficients, source "prior".
CostProfile PriorProfile(const models::Classifier& classifier);

// Times batches of the classifier's synthetic inputs: each budget of its accuracy order (and full attention where
// supported) at a few token counts (its one count when fixed; else 128, x4, up to the longest it takes, at most
// `max_batch_tokens`) and batch sizes (1, and up to `max_batch_size`; several only for inputs of at most 512
// tokens), cheapest first, skipping a batch whose estimated time would pass `limit`; then fits the coefficients
// (FitCostCoefficients); a feature no timed batch had keeps its prior coefficient scaled by the median measured /
// prior ratio. Fewer timed batches than features: the prior coefficients scaled by that ratio. `limit` zero: the
// prior, not timed.
// Errors: the classifier's Run errors (RESOURCE_EXHAUSTED, INTERNAL).
absl::StatusOr<CostProfile> CalibrateCostModel(const models::Classifier& classifier, absl::Duration limit,
                                               int64_t max_batch_size, int64_t max_batch_tokens);

// A file of saved profiles (JSON): for each model its device, weights dtype, shape, coefficients and
// correction. `profiles` by model name, `models` the same names' descriptions.
std::string CostProfilesToJson(const std::map<std::string, CostProfile>& profiles,
                               const std::map<std::string, const models::ClassifierDescription*>& models);

// The profile of `model` in the JSON text of a profile file (`file` names it in errors), with source "loaded".
// Errors: INVALID_ARGUMENT for text that is not such a file, no profile of the model, or one saved for another
// device, dtype or shape ("saved for cpu float32 d=96 L=4, the model runs on cuda:0 ...").
absl::StatusOr<CostProfile> FindCostProfile(absl::string_view json_text, absl::string_view file,
                                            const models::ClassifierDescription& model);

}  // namespace mita::server
