// Budget resolution (see budget.h).
#include "models/budget.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/status_macros.h"
#include "models/request_error.h"

namespace mita::models {
namespace {

// A request value quoted in an error: at most 64 bytes of it.
std::string Quote(absl::string_view value) {
  constexpr size_t kMax = 64;
  return value.size() > kMax ? absl::StrCat("'", value.substr(0, kMax), "...'") : absl::StrCat("'", value, "'");
}

}  // namespace

std::optional<FieldProblem> KnobProblem(const BudgetKnobs& knobs, RequestField field, int64_t value) {
  if (field == RequestField::kExpertCount) {
    const std::vector<int64_t>& allowed = knobs.allowed_expert_counts;
    if (!allowed.empty()) {
      if (std::find(allowed.begin(), allowed.end(), value) != allowed.end()) return std::nullopt;
      return FieldProblem{field, -1, absl::StrCat(value, " is not allowed: use one of ", absl::StrJoin(allowed, ", "))};
    }
    if (value >= knobs.min_expert_count && value <= knobs.max_expert_count) return std::nullopt;
    return FieldProblem{field, -1,
                        absl::StrCat(value, " is out of range: allowed [", knobs.min_expert_count, ", ",
                                     knobs.max_expert_count, "]")};
  }
  if (value >= knobs.min_expert_width && value <= knobs.max_expert_width) return std::nullopt;
  return FieldProblem{field, -1,
                      absl::StrCat(value, " is out of range: allowed [", knobs.min_expert_width, ", ",
                                   knobs.max_expert_width, "]")};
}

absl::Status CheckBudget(const BudgetKnobs& knobs, const AttentionBudget& budget) {
  if (budget.full_attention) return absl::OkStatus();
  std::vector<FieldProblem> problems;
  for (const auto& [field, value] : {std::pair{RequestField::kExpertCount, budget.expert_count},
                                     std::pair{RequestField::kExpertWidth, budget.expert_width}}) {
    if (std::optional<FieldProblem> problem = KnobProblem(knobs, field, value)) problems.push_back(*problem);
  }
  if (problems.empty()) return absl::OkStatus();
  return InvalidRequest(std::move(problems));
}

absl::StatusOr<ResolvedBudget> ResolveBudget(const BudgetKnobs& knobs, const BudgetRequest& request) {
  switch (request.choice) {
    case BudgetRequest::Choice::kDefault:
      return ResolvedBudget{knobs.default_budget, "default"};
    case BudgetRequest::Choice::kPreset: {
      auto it = knobs.presets.find(request.preset);
      if (it != knobs.presets.end()) return ResolvedBudget{it->second, it->first};
      // "" (what proto3 clients send for a string they did not fill in) and "default" (the name responses give
      // the default budget) mean the default budget, unless the model declares a preset of that name.
      if (request.preset.empty() || request.preset == "default") return ResolvedBudget{knobs.default_budget, "default"};
      std::vector<std::string> names;
      for (const auto& [name, preset] : knobs.presets) names.push_back(name);
      return InvalidRequest(RequestField::kPreset,
                            absl::StrCat("unknown preset ", Quote(request.preset), "; available: ",
                                         names.empty() ? std::string("none (ask for an expert budget or full attention)")
                                                       : absl::StrJoin(names, ", ")));
    }
    case BudgetRequest::Choice::kExperts: {
      // A knob left at 0 takes the model's default, so a client may set only the expert count or only the
      // expert width. Negative values are errors (CheckBudget names the knob and the range).
      const AttentionBudget& fallback = knobs.default_budget;
      if (fallback.full_attention && (request.expert_count == 0 || request.expert_width == 0)) {
        return InvalidRequest(RequestField::kExperts,
                              "the model's default is full attention, so set both expert_count and expert_width");
      }
      AttentionBudget budget;
      budget.expert_count = request.expert_count == 0 ? fallback.expert_count : request.expert_count;
      budget.expert_width = request.expert_width == 0 ? fallback.expert_width : request.expert_width;
      if (absl::Status status = CheckBudget(knobs, budget); !status.ok()) return status;
      return ResolvedBudget{budget, ""};
    }
    case BudgetRequest::Choice::kFullAttention: {
      if (!knobs.full_attention_supported) {
        return InvalidRequest(RequestField::kBudget, "this model does not run full attention");
      }
      AttentionBudget budget;
      budget.full_attention = true;
      return ResolvedBudget{budget, ""};
    }
    case BudgetRequest::Choice::kLatencyTarget: {
      ASSIGN_OR_RETURN(std::vector<ResolvedBudget> allowed, AllowedBudgets(knobs, request));
      return allowed.front();
    }
  }
  return InvalidRequest(RequestField::kBudget, "unknown budget choice");
}

absl::StatusOr<std::vector<ResolvedBudget>> AllowedBudgets(const BudgetKnobs& knobs, const BudgetRequest& request) {
  if (request.choice != BudgetRequest::Choice::kLatencyTarget) {
    ASSIGN_OR_RETURN(ResolvedBudget resolved, ResolveBudget(knobs, request));
    return std::vector<ResolvedBudget>{std::move(resolved)};
  }
  if (request.latency_target < absl::ZeroDuration()) {
    return InvalidRequest(RequestField::kLatencyTarget,
                          absl::StrCat(absl::ToInt64Milliseconds(request.latency_target),
                                       " ms is out of range: allowed >= 0 (0 means the call's deadline)"));
  }
  if (knobs.accuracy_order.empty()) {
    return InvalidRequest(RequestField::kBudget, "this model declares no budgets to choose from");
  }
  // The floor may name a budget of the order by its order name, a preset's name, "default", or its text
  // ("9x16", "full").
  std::optional<AttentionBudget> floor_budget;
  if (auto preset = knobs.presets.find(request.floor); preset != knobs.presets.end()) {
    floor_budget = preset->second;
  } else if (request.floor == "default") {
    floor_budget = knobs.default_budget;
  } else if (absl::StatusOr<AttentionBudget> parsed = ParseBudget(request.floor); parsed.ok()) {
    floor_budget = *parsed;
  }
  std::vector<ResolvedBudget> allowed;
  for (const DeclaredBudget& declared : knobs.accuracy_order) {
    // The echoed name: a preset's (or "default"), none for a budget named by its text.
    const bool named = declared.name == "default" || knobs.presets.count(declared.name) > 0;
    allowed.push_back(ResolvedBudget{declared.budget, named ? declared.name : ""});
    if (!request.floor.empty() &&
        (declared.name == request.floor || (floor_budget.has_value() && *floor_budget == declared.budget))) {
      return allowed;
    }
  }
  if (request.floor.empty()) return allowed;
  std::vector<std::string> names;
  for (const DeclaredBudget& declared : knobs.accuracy_order) names.push_back(declared.name);
  return InvalidRequest(RequestField::kBudgetFloor, absl::StrCat("unknown budget ", Quote(request.floor),
                                                                 "; the model's budgets, most accurate first: ",
                                                                 absl::StrJoin(names, ", ")));
}

std::vector<DeclaredBudget> DefaultAccuracyOrder(const BudgetKnobs& knobs, int64_t tokens) {
  std::vector<DeclaredBudget> order;
  auto add = [&](const AttentionBudget& budget) {
    for (const DeclaredBudget& existing : order) {
      if (existing.budget == budget) return;
    }
    order.push_back(DeclaredBudget{DeclaredBudgetName(knobs, budget), budget, -1});
  };
  if (knobs.full_attention_supported) add(AttentionBudget{true, 0, 0});
  add(knobs.default_budget);
  for (const auto& [name, budget] : knobs.presets) add(budget);
  std::stable_sort(order.begin(), order.end(), [tokens](const DeclaredBudget& a, const DeclaredBudget& b) {
    return ComputeUnits(tokens, ApplyBudget(a.budget, tokens)) > ComputeUnits(tokens, ApplyBudget(b.budget, tokens));
  });
  return order;
}

AttentionBudget ApplyBudget(const AttentionBudget& budget, int64_t tokens) {
  if (budget.full_attention) return budget;
  AttentionBudget applied = budget;
  applied.expert_count = std::min(budget.expert_count, tokens);
  applied.expert_width = std::min(budget.expert_width, tokens);
  return applied;
}

int64_t ComputeUnits(int64_t tokens, const AttentionBudget& budget) {
  const int64_t width = budget.full_attention ? tokens : budget.expert_count + budget.expert_width;
  return tokens * std::max<int64_t>(width, 1);
}

absl::StatusOr<AttentionBudget> ParseBudget(absl::string_view text) {
  AttentionBudget budget;
  if (text == "full") {
    budget.full_attention = true;
    return budget;
  }
  const std::vector<std::string> parts = absl::StrSplit(text, 'x');
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &budget.expert_count) ||
      !absl::SimpleAtoi(parts[1], &budget.expert_width)) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget '", text, "' is not expert_count x expert_width (e.g. 9x16) or 'full'"));
  }
  return budget;
}

std::string BudgetName(const AttentionBudget& budget) {
  if (budget.full_attention) return "full attention";
  return absl::StrCat("MiTA m=", budget.expert_count, " k=", budget.expert_width);
}

std::string BudgetText(const AttentionBudget& budget) {
  if (budget.full_attention) return "full";
  return absl::StrCat(budget.expert_count, "x", budget.expert_width);
}

std::string DeclaredBudgetName(const BudgetKnobs& knobs, const AttentionBudget& budget) {
  if (budget == knobs.default_budget) return "default";
  for (const auto& [name, preset] : knobs.presets) {
    if (preset == budget) return name;
  }
  return BudgetText(budget);
}

}  // namespace mita::models
