// Cost-model calibration and profile files (see cost_calibration.h).
#include "server/planning/cost_calibration.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "kernels/aten_errors.h"
#include "kernels/status_macros.h"

namespace mita::server {
namespace {

using Json = nlohmann::json;

// One batch of the sweep: `batch_size` inputs of `tokens` tokens at `budget` (applied).
struct SweepBatch {
  int64_t tokens = 0;
  int64_t batch_size = 0;
  models::AttentionBudget budget;
  std::vector<CostItem> items() const { return std::vector<CostItem>(batch_size, CostItem{tokens, budget}); }
};

// The batch's features by the classifier.
CostFeatures FeaturesOf(const models::Classifier& classifier, const SweepBatch& batch) {
  return classifier.BatchCostFeatures(batch.items());
}

// The sweep's batches, cheapest (by the prior) first.
std::vector<SweepBatch> SweepPlan(const models::Classifier& classifier, int64_t max_batch_size,
                                  int64_t max_batch_tokens) {
  const models::ClassifierDescription& model = classifier.description();
  std::vector<int64_t> lengths;
  std::vector<int64_t> batch_sizes;
  if (model.tokens_per_input > 0) {
    lengths = {model.tokens_per_input};
    batch_sizes = {1, std::min<int64_t>(max_batch_size, 4), std::min<int64_t>(max_batch_size, 16)};
  } else {
    const int64_t longest = std::min(model.max_input_tokens, max_batch_tokens);
    for (int64_t length = 128; length <= longest; length *= 4) lengths.push_back(length);
    if (lengths.empty() || lengths.back() != longest) lengths.push_back(longest);
    batch_sizes = {1, std::min<int64_t>(max_batch_size, 4)};
  }
  std::vector<SweepBatch> plan;
  for (int64_t length : lengths) {
    for (int64_t batch_size : batch_sizes) {
      if (batch_size * length > max_batch_tokens) continue;
      // Batches of several inputs only for short inputs (they separate the batch and item costs).
      if (batch_size > 1 && model.tokens_per_input == 0 && length > 512) continue;
      // The accuracy order's budgets, and full attention where it is supported but not in the order (a request
      // may still name it; its feature must be timed).
      std::vector<models::AttentionBudget> budgets;
      for (const models::DeclaredBudget& declared : model.knobs.accuracy_order) budgets.push_back(declared.budget);
      if (model.knobs.full_attention_supported) budgets.push_back(models::AttentionBudget{true, 0, 0});
      for (const models::AttentionBudget& budget : budgets) {
        SweepBatch batch{length, batch_size, models::ApplyBudget(budget, length)};
        const bool seen = std::any_of(plan.begin(), plan.end(), [&](const SweepBatch& other) {
          return other.tokens == batch.tokens && other.batch_size == batch.batch_size && other.budget == batch.budget;
        });
        if (!seen) plan.push_back(batch);
      }
    }
  }
  const CostFeatures prior = classifier.PriorCostCoefficients();
  std::stable_sort(plan.begin(), plan.end(), [&](const SweepBatch& a, const SweepBatch& b) {
    return CostSeconds(prior, FeaturesOf(classifier, a)) < CostSeconds(prior, FeaturesOf(classifier, b));
  });
  return plan;
}

}  // namespace

CostProfile PriorProfile(const models::Classifier& classifier) {
  CostProfile profile;
  profile.coefficients = classifier.PriorCostCoefficients();
  return profile;
}

absl::StatusOr<CostProfile> CalibrateCostModel(const models::Classifier& classifier, absl::Duration limit,
                                               int64_t max_batch_size, int64_t max_batch_tokens) {
  CostProfile profile = PriorProfile(classifier);
  if (limit <= absl::ZeroDuration()) return profile;
  const CostFeatures prior_coefficients = profile.coefficients;
  const absl::Time start = absl::Now();
  std::vector<CostSample> samples;
  // measured / prior over the batches so far: the largest decides whether the next batch fits the limit, the
  // median scales the prior when too few batches were timed for a fit.
  double prior_ratio = 1;
  double largest_ratio = 1;
  c10::InferenceMode inference_mode;
  bool warmed_up = false;
  for (const SweepBatch& batch : SweepPlan(classifier, max_batch_size, max_batch_tokens)) {
    const CostFeatures features = FeaturesOf(classifier, batch);
    const double prior = CostSeconds(prior_coefficients, features);
    const absl::Duration left = limit - (absl::Now() - start);
    // Two runs of each batch (the first warms caches and the allocator), the faster one kept.
    if (absl::Seconds(2 * prior * largest_ratio) > left) continue;
    std::vector<models::BatchItem> inputs;
    for (int64_t i = 0; i < batch.batch_size; ++i) {
      ASSIGN_OR_RETURN(models::BatchItem input, classifier.SyntheticItem(batch.tokens, batch.budget));
      inputs.push_back(std::move(input));
    }
    std::vector<const models::BatchItem*> items;
    for (const models::BatchItem& input : inputs) items.push_back(&input);
    double fastest = 0;
    for (int run = warmed_up ? 0 : -1; run < 2; ++run) {
      const absl::Time begin = absl::Now();
      absl::StatusOr<models::ClassifierOutput> output = absl::UnknownError("not run");
      try {
        output = classifier.Run(items, /*want_statistics=*/true);
      } catch (...) {
        output = kernels::CurrentExceptionStatus("cost calibration");
      }
      if (!output.ok()) return output.status();
      const double seconds = absl::ToDoubleSeconds(absl::Now() - begin);
      if (run >= 0) fastest = run == 0 ? seconds : std::min(fastest, seconds);
    }
    warmed_up = true;
    samples.push_back(CostSample{features, fastest});
    std::vector<double> ratios;
    for (const CostSample& sample : samples) {
      ratios.push_back(sample.seconds / CostSeconds(prior_coefficients, sample.features));
    }
    std::sort(ratios.begin(), ratios.end());
    prior_ratio = ratios[ratios.size() / 2];
    largest_ratio = ratios.back();
  }
  profile.calibration_batches = static_cast<int>(samples.size());
  profile.calibration_time = absl::Now() - start;
  if (samples.empty()) return profile;
  profile.source = "calibrated";
  absl::StatusOr<CostFeatures> fitted = FitCostCoefficients(samples);
  if (fitted.ok() && samples.size() >= static_cast<size_t>(kNumCostFeatures)) {
    profile.coefficients = *fitted;
    // A feature no timed batch had (e.g. full attention when even its cheapest batch did not fit the limit), or
    // one the non-negative fit priced at 0 (timings slowed by other work let the other features absorb it), keeps
    // the prior, scaled to this machine, instead of costing nothing: every feature is real work.
    for (int i = 0; i < kNumCostFeatures; ++i) {
      const bool seen = std::any_of(samples.begin(), samples.end(),
                                    [i](const CostSample& sample) { return sample.features[i] > 0; });
      if (!seen || profile.coefficients[i] <= 0) profile.coefficients[i] = prior_coefficients[i] * prior_ratio;
    }
  } else {
    profile.correction = prior_ratio;
  }
  std::vector<double> errors;
  for (const CostSample& sample : samples) {
    errors.push_back(
        std::abs(profile.correction * CostSeconds(profile.coefficients, sample.features) / sample.seconds - 1));
  }
  std::sort(errors.begin(), errors.end());
  profile.fit_error = errors[errors.size() / 2];
  return profile;
}

std::string CostProfilesToJson(const std::map<std::string, CostProfile>& profiles,
                               const std::map<std::string, const models::ClassifierDescription*>& models) {
  Json root = Json::object();
  root["format"] = "mita-cost-profile-1";
  Json& entries = root["models"] = Json::object();
  for (const auto& [name, profile] : profiles) {
    auto model = models.find(name);
    if (model == models.end()) continue;
    Json entry;
    entry["device"] = model->second->device;
    entry["weights_dtype"] = model->second->weights_dtype;
    entry["embed_dim"] = model->second->embed_dim;
    entry["layers"] = model->second->layers;
    entry["coefficients"] = profile.coefficients;
    entry["correction"] = profile.correction;
    entry["calibration_batches"] = profile.calibration_batches;
    entries[name] = entry;
  }
  return root.dump(2) + "\n";
}

absl::StatusOr<CostProfile> FindCostProfile(absl::string_view json_text, absl::string_view file,
                                            const models::ClassifierDescription& model) {
  const Json root = Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  auto invalid = [&](absl::string_view detail) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", detail));
  };
  if (!root.is_object() || root.value("format", "") != "mita-cost-profile-1" || !root.contains("models") ||
      !root["models"].is_object()) {
    return invalid("not a cost profile file (save one with --save_cost_profile)");
  }
  const Json& models = root["models"];
  if (!models.contains(model.name)) {
    return invalid(absl::StrCat("no profile of model '", model.name, "' (save one with --save_cost_profile)"));
  }
  const Json& entry = models[model.name];
  if (!entry.is_object() || !entry.contains("coefficients") || !entry["coefficients"].is_array() ||
      entry["coefficients"].size() != kNumCostFeatures || !entry.contains("correction") ||
      !entry["correction"].is_number()) {
    return invalid(absl::StrCat("the profile of model '", model.name, "' is malformed"));
  }
  const std::string saved_for =
      absl::StrCat(entry.value("device", "?"), " ", entry.value("weights_dtype", "?"), " d=",
                   entry.value("embed_dim", int64_t{0}), " L=", entry.value("layers", int64_t{0}));
  const std::string runs_as =
      absl::StrCat(model.device, " ", model.weights_dtype, " d=", model.embed_dim, " L=", model.layers);
  if (saved_for != runs_as) {
    return invalid(absl::StrCat("the profile of model '", model.name, "' was saved for ", saved_for,
                                "; the model runs as ", runs_as));
  }
  CostProfile profile;
  profile.source = "loaded";
  for (int i = 0; i < kNumCostFeatures; ++i) {
    const Json& value = entry["coefficients"][static_cast<size_t>(i)];
    if (!value.is_number() || !(value.get<double>() >= 0) || !std::isfinite(value.get<double>())) {
      return invalid(absl::StrCat("the profile of model '", model.name, "' has a coefficient that is not >= 0"));
    }
    profile.coefficients[i] = value.get<double>();
  }
  profile.correction = entry["correction"].get<double>();
  if (!(profile.correction > 0) || !std::isfinite(profile.correction)) {
    return invalid(absl::StrCat("the profile of model '", model.name, "' has a correction that is not > 0"));
  }
  profile.calibration_batches = entry.value("calibration_batches", 0);
  return profile;
}

}  // namespace mita::server
