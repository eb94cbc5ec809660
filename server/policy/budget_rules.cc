// A client's rules applied to one request (see budget_rules.h).
#include "server/policy/budget_rules.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mita::server::policy {
namespace {

// Why `budget` (as resolved, before ApplyBudget; `preset` its preset name, "" for one named by its values) is
// outside `client`'s rules for an input of `tokens` tokens (nullopt: not known yet); nullopt when it is allowed.
struct Refusal {
  PolicyRule rule;
  std::string message;
};

std::optional<Refusal> BudgetRefusal(const ClientAdmission& client, const models::AttentionBudget& budget,
                                     const std::string& preset, std::optional<int64_t> tokens) {
  const ClientRules& rules = client.rules;
  const std::string who = absl::StrCat("client '", client.name, "'");
  if (!preset.empty() && rules.presets.has_value() &&
      std::find(rules.presets->begin(), rules.presets->end(), preset) == rules.presets->end()) {
    return Refusal{
        PolicyRule::kPreset,
        absl::StrCat(who, " may not use preset '", preset, "' (policy: presets ",
                     rules.presets->empty() ? std::string("none") : absl::StrJoin(*rules.presets, ", "), ")")};
  }
  if (budget.full_attention) {
    if (!rules.full_attention_max_tokens.has_value()) return std::nullopt;
    if (*rules.full_attention_max_tokens == 0) {
      return Refusal{PolicyRule::kFullAttention,
                     absl::StrCat(who, " may not use full attention (policy: full_attention_max_tokens 0)")};
    }
    if (tokens.has_value() && *tokens > *rules.full_attention_max_tokens) {
      return Refusal{PolicyRule::kFullAttentionTokens,
                     absl::StrCat(who, " may use full attention up to ", *rules.full_attention_max_tokens,
                                  " tokens (policy: full_attention_max_tokens); the input has ", *tokens)};
    }
    return std::nullopt;
  }
  if (rules.max_expert_count.has_value() && budget.expert_count > *rules.max_expert_count) {
    return Refusal{PolicyRule::kExpertCount, absl::StrCat(who, " may use expert count up to ", *rules.max_expert_count,
                                                          "; asked ", budget.expert_count)};
  }
  if (rules.max_expert_width.has_value() && budget.expert_width > *rules.max_expert_width) {
    return Refusal{PolicyRule::kExpertWidth, absl::StrCat(who, " may use expert width up to ", *rules.max_expert_width,
                                                          "; asked ", budget.expert_width)};
  }
  return std::nullopt;
}

absl::Status Deny(const Refusal& refusal, PolicyRule* rule) {
  *rule = refusal.rule;
  return absl::PermissionDeniedError(refusal.message);
}

// The refusal of a latency target none of whose budgets is allowed: each budget with its reason.
absl::Status DenyLatencyTarget(const ClientAdmission& client, const std::vector<std::string>& reasons,
                               PolicyRule* rule) {
  *rule = PolicyRule::kLatencyTarget;
  return absl::PermissionDeniedError(
      absl::StrCat("client '", client.name,
                   "' may use none of the budgets its latency target allows: ", absl::StrJoin(reasons, "; ")));
}

std::string NameOf(const models::ResolvedBudget& budget) {
  return budget.preset.empty() ? models::BudgetText(budget.budget) : budget.preset;
}

}  // namespace

const char* PolicyRuleName(PolicyRule rule) {
  switch (rule) {
    case PolicyRule::kPreset:
      return "preset";
    case PolicyRule::kExpertCount:
      return "max_expert_count";
    case PolicyRule::kExpertWidth:
      return "max_expert_width";
    case PolicyRule::kFullAttention:
      return "full_attention";
    case PolicyRule::kFullAttentionTokens:
      return "full_attention_max_tokens";
    case PolicyRule::kLatencyTarget:
      return "latency_target";
  }
  return "preset";
}

absl::Status AdmitBudgetRequest(const ClientAdmission& client, const models::BudgetKnobs& knobs,
                                models::BudgetRequest* budget, PolicyRule* rule) {
  using Choice = models::BudgetRequest::Choice;
  const bool asks_default =
      budget->choice == Choice::kDefault ||
      (budget->choice == Choice::kPreset && (budget->preset.empty() || budget->preset == "default") &&
       knobs.presets.count(budget->preset) == 0);
  if (asks_default && !client.rules.default_preset.empty() && knobs.presets.count(client.rules.default_preset) > 0) {
    budget->choice = Choice::kPreset;
    budget->preset = client.rules.default_preset;
  }
  // A budget the model refuses is the model's INVALID_ARGUMENT, worded by Prepare.
  absl::StatusOr<std::vector<models::ResolvedBudget>> allowed = models::AllowedBudgets(knobs, *budget);
  if (!allowed.ok()) return absl::OkStatus();
  if (budget->choice != Choice::kLatencyTarget) {
    const models::ResolvedBudget& resolved = allowed->front();
    if (std::optional<Refusal> refusal = BudgetRefusal(client, resolved.budget, resolved.preset, std::nullopt)) {
      return Deny(*refusal, rule);
    }
    return absl::OkStatus();
  }
  std::vector<std::string> reasons;
  for (const models::ResolvedBudget& choice : *allowed) {
    std::optional<Refusal> refusal = BudgetRefusal(client, choice.budget, choice.preset, std::nullopt);
    if (!refusal.has_value()) return absl::OkStatus();
    reasons.push_back(absl::StrCat(NameOf(choice), ": ", refusal->message));
  }
  return DenyLatencyTarget(client, reasons, rule);
}

absl::Status AdmitPreparedItem(const ClientAdmission& client, const models::BudgetKnobs& knobs,
                               const models::BudgetRequest& budget, models::BatchItem* item, PolicyRule* rule) {
  if (!item->latency_target) {
    const models::ResolvedBudget requested{item->requested_budget, item->budget.preset};
    if (std::optional<Refusal> refusal = BudgetRefusal(client, requested.budget, requested.preset, item->tokens)) {
      return Deny(*refusal, rule);
    }
    return absl::OkStatus();
  }
  // The budgets Prepare applied to the item, in the same order as before ApplyBudget (the rules read the budget
  // asked for, not its application to a short input).
  absl::StatusOr<std::vector<models::ResolvedBudget>> asked = models::AllowedBudgets(knobs, budget);
  if (!asked.ok() || asked->size() != item->allowed_budgets.size()) {
    return absl::InternalError("the latency target's budgets changed between submission and preparation");
  }
  std::vector<models::ResolvedBudget> kept;
  std::optional<models::AttentionBudget> most_accurate;
  std::vector<std::string> reasons;
  for (size_t i = 0; i < asked->size(); ++i) {
    std::optional<Refusal> refusal = BudgetRefusal(client, (*asked)[i].budget, (*asked)[i].preset, item->tokens);
    if (refusal.has_value()) {
      reasons.push_back(absl::StrCat(NameOf((*asked)[i]), ": ", refusal->message));
      continue;
    }
    if (!most_accurate.has_value()) most_accurate = (*asked)[i].budget;
    kept.push_back(item->allowed_budgets[i]);
  }
  if (kept.empty()) return DenyLatencyTarget(client, reasons, rule);
  if (kept.size() == item->allowed_budgets.size()) return absl::OkStatus();
  item->allowed_budgets = std::move(kept);
  item->budget = item->allowed_budgets.front();
  item->requested_budget = *most_accurate;
  item->compute_units = models::ComputeUnits(item->tokens, item->budget.budget);
  return absl::OkStatus();
}

absl::Status CheckQuota(const ClientAdmission& client) {
  if (client.quota == nullptr) return absl::OkStatus();
  const absl::Duration wait = client.quota->TimeUntilAdmitted();
  if (wait == absl::ZeroDuration()) return absl::OkStatus();
  const ClientRules::Quota quota = client.quota->quota();
  const int64_t wait_ms = static_cast<int64_t>(std::ceil(absl::ToDoubleMilliseconds(wait)));
  return absl::ResourceExhaustedError(absl::StrCat(
      "client '", client.name, "' is over its quota of ", quota.compute_units_per_second, " compute units/s (burst ",
      quota.burst_compute_units, "); retry in ", std::max<int64_t>(wait_ms, 1), " ms"));
}

}  // namespace mita::server::policy
