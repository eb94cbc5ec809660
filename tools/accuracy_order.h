// The evaluation tools' --write_accuracy_order: the measured budgets, sorted, written into a package's
// config.json as attention.accuracy_order (models/model_config.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "models/budget.h"

namespace mita::tools {

// One evaluated budget and its measured held-out accuracy in [0, 1].
struct MeasuredAccuracy {
  models::AttentionBudget budget;
  double accuracy = 0;
};

// `measured` in declared order: accuracy rounded to 4 decimals (as written), most accurate first; at equal
// accuracy the budget with fewer ComputeUnits at `tokens` tokens first (the better choice at equal accuracy),
// then the given order. A budget given twice is kept once, with its first accuracy.
std::vector<MeasuredAccuracy> SortByAccuracy(const std::vector<MeasuredAccuracy>& measured, int64_t tokens);

// Rewrites <package_directory>/config.json with attention.accuracy_order set to `order` (kept in that order,
// each {"budget": BudgetText, "accuracy": a}): every other key stays in its place, 2-space indentation, a final
// newline. The new text must parse with the package's own parser (ParseVitConfig or ParseDocumentConfig) before
// it replaces the file (written beside it, then renamed). Returns the parsed order (with DeclaredBudgetName's
// names). Errors: NOT_FOUND for an unreadable config.json, the parser's INVALID_ARGUMENT, INTERNAL when the
// file cannot be written.
absl::StatusOr<std::vector<models::DeclaredBudget>> WriteAccuracyOrder(const std::string& package_directory,
                                                                      const std::vector<MeasuredAccuracy>& order);

}  // namespace mita::tools
