// One lane of a model: a queue with its batch threads (DynamicBatcher, each running forwards on the lane's share of
// the intra-op threads), its cost model, and the planner of what enters it (LanePlanner). Admission plans a
// request and queues it (and can refuse one before its input is prepared); the queue's own sums are the one ledger
// of queued work; batch start lowers late budgets and batch finish learns. A model has one lane, or two when its
// inputs can be long (ModelRunner): then a long input's forward runs beside the short requests' batches, not ahead
// of them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "models/classifier.h"
#include "server/planning/batcher.h"
#include "server/planning/clock.h"
#include "server/planning/cost_model.h"
#include "server/planning/lane_planner.h"

namespace mita::server {

class Request;

// What a lane queues for one request: its prepared item (as Classifier::Prepare made it, never edited), the
// request it answers, when that must be answered, and the lane's plan for it (a value: its budget choice).
struct BatchTask {
  models::BatchItem item;
  std::shared_ptr<Request> request;
  // Request::PlannedEnd: its latency target's end or deadline, the earlier, and whether the target binds.
  absl::Time end = absl::InfiniteFuture();
  bool target_binds = false;
  PlannedBudget plan;
  // Its client's priority (server/policy/client_policy.h): the batcher batches higher priorities first.
  int client_priority = 0;

  // The applied budget it runs with: the planned choice of its allowed budgets, or its one budget.
  const models::ResolvedBudget& budget() const {
    return plan.choice < item.allowed_budgets.size() ? item.allowed_budgets[plan.choice] : item.budget;
  }
  // The budgets it may run with, most accurate first.
  std::vector<models::AttentionBudget> allowed() const;

  // Batcher units (server/planning/batcher.h).
  int64_t tokens() const { return item.tokens; }
  int64_t compute_units() const { return models::ComputeUnits(item.tokens, budget().budget); }
  absl::Duration predicted_compute() const { return plan.share; }
  int priority() const { return client_priority; }
};

class Lane;

// The intra-op threads each of a lane's `batch_threads` batch threads runs on when they share `intra_op_threads`
// (at least 1); 0 when `intra_op_threads` is 0 (as the process set them).
inline int IntraOpThreadsPerBatchThread(int intra_op_threads, int batch_threads) {
  return intra_op_threads > 0 ? std::max(1, intra_op_threads / std::max(1, batch_threads)) : 0;
}

// How long a lane's batch thread, with nothing queued, keeps its OpenMP team before it ends it
// (kernels::ReleaseCallingThreadIntraOpTeam): kept, its workers would stop every other lane's workers from spinning;
// ended at once, the next batch would pay for a new team, which costs more than the gap between the batches of a
// steady stream (measured: docs/kernels.md, "Why the server did not move, and the fix").
inline constexpr absl::Duration kIdleBatchThreadKeepsTeamFor = absl::Milliseconds(100);

// Where a queued task is: its lane and its ticket there.
struct QueueTicket {
  Lane* lane = nullptr;
  uint64_t id = 0;
};

class Lane {
 public:
  // Runs one released batch on a batch thread (ModelRunner's execution).
  using ProcessBatch = std::function<void(Lane& lane, Batch<BatchTask> batch)>;

  // Starts the lane's batch threads, each running its forwards on `intra_op_threads` threads (0: as the process set
  // them; kernels::SetCallingThreadIntraOpThreads) and ending its OpenMP team when idle (kIdleBatchThreadKeepsTeamFor).
  // `cost` is the lane's own cost model (its correction learns from this lane's batches, which may run on other thread
  // counts than another lane's); `clock` must outlive it; `depth` (optional) hears every change of the queue depth.
  // Errors: INVALID_ARGUMENT for invalid options.
  static absl::StatusOr<std::unique_ptr<Lane>> Create(BatcherOptions batching, PlanningOptions planning,
                                                      std::unique_ptr<CostModel> cost, int intra_op_threads,
                                                      const Clock* clock, ProcessBatch process,
                                                      QueueDepthListener depth = nullptr);

  // Plans `*task` (LanePlanner::Admit: its budget choice and predicted answer time go into task->plan) and queues
  // it; on success takes `*task` and fills `*ticket`. `*plan` receives the plan (also when refused: the slack it
  // planned with), `*rejection` the reason of a refusal. `planned` (optional) sees the task with its plan before it
  // is queued, also when refused (once queued, a batch thread may answer and free it at once). Errors: the planner's (DEADLINE_EXCEEDED,
  // RESOURCE_EXHAUSTED naming the prediction) and the queue's (RESOURCE_EXHAUSTED naming the limit, UNAVAILABLE
  // while shutting down, INVALID_ARGUMENT).
  absl::Status Admit(std::unique_ptr<BatchTask>* task, QueueTicket* ticket, PlannedBudget* plan,
                     AdmissionRejection* rejection,
                     const std::function<void(const BatchTask&)>& planned = nullptr);
  // Before its input is prepared: refuses a request ending at `end` whose queue wait, batch fill and the least
  // compute of `cheapest` already pass it (LanePlanner::AdmitBeforePreparation, its errors and `*rejection`).
  absl::Status AdmitBeforePreparation(absl::Time end, bool target_binds, absl::Span<const CostItem> cheapest,
                                      AdmissionRejection* rejection);
  // Takes the task with ticket `id` out of the queue; nullptr when a batch thread already has it.
  std::unique_ptr<BatchTask> Cancel(uint64_t id);

  // The batch of `tasks` starts at `start`: latency-target tasks behind their plan get lower budgets
  // (LanePlanner::StartBatch), recorded in their plan with reason kLoweredAtBatchStart. Returns how many were
  // lowered, and `*started` for FinishBatch.
  int StartBatch(absl::Span<BatchTask* const> tasks, absl::Time start, StartedBatch* started);
  // The batch `started` ended at `end` after `compute`; `learn`: the cost model learns from it. Records how late
  // against its prediction each planned task of `answered` was. Returns measured / predicted when it learned.
  double FinishBatch(const StartedBatch& started, absl::Span<BatchTask* const> answered, absl::Time end,
                     absl::Duration compute, bool learn);
  // Planned tasks whose deadline passed in the queue: at least this late, as their batch started at `start`.
  void Expired(absl::Span<BatchTask* const> tasks, absl::Time start);

  // The lane's cost model.
  const CostModel& cost() const { return *cost_; }

  // Stops admitting and releases what is queued without waiting for batches to fill (returns at once).
  void BeginShutdown() { batcher_->BeginShutdown(); }
  // Runs what is queued and joins the batch threads.
  void Shutdown() { batcher_->Shutdown(); }

 private:
  Lane(const Clock* clock, std::unique_ptr<CostModel> cost, int intra_op_threads, BatcherOptions batching,
       PlanningOptions planning)
      : clock_(clock),
        cost_(std::move(cost)),
        intra_op_threads_(intra_op_threads),
        planner_(cost_.get(), std::move(batching), planning) {}

  // Records the lateness of each planned task of `tasks` at `at`.
  void ObserveLateness(absl::Span<BatchTask* const> tasks, absl::Time at) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock* const clock_;
  const std::unique_ptr<CostModel> cost_;
  const int intra_op_threads_;
  mutable absl::Mutex mu_;
  LanePlanner planner_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<DynamicBatcher<BatchTask>> batcher_;
};

}  // namespace mita::server
