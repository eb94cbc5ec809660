// One model's batching and execution (see model_runner.h).
#include "server/model_runner.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/aten_errors.h"
#include "server/latency_planner.h"

namespace mita::server {

absl::Status BatchFailure(absl::string_view model, absl::string_view device, int64_t requests, int64_t tokens,
                          const absl::Status& forward) {
  if (absl::IsResourceExhausted(forward)) {
    return absl::ResourceExhaustedError(absl::StrCat("model '", model, "' ran out of memory on ", device,
                                                     " for this batch of ", requests,
                                                     requests == 1 ? " request, " : " requests, ", tokens,
                                                     " tokens (", forward.message(),
                                                     "); retry later or with a smaller budget"));
  }
  return absl::InternalError(absl::StrCat("model '", model, "' failed: ", forward.message()));
}

namespace {

// When `task` must be answered: its deadline, or its latency target's end when earlier.
absl::Time PlannedEnd(const BatchTask& task) {
  const PendingRequest& request = *task.request;
  const absl::Duration target = request.request.budget.latency_target;
  if (!task.item.latency_target || target <= absl::ZeroDuration()) return request.request.deadline;
  return std::min(request.request.deadline, request.receipt + target);
}

// The applied budgets `task` may run with, most accurate first: its choices, or its one budget.
std::vector<models::AttentionBudget> AllowedOf(const BatchTask& task) {
  std::vector<models::AttentionBudget> allowed;
  for (const models::ResolvedBudget& choice : task.item.allowed_budgets) allowed.push_back(choice.budget);
  if (allowed.empty()) allowed.push_back(task.item.budget.budget);
  return allowed;
}

}  // namespace

void ModelRunner::LowerLateBudgets(absl::Span<BatchTask* const> tasks, absl::Time start) {
  const bool any_target = std::any_of(tasks.begin(), tasks.end(), [](const BatchTask* task) {
    return task->item.latency_target && task->item.allowed_budgets.size() > 1;
  });
  if (!any_target) return;
  std::vector<BatchMember> members;
  std::vector<size_t> first_choice;
  for (const BatchTask* task : tasks) {
    BatchMember member;
    member.tokens = task->item.tokens;
    member.allowed = AllowedOf(*task);
    member.choice = static_cast<size_t>(
        std::find(member.allowed.begin(), member.allowed.end(), task->item.budget.budget) - member.allowed.begin());
    if (member.choice >= member.allowed.size()) member.choice = 0;
    const absl::Time end = PlannedEnd(*task);
    member.time_left = end == absl::InfiniteFuture() ? absl::InfiniteDuration() : end - start;
    first_choice.push_back(member.choice);
    members.push_back(std::move(member));
  }
  if (LowerToFit(members, [this](absl::Span<const CostItem> items) { return cost_.Predict(items); }) == 0) return;
  for (size_t i = 0; i < tasks.size(); ++i) {
    if (members[i].choice == first_choice[i]) continue;
    models::BatchItem& item = tasks[i]->item;
    item.budget = item.allowed_budgets[members[i].choice];
    item.compute_units = models::ComputeUnits(item.tokens, item.budget.budget);
    tasks[i]->budget_reason = BudgetReason::kLoweredAtBatchStart;
    metrics_->CountBudgetChoice(BudgetReason::kLoweredAtBatchStart);
  }
}

absl::Status QueuedDeadlineExceeded(absl::Duration queued) {
  return absl::DeadlineExceededError(
      absl::StrCat("the deadline passed after ", absl::ToInt64Microseconds(queued),
                   " us in the queue, before the request's batch started; it was not run"));
}

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(const models::Classifier* classifier,
                                                                 ModelMetrics* metrics,
                                                                 const BatcherOptions& options, const Clock* clock,
                                                                 RequestCompleter* completer,
                                                                 int64_t long_input_tokens,
                                                                 PlanningOptions planning) {
  if (classifier == nullptr || metrics == nullptr || clock == nullptr ||
      completer == nullptr) {
    return absl::InvalidArgumentError("classifier, metrics, clock and completer must be set");
  }
  const models::ClassifierDescription& model = classifier->description();
  if (model.tokens_per_input > options.max_batch_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("max_batch_tokens ", options.max_batch_tokens, " (",
                                                   options.max_batch_tokens_source, ") is smaller than the ",
                                                   model.tokens_per_input, " tokens of one input of model '",
                                                   model.name, "'"));
  }
  if (long_input_tokens < 0) return absl::InvalidArgumentError("long_input_tokens must be >= 0");
  std::unique_ptr<ModelRunner> runner(new ModelRunner(classifier, metrics, clock, completer, std::move(planning)));
  ModelRunner* self = runner.get();
  // A second lane only where inputs can be long: a document model whose documents may exceed the threshold.
  const bool two_lanes = long_input_tokens > 0 && model.document.has_value() &&
                         std::min(model.document->max_tokens, options.max_batch_tokens) > long_input_tokens;
  for (int lane = 0; lane < (two_lanes ? 2 : 1); ++lane) {
    BatcherOptions lane_options = options;
    if (lane == 1) lane_options.num_batch_threads = 1;  // long documents one after another, beside the short
    absl::StatusOr<std::unique_ptr<DynamicBatcher<BatchTask>>> batcher = DynamicBatcher<BatchTask>::Create(
        lane_options, [self, lane](Batch<BatchTask> batch) { self->ProcessBatch(lane, std::move(batch)); }, clock,
        [metrics](const QueueDepthChange& change) {
          metrics->AddQueued(change.tasks_delta, change.compute_units_delta);
        });
    if (!batcher.ok()) return batcher.status();
    runner->lanes_.push_back(*std::move(batcher));
    absl::MutexLock lock(&runner->load_mu_);
    LaneLoad load{lane_options};
    if (runner->planning_.slack_percentile > 0) {
      load.slack = PlanningSlack(runner->planning_.slack_percentile / 100.0, kSlackWindow, kSlackHorizon);
    }
    runner->load_.push_back(std::move(load));
  }
  runner->long_input_tokens_ = two_lanes ? long_input_tokens : 0;
  return runner;
}

std::unique_ptr<BatchTask> ModelRunner::TakeBack(uint64_t ticket) {
  const uint64_t lane = ticket % kLanes;
  std::unique_ptr<BatchTask> task = lane < lanes_.size() ? lanes_[lane]->Cancel(ticket / kLanes) : nullptr;
  if (task != nullptr) {
    absl::MutexLock lock(&load_mu_);
    load_[lane].queued_compute -= task->queued_compute;
    --load_[lane].queued_tasks;
  }
  return task;
}

absl::Duration ModelRunner::PredictedCompute(const models::BatchItem& item,
                                             const models::AttentionBudget& budget) const {
  const CostItem cost_item{item.tokens, budget};
  return cost_.Predict(absl::MakeConstSpan(&cost_item, 1));
}

absl::Duration ModelRunner::PredictedWait(size_t lane, absl::Time now) const {
  const absl::Duration overhead = cost_.BatchOverhead();
  absl::MutexLock lock(&load_mu_);
  const LaneLoad& load = load_[lane];
  absl::Duration work = load.queued_compute;
  const int64_t batches = (load.queued_tasks + load.options.max_batch_size - 1) / load.options.max_batch_size;
  work += overhead * batches;
  for (const absl::Time end : load.running_ends) work += std::max(end - now, absl::ZeroDuration());
  return work / std::max(1, load.options.num_batch_threads);
}

absl::Duration ModelRunner::PlanningSlackOf(size_t lane, absl::Time now) {
  if (planning_.slack_percentile == 0) return absl::ZeroDuration();
  absl::MutexLock lock(&load_mu_);
  return load_[lane].slack.SlackAt(now);
}

double ModelRunner::LaneLoad::BatchSizeAt(absl::Time now) const {
  if (now <= last_batch_start) return recent_batch_size;
  const double fade = std::exp(-absl::FDivDuration(now - last_batch_start, kRecentFade));
  return 1 + (recent_batch_size - 1) * fade;
}

absl::Duration ModelRunner::PredictedBatchFill(size_t lane, absl::Time now) const {
  absl::MutexLock lock(&load_mu_);
  const LaneLoad& load = load_[lane];
  const int64_t batch =
      std::min<int64_t>(load.options.max_batch_size, std::llround(load.BatchSizeAt(now)));
  const int64_t ahead_in_batch = load.queued_tasks % load.options.max_batch_size;
  return load.recent_task_compute * std::max<int64_t>(0, batch - 1 - ahead_in_batch);
}

void ModelRunner::ObserveLateness(size_t lane, absl::Span<BatchTask* const> tasks, absl::Time answered) {
  if (planning_.slack_percentile == 0) return;
  absl::MutexLock lock(&load_mu_);
  for (const BatchTask* task : tasks) {
    if (task->admitted_at != absl::InfinitePast()) {
      load_[lane].slack.Observe(answered, answered - task->admitted_at - task->predicted);
    }
  }
}

CostSummary ModelRunner::cost_summary() const {
  const models::ClassifierDescription& model = classifier_->description();
  CostSummary summary;
  summary.profile = planning_.cost_profile;
  summary.correction = cost_.correction();
  summary.batch_overhead = cost_.BatchOverhead();
  summary.reference_tokens =
      model.tokens_per_input > 0 ? model.tokens_per_input : std::min<int64_t>(16384, model.document->max_tokens);
  for (const models::DeclaredBudget& declared : model.knobs.accuracy_order) {
    const CostItem item{summary.reference_tokens, models::ApplyBudget(declared.budget, summary.reference_tokens)};
    summary.predicted.push_back(cost_.Predict(absl::MakeConstSpan(&item, 1)));
  }
  return summary;
}

void ModelRunner::BeginShutdown() {
  for (auto& lane : lanes_) lane->BeginShutdown();
}

void ModelRunner::Shutdown() {
  for (auto& lane : lanes_) lane->Shutdown();
}

namespace {

std::string Milliseconds(absl::Duration duration) {
  return absl::StrCat(absl::ToInt64Milliseconds(duration), " ms");
}

}  // namespace

absl::Status ModelRunner::Admit(std::unique_ptr<BatchTask>* task, uint64_t* ticket) {
  BatchTask& admitted = **task;
  models::BatchItem& item = admitted.item;
  const PendingRequest& request = *admitted.request;
  const int64_t tokens = item.tokens;
  const size_t lane = long_input_tokens_ > 0 && tokens > long_input_tokens_ ? 1 : 0;
  const absl::Time now = clock_->Now();
  // The time the request may take from now: its latency target's end or its deadline, the earlier.
  const absl::Time end = PlannedEnd(admitted);
  const bool planned = item.latency_target || (planning_.deadline_admission && end != absl::InfiniteFuture());
  if (planned) {
    const std::vector<models::AttentionBudget> allowed = AllowedOf(admitted);
    const absl::Duration wait = PredictedWait(lane, now);
    const absl::Duration fill = PredictedBatchFill(lane, now);
    const absl::Duration slack = PlanningSlackOf(lane, now);
    metrics_->SetPlanningSlack(slack);
    const BudgetChoice choice =
        ChooseBudget(allowed, wait, end - now - slack,
                     [&](const models::AttentionBudget& budget) { return PredictedCompute(item, budget) + fill; });
    if (!choice.meets && planning_.deadline_admission && end != absl::InfiniteFuture()) {
      const bool by_target = end < request.request.deadline;
      const AdmissionRejection rejection =
          by_target ? AdmissionRejection::kLatencyTargetUnmeetable : AdmissionRejection::kDeadlineUnmeetable;
      metrics_->CountRejection(rejection);
      const std::string prediction = absl::StrCat(
          "predicted ", Milliseconds(choice.predicted), " to answer (queue wait ", Milliseconds(wait), " + compute ",
          Milliseconds(choice.compute), " at ", models::BudgetName(allowed[choice.index]),
          item.latency_target ? ", the least accurate budget allowed)" : ")",
          slack > absl::ZeroDuration()
              ? absl::StrCat(" and recent answers came up to ", Milliseconds(slack), " later than predicted,")
              : "");
      if (by_target) {
        return absl::ResourceExhaustedError(
            absl::StrCat(prediction, " but the latency target leaves ", Milliseconds(end - now),
                         "; it was not run (retry later, or with a larger target or a lower floor)"));
      }
      return absl::DeadlineExceededError(
          absl::StrCat(prediction, " but the deadline is in ", Milliseconds(end - now), "; it was not run"));
    }
    if (item.latency_target) {
      item.budget = item.allowed_budgets[choice.index];
      item.compute_units = models::ComputeUnits(tokens, item.budget.budget);
      admitted.budget_reason = choice.index == 0 ? BudgetReason::kMostAccurate : BudgetReason::kLoweredAtAdmission;
    }
    admitted.predicted = choice.predicted;
    admitted.admitted_at = now;
  }
  admitted.queued_compute = PredictedCompute(item, item.budget.budget) - cost_.BatchOverhead();
  const models::AttentionBudget requested = item.requested_budget;
  const models::AttentionBudget applied = item.budget.budget;
  const BudgetReason reason = admitted.budget_reason;
  const absl::Duration queued_compute = admitted.queued_compute;
  {
    // Counted before Submit: a batch thread may take the task at once.
    absl::MutexLock lock(&load_mu_);
    load_[lane].queued_compute += queued_compute;
    ++load_[lane].queued_tasks;
  }
  AdmissionRejection rejection = AdmissionRejection::kNone;
  uint64_t lane_ticket = 0;
  if (absl::Status status = lanes_[lane]->Submit(task, &rejection, &lane_ticket); !status.ok()) {
    {
      absl::MutexLock lock(&load_mu_);
      load_[lane].queued_compute -= queued_compute;
      --load_[lane].queued_tasks;
    }
    metrics_->CountRejection(rejection);
    return status;
  }
  // The lane travels in the ticket; lane tickets start at 1, so a ticket is never 0.
  if (ticket != nullptr) *ticket = lane_ticket * kLanes + lane;
  // `*task` now belongs to the batcher (and may already be running): use only the copies.
  metrics_->ObserveBudget(requested, applied);
  metrics_->ObserveRequestTokens(tokens);
  metrics_->CountBudgetChoice(reason);
  return absl::OkStatus();
}

void ModelRunner::ProcessBatch(size_t lane, Batch<BatchTask> batch) {
  const absl::Time start = clock_->Now();
  {
    // The batch has left the queue.
    absl::MutexLock lock(&load_mu_);
    for (const auto& task : batch.tasks) {
      load_[lane].queued_compute -= task->queued_compute;
      --load_[lane].queued_tasks;
    }
  }
  // Skip what nobody waits for any more, and what is already too late. A request is started only by winning
  // kQueued -> kStarted; one its caller gave up on (kGivenUp) was answered then.
  std::vector<BatchTask*> runnable;
  std::vector<BatchTask*> expired;   // their deadline passed in the queue
  std::vector<absl::Time> enqueued;  // parallel to `runnable`
  runnable.reserve(batch.tasks.size());
  for (size_t i = 0; i < batch.tasks.size(); ++i) {
    PendingRequest& request = *batch.tasks[i]->request;
    bool cancelled = false;
    {
      absl::MutexLock lock(&request.mu);
      cancelled = request.cancelled;
    }
    // The deadline first: gRPC also cancels a call whose deadline passed.
    if (start >= request.request.deadline) {
      expired.push_back(batch.tasks[i].get());
      if (request.Advance(RequestStage::kQueued, RequestStage::kGivenUp)) {
        completer_->Complete(request, QueuedDeadlineExceeded(start - batch.enqueue_times[i]));
      }
    } else if (cancelled) {
      if (request.Advance(RequestStage::kQueued, RequestStage::kGivenUp)) {
        completer_->Complete(request,
                             absl::CancelledError("the call was cancelled before its batch started; it was not run"));
      }
    } else if (request.Advance(RequestStage::kQueued, RequestStage::kStarted)) {
      runnable.push_back(batch.tasks[i].get());
      enqueued.push_back(batch.enqueue_times[i]);
    }
  }
  // At least this late: they would have been answered after `start`.
  ObserveLateness(lane, expired, start);
  if (runnable.empty()) return;
  LowerLateBudgets(runnable, start);

  const models::ClassifierDescription& model = classifier_->description();
  const int64_t batch_size = static_cast<int64_t>(runnable.size());
  int64_t batch_tokens = 0;
  std::vector<const models::BatchItem*> items;
  std::vector<int64_t> top_n;
  items.reserve(runnable.size());
  top_n.reserve(runnable.size());
  for (const BatchTask* task : runnable) {
    batch_tokens += task->item.tokens;
    items.push_back(&task->item);
    top_n.push_back(task->request->top_n);
    // Guard of the drop-before-run guarantee: work started for a caller that had already given up. The stage
    // machine makes this 0; the metric and the tests watch it.
    if (task->request->current_stage() != RequestStage::kStarted) metrics_->CountExecutedAfterCancel();
  }
  // Between layers the forward asks whether each caller still waits: work for one that left stops there.
  std::vector<absl::Time> stopped_at(runnable.size(), absl::InfiniteFuture());
  const models::ItemCheck check = [&](size_t i) -> absl::Status {
    const absl::Time now = clock_->Now();
    bool deadline_passed = false;
    if (runnable[i]->request->LeftAt(now, &deadline_passed) == absl::InfiniteFuture()) return absl::OkStatus();
    stopped_at[i] = std::min(stopped_at[i], now);
    return deadline_passed ? absl::DeadlineExceededError("the deadline passed while its batch ran; its work was stopped")
                           : absl::CancelledError("the call was cancelled while its batch ran; its work was stopped");
  };
  std::vector<CostItem> cost_items;
  for (const BatchTask* task : runnable) cost_items.push_back(CostItem{task->item.tokens, task->item.budget.budget});
  const absl::Duration predicted_compute = cost_.Predict(cost_items);
  {
    absl::MutexLock lock(&load_mu_);
    LaneLoad& load = load_[lane];
    load.running_ends.push_back(start + predicted_compute);
    constexpr double kWeight = 0.2;
    load.recent_batch_size = (1 - kWeight) * load.BatchSizeAt(start) + kWeight * static_cast<double>(batch_size);
    load.last_batch_start = std::max(load.last_batch_start, start);
    load.recent_task_compute = (1 - kWeight) * load.recent_task_compute +
                               kWeight * (predicted_compute - cost_.BatchOverhead()) / batch_size;
  }
  absl::Status failure;
  absl::StatusOr<models::ClassifierOutput> output = absl::UnknownError("not run");
  absl::StatusOr<std::vector<std::vector<models::ClassScore>>> classes = absl::UnknownError("not run");
  try {
    c10::InferenceMode inference_mode;
    output = classifier_->Run(items, /*want_statistics=*/true, check);
    if (output.ok()) classes = models::TopClasses(output->logits, top_n);
    if (!output.ok()) {
      failure = BatchFailure(model.name, model.device, batch_size, batch_tokens, output.status());
    } else if (!classes.ok()) {
      failure = BatchFailure(model.name, model.device, batch_size, batch_tokens, classes.status());
    }
  } catch (...) {
    failure = BatchFailure(model.name, model.device, batch_size, batch_tokens, kernels::CurrentExceptionStatus("batch"));
  }
  // The memory the batch left on a CUDA device (its caching allocator's counts; nothing on the CPU).
  metrics_->ObserveDeviceMemory();
  const absl::Time end = clock_->Now();
  const absl::Duration compute = end - start;
  {
    absl::MutexLock lock(&load_mu_);
    std::vector<absl::Time>& ends = load_[lane].running_ends;
    ends.erase(std::find(ends.begin(), ends.end(), start + predicted_compute));
  }
  ObserveLateness(lane, runnable, end);
  // The cost model learns from batches that ran to the end for every item.
  const bool ran_whole = failure.ok() && std::all_of(output->stopped.begin(), output->stopped.end(),
                                                     [](const absl::Status& stopped) { return stopped.ok(); });
  if (ran_whole) {
    const double ratio = cost_.Observe(cost_items, compute);
    if (ratio > 0) metrics_->ObservePredictionRatio(ratio);
  }
  // Compute spent for callers who had already left: from when each left to when its work stopped (or the batch
  // ended), by its share of the batch's tokens.
  absl::Duration after_caller_left;
  for (size_t b = 0; b < runnable.size(); ++b) {
    const absl::Time left = std::max(runnable[b]->request->LeftAt(end), start);
    const absl::Time stopped = std::min(stopped_at[b], end);
    if (left < stopped) {
      after_caller_left += (stopped - left) * (static_cast<double>(runnable[b]->item.tokens) / batch_tokens);
    }
  }
  if (after_caller_left > absl::ZeroDuration()) metrics_->AddComputeAfterCallerLeft(after_caller_left);

  metrics_->ObserveBatchSize(batch_size);
  metrics_->ObserveBatchTokens(batch_tokens);
  for (size_t b = 0; b < runnable.size(); ++b) {
    BatchTask& task = *runnable[b];
    PendingRequest& request = *task.request;
    if (!failure.ok()) {
      completer_->Complete(request, failure);
      continue;
    }
    if (b < output->stopped.size() && !output->stopped[b].ok()) {
      completer_->Complete(request, output->stopped[b]);
      continue;
    }
    InferenceResult result;
    result.model = &model;
    result.classes = std::move((*classes)[b]);
    result.budget = task.item.budget;
    result.budget_reason = task.budget_reason;
    result.predicted = task.predicted;
    result.queue_delay = start - enqueued[b];
    result.compute = compute;
    result.batch_size = batch_size;
    result.tokens = task.item.tokens;
    result.input_tokens = task.item.input_tokens;
    if (b < output->statistics.size()) result.statistics = std::move(output->statistics[b]);
    metrics_->ObserveQueueDelay(result.queue_delay);
    metrics_->ObserveCompute(compute);
    for (size_t layer = 0; layer < result.statistics.size(); ++layer) {
      const kernels::MitaItemStatistics& stats = result.statistics[layer];
      metrics_->ObserveLayer(static_cast<int64_t>(layer), stats.load_imbalance, stats.routing_entropy,
                             stats.pruned_key_fraction);
    }
    if (!request.request.return_statistics) result.statistics.clear();
    completer_->Complete(request, std::move(result));
  }
}

}  // namespace mita::server
