// Budget choice (see latency_planner.h).
#include "server/latency_planner.h"

#include <algorithm>

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
    // The step down that saves the most.
    size_t best = members.size();
    absl::Duration best_time = predicted;
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i].choice + 1 >= members[i].allowed.size()) continue;
      ++members[i].choice;
      const absl::Duration lowered = predict(Items(members));
      --members[i].choice;
      if (lowered < best_time) {
        best = i;
        best_time = lowered;
      }
    }
    if (best == members.size()) break;  // nothing lowers the prediction any further
    ++members[best].choice;
    predicted = best_time;
    ++steps;
  }
  return steps;
}

}  // namespace mita::server
