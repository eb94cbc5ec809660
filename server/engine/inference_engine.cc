// The request path (see inference_engine.h).
#include "server/engine/inference_engine.h"

#include <algorithm>
#include <exception>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "models/request_error.h"
#include "server/policy/budget_rules.h"

namespace mita::server {
namespace {

constexpr int64_t kDefaultTopN = 5;

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
    return absl::InvalidArgumentError(absl::StrCat("long_document_tokens ", options.long_document_tokens,
                                                   " must be >= 0 (flag --long_document_tokens)"));
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
    auto profile = engine->options_.cost_profiles.find(package->name);
    ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner,
                     ModelRunner::Create(package->classifier.get(), model_metrics, engine->options_.batching,
                                         clock, engine->options_.long_document_tokens,
                                         profile != engine->options_.cost_profiles.end()
                                             ? profile->second
                                             : PriorProfile(*package->classifier),
                                         engine->options_.planning));
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
  {
    absl::MutexLock lock(&in_flight_mu_);
    ++in_flight_;
  }
  auto found = runners_.find(request.model);
  ModelRunner* runner = found != runners_.end() ? found->second.get() : nullptr;
  const absl::Status client_admitted =
      runner != nullptr && !draining_.load() ? AdmitClient(*runner, &request) : absl::OkStatus();
  auto submitted = std::make_shared<Request>(std::move(request), clock_, std::move(done),
                                             [this](bool admitted, bool ok) { Answered(admitted, ok); });
  const absl::Status ready = [&]() -> absl::Status {
    if (draining_.load()) return absl::UnavailableError("the server is shutting down: no new requests are accepted");
    if (runner == nullptr) return FindModel(submitted->request().model).status();
    ASSIGN_OR_RETURN(const int64_t top_n,
                     ResolveTopN(submitted->request().top_n,
                                 static_cast<int64_t>(runner->classifier().description().labels.size())));
    submitted->set_top_n(top_n);
    RETURN_IF_ERROR(client_admitted);
    RETURN_IF_ERROR(submitted->CallerWaits(Request::Missed::kPreparation));
    return preparation_->Submit([this, submitted, runner] { Prepare(submitted, runner); });
  }();
  if (!ready.ok()) submitted->Answer(ready);
  return std::make_unique<InferenceCall>(std::move(submitted));
}

void InferenceEngine::Prepare(const std::shared_ptr<Request>& request, ModelRunner* runner) {
  // The caller may have left while this waited; then its input must not be read (the front end may have freed
  // it once the request was answered).
  if (!request->BeginPreparing()) return;
  absl::StatusOr<models::BatchItem> item = absl::UnknownError("not prepared");
  if (absl::Status waits = request->CallerWaits(Request::Missed::kPreparing); !waits.ok()) {
    item = std::move(waits);
  } else {
    // Long preparation (a long text, piece by piece) stops when the caller leaves.
    const models::StopCheck stop = [&request] { return request->CallerWaits(Request::Missed::kPreparing); };
    try {
      // Admitted to preparation by its working memory (an image's header tells its decoded size).
      const models::Classifier& classifier = runner->classifier();
      const InferenceRequest& input = request->request();
      const absl::StatusOr<int64_t> bytes = classifier.PreparationBytes(input.input, input_limits_);
      absl::Status taken = bytes.ok() ? preparation_memory_->Acquire(*bytes, stop) : bytes.status();
      if (taken.ok()) {
        metrics_->SetPreparationMemory(preparation_memory_->in_use());
        const absl::Cleanup release = [&] {
          preparation_memory_->Release(*bytes);
          metrics_->SetPreparationMemory(preparation_memory_->in_use());
        };
        item = classifier.Prepare(input.input, input.budget, input_limits_, stop);
      } else {
        item = std::move(taken);
      }
    } catch (const std::exception& e) {
      // Never crash on a request; an exception here is a server fault.
      item = absl::InternalError(absl::StrCat("unexpected error preparing the input: ", e.what()));
    }
  }
  if (item.ok()) {
    if (absl::Status waits = request->CallerWaits(Request::Missed::kPreparing); !waits.ok()) item = waits;
  }
  const policy::ClientAdmission* client = request->request().client.get();
  if (item.ok() && client != nullptr) {
    if (absl::Status allowed = AdmitPreparedForClient(*runner, request->request(), &*item); !allowed.ok()) {
      item = allowed;
    }
  }
  if (!item.ok()) {
    request->Answer(item.status());
    return;
  }
  auto task = std::make_unique<BatchTask>();
  task->item = *std::move(item);
  task->request = request;
  task->end = request->PlannedEnd(task->item.latency_target, &task->target_binds);
  // The client's quota is charged the request's cost before it is queued (concurrent requests see the debt), and
  // given back when the lane refuses it.
  const int64_t compute_units = task->item.compute_units;
  if (client != nullptr) {
    task->client_priority = client->rules.priority;
    if (client->quota != nullptr) client->quota->Charge(compute_units);
  }
  request->BeginQueueing();
  ++admitted_;
  QueueTicket ticket;
  if (absl::Status admitted = runner->Admit(&task, &ticket); !admitted.ok()) {
    --admitted_;
    if (client != nullptr && client->quota != nullptr) client->quota->Refund(compute_units);
    request->Refused(admitted);
    return;
  }
  if (client != nullptr) metrics_->ForClient(client->name)->AddComputeUnits(compute_units);
  request->Queued(ticket);
}

absl::Status InferenceEngine::AdmitClient(const ModelRunner& runner, InferenceRequest* request) {
  if (request->client == nullptr) return absl::OkStatus();
  const policy::ClientAdmission& client = *request->client;
  policy::PolicyRule rule = policy::PolicyRule::kPreset;
  if (absl::Status allowed =
          policy::AdmitBudgetRequest(client, runner.classifier().description().knobs, &request->budget, &rule);
      !allowed.ok()) {
    metrics_->ForClient(client.name)->CountPolicyRefusal(policy::PolicyRuleName(rule));
    return allowed;
  }
  if (absl::Status quota = policy::CheckQuota(client); !quota.ok()) {
    metrics_->ForClient(client.name)->CountQuotaRefusal();
    return quota;
  }
  return absl::OkStatus();
}

absl::Status InferenceEngine::AdmitPreparedForClient(const ModelRunner& runner, const InferenceRequest& request,
                                                     models::BatchItem* item) {
  policy::PolicyRule rule = policy::PolicyRule::kPreset;
  absl::Status allowed = policy::AdmitPreparedItem(*request.client, runner.classifier().description().knobs,
                                                   request.budget, item, &rule);
  if (!allowed.ok() && allowed.code() == absl::StatusCode::kPermissionDenied) {
    metrics_->ForClient(request.client->name)->CountPolicyRefusal(policy::PolicyRuleName(rule));
  }
  return allowed;
}

void InferenceEngine::Answered(bool admitted, bool ok) {
  if (admitted) ++(ok ? admitted_ok_ : admitted_failed_);
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
