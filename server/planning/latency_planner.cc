// Budget choice (see latency_planner.h).
#include "server/planning/latency_planner.h"

#include "base/percentile.h"

#include <algorithm>
#include <cmath>

#include "base/percentile.h"

namespace mita::server {
namespace {

std::vector<CostItem> Items(const std::vector<BatchMember>& members) {
  std::vector<CostItem> items;
  items.reserve(members.size());
  for (const BatchMember& member : members) items.push_back(CostItem{member.tokens, member.allowed[member.choice]});
  return items;
}

}  // namespace

BudgetChoice ChooseBudget(absl::Span<const models::AttentionBudget> allowed, absl::Duration wait,
                          absl::Duration time_left, const ComputeAtBudget& compute) {
  BudgetChoice choice;
  for (size_t i = 0; i < allowed.size(); ++i) {
    choice.index = i;
    choice.compute = compute(allowed[i]);
    choice.predicted = wait + choice.compute;
    choice.meets = choice.predicted <= time_left;
    if (choice.meets) return choice;
  }
  return choice;
}

int LowerToFit(std::vector<BatchMember>& members, const PredictBatch& predict) {
  if (members.empty()) return 0;
  // The members the batch can serve in time: those whose time left covers the batch with everyone at the floor.
  std::vector<BatchMember> floors = members;
  for (BatchMember& member : floors) member.choice = member.allowed.size() - 1;
  const absl::Duration fastest = predict(Items(floors));
  absl::Duration bound = absl::InfiniteDuration();
  for (const BatchMember& member : members) {
    if (member.time_left >= fastest) bound = std::min(bound, member.time_left);
  }
  int steps = 0;
  absl::Duration predicted = predict(Items(members));
  while (predicted > bound) {
    // The step down that saves the most. A member's step is to its next less accurate budget that is cheaper
    // (an order may rank a dearer budget, e.g. full attention, below a cheaper one).
    size_t best = members.size();
    size_t best_choice = 0;
    absl::Duration best_time = predicted;
    for (size_t i = 0; i < members.size(); ++i) {
      const size_t current = members[i].choice;
      for (size_t next = current + 1; next < members[i].allowed.size(); ++next) {
        members[i].choice = next;
        const absl::Duration lowered = predict(Items(members));
        members[i].choice = current;
        if (lowered >= predicted) continue;
        if (lowered < best_time) {
          best = i;
          best_choice = next;
          best_time = lowered;
        }
        break;
      }
    }
    if (best == members.size()) break;  // nothing lowers the prediction any further
    members[best].choice = best_choice;
    predicted = best_time;
    ++steps;
  }
  return steps;
}

PlanningSlack::PlanningSlack(double quantile, size_t window, absl::Duration horizon)
    : quantile_(std::clamp(quantile, 1e-6, 1.0)), window_(std::max<size_t>(1, window)), horizon_(horizon) {}

void PlanningSlack::Observe(absl::Time at, absl::Duration lateness) {
  recent_.emplace_back(at, absl::ToDoubleSeconds(lateness));
  if (recent_.size() > window_) recent_.pop_front();
  stale_ = true;
}

absl::Duration PlanningSlack::SlackAt(absl::Time now) {
  while (!recent_.empty() && recent_.front().first < now - horizon_) {
    recent_.pop_front();
    stale_ = true;
  }
  if (stale_) Update();
  return slack_;
}

void PlanningSlack::Update() {
  stale_ = false;
  slack_ = absl::ZeroDuration();
  if (recent_.empty()) return;
  sorted_.clear();
  for (const auto& [at, lateness] : recent_) sorted_.push_back(lateness);
  slack_ = absl::Seconds(std::max(0.0, Percentile(sorted_, 100 * quantile_)));
}

}  // namespace mita::server
