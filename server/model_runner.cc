// One model's batching and execution (see model_runner.h).
#include "server/model_runner.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/aten_errors.h"

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

absl::Status QueuedDeadlineExceeded(absl::Duration queued) {
  return absl::DeadlineExceededError(
      absl::StrCat("the deadline passed after ", absl::ToInt64Microseconds(queued),
                   " us in the queue, before the request's batch started; it was not run"));
}

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(const models::Classifier* classifier,
                                                                 ModelMetrics* metrics,
                                                                 const BatcherOptions& options, const Clock* clock,
                                                                 RequestCompleter* completer,
                                                                 int64_t long_input_tokens) {
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
  std::unique_ptr<ModelRunner> runner(new ModelRunner(classifier, metrics, clock, completer));
  ModelRunner* self = runner.get();
  // A second lane only where inputs can be long: a document model whose documents may exceed the threshold.
  const bool two_lanes = long_input_tokens > 0 && model.document.has_value() &&
                         std::min(model.document->max_tokens, options.max_batch_tokens) > long_input_tokens;
  for (int lane = 0; lane < (two_lanes ? 2 : 1); ++lane) {
    BatcherOptions lane_options = options;
    if (lane == 1) lane_options.num_batch_threads = 1;  // long documents one after another, beside the short
    absl::StatusOr<std::unique_ptr<DynamicBatcher<BatchTask>>> batcher = DynamicBatcher<BatchTask>::Create(
        lane_options, [self](Batch<BatchTask> batch) { self->ProcessBatch(std::move(batch)); }, clock,
        [metrics](const QueueDepthChange& change) {
          metrics->AddQueued(change.tasks_delta, change.compute_units_delta);
        });
    if (!batcher.ok()) return batcher.status();
    runner->lanes_.push_back(*std::move(batcher));
  }
  runner->long_input_tokens_ = two_lanes ? long_input_tokens : 0;
  return runner;
}

std::unique_ptr<BatchTask> ModelRunner::TakeBack(uint64_t ticket) {
  const uint64_t lane = ticket % kLanes;
  return lane < lanes_.size() ? lanes_[lane]->Cancel(ticket / kLanes) : nullptr;
}

void ModelRunner::BeginShutdown() {
  for (auto& lane : lanes_) lane->BeginShutdown();
}

void ModelRunner::Shutdown() {
  for (auto& lane : lanes_) lane->Shutdown();
}

absl::Status ModelRunner::Admit(std::unique_ptr<BatchTask>* task, uint64_t* ticket) {
  const models::AttentionBudget requested = (*task)->item.requested_budget;
  const models::AttentionBudget applied = (*task)->item.budget.budget;
  const int64_t tokens = (*task)->item.tokens;
  AdmissionRejection rejection = AdmissionRejection::kNone;
  const size_t lane = long_input_tokens_ > 0 && tokens > long_input_tokens_ ? 1 : 0;
  uint64_t lane_ticket = 0;
  if (absl::Status status = lanes_[lane]->Submit(task, &rejection, &lane_ticket); !status.ok()) {
    metrics_->CountRejection(rejection);
    return status;
  }
  // The lane travels in the ticket; lane tickets start at 1, so a ticket is never 0.
  if (ticket != nullptr) *ticket = lane_ticket * kLanes + lane;
  // `*task` now belongs to the batcher (and may already be running): use only the copies.
  metrics_->ObserveBudget(requested, applied);
  metrics_->ObserveRequestTokens(tokens);
  return absl::OkStatus();
}

void ModelRunner::ProcessBatch(Batch<BatchTask> batch) {
  const absl::Time start = clock_->Now();
  // Skip what nobody waits for any more, and what is already too late. A request is started only by winning
  // kQueued -> kStarted; one its caller gave up on (kGivenUp) was answered then.
  std::vector<BatchTask*> runnable;
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
  if (runnable.empty()) return;

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
