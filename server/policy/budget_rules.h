// A client's rules applied to one request (server/engine/inference_engine.cc calls these): before preparation the
// budget it asked for (PERMISSION_DENIED outside the rules; the client's default preset for the model's default; a
// latency target's choices narrowed to the allowed ones) and its quota (RESOURCE_EXHAUSTED with the time to wait);
// after preparation the token-dependent rule (full attention up to a token count) and the latency target's choices
// as the batch item carries them.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "models/budget.h"
#include "models/classifier.h"
#include "server/policy/policy_holder.h"

namespace mita::server::policy {

// The rule a refusal names (the label rule of mita_client_policy_refusals_total).
enum class PolicyRule {
  kPreset = 0,               // the preset is not in the client's presets
  kExpertCount = 1,          // expert count over max_expert_count
  kExpertWidth = 2,          // expert width over max_expert_width
  kFullAttention = 3,        // full attention with full_attention_max_tokens 0
  kFullAttentionTokens = 4,  // full attention on more tokens than full_attention_max_tokens
  kLatencyTarget = 5,        // none of a latency target's budgets is allowed
};
inline constexpr int kNumPolicyRules = 6;
// "preset", "max_expert_count", "max_expert_width", "full_attention", "full_attention_max_tokens",
// "latency_target".
const char* PolicyRuleName(PolicyRule rule);

// Applies `client`'s rules to `*budget`, a request for a model with `knobs`, before its input is prepared: the
// client's default_preset replaces a request for the model's default when the model has that preset; a fixed budget
// (preset, expert budget, full attention) outside the rules is refused; a latency target must leave at least one
// allowed budget of the model's order. A budget the model itself refuses passes (Classifier::Prepare words it).
// Errors: PERMISSION_DENIED naming the client and the rule ("client 'free' may use expert width up to 16; asked
// 32"), with `*rule` set.
absl::Status AdmitBudgetRequest(const ClientAdmission& client, const models::BudgetKnobs& knobs,
                                models::BudgetRequest* budget, PolicyRule* rule);

// Applies `client`'s rules to a prepared `*item` of a request for `budget` (as AdmitBudgetRequest left it) on a
// model with `knobs`: full attention only up to full_attention_max_tokens tokens; a latency target's allowed budgets
// (item->allowed_budgets, most accurate first) narrowed to those within the rules, its budget and compute units
// following the most accurate one left. Errors: PERMISSION_DENIED naming the client and the rule, with `*rule` set.
absl::Status AdmitPreparedItem(const ClientAdmission& client, const models::BudgetKnobs& knobs,
                               const models::BudgetRequest& budget, models::BatchItem* item, PolicyRule* rule);

// OK when `client` has no quota or its quota lets a request in now. Errors: RESOURCE_EXHAUSTED "client 'batch' is
// over its quota of 20000 compute units/s (burst 40000); retry in 120 ms".
absl::Status CheckQuota(const ClientAdmission& client);

}  // namespace mita::server::policy
