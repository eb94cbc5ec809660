// Budget choice for latency targets and deadlines (docs/serving.md "Latency targets"): pure functions over
// predicted times, so that the policy is tested without a model or a clock, and the slack of recent lateness.
// LanePlanner (lane_planner.h) calls them at admission (ChooseBudget) and when a batch starts (LowerToFit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "models/budget.h"
#include "server/planning/cost_model.h"

namespace mita::server {

// Why a request ran with its budget (mita.v1 BudgetReason; the mita_budget_choices_total metric's label).
enum class BudgetReason {
  kRequested,            // the request named it (or none: the default)
  kMostAccurate,         // latency target: the most accurate declared budget was predicted to meet it
  kLoweredAtAdmission,   // latency target: a less accurate one, the most accurate predicted to meet it
  kLoweredAtBatchStart,  // latency target: lowered again when its batch started, to finish within it
};
inline constexpr int kNumBudgetReasons = 4;

// The metric label of `reason`: "requested", "most_accurate", "lowered_at_admission", "lowered_at_batch_start".
inline const char* BudgetReasonName(BudgetReason reason) {
  switch (reason) {
    case BudgetReason::kRequested:
      return "requested";
    case BudgetReason::kMostAccurate:
      return "most_accurate";
    case BudgetReason::kLoweredAtAdmission:
      return "lowered_at_admission";
    case BudgetReason::kLoweredAtBatchStart:
      return "lowered_at_batch_start";
  }
  return "requested";
}

// The outcome of ChooseBudget.
struct BudgetChoice {
  // Index into the allowed budgets.
  size_t index = 0;
  // Predicted queue wait plus compute at that budget.
  absl::Duration predicted = absl::ZeroDuration();
  absl::Duration compute = absl::ZeroDuration();
  // predicted <= time_left.
  bool meets = true;
};

// Predicted compute of one request at `budget` (applied) in its batch.
using ComputeAtBudget = std::function<absl::Duration(const models::AttentionBudget& budget)>;

// The most accurate budget of `allowed` (most accurate first, at least one) whose `wait` + `compute(budget)` is at
// most `time_left`; when none is, the last one (the floor) with meets = false. `time_left` may be infinite.
BudgetChoice ChooseBudget(absl::Span<const models::AttentionBudget> allowed, absl::Duration wait,
                          absl::Duration time_left, const ComputeAtBudget& compute);

// One request of a batch about to start, as LowerToFit sees it.
struct BatchMember {
  int64_t tokens = 0;
  // Budgets it may run with (applied), most accurate first: one for a fixed budget.
  std::vector<models::AttentionBudget> allowed;
  // Index into `allowed` of the budget it would run with now; LowerToFit may raise it (a less accurate one).
  size_t choice = 0;
  // Until its target or deadline; infinite when it has neither.
  absl::Duration time_left = absl::InfiniteDuration();
};

// Predicted compute of a batch of `items`.
using PredictBatch = std::function<absl::Duration(absl::Span<const CostItem> items)>;

// Degradation when a batch starts: while the batch's predicted compute is over the time left of a member that it
// can still serve in time, lowers one member a step (to its next less accurate budget that is cheaper), the one
// whose step saves the most predicted compute (ties: the first). A member that would miss even with every member at its floor does not hold the
// others down. Returns the steps taken (0 when the batch fits as it is).
int LowerToFit(std::vector<BatchMember>& members, const PredictBatch& predict);

// How much later than predicted a lane's planned requests were answered: a high quantile of the lateness (answer
// time since admission less the queue wait plus compute predicted then) over the last `window` of them answered
// within `horizon`. Admission plans with time left less this slack, so that a request admitted at the edge of its
// deadline still makes it when the prediction is as wrong as it recently was (an unbiased prediction alone misses
// about half of those). The horizon keeps it live: a slack that refuses every request gets no new answers, and
// its samples expire. Not thread-safe (its lane guards it).
class PlanningSlack {
 public:
  PlanningSlack() = default;
  // `quantile` in (0, 1]; `window` >= 1 requests; `horizon` > 0.
  PlanningSlack(double quantile, size_t window, absl::Duration horizon);

  // One planned request's lateness (negative when it was answered sooner than predicted), answered at `at`
  // (non-decreasing across calls).
  void Observe(absl::Time at, absl::Duration lateness);
  // The `quantile` of the lateness answered after now - horizon, at least 0; 0 when there is none.
  absl::Duration SlackAt(absl::Time now);

 private:
  // Recomputes slack_ from recent_.
  void Update();

  double quantile_ = 0.99;
  size_t window_ = 512;
  absl::Duration horizon_ = absl::Seconds(2);
  std::deque<std::pair<absl::Time, double>> recent_;  // (answered, lateness in seconds), oldest first
  std::vector<double> sorted_;                        // Update's scratch copy
  absl::Duration slack_ = absl::ZeroDuration();
  bool stale_ = false;  // recent_ changed since slack_ was computed (computed when asked, not per answer)
};

}  // namespace mita::server
