// The neutral request and result every front end translates to and from (mita.v1 in
// server/frontend/mita_v1_service.h, the Open Inference Protocol in server/frontend/open_inference_service.h).
// InferenceEngine (inference_engine.h) serves them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "kernels/mita_attention.h"
#include "models/budget.h"
#include "models/classifier.h"
#include "server/policy/policy_holder.h"
#include "server/planning/latency_planner.h"

namespace mita::server {

// One classification request.
struct InferenceRequest {
  // The model's name (a folder of the repository) and version (0: its highest served version).
  std::string model;
  int64_t model_version = 0;
  // The input; it views the front end's request message, which outlives the call.
  models::ClassifierInput input;
  models::BudgetRequest budget;
  // Classes to return, best first: 0 means min(5, classes); at most the model's class count.
  int64_t top_n = 0;
  // Return per-layer attention statistics (they are computed for the metrics either way).
  bool return_statistics = false;
  // When the caller stops waiting (absl::InfiniteFuture() for never).
  absl::Time deadline = absl::InfiniteFuture();
  // The budget policy's client that sent it, with its rules and quota as the policy in force when it arrived
  // (server/policy/policy_holder.h; the front end identifies it); null when the server has no client policy.
  std::shared_ptr<const policy::ClientAdmission> client;
};

// The answer to one InferenceRequest.
struct InferenceResult {
  // The model that answered (its labels name the classes) and its version; valid while the result is.
  const models::ClassifierDescription* model = nullptr;
  int64_t model_version = 0;
  // The top_n most probable classes, best first.
  std::vector<models::ClassScore> classes;
  // The budget applied to this input and the preset name to echo (models/budget.h ResolvedBudget).
  models::ResolvedBudget budget;
  // Why that budget, and the queue wait plus compute predicted for it when it was chosen (zero: not predicted).
  BudgetReason budget_reason = BudgetReason::kRequested;
  absl::Duration predicted = absl::ZeroDuration();
  // Admission to the start of the request's batch; the batch's model forward; receipt to answer.
  absl::Duration queue_delay;
  absl::Duration compute;
  absl::Duration total;
  // Requests in the batch that ran this one.
  int64_t batch_size = 0;
  // Tokens attended over, and before truncation.
  int64_t tokens = 0;
  int64_t input_tokens = 0;
  // Per layer, when return_statistics was set and MiTA ran; empty otherwise.
  std::vector<kernels::MitaItemStatistics> statistics;
};

}  // namespace mita::server
