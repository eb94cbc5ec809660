// Prometheus metrics (see metrics.h).
#include "server/metrics/metrics.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/device.h"

namespace mita::server {
namespace {

using prometheus::Histogram;

// Seconds: 50 us .. 10 s, roughly x2-x2.5 per bucket.
const Histogram::BucketBoundaries& SecondsBuckets() {
  static const Histogram::BucketBoundaries* const buckets = new Histogram::BucketBoundaries{
      0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
  return *buckets;
}

// Counts: 1, 2, 4, ... 2^max_power.
Histogram::BucketBoundaries PowersOfTwo(int max_power) {
  Histogram::BucketBoundaries buckets;
  for (int p = 0; p <= max_power; ++p) buckets.push_back(static_cast<double>(int64_t{1} << p));
  return buckets;
}

// max/mean >= 1.
const Histogram::BucketBoundaries& ImbalanceBuckets() {
  static const Histogram::BucketBoundaries* const buckets =
      new Histogram::BucketBoundaries{1.05, 1.1, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16, 32, 64};
  return *buckets;
}

// Fractions in [0, 1].
const Histogram::BucketBoundaries& FractionBuckets() {
  static const Histogram::BucketBoundaries* const buckets =
      new Histogram::BucketBoundaries{0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0};
  return *buckets;
}

constexpr const char* kMethodNames[kNumRpcMethods] = {
    "Classify",    "ListModels",     "GetModel",   "ModelInfer",      "ModelMetadata",       "ModelReady",
    "ServerLive",  "ServerReady",    "ServerMetadata", "ModelConfig", "RepositoryIndex",     "RepositoryModelLoad",
    "RepositoryModelUnload", "ListRepository", "LoadModel", "UnloadModel"};

}  // namespace

const char* RpcMethodName(RpcMethod method) {
  const int index = static_cast<int>(method);
  return index >= 0 && index < kNumRpcMethods ? kMethodNames[index] : "unknown";
}

bool IsModelMethod(RpcMethod method) {
  switch (method) {
    case RpcMethod::kClassify:
    case RpcMethod::kGetModel:
    case RpcMethod::kModelInfer:
    case RpcMethod::kModelMetadata:
    case RpcMethod::kModelReady:
    case RpcMethod::kModelConfig:
    case RpcMethod::kRepositoryModelLoad:
    case RpcMethod::kRepositoryModelUnload:
    case RpcMethod::kLoadModel:
    case RpcMethod::kUnloadModel:
      return true;
    case RpcMethod::kListModels:
    case RpcMethod::kServerLive:
    case RpcMethod::kServerReady:
    case RpcMethod::kServerMetadata:
    case RpcMethod::kRepositoryIndex:
    case RpcMethod::kListRepository:
      return false;
  }
  return false;
}

void ModelMetrics::ObserveBudget(const models::AttentionBudget& requested, const models::AttentionBudget& applied) {
  if (requested.full_attention) {
    full_attention_->Increment();
    return;
  }
  expert_count_->Observe(static_cast<double>(requested.expert_count));
  expert_width_->Observe(static_cast<double>(requested.expert_width));
  applied_expert_count_->Observe(static_cast<double>(applied.expert_count));
  applied_expert_width_->Observe(static_cast<double>(applied.expert_width));
}

void ModelMetrics::CountRejection(AdmissionRejection reason) {
  const int index = static_cast<int>(reason);
  if (index <= 0 || index >= kNumAdmissionRejections) return;
  rejections_[static_cast<size_t>(index)]->Increment();
}

void DeviceMemoryGauges::Update() {
  absl::StatusOr<kernels::DeviceMemory> memory = kernels::CudaMemory(device_);
  if (!memory.ok()) return;
  allocated_->Set(static_cast<double>(memory->allocated_bytes));
  reserved_->Set(static_cast<double>(memory->reserved_bytes));
}

void ModelMetrics::ObserveLayer(int64_t layer, double load_imbalance, double routing_entropy,
                                double pruned_key_fraction) {
  if (layer < 0 || layer >= static_cast<int64_t>(layers_.size())) return;
  const Layer& series = layers_[static_cast<size_t>(layer)];
  series.load_imbalance->Observe(load_imbalance);
  series.routing_entropy->Observe(routing_entropy);
  series.pruned_key_fraction->Observe(pruned_key_fraction);
}

ServerMetrics::ServerMetrics(const std::vector<ModelInfo>& models)
    : registry_(std::make_shared<prometheus::Registry>()) {
  auto& requests = prometheus::BuildCounter()
                       .Name("mita_requests_total")
                       .Help("RPCs answered by the service, by method, model and final gRPC status code.")
                       .Register(*registry_);
  auto& latency = prometheus::BuildHistogram()
                      .Name("mita_request_latency_seconds")
                      .Help("Time in the server from receipt to answer of successful Classify and ModelInfer RPCs, "
                            "seconds.")
                      .Register(*registry_);
  auto& queue_delay = prometheus::BuildHistogram()
                          .Name("mita_queue_delay_seconds")
                          .Help("Time from admission to the start of the request's batch, seconds.")
                          .Register(*registry_);
  auto& compute = prometheus::BuildHistogram()
                      .Name("mita_compute_seconds")
                      .Help("Model forward time of the batch that ran the request, seconds (per request).")
                      .Register(*registry_);
  auto& batch_size = prometheus::BuildHistogram()
                         .Name("mita_batch_size")
                         .Help("Requests per batch run (one observation per batch).")
                         .Register(*registry_);
  auto& queue_depth = prometheus::BuildGauge()
                          .Name("mita_queue_depth")
                          .Help("Requests queued in the model's batcher, not yet taken into a batch.")
                          .Register(*registry_);
  auto& queue_compute_units =
      prometheus::BuildGauge()
          .Name("mita_queue_compute_units")
          .Help("Compute units (tokens x attention width: M + k for MiTA, N for full attention) queued in the "
                "model's batcher.")
          .Register(*registry_);
  auto& rejected = prometheus::BuildCounter()
                       .Name("mita_rejected_requests_total")
                       .Help("Classify requests refused at admission, by reason (queue_tasks, queue_compute_units, "
                             "task_over_queue_compute_units, shutting_down, deadline_unmeetable, "
                             "latency_target_unmeetable, low_priority_queue_share).")
                       .Register(*registry_);
  auto& budget_choices =
      prometheus::BuildCounter()
          .Name("mita_budget_choices_total")
          .Help("Budgets chosen for admitted requests, by reason: requested (the request named it), most_accurate "
                "and lowered_at_admission (latency targets), lowered_at_batch_start (lowered again when the "
                "batch started).")
          .Register(*registry_);
  auto& prediction_ratio = prometheus::BuildHistogram()
                               .Name("mita_compute_prediction_ratio")
                               .Help("Measured / predicted compute of each batch run to the end (the cost model's "
                                     "error; 1 = exact).")
                               .Register(*registry_);
  auto& planning_slack = prometheus::BuildGauge()
                             .Name("mita_planning_slack_seconds")
                             .Help("Time admission subtracted from the latest planned request's time left: the "
                                   "--planning_slack_percentile of how much later than predicted its lane's planned "
                                   "requests of the last 2 s were answered.")
                             .Register(*registry_);
  auto& request_tokens = prometheus::BuildHistogram()
                             .Name("mita_request_tokens")
                             .Help("Tokens of each admitted request (documents: after truncation).")
                             .Register(*registry_);
  auto& batch_tokens = prometheus::BuildHistogram()
                           .Name("mita_batch_tokens")
                           .Help("Tokens per packed batch run (one observation per batch).")
                           .Register(*registry_);
  auto& expert_count = prometheus::BuildHistogram()
                           .Name("mita_requested_expert_count")
                           .Help("Expert count m admitted MiTA requests asked for (after the model's defaults "
                                 "and presets).")
                           .Register(*registry_);
  auto& expert_width = prometheus::BuildHistogram()
                           .Name("mita_requested_expert_width")
                           .Help("Expert width k (keys per routed expert) admitted MiTA requests asked for.")
                           .Register(*registry_);
  auto& applied_expert_count = prometheus::BuildHistogram()
                                   .Name("mita_applied_expert_count")
                                   .Help("Expert count m applied to admitted MiTA requests' inputs (at most their "
                                         "tokens).")
                                   .Register(*registry_);
  auto& applied_expert_width = prometheus::BuildHistogram()
                                   .Name("mita_applied_expert_width")
                                   .Help("Expert width k applied to admitted MiTA requests' inputs (at most their "
                                         "tokens).")
                                   .Register(*registry_);
  auto& full_attention = prometheus::BuildCounter()
                             .Name("mita_full_attention_requests_total")
                             .Help("Admitted requests that asked for full attention.")
                             .Register(*registry_);
  auto& executed_after_cancel =
      prometheus::BuildCounter()
          .Name("mita_work_executed_after_cancel_total")
          .Help("Requests whose batch ran although their caller had given up (cancelled, deadline passed) before "
                "the batch started; 0 by design.")
          .Register(*registry_);
  auto& compute_after_caller_left =
      prometheus::BuildCounter()
          .Name("mita_compute_after_caller_left_seconds_total")
          .Help("Forward time spent for callers who had left (cancelled, deadline passed) while their batch ran: "
                "from when each left to when its work stopped, by its share of the batch's tokens; seconds.")
          .Register(*registry_);
  auto& load_imbalance =
      prometheus::BuildHistogram()
          .Name("mita_attention_expert_load_imbalance")
          .Help("Max/mean queries per routed expert (1 = balanced), averaged over heads; per request and layer.")
          .Register(*registry_);
  auto& routing_entropy =
      prometheus::BuildHistogram()
          .Name("mita_attention_routing_entropy")
          .Help(
              "Entropy of the queries-per-expert distribution / log(expert count), in [0, 1]; per request and "
              "layer.")
          .Register(*registry_);
  auto& pruned_key_fraction =
      prometheus::BuildHistogram()
          .Name("mita_attention_pruned_key_fraction")
          .Help("Fraction of keys selected by no routed expert (emergent token pruning); per request and layer.")
          .Register(*registry_);

  families_.requests = &requests;
  families_.latency = &latency;
  families_.queue_delay = &queue_delay;
  families_.compute = &compute;
  families_.batch_size = &batch_size;
  families_.queue_depth = &queue_depth;
  families_.queue_compute_units = &queue_compute_units;
  families_.rejected = &rejected;
  families_.budget_choices = &budget_choices;
  families_.prediction_ratio = &prediction_ratio;
  families_.planning_slack = &planning_slack;
  families_.request_tokens = &request_tokens;
  families_.batch_tokens = &batch_tokens;
  families_.expert_count = &expert_count;
  families_.expert_width = &expert_width;
  families_.applied_expert_count = &applied_expert_count;
  families_.applied_expert_width = &applied_expert_width;
  families_.full_attention = &full_attention;
  families_.executed_after_cancel = &executed_after_cancel;
  families_.compute_after_caller_left = &compute_after_caller_left;
  families_.load_imbalance = &load_imbalance;
  families_.routing_entropy = &routing_entropy;
  families_.pruned_key_fraction = &pruned_key_fraction;
  families_.model_ready = &prometheus::BuildGauge()
                               .Name("mita_model_ready")
                               .Help("1 while the model version serves requests, 0 once it is unloaded, replaced or "
                                     "failed to load (model versions of the repository).")
                               .Register(*registry_);
  families_.model_load_seconds = &prometheus::BuildGauge()
                                      .Name("mita_model_load_seconds")
                                      .Help("Time the model version's last load took: reading the package, the "
                                            "cost calibration and starting its lanes, seconds.")
                                      .Register(*registry_);
  families_.model_loads = &prometheus::BuildCounter()
                               .Name("mita_model_loads_total")
                               .Help("Loads of a model version from the repository, by result (ok, failed).")
                               .Register(*registry_);
  families_.model_unloads = &prometheus::BuildCounter()
                                 .Name("mita_model_unloads_total")
                                 .Help("Model versions unloaded (removed, replaced or no longer chosen by the "
                                       "version policy) after their requests finished.")
                                 .Register(*registry_);
  for (int m = 0; m < kNumRpcMethods; ++m) {
    const auto method = static_cast<RpcMethod>(m);
    other_requests_[m] = CodeCountersFor(method, IsModelMethod(method) ? "unknown" : "");
  }
  preparation_memory_ = &prometheus::BuildGauge()
                             .Name("mita_preparation_memory_bytes")
                             .Help("Working memory taken by the inputs being decoded or tokenized (estimates from "
                                   "their headers), bytes; bounded by --preparation_memory_bytes.")
                             .Register(*registry_)
                             .Add({});
  heap_kept_free_ = &prometheus::BuildGauge()
                         .Name("mita_heap_kept_free_bytes")
                         .Help("Resident memory the C heap holds free for reuse (estimated every second); returned "
                               "to the system when over --keep_freed_memory_limit_bytes.")
                         .Register(*registry_)
                         .Add({});
  heap_returned_ = &prometheus::BuildCounter()
                        .Name("mita_heap_returned_bytes_total")
                        .Help("Resident memory the C heap returned to the system: once at start, after the cost "
                              "calibration, and whenever it held more than --keep_freed_memory_limit_bytes free.")
                        .Register(*registry_)
                        .Add({});
  retried_calls_ = &prometheus::BuildCounter()
                        .Name("mita_retried_calls_total")
                        .Help("Calls that arrived as a retry of an earlier attempt (grpc-previous-rpc-attempts > 0): "
                              "re-sent by their client's retry policy, e.g. while another replica drained.")
                        .Register(*registry_)
                        .Add({});

  client_requests_ = &prometheus::BuildCounter()
                         .Name("mita_client_requests_total")
                         .Help("Inference calls (Classify, ModelInfer) answered, by client of the budget policy and "
                               "final gRPC status code.")
                         .Register(*registry_);
  client_compute_units_ = &prometheus::BuildCounter()
                              .Name("mita_client_compute_units_total")
                              .Help("Compute units (tokens x attention width) of the requests admitted to a lane, by "
                                    "client of the budget policy: what its quota is charged.")
                              .Register(*registry_);
  client_quota_refusals_ = &prometheus::BuildCounter()
                               .Name("mita_client_quota_refusals_total")
                               .Help("Requests refused because their client was over its compute quota "
                                     "(RESOURCE_EXHAUSTED).")
                               .Register(*registry_);
  client_policy_refusals_ = &prometheus::BuildCounter()
                                .Name("mita_client_policy_refusals_total")
                                .Help("Requests refused by their client's budget rules (PERMISSION_DENIED), by rule.")
                                .Register(*registry_);

  for (const ModelInfo& info : models) AddModel(info);
}

ServerMetrics::CodeCounters ServerMetrics::CodeCountersFor(RpcMethod method, const std::string& model) {
  CodeCounters counters{};
  for (int code = 0; code < kNumStatusCodes; ++code) {
    counters[code] = &families_.requests->Add({{"method", kMethodNames[static_cast<int>(method)]},
                                               {"model", model},
                                               {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(code))}});
  }
  return counters;
}

ModelMetrics* ServerMetrics::AddModel(const ModelInfo& info) {
  absl::MutexLock lock(&models_mu_);
  auto existing = models_.find(info.name);
  if (existing != models_.end() && existing->second->layers() >= info.layers &&
      existing->second->device_ == info.device) {
    return existing->second.get();
  }
  const Histogram::BucketBoundaries count_buckets = PowersOfTwo(12);  // up to 4096 experts
  const Histogram::BucketBoundaries width_buckets = PowersOfTwo(16);  // up to 65536 keys
  const Histogram::BucketBoundaries batch_buckets = PowersOfTwo(10);  // up to 1024 requests
  const Histogram::BucketBoundaries token_buckets = PowersOfTwo(20);  // up to 1M tokens
  // A model seen again with more layers or on another device gets a new object over the same series (the families
  // return the series a label set already has); the old one stays valid for the runners that still hold it.
  auto model = std::make_unique<ModelMetrics>();
  model->name_ = info.name;
  model->device_ = info.device;
  const prometheus::Labels labels = {{"model", info.name}};
  for (int m = 0; m < kNumRpcMethods; ++m) {
    const auto method = static_cast<RpcMethod>(m);
    if (IsModelMethod(method)) model->requests_[m] = CodeCountersFor(method, info.name);
  }
  model->queue_depth_ = &families_.queue_depth->Add(labels);
  model->queue_compute_units_ = &families_.queue_compute_units->Add(labels);
  model->latency_ = &families_.latency->Add(labels, SecondsBuckets());
  model->queue_delay_ = &families_.queue_delay->Add(labels, SecondsBuckets());
  model->compute_ = &families_.compute->Add(labels, SecondsBuckets());
  model->batch_size_ = &families_.batch_size->Add(labels, batch_buckets);
  model->batch_tokens_ = &families_.batch_tokens->Add(labels, token_buckets);
  model->request_tokens_ = &families_.request_tokens->Add(labels, token_buckets);
  for (int reason = 1; reason < kNumAdmissionRejections; ++reason) {
    model->rejections_[static_cast<size_t>(reason)] = &families_.rejected->Add(
        {{"model", info.name}, {"reason", AdmissionRejectionName(static_cast<AdmissionRejection>(reason))}});
  }
  model->expert_count_ = &families_.expert_count->Add(labels, count_buckets);
  model->expert_width_ = &families_.expert_width->Add(labels, width_buckets);
  model->applied_expert_count_ = &families_.applied_expert_count->Add(labels, count_buckets);
  model->applied_expert_width_ = &families_.applied_expert_width->Add(labels, width_buckets);
  model->full_attention_ = &families_.full_attention->Add(labels);
  for (int reason = 0; reason < 4; ++reason) {
    model->budget_choices_[static_cast<size_t>(reason)] = &families_.budget_choices->Add(
        {{"model", info.name}, {"reason", BudgetReasonName(static_cast<BudgetReason>(reason))}});
  }
  model->prediction_ratio_ = &families_.prediction_ratio->Add(
      labels, Histogram::BucketBoundaries{0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0});
  model->planning_slack_ = &families_.planning_slack->Add(labels);
  model->executed_after_cancel_ = &families_.executed_after_cancel->Add(labels);
  model->compute_after_caller_left_ = &families_.compute_after_caller_left->Add(labels);
  // The repository's counters start at 0 with the model.
  families_.model_unloads->Add(labels);
  families_.model_loads->Add({{"model", info.name}, {"result", "ok"}});
  families_.model_loads->Add({{"model", info.name}, {"result", "failed"}});
  const int64_t layers = std::max(info.layers, existing != models_.end() ? existing->second->layers() : int64_t{0});
  for (int64_t layer = 0; layer < layers; ++layer) {
    const prometheus::Labels layer_labels = {{"model", info.name}, {"layer", std::to_string(layer)}};
    ModelMetrics::Layer series;
    series.load_imbalance = &families_.load_imbalance->Add(layer_labels, ImbalanceBuckets());
    series.routing_entropy = &families_.routing_entropy->Add(layer_labels, FractionBuckets());
    series.pruned_key_fraction = &families_.pruned_key_fraction->Add(layer_labels, FractionBuckets());
    model->layers_.push_back(series);
  }
  // GPU memory, per CUDA device a model runs on (the families only once a model is on one).
  if (absl::StatusOr<c10::Device> device = kernels::ParseDevice(info.device); device.ok() && device->is_cuda()) {
    if (families_.gpu_allocated == nullptr) {
      families_.gpu_allocated = &prometheus::BuildGauge()
                                     .Name("mita_gpu_memory_allocated_bytes")
                                     .Help("Bytes of the CUDA device's memory in tensors (LibTorch's caching "
                                           "allocator), after the last batch on it.")
                                     .Register(*registry_);
      families_.gpu_reserved = &prometheus::BuildGauge()
                                    .Name("mita_gpu_memory_reserved_bytes")
                                    .Help("Bytes of the CUDA device's memory LibTorch's caching allocator holds (in "
                                          "tensors and cached), after the last batch on it.")
                                    .Register(*registry_);
    }
    std::unique_ptr<DeviceMemoryGauges>& gauges = devices_[info.device];
    if (gauges == nullptr) {
      gauges = std::make_unique<DeviceMemoryGauges>();
      gauges->device_ = *device;
      gauges->allocated_ = &families_.gpu_allocated->Add({{"device", info.device}});
      gauges->reserved_ = &families_.gpu_reserved->Add({{"device", info.device}});
      gauges->Update();
    }
    model->device_memory_ = gauges.get();
  }
  ModelMetrics* added = model.get();
  if (existing != models_.end()) {
    replaced_models_.push_back(std::move(existing->second));
    existing->second = std::move(model);
  } else {
    models_.emplace(info.name, std::move(model));
  }
  return added;
}

void ServerMetrics::ObserveModelLoad(const std::string& model, int64_t version, bool ok, absl::Duration took) {
  families_.model_loads->Add({{"model", model}, {"result", ok ? "ok" : "failed"}}).Increment();
  if (ok) {
    families_.model_load_seconds->Add({{"model", model}, {"version", std::to_string(version)}})
        .Set(absl::ToDoubleSeconds(took));
  }
}

void ServerMetrics::SetModelReady(const std::string& model, int64_t version, bool ready) {
  families_.model_ready->Add({{"model", model}, {"version", std::to_string(version)}}).Set(ready ? 1 : 0);
}

void ServerMetrics::CountModelUnload(const std::string& model) {
  families_.model_unloads->Add({{"model", model}}).Increment();
}

ModelMetrics* ServerMetrics::ForModel(const std::string& name) {
  absl::MutexLock lock(&models_mu_);
  auto it = models_.find(name);
  return it == models_.end() ? nullptr : it->second.get();
}

ClientMetrics* ServerMetrics::ForClient(const std::string& name) {
  absl::MutexLock lock(&clients_mu_);
  std::unique_ptr<ClientMetrics>& client = clients_[name];
  if (client == nullptr) {
    client = std::make_unique<ClientMetrics>();
    client->name_ = name;
    for (int code = 0; code < kNumStatusCodes; ++code) {
      client->requests_[static_cast<size_t>(code)] = &client_requests_->Add(
          {{"client", name}, {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(code))}});
    }
    client->compute_units_ = &client_compute_units_->Add({{"client", name}});
    client->quota_refusals_ = &client_quota_refusals_->Add({{"client", name}});
    client->policy_refusals_family_ = client_policy_refusals_;
  }
  return client.get();
}

void ClientMetrics::CountRequest(absl::StatusCode code) {
  int index = static_cast<int>(code);
  if (index < 0 || index >= kNumStatusCodes) index = static_cast<int>(absl::StatusCode::kUnknown);
  requests_[static_cast<size_t>(index)]->Increment();
}

void ClientMetrics::DeclarePolicyRule(const std::string& rule) {
  absl::MutexLock lock(&mu_);
  prometheus::Counter*& counter = policy_refusals_[rule];
  if (counter == nullptr) counter = &policy_refusals_family_->Add({{"client", name_}, {"rule", rule}});
}

void ClientMetrics::CountPolicyRefusal(const std::string& rule) {
  absl::MutexLock lock(&mu_);
  prometheus::Counter*& counter = policy_refusals_[rule];
  if (counter == nullptr) counter = &policy_refusals_family_->Add({{"client", name_}, {"rule", rule}});
  counter->Increment();
}

void ServerMetrics::CountRequest(RpcMethod method, const ModelMetrics* model, absl::StatusCode code) {
  int index = static_cast<int>(code);
  if (index < 0 || index >= kNumStatusCodes) index = static_cast<int>(absl::StatusCode::kUnknown);
  const int m = static_cast<int>(method);
  if (m < 0 || m >= kNumRpcMethods) return;
  const CodeCounters& counters =
      (model == nullptr || !IsModelMethod(method)) ? other_requests_[m] : model->requests_[m];
  counters[index]->Increment();
}

void ServerMetrics::SetHeapMemory(int64_t kept_free_bytes, int64_t returned_bytes) {
  absl::MutexLock lock(&heap_mu_);
  heap_kept_free_->Set(static_cast<double>(kept_free_bytes));
  // The counter follows the running total it is given.
  const double increase = static_cast<double>(returned_bytes) - heap_returned_->Value();
  if (increase > 0) heap_returned_->Increment(increase);
}

void ServerMetrics::CallFinished() {
  absl::MutexLock lock(&uncounted_mu_);
  ++uncounted_calls_;
}

void ServerMetrics::CallCounted() {
  absl::MutexLock lock(&uncounted_mu_);
  --uncounted_calls_;
}

bool ServerMetrics::AwaitFinishedCallsCounted(absl::Duration bound) const {
  absl::MutexLock lock(&uncounted_mu_);
  const auto all_counted = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(uncounted_mu_) { return uncounted_calls_ <= 0; };
  return uncounted_mu_.AwaitWithTimeout(absl::Condition(&all_counted), bound);
}

}  // namespace mita::server
