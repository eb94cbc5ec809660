// One lane of a model (see lane.h).
#include "server/engine/lane.h"

#include <utility>
#include <vector>

#include "kernels/runtime_environment.h"
#include "kernels/status_macros.h"

namespace mita::server {

std::vector<models::AttentionBudget> BatchTask::allowed() const {
  std::vector<models::AttentionBudget> budgets;
  for (const models::ResolvedBudget& choice : item.allowed_budgets) budgets.push_back(choice.budget);
  if (budgets.empty()) budgets.push_back(item.budget.budget);
  return budgets;
}

absl::StatusOr<std::unique_ptr<Lane>> Lane::Create(BatcherOptions batching, PlanningOptions planning,
                                                   std::unique_ptr<CostModel> cost, int intra_op_threads,
                                                   const Clock* clock, ProcessBatch process,
                                                   QueueDepthListener depth) {
  if (cost == nullptr || clock == nullptr || !process) {
    return absl::InvalidArgumentError("cost, clock and process must be set");
  }
  if (intra_op_threads < 0) return absl::InvalidArgumentError("intra_op_threads must be >= 0");
  std::unique_ptr<Lane> lane(new Lane(clock, std::move(cost), intra_op_threads, batching, planning));
  Lane* self = lane.get();
  DynamicBatcher<BatchTask>::ProcessBatchFn run = [self, process = std::move(process)](Batch<BatchTask> batch) {
    if (self->intra_op_threads_ > 0) kernels::SetCallingThreadIntraOpThreads(self->intra_op_threads_);
    process(*self, std::move(batch));
  };
  const BatchThreadIdle idle{kIdleBatchThreadKeepsTeamFor, [] { kernels::ReleaseCallingThreadIntraOpTeam(); }};
  ASSIGN_OR_RETURN(lane->batcher_, DynamicBatcher<BatchTask>::Create(std::move(batching), std::move(run), clock,
                                                                     std::move(depth), idle));
  return lane;
}

absl::Status Lane::Admit(std::unique_ptr<BatchTask>* task, QueueTicket* ticket, PlannedBudget* plan,
                         AdmissionRejection* rejection, const std::function<void(const BatchTask&)>& planned) {
  BatchTask& queued = **task;
  const PlanningRequest request{queued.item.tokens, queued.allowed(), queued.item.latency_target, queued.end,
                                queued.target_binds};
  const absl::Time now = clock_->Now();
  absl::Status admitted;
  {
    absl::MutexLock lock(&mu_);
    admitted = planner_.Admit(request, batcher_->load(), now, plan, rejection);
  }
  queued.plan = *plan;
  if (planned) planned(queued);
  RETURN_IF_ERROR(admitted);
  uint64_t id = 0;
  RETURN_IF_ERROR(batcher_->Submit(task, rejection, &id));
  // `*task` now belongs to the batcher (and may already be running).
  *ticket = QueueTicket{this, id};
  return absl::OkStatus();
}

absl::Status Lane::AdmitBeforePreparation(absl::Time end, bool target_binds, absl::Span<const CostItem> cheapest,
                                          AdmissionRejection* rejection) {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  return planner_.AdmitBeforePreparation(end, target_binds, cheapest, batcher_->load(), now, rejection);
}

std::unique_ptr<BatchTask> Lane::Cancel(uint64_t id) { return batcher_->Cancel(id); }

int Lane::StartBatch(absl::Span<BatchTask* const> tasks, absl::Time start, StartedBatch* started) {
  std::vector<StartingMember> members;
  members.reserve(tasks.size());
  for (const BatchTask* task : tasks) {
    members.push_back(StartingMember{task->item.tokens, task->allowed(), task->plan.choice,
                                     task->item.latency_target, task->end});
  }
  std::vector<size_t> choices;
  {
    absl::MutexLock lock(&mu_);
    choices = planner_.StartBatch(members, start, started);
  }
  int lowered = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    if (choices[i] == tasks[i]->plan.choice) continue;
    tasks[i]->plan.choice = choices[i];
    tasks[i]->plan.reason = BudgetReason::kLoweredAtBatchStart;
    ++lowered;
  }
  return lowered;
}

double Lane::FinishBatch(const StartedBatch& started, absl::Span<BatchTask* const> answered, absl::Time end,
                         absl::Duration compute, bool learn) {
  absl::MutexLock lock(&mu_);
  ObserveLateness(answered, end);
  return planner_.FinishBatch(started, compute, learn);
}

void Lane::Expired(absl::Span<BatchTask* const> tasks, absl::Time start) {
  absl::MutexLock lock(&mu_);
  ObserveLateness(tasks, start);
}

void Lane::ObserveLateness(absl::Span<BatchTask* const> tasks, absl::Time at) {
  for (const BatchTask* task : tasks) {
    if (task->plan.planned()) planner_.ObserveLateness(at, at - task->plan.planned_at - task->plan.predicted);
  }
}

}  // namespace mita::server
