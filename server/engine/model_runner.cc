// One model's execution (see model_runner.h).
#include "server/engine/model_runner.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/aten_errors.h"
#include "server/engine/request.h"

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

ModelRunner::ModelRunner(const models::Classifier* classifier, ModelMetrics* metrics, const Clock* clock,
                         CostProfile profile)
    : classifier_(classifier),
      metrics_(metrics),
      clock_(clock),
      profile_(std::move(profile)) {}

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(const models::Classifier* classifier,
                                                                 ModelMetrics* metrics, const BatcherOptions& options,
                                                                 const Clock* clock, int64_t long_input_tokens,
                                                                 CostProfile profile, PlanningOptions planning,
                                                                 int intra_op_threads) {
  if (classifier == nullptr || metrics == nullptr || clock == nullptr) {
    return absl::InvalidArgumentError("classifier, metrics and clock must be set");
  }
  const models::ClassifierDescription& model = classifier->description();
  if (model.tokens_per_input > options.max_batch_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("max_batch_tokens ", options.max_batch_tokens, " (",
                                                   options.max_batch_tokens_source, ") is smaller than the ",
                                                   model.tokens_per_input, " tokens of one input of model '",
                                                   model.name, "'"));
  }
  if (long_input_tokens < 0) return absl::InvalidArgumentError("long_input_tokens must be >= 0");
  if (intra_op_threads < 0) return absl::InvalidArgumentError("intra_op_threads must be >= 0");
  std::unique_ptr<ModelRunner> runner(new ModelRunner(classifier, metrics, clock, std::move(profile)));
  ModelRunner* self = runner.get();
  // A second lane only where inputs can be long: a model whose inputs (within a batch) may exceed the threshold.
  const bool two_lanes =
      long_input_tokens > 0 && std::min(model.max_input_tokens, options.max_batch_tokens) > long_input_tokens;
  for (int lane = 0; lane < (two_lanes ? 2 : 1); ++lane) {
    BatcherOptions lane_options = options;
    if (lane == 1) lane_options.num_batch_threads = 1;  // long inputs one after another, beside the short
    // A lane's batch threads share the intra-op threads: the long-input lane's one thread has them all.
    const int threads = IntraOpThreadsPerBatchThread(intra_op_threads, lane_options.num_batch_threads);
    auto cost = std::make_unique<CostModel>(
        [classifier](absl::Span<const CostItem> items) { return classifier->BatchCostFeatures(items); },
        runner->profile_.coefficients, runner->profile_.correction);
    absl::StatusOr<std::unique_ptr<Lane>> created = Lane::Create(
        lane_options, planning, std::move(cost), threads, clock,
        [self](Lane& lane, Batch<BatchTask> batch) { self->ProcessBatch(lane, std::move(batch)); },
        [metrics](const QueueDepthChange& change) {
          metrics->AddQueued(change.tasks_delta, change.compute_units_delta);
        });
    if (!created.ok()) return created.status();
    runner->lanes_.push_back(*std::move(created));
  }
  runner->long_input_tokens_ = two_lanes ? long_input_tokens : 0;
  // Each lane's cheapest inputs: its fewest tokens (the cost grows with tokens and with the budget) at the model's
  // cheapest MiTA budget, and under full attention where the model runs it.
  const models::BudgetKnobs& knobs = model.knobs;
  const int64_t fewest_experts =
      knobs.allowed_expert_counts.empty()
          ? knobs.min_expert_count
          : *std::min_element(knobs.allowed_expert_counts.begin(), knobs.allowed_expert_counts.end());
  for (size_t lane = 0; lane < runner->lanes_.size(); ++lane) {
    const int64_t tokens = lane == 0 ? std::max<int64_t>(1, model.tokens_per_input) : long_input_tokens + 1;
    std::vector<CostItem> cheapest = {CostItem{
        tokens, models::ApplyBudget(models::AttentionBudget{false, fewest_experts, knobs.min_expert_width}, tokens)}};
    if (knobs.full_attention_supported) cheapest.push_back(CostItem{tokens, models::AttentionBudget{true, 0, 0}});
    runner->cheapest_inputs_.push_back(std::move(cheapest));
  }
  return runner;
}

absl::Status ModelRunner::Admit(std::unique_ptr<BatchTask>* task, QueueTicket* ticket) {
  const models::BatchItem& item = (*task)->item;
  Lane& lane = LaneFor(item.tokens);
  // Copies, taken while `*task` is ours: once queued, it belongs to the lane (and may already be answered and
  // freed by a batch thread).
  const int64_t tokens = item.tokens;
  const models::AttentionBudget requested = item.requested_budget;
  models::AttentionBudget applied;
  PlannedBudget plan;
  AdmissionRejection rejection = AdmissionRejection::kNone;
  const absl::Status admitted = lane.Admit(task, ticket, &plan, &rejection, [this, &applied](const BatchTask& planned) {
    if (planned.plan.planned()) metrics_->SetPlanningSlack(planned.plan.slack);
    applied = planned.budget().budget;
  });
  if (!admitted.ok()) {
    metrics_->CountRejection(rejection);
    return admitted;
  }
  metrics_->ObserveBudget(requested, applied);
  metrics_->ObserveRequestTokens(tokens);
  metrics_->CountBudgetChoice(plan.reason);
  return absl::OkStatus();
}

absl::Status ModelRunner::AdmitBeforePreparation(absl::Time end, bool target_binds) {
  absl::Status first = absl::OkStatus();
  AdmissionRejection first_rejection = AdmissionRejection::kNone;
  for (size_t i = 0; i < lanes_.size(); ++i) {
    AdmissionRejection rejection = AdmissionRejection::kNone;
    const absl::Status admitted =
        lanes_[i]->AdmitBeforePreparation(end, target_binds, cheapest_inputs_[i], &rejection);
    if (admitted.ok()) return admitted;
    if (first.ok()) {
      first = admitted;
      first_rejection = rejection;
    }
  }
  metrics_->CountRejection(first_rejection);
  return first;
}

CostSummary ModelRunner::cost_summary() const {
  const models::ClassifierDescription& model = classifier_->description();
  CostSummary summary;
  summary.profile = profile_;
  const CostModel& cost = LaneFor(model.reference_tokens).cost();
  summary.correction = cost.correction();
  summary.batch_overhead = cost.BatchOverhead();
  summary.reference_tokens = model.reference_tokens;
  for (const models::DeclaredBudget& declared : model.knobs.accuracy_order) {
    const CostItem item{summary.reference_tokens, models::ApplyBudget(declared.budget, summary.reference_tokens)};
    summary.predicted.push_back(cost.Predict(absl::MakeConstSpan(&item, 1)));
  }
  return summary;
}

Lane& ModelRunner::LaneFor(int64_t tokens) const {
  return *lanes_[long_input_tokens_ > 0 && tokens > long_input_tokens_ ? 1 : 0];
}

void ModelRunner::BeginShutdown() {
  for (auto& lane : lanes_) lane->BeginShutdown();
}

void ModelRunner::Shutdown() {
  for (auto& lane : lanes_) lane->Shutdown();
}

void ModelRunner::ProcessBatch(Lane& lane, Batch<BatchTask> batch) {
  const absl::Time start = clock_->Now();
  // Start each request unless its caller left (then it was answered, and never runs).
  std::vector<BatchTask*> runnable;
  std::vector<BatchTask*> expired;   // their deadline passed in the queue
  std::vector<absl::Time> enqueued;  // parallel to `runnable`
  runnable.reserve(batch.tasks.size());
  for (size_t i = 0; i < batch.tasks.size(); ++i) {
    bool deadline_passed = false;
    if (batch.tasks[i]->request->Start(start, &deadline_passed)) {
      runnable.push_back(batch.tasks[i].get());
      enqueued.push_back(batch.enqueue_times[i]);
    } else if (deadline_passed) {
      expired.push_back(batch.tasks[i].get());
    }
  }
  lane.Expired(expired, start);
  if (runnable.empty()) return;
  StartedBatch started;
  for (int lowered = lane.StartBatch(runnable, start, &started); lowered > 0; --lowered) {
    metrics_->CountBudgetChoice(BudgetReason::kLoweredAtBatchStart);
  }

  const models::ClassifierDescription& model = classifier_->description();
  const int64_t batch_size = static_cast<int64_t>(runnable.size());
  int64_t batch_tokens = 0;
  // The items as prepared, or with the budget the lane chose when it is not the prepared one.
  std::vector<models::BatchItem> lowered_items;
  lowered_items.reserve(runnable.size());
  std::vector<const models::BatchItem*> items;
  std::vector<int64_t> top_n;
  for (const BatchTask* task : runnable) {
    batch_tokens += task->item.tokens;
    if (task->plan.choice == 0 || task->item.allowed_budgets.empty()) {
      items.push_back(&task->item);
    } else {
      items.push_back(&lowered_items.emplace_back(task->item.WithBudget(task->plan.choice)));
    }
    top_n.push_back(task->request->top_n());
    // Guard of the drop-before-run guarantee: work started for a caller that had already given up. The stage
    // machine makes this 0; the metric and the tests watch it.
    if (task->request->stage() != Request::Stage::kStarted) metrics_->CountExecutedAfterCancel();
  }
  // Between layers the forward asks whether each caller still waits: work for one that left stops there.
  std::vector<absl::Time> stopped_at(runnable.size(), absl::InfiniteFuture());
  const models::ItemCheck check = [&](size_t i) -> absl::Status {
    absl::Status waits = runnable[i]->request->CallerWaits(Request::Missed::kWork);
    if (!waits.ok()) stopped_at[i] = std::min(stopped_at[i], clock_->Now());
    return waits;
  };
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
  // The cost model learns from batches that ran to the end for every item.
  const bool ran_whole = failure.ok() && std::all_of(output->stopped.begin(), output->stopped.end(),
                                                     [](const absl::Status& stopped) { return stopped.ok(); });
  const double ratio = lane.FinishBatch(started, runnable, end, compute, ran_whole);
  if (ratio > 0) metrics_->ObservePredictionRatio(ratio);
  // Compute spent for callers who had already left: from when each left to when its work stopped (or the batch
  // ended), by its share of the batch's tokens.
  absl::Duration after_caller_left;
  for (size_t b = 0; b < runnable.size(); ++b) {
    const absl::Time left = std::max(runnable[b]->request->LeftAt(end).at, start);
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
    Request& request = *task.request;
    if (!failure.ok()) {
      request.Answer(failure);
      continue;
    }
    if (b < output->stopped.size() && !output->stopped[b].ok()) {
      request.Answer(output->stopped[b]);
      continue;
    }
    InferenceResult result;
    result.model = &model;
    result.classes = std::move((*classes)[b]);
    result.budget = task.budget();
    result.budget_reason = task.plan.reason;
    result.predicted = task.plan.predicted;
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
    if (!request.request().return_statistics) result.statistics.clear();
    request.Answer(std::move(result));
  }
}

}  // namespace mita::server
