// The request path (see inference_engine.h).
#include "server/inference_engine.h"

#include <algorithm>
#include <exception>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "models/request_error.h"

namespace mita::server {
namespace {

constexpr int64_t kDefaultTopN = 5;

constexpr absl::Duration kDeadlineClockSlack = PendingRequest::kDeadlineClockSlack;

}  // namespace

absl::StatusOr<int64_t> ResolveTopN(int64_t top_n, int64_t classes) {
  const int64_t default_top_n = std::min(kDefaultTopN, classes);
  if (top_n == 0) return default_top_n;
  if (top_n < 0 || top_n > classes) {
    return models::InvalidRequest(models::RequestField::kTopN,
                                  absl::StrCat(top_n, " is out of range: allowed [0, ", classes, "] (0 means ",
                                               default_top_n, ")"));
  }
  return top_n;
}

std::vector<ServerMetrics::ModelInfo> MetricsModelInfos(const ModelRegistry& registry) {
  std::vector<ServerMetrics::ModelInfo> infos;
  for (const models::ModelPackage* package : registry.packages()) {
    const models::ClassifierDescription& model = package->classifier->description();
    infos.push_back({package->name, model.layers, model.device});
  }
  return infos;
}

void InferenceCall::Cancel() {
  if (engine_ != nullptr && request_ != nullptr) engine_->Cancel(*request_);
}

absl::StatusOr<std::unique_ptr<InferenceEngine>> InferenceEngine::Create(const ModelRegistry* registry,
                                                                         ServerMetrics* metrics, EngineOptions options,
                                                                         const Clock* clock) {
  if (registry == nullptr || metrics == nullptr || clock == nullptr) {
    return absl::InvalidArgumentError("registry, metrics and clock must be set");
  }
  RETURN_IF_ERROR(ValidateBatcherOptions(options.batching));
  if (options.preparation_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("preparation_threads ", options.preparation_threads, " must be >= 0"));
  }
  if (options.long_document_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("long_document_tokens ", options.long_document_tokens, " must be >= 0 (flag --long_document_tokens)"));
  }
  if (options.preparation_memory_bytes < 1) {
    return absl::InvalidArgumentError(absl::StrCat("preparation_memory_bytes ", options.preparation_memory_bytes,
                                                   " must be >= 1 (", options.preparation_memory_bytes_source, ")"));
  }
  if (options.preparation_queue_capacity < 1) {
    return absl::InvalidArgumentError(absl::StrCat("preparation_queue_capacity ", options.preparation_queue_capacity,
                                                   " must be >= 1 (", options.preparation_queue_capacity_source,
                                                   ")"));
  }
  std::unique_ptr<InferenceEngine> engine(new InferenceEngine(registry, metrics, std::move(options), clock));
  for (const models::ModelPackage* package : registry->packages()) {
    ModelMetrics* model_metrics = metrics->ForModel(package->name);
    if (model_metrics == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("metrics were not built for model '", package->name, "'"));
    }
    PlanningOptions planning;
    planning.deadline_admission = engine->options_.deadline_admission;
    planning.slack_percentile = engine->options_.slack_percentile;
    if (auto profile = engine->options_.cost_profiles.find(package->name);
        profile != engine->options_.cost_profiles.end()) {
      planning.cost_profile = profile->second;
    }
    ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner,
                     ModelRunner::Create(package->classifier.get(), model_metrics, engine->options_.batching,
                                         clock, engine.get(), engine->options_.long_document_tokens,
                                         std::move(planning)));
    engine->runners_.emplace(package->name, std::move(runner));
  }
  const int threads = engine->options_.preparation_threads > 0
                          ? engine->options_.preparation_threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  engine->preparation_ = std::make_unique<PreparationPool>(threads, engine->options_.preparation_queue_capacity,
                                                           engine->options_.preparation_queue_capacity_source);
  engine->preparation_memory_ = std::make_unique<PreparationMemory>(engine->options_.preparation_memory_bytes,
                                                                    engine->options_.preparation_memory_bytes_source);
  return engine;
}

InferenceEngine::InferenceEngine(const ModelRegistry* registry, ServerMetrics* metrics, EngineOptions options,
                                 const Clock* clock)
    : registry_(registry), metrics_(metrics), options_(std::move(options)), clock_(clock) {
  input_limits_.max_encoded_image_bytes = options_.max_encoded_image_bytes;
  input_limits_.max_tokens = options_.batching.max_batch_tokens;
  input_limits_.max_tokens_source = options_.batching.max_batch_tokens_source;
}

InferenceEngine::~InferenceEngine() { Shutdown(); }

absl::StatusOr<const models::ClassifierDescription*> InferenceEngine::FindModel(const std::string& name) const {
  auto it = runners_.find(name);
  if (it != runners_.end()) return &it->second->classifier().description();
  // The registry's error says what is wrong with the name (empty, or unknown with the available ones).
  absl::Status status = registry_->Lookup(name).status();
  if (status.ok()) status = absl::InternalError(absl::StrCat("model '", name, "' is registered but not served"));
  return status;
}

absl::StatusOr<CostSummary> InferenceEngine::CostSummaryOf(const std::string& name) const {
  auto it = runners_.find(name);
  if (it == runners_.end()) return FindModel(name).status();
  return it->second->cost_summary();
}

std::vector<const models::ClassifierDescription*> InferenceEngine::models() const {
  std::vector<const models::ClassifierDescription*> result;
  for (const auto& [name, runner] : runners_) result.push_back(&runner->classifier().description());
  return result;
}

std::unique_ptr<InferenceCall> InferenceEngine::Submit(InferenceRequest request, InferenceDone done) {
  const absl::Time receipt = clock_->Now();
  {
    absl::MutexLock lock(&in_flight_mu_);
    ++in_flight_;
  }
  auto runner = runners_.find(request.model);
  auto pending = std::make_shared<PendingRequest>(std::move(request),
                                                  runner != runners_.end() ? runner->second.get() : nullptr,
                                                  receipt, std::move(done));
  auto call = std::make_unique<InferenceCall>();
  call->engine_ = this;
  call->request_ = pending;
  const absl::Status ready = [&]() -> absl::Status {
    if (draining_.load()) return absl::UnavailableError("the server is shutting down: no new requests are accepted");
    if (pending->runner == nullptr) return FindModel(pending->request.model).status();
    ASSIGN_OR_RETURN(pending->top_n,
                     ResolveTopN(pending->request.top_n,
                                 static_cast<int64_t>(pending->runner->classifier().description().labels.size())));
    if (clock_->Now() >= pending->request.deadline) {
      return absl::DeadlineExceededError("the deadline passed before the request was queued; it was not run");
    }
    return preparation_->Submit([this, pending] { Prepare(pending); });
  }();
  if (!ready.ok()) Complete(*pending, ready);
  return call;
}

void InferenceEngine::Prepare(const std::shared_ptr<PendingRequest>& request) {
  // The caller may have left while this waited; then its input must not be read (the front end may have freed
  // it once the request was answered).
  if (!request->Advance(RequestStage::kWaiting, RequestStage::kPreparing)) return;
  absl::StatusOr<models::BatchItem> item = absl::UnknownError("not prepared");
  if (clock_->Now() >= request->request.deadline) {
    item = absl::DeadlineExceededError("the deadline passed before the request was queued; it was not run");
  } else {
    // Long preparation (a long text, piece by piece) stops when the caller leaves.
    const models::StopCheck stop = [this, &request]() -> absl::Status {
      bool deadline_passed = false;
      if (request->LeftAt(clock_->Now(), &deadline_passed) == absl::InfiniteFuture()) return absl::OkStatus();
      return deadline_passed
                 ? absl::DeadlineExceededError("the deadline passed while its input was prepared; it was not run")
                 : absl::CancelledError("the call was cancelled while its input was prepared; it was not run");
    };
    try {
      // Admitted to preparation by its working memory (an image's header tells its decoded size).
      const models::Classifier& classifier = request->runner->classifier();
      const absl::StatusOr<int64_t> bytes = classifier.PreparationBytes(request->request.input, input_limits_);
      absl::Status taken = bytes.ok() ? preparation_memory_->Acquire(*bytes, stop) : bytes.status();
      if (taken.ok()) {
        metrics_->SetPreparationMemory(preparation_memory_->in_use());
        const absl::Cleanup release = [&] {
          preparation_memory_->Release(*bytes);
          metrics_->SetPreparationMemory(preparation_memory_->in_use());
        };
        item = classifier.Prepare(request->request.input, request->request.budget, input_limits_, stop);
      } else {
        item = std::move(taken);
      }
    } catch (const std::exception& e) {
      // Never crash on a request; an exception here is a server fault.
      item = absl::InternalError(absl::StrCat("unexpected error preparing the input: ", e.what()));
    }
  }
  bool cancelled = false;
  {
    absl::MutexLock lock(&request->mu);
    cancelled = request->cancelled;
  }
  if (cancelled) item = absl::CancelledError("the call was cancelled while its input was prepared; it was not run");
  if (!item.ok()) {
    Complete(*request, item.status());
    return;
  }
  auto task = std::make_unique<BatchTask>();
  task->item = *std::move(item);
  task->request = request;
  // kQueued before the batcher sees it: a batch thread starts it only from kQueued.
  request->stage.store(static_cast<int>(RequestStage::kQueued));
  request->admitted.store(true);
  ++admitted_;
  uint64_t ticket = 0;
  if (absl::Status admitted = request->runner->Admit(&task, &ticket); !admitted.ok()) {
    request->admitted.store(false);
    --admitted_;
    Complete(*request, admitted);
    return;
  }
  {
    absl::MutexLock lock(&request->mu);
    request->ticket = ticket;
    cancelled = request->cancelled;
  }
  // Cancelled while it was being admitted: Cancel could not know the ticket yet.
  if (cancelled) GiveUp(*request);
}

void InferenceEngine::Cancel(PendingRequest& request) {
  uint64_t ticket = 0;
  {
    absl::MutexLock lock(&request.mu);
    if (request.cancelled) return;
    request.cancelled = true;
    request.cancelled_at = clock_->Now();
    ticket = request.ticket;
  }
  const absl::Time now = clock_->Now();
  if (request.Advance(RequestStage::kWaiting, RequestStage::kGivenUp)) {
    Complete(request, now >= request.request.deadline - kDeadlineClockSlack
                          ? absl::DeadlineExceededError(
                                "the deadline passed while the request waited for preparation; it was not run")
                          : absl::CancelledError("the call was cancelled before its input was prepared; it was not run"));
    return;
  }
  // Admitted (the ticket is known): give up now. Being prepared or admitted: Prepare sees the flag once it knows
  // the ticket (so that only Prepare answers a request whose admission fails). Started: the batch finishes and
  // the answer is discarded (Complete).
  if (ticket != 0) GiveUp(request);
}

void InferenceEngine::GiveUp(PendingRequest& request) {
  uint64_t ticket = 0;
  {
    absl::MutexLock lock(&request.mu);
    ticket = request.ticket;
  }
  // Still in the queue: take it back, which frees its queue slot now rather than at batch formation.
  std::unique_ptr<BatchTask> taken_back = ticket != 0 ? request.runner->TakeBack(ticket) : nullptr;
  if (!request.Advance(RequestStage::kQueued, RequestStage::kGivenUp)) return;  // started, or answered
  const absl::Time now = clock_->Now();
  const absl::Duration queued = now - request.receipt;
  Complete(request, now >= request.request.deadline - kDeadlineClockSlack
                        ? QueuedDeadlineExceeded(queued)
                        : absl::CancelledError("the call was cancelled while queued; it was not run"));
}

void InferenceEngine::Complete(PendingRequest& request, absl::StatusOr<InferenceResult> result) {
  if (request.completed.exchange(true)) return;
  if (result.ok()) {
    bool cancelled = false;
    {
      absl::MutexLock lock(&request.mu);
      cancelled = request.cancelled;
    }
    // The batch had started when the call was cancelled (by its client, its deadline or the server stopping at
    // the drain timeout), so it ran to the end, but the caller is gone: the answer is not delivered.
    if (cancelled) result = absl::CancelledError("the call was cancelled while its batch ran; the result was discarded");
  }
  if (result.ok()) result->total = clock_->Now() - request.receipt;
  if (request.admitted.load()) ++(result.ok() ? admitted_ok_ : admitted_failed_);
  request.done(std::move(result));
  absl::MutexLock lock(&in_flight_mu_);
  --in_flight_;
}

void InferenceEngine::BeginDrain() {
  draining_.store(true);
  for (auto& [name, runner] : runners_) runner->BeginShutdown();
}

bool InferenceEngine::WaitUntilIdle(absl::Time deadline) {
  absl::MutexLock lock(&in_flight_mu_);
  return in_flight_mu_.AwaitWithDeadline(
      absl::Condition(+[](int64_t* in_flight) { return *in_flight == 0; }, &in_flight_), deadline);
}

void InferenceEngine::Shutdown() {
  draining_.store(true);
  if (preparation_ != nullptr) preparation_->Shutdown();
  for (auto& [name, runner] : runners_) runner->Shutdown();
}

InferenceEngine::AdmissionCounts InferenceEngine::admission_counts() const {
  return AdmissionCounts{admitted_.load(), admitted_ok_.load(), admitted_failed_.load()};
}

}  // namespace mita::server
