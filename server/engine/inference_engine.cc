// The request path (see inference_engine.h).
#include "server/engine/inference_engine.h"

#include <algorithm>
#include <exception>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/runtime_environment.h"
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
  if (metrics == nullptr || clock == nullptr) return absl::InvalidArgumentError("metrics and clock must be set");
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
  std::unique_ptr<InferenceEngine> engine(new InferenceEngine(metrics, std::move(options), clock));
  const int threads = engine->options_.preparation_threads > 0
                          ? engine->options_.preparation_threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  engine->preparation_ = std::make_unique<PreparationPool>(threads, engine->options_.preparation_queue_capacity,
                                                           engine->options_.preparation_queue_capacity_source);
  engine->preparation_memory_ = std::make_unique<PreparationMemory>(engine->options_.preparation_memory_bytes,
                                                                    engine->options_.preparation_memory_bytes_source);
  if (registry != nullptr) {
    for (const models::ModelPackage* package : registry->packages()) {
      auto profile = engine->options_.cost_profiles.find(package->name);
      // The registry owns its packages and outlives the engine: borrowed, never freed here.
      RETURN_IF_ERROR(engine->ServeVersion(
          package->name, 1, std::shared_ptr<const models::ModelPackage>(package, [](const models::ModelPackage*) {}),
          profile != engine->options_.cost_profiles.end() ? profile->second : PriorProfile(*package->classifier)));
    }
  }
  return engine;
}

InferenceEngine::InferenceEngine(ServerMetrics* metrics, EngineOptions options, const Clock* clock)
    : metrics_(metrics), options_(std::move(options)), clock_(clock) {
  input_limits_.max_encoded_image_bytes = options_.max_encoded_image_bytes;
  input_limits_.max_tokens = options_.batching.max_batch_tokens;
  input_limits_.max_tokens_source = options_.batching.max_batch_tokens_source;
}

InferenceEngine::~InferenceEngine() { Shutdown(); }

absl::StatusOr<std::shared_ptr<ServedModel>> InferenceEngine::FindLocked(const std::string& name,
                                                                         int64_t version) const {
  auto model = served_.find(name);
  if (model == served_.end() || model->second.empty()) {
    std::vector<std::string> names;
    for (const auto& [served_name, versions] : served_) {
      if (!versions.empty()) names.push_back(served_name);
    }
    if (name.empty()) {
      return models::InvalidRequest(models::RequestField::kModel,
                                    absl::StrCat("the model name is empty; available: ", absl::StrJoin(names, ", ")));
    }
    // The name comes from a request: echo at most 100 bytes of it.
    constexpr size_t kMaxEcho = 100;
    const std::string shown = name.size() > kMaxEcho ? absl::StrCat(name.substr(0, kMaxEcho), "...") : name;
    return absl::NotFoundError(absl::StrCat("model '", shown, "' not found; available: ",
                                            names.empty() ? "none" : absl::StrJoin(names, ", ")));
  }
  if (version == 0) return model->second.rbegin()->second;
  auto found = model->second.find(version);
  if (found == model->second.end()) {
    std::vector<int64_t> versions;
    for (const auto& [number, served] : model->second) versions.push_back(number);
    return absl::NotFoundError(
        absl::StrCat("model '", name, "' has no version ", version, "; served: ", absl::StrJoin(versions, ", ")));
  }
  return found->second;
}

absl::StatusOr<ModelHandle> InferenceEngine::FindModel(const std::string& name, int64_t version) const {
  absl::ReaderMutexLock lock(&models_mu_);
  return FindLocked(name, version);
}

absl::StatusOr<CostSummary> InferenceEngine::CostSummaryOf(const std::string& name) const {
  ASSIGN_OR_RETURN(const ModelHandle model, FindModel(name));
  return model->runner().cost_summary();
}

std::vector<ModelHandle> InferenceEngine::models() const {
  absl::ReaderMutexLock lock(&models_mu_);
  std::vector<ModelHandle> result;
  for (const auto& [name, versions] : served_) {
    if (!versions.empty()) result.push_back(versions.rbegin()->second);
  }
  return result;
}

std::vector<int64_t> InferenceEngine::versions(const std::string& name) const {
  absl::ReaderMutexLock lock(&models_mu_);
  std::vector<int64_t> result;
  if (auto model = served_.find(name); model != served_.end()) {
    for (const auto& [version, served] : model->second) result.push_back(version);
  }
  return result;
}

absl::Status InferenceEngine::ServeVersion(const std::string& name, int64_t version,
                                           std::shared_ptr<const models::ModelPackage> package, CostProfile profile) {
  if (draining_.load()) return absl::UnavailableError("the server is shutting down: no model is loaded");
  const models::ClassifierDescription& description = package->classifier->description();
  ModelMetrics* model_metrics = metrics_->AddModel({name, description.layers, description.device});
  BatcherOptions batching = options_.batching;
  batching.num_batch_threads = options_.BatchThreadsOf(name);
  ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner,
                   ModelRunner::Create(package->classifier.get(), model_metrics, batching, clock_,
                                       options_.long_document_tokens, std::move(profile), options_.planning,
                                       options_.intra_op_threads));
  auto served = std::make_shared<ServedModel>(name, version, std::move(package), std::move(runner));
  {
    absl::MutexLock lock(&models_mu_);
    std::shared_ptr<ServedModel>& slot = served_[name][version];
    if (slot != nullptr) retired_.push_back(std::move(slot));
    slot = std::move(served);
  }
  metrics_->SetModelReady(name, version, true);
  return absl::OkStatus();
}

std::vector<int64_t> InferenceEngine::RetireVersions(const std::string& name, const std::set<int64_t>& keep) {
  std::vector<int64_t> retired;
  {
    absl::MutexLock lock(&models_mu_);
    auto model = served_.find(name);
    if (model == served_.end()) return retired;
    for (auto it = model->second.begin(); it != model->second.end();) {
      if (keep.count(it->first) > 0) {
        ++it;
        continue;
      }
      retired.push_back(it->first);
      retired_.push_back(std::move(it->second));
      it = model->second.erase(it);
    }
    if (model->second.empty()) served_.erase(model);
  }
  for (int64_t version : retired) metrics_->SetModelReady(name, version, false);
  return retired;
}

std::vector<std::pair<std::string, int64_t>> InferenceEngine::ReleaseRetired(absl::Time deadline) {
  // A retired version is idle once the engine holds its only reference: no request (nor front end) has it, and
  // none can take it again. Requests end by their own deadlines; the reference counts change without the lock, so
  // they are polled.
  const auto all_idle = [this]() {
    absl::MutexLock lock(&models_mu_);
    return std::all_of(retired_.begin(), retired_.end(), [](const auto& served) { return served.use_count() == 1; });
  };
  while (!all_idle() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  std::vector<std::shared_ptr<ServedModel>> idle;
  {
    absl::MutexLock lock(&models_mu_);
    for (auto it = retired_.begin(); it != retired_.end();) {
      if (it->use_count() == 1) {
        idle.push_back(std::move(*it));
        it = retired_.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::vector<std::pair<std::string, int64_t>> released;
  for (std::shared_ptr<ServedModel>& served : idle) {
    served->runner().Shutdown();
    released.emplace_back(served->name(), served->version());
    metrics_->CountModelUnload(served->name());
    served.reset();
  }
  if (!released.empty()) kernels::ReturnFreedMemory();
  return released;
}

std::unique_ptr<InferenceCall> InferenceEngine::Submit(InferenceRequest request, InferenceDone done,
                                                        ModelHandle model) {
  {
    absl::MutexLock lock(&in_flight_mu_);
    ++in_flight_;
  }
  absl::Status found = absl::OkStatus();
  if (model == nullptr) {
    absl::StatusOr<ModelHandle> resolved = FindModel(request.model, request.model_version);
    if (resolved.ok()) {
      model = *std::move(resolved);
    } else {
      found = resolved.status();
    }
  }
  ModelRunner* runner = model != nullptr ? &model->runner() : nullptr;
  const absl::Status client_admitted =
      runner != nullptr && !draining_.load() ? AdmitClient(*runner, &request) : absl::OkStatus();
  // The answer says which version ran it; the request holds the version until it is answered.
  InferenceDone answer = [done = std::move(done), model](absl::StatusOr<InferenceResult> result) mutable {
    if (result.ok() && model != nullptr) result->model_version = model->version();
    done(std::move(result));
  };
  auto submitted = std::make_shared<Request>(std::move(request), clock_, std::move(answer),
                                             [this](bool admitted, bool ok) { Answered(admitted, ok); });
  const absl::Status ready = [&]() -> absl::Status {
    if (draining_.load()) return absl::UnavailableError("the server is shutting down: no new requests are accepted");
    RETURN_IF_ERROR(found);
    ASSIGN_OR_RETURN(const int64_t top_n,
                     ResolveTopN(submitted->request().top_n,
                                 static_cast<int64_t>(runner->classifier().description().labels.size())));
    submitted->set_top_n(top_n);
    RETURN_IF_ERROR(client_admitted);
    RETURN_IF_ERROR(submitted->CallerWaits(Request::Missed::kPreparation));
    // A request predicted to miss even with the cheapest input is refused before it costs any preparation.
    bool target_binds = false;
    const absl::Time end = submitted->PlannedEnd(
        submitted->request().budget.choice == models::BudgetRequest::Choice::kLatencyTarget, &target_binds);
    RETURN_IF_ERROR(runner->AdmitBeforePreparation(end, target_binds));
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
  absl::ReaderMutexLock lock(&models_mu_);
  for (auto& [name, versions] : served_) {
    for (auto& [version, served] : versions) served->runner().BeginShutdown();
  }
  for (auto& served : retired_) served->runner().BeginShutdown();
}

bool InferenceEngine::WaitUntilIdle(absl::Time deadline) {
  absl::MutexLock lock(&in_flight_mu_);
  return in_flight_mu_.AwaitWithDeadline(
      absl::Condition(+[](int64_t* in_flight) { return *in_flight == 0; }, &in_flight_), deadline);
}

void InferenceEngine::Shutdown() {
  draining_.store(true);
  if (preparation_ != nullptr) preparation_->Shutdown();
  absl::ReaderMutexLock lock(&models_mu_);
  for (auto& [name, versions] : served_) {
    for (auto& [version, served] : versions) served->runner().Shutdown();
  }
  for (auto& served : retired_) served->runner().Shutdown();
}

InferenceEngine::AdmissionCounts InferenceEngine::admission_counts() const {
  return AdmissionCounts{admitted_.load(), admitted_ok_.load(), admitted_failed_.load()};
}

}  // namespace mita::server
