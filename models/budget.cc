// Budget resolution (see budget.h).
#include "models/budget.h"

#include <algorithm>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "models/request_error.h"

namespace mita::models {
namespace {

// A request value quoted in an error: at most 64 bytes of it.
std::string Quote(absl::string_view value) {
  constexpr size_t kMax = 64;
  return value.size() > kMax ? absl::StrCat("'", value.substr(0, kMax), "...'") : absl::StrCat("'", value, "'");
}

}  // namespace

absl::Status CheckBudget(const BudgetKnobs& knobs, const AttentionBudget& budget) {
  if (budget.full_attention) return absl::OkStatus();
  std::vector<FieldProblem> problems;
  const std::vector<int64_t>& allowed = knobs.allowed_expert_counts;
  if (!allowed.empty()) {
    if (std::find(allowed.begin(), allowed.end(), budget.expert_count) == allowed.end()) {
      problems.push_back({RequestField::kExpertCount, -1,
                          absl::StrCat(budget.expert_count, " is not allowed: use one of ", absl::StrJoin(allowed, ", "))});
    }
  } else if (budget.expert_count < knobs.min_expert_count || budget.expert_count > knobs.max_expert_count) {
    problems.push_back({RequestField::kExpertCount, -1,
                        absl::StrCat(budget.expert_count, " is out of range: allowed [", knobs.min_expert_count, ", ",
                                     knobs.max_expert_count, "]")});
  }
  if (budget.expert_width < knobs.min_expert_width || budget.expert_width > knobs.max_expert_width) {
    problems.push_back({RequestField::kExpertWidth, -1,
                        absl::StrCat(budget.expert_width, " is out of range: allowed [", knobs.min_expert_width, ", ",
                                     knobs.max_expert_width, "]")});
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
  }
  return InvalidRequest(RequestField::kBudget, "unknown budget choice");
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

}  // namespace mita::models
