// The planner of one lane (a queue and its batch threads, server/engine/lane.h): what a request admitted now is
// predicted to wait and to compute, which budget it gets, and what the lane learns when batches start and finish.
// It keeps the lane's planner state (its running batches' predicted ends, its recent batch size and compute per
// request, its slack); what is queued it reads from the queue's own sums (QueueLoad). Times are passed in; not
// thread-safe (the lane guards it). Policy: docs/serving.md "Latency targets".
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "models/budget.h"
#include "server/planning/batcher.h"
#include "server/planning/cost_model.h"
#include "server/planning/latency_planner.h"

namespace mita::server {

// How a lane predicts and uses compute times (docs/serving.md "Latency targets").
struct PlanningOptions {
  // Answer at once, DEADLINE_EXCEEDED, a request whose predicted queue wait plus compute at the least accurate
  // budget it allows would pass its deadline (mita-server --deadline_admission).
  bool deadline_admission = true;
  // Admission plans with time left less this percentile of the lane's recent lateness (PlanningSlack); 0: with
  // the prediction alone (mita-server --planning_slack_percentile).
  int slack_percentile = 99;
};

// One request at admission, as the planner sees it.
struct PlanningRequest {
  int64_t tokens = 0;
  // The applied budgets it may run with, most accurate first (one for a fixed budget).
  std::vector<models::AttentionBudget> allowed;
  // Whether it set a latency target (the planner then chooses among `allowed`).
  bool latency_target = false;
  // When it must be answered: its latency target's end or its deadline, the earlier; InfiniteFuture for neither.
  absl::Time end = absl::InfiniteFuture();
  // Whether `end` is the latency target's (a refusal is then RESOURCE_EXHAUSTED, else DEADLINE_EXCEEDED).
  bool target_binds = false;
};

// What admission planned for a request: values the lane keeps with its task.
struct PlannedBudget {
  // Index into PlanningRequest::allowed, and why (kRequested when nothing was chosen).
  size_t choice = 0;
  BudgetReason reason = BudgetReason::kRequested;
  // Queue wait plus compute predicted at admission (zero: not planned), and when it was admitted.
  absl::Duration predicted = absl::ZeroDuration();
  absl::Time planned_at = absl::InfinitePast();
  // The slack it planned with (PlanningSlack; also set when refused).
  absl::Duration slack = absl::ZeroDuration();
  // Its predicted share of a batch's compute without the batch's fixed cost (the queue sums it).
  absl::Duration share = absl::ZeroDuration();

  bool planned() const { return planned_at != absl::InfinitePast(); }
};

// One request of a batch about to start.
struct StartingMember {
  int64_t tokens = 0;
  std::vector<models::AttentionBudget> allowed;
  size_t choice = 0;
  bool latency_target = false;
  absl::Time end = absl::InfiniteFuture();
};

// A batch the planner saw start: when, and its predicted compute.
struct StartedBatch {
  absl::Time start;
  absl::Duration predicted;
  std::vector<CostItem> items;
};

class LanePlanner {
 public:
  // `cost` (the model's, shared by its lanes) must outlive the planner; `batching` are the lane's batcher options.
  LanePlanner(CostModel* cost, BatcherOptions batching, PlanningOptions options);

  // Plans `request` arriving at `now` with `queued` in the lane's queue. A request with a latency target gets the
  // most accurate allowed budget whose predicted queue wait plus compute fits its time left less the slack
  // (ChooseBudget); one without gets its one budget, checked when deadline admission is on. Returns the plan, or
  // (with deadline admission) the refusal: DEADLINE_EXCEEDED when even the least accurate allowed budget is
  // predicted to pass the deadline, RESOURCE_EXHAUSTED when it would pass the latency target, each naming the
  // predicted time and the time left; `*rejection` receives its reason.
  absl::Status Admit(const PlanningRequest& request, const QueueLoad& queued, absl::Time now, PlannedBudget* plan,
                     AdmissionRejection* rejection);
  // The refusal Admit would give a request ending at `end` (its latency target's end or deadline, the earlier;
  // `target_binds` as in PlanningRequest), decided before its input is prepared, so that a request predicted to
  // miss costs no decoding or tokenizing: refused (Admit's codes and `*rejection`) when its queue wait, batch fill
  // and the least predicted compute of `cheapest` (the cheapest inputs and budgets it could bring) already pass its
  // time left less the slack. Never refuses what Admit would admit at `now` (its prediction is a lower bound of
  // Admit's); OK without deadline admission or for an unbounded `end`.
  absl::Status AdmitBeforePreparation(absl::Time end, bool target_binds, absl::Span<const CostItem> cheapest,
                                      const QueueLoad& queued, absl::Time now, AdmissionRejection* rejection);
  // A batch of `members` starts at `start`: the budgets of latency-target members that `start` finds behind their
  // plan are lowered until the batch's predicted compute fits their (and the others') time left (LowerToFit).
  // Returns each member's choice (into its `allowed`), and the started batch for FinishBatch.
  std::vector<size_t> StartBatch(absl::Span<const StartingMember> members, absl::Time start, StartedBatch* started);
  // The batch `started` finished after `compute`; `learn`: every item ran to the end, so the cost model learns
  // from it. Returns measured / predicted compute when it learned, else 0.
  double FinishBatch(const StartedBatch& started, absl::Duration compute, bool learn);
  // A planned request was answered (or expired) at `at`, `lateness` after its prediction (negative: sooner).
  void ObserveLateness(absl::Time at, absl::Duration lateness);

  // Predicted compute of one input of `tokens` tokens at `budget` alone in a batch.
  absl::Duration PredictedCompute(int64_t tokens, const models::AttentionBudget& budget) const;

 private:
  // Predicted wait before the batch of a request admitted now starts: the running batches' predicted remainder,
  // the queued tasks' predicted compute and their batches' fixed cost, shared by the lane's batch threads. The
  // max_queue_delay is not counted: later arrivals may fill the batch sooner, and a batch that starts late is
  // caught at its start (StartBatch).
  absl::Duration PredictedWait(const QueueLoad& queued, absl::Time now) const;
  // Predicted compute that the requests admitted after one admitted now add to its batch: the lane's recent
  // batch size (BatchSizeAt), less the queued tasks ahead of it in its batch, times the recent compute per
  // request (a request waits for its whole batch, which under load fills with later arrivals).
  absl::Duration PredictedBatchFill(const QueueLoad& queued, absl::Time now) const;
  // The recent batch size faded toward 1 (an idle lane's batch) by exp(-(now - last batch start) / 2 s), so a
  // lane that went quiet after a burst does not plan with the burst's batches forever (a refused request starts
  // no batch).
  double BatchSizeAt(absl::Time now) const;

  CostModel* const cost_;
  const BatcherOptions batching_;
  const PlanningOptions options_;
  std::vector<absl::Time> running_ends_;  // predicted end of each running batch
  // Moving averages (weight 0.2) over the batches started: requests per batch, predicted compute per request
  // without the batch's fixed cost.
  double recent_batch_size_ = 1;
  absl::Duration recent_task_compute_;
  absl::Time last_batch_start_ = absl::InfinitePast();
  PlanningSlack slack_;
};

}  // namespace mita::server
