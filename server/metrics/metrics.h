// Prometheus metrics of the server (prometheus-cpp), scraped over HTTP at /metrics on a separate address
// (metrics_http_server.h). The list of series, their types, labels and meaning is docs/metrics.md (checked
// against a live scrape and these sources by tests/metrics_docs_test.cc).
//
// Families are registered once at start and every label combination is created up front; the hot path only
// observes through references kept here (no lookups, no allocation, no locks beyond the metric's own atomics).
// Label sets are bounded: model names come from the model registry, never from a request (a request for an
// unknown model is counted with model="unknown"); code is the gRPC status code name ("OK",
// "INVALID_ARGUMENT", ...); method is the RPC name; layer is the transformer block index "0" .. depth-1.
//
// The series, their types, labels and meaning: docs/metrics.md (the one list; tests/metrics_docs_test.cc checks it
// against a live scrape).
// Attention statistics are always computed by the server for these metrics; they are returned to a client
// only when it asks (ClassifyRequest.return_statistics).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include <c10/core/Device.h>
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "models/budget.h"
#include "server/planning/batcher.h"
#include "server/planning/latency_planner.h"

namespace mita::server {

// The RPCs counted in mita_requests_total, under their own names: mita.v1's and the Open Inference Protocol's.
enum class RpcMethod {
  kClassify = 0,
  kListModels = 1,
  kGetModel = 2,
  kModelInfer = 3,
  kModelMetadata = 4,
  kModelReady = 5,
  kServerLive = 6,
  kServerReady = 7,
  kServerMetadata = 8,
  kModelConfig = 9,
  kRepositoryIndex = 10,
  kRepositoryModelLoad = 11,
  kRepositoryModelUnload = 12,
  kListRepository = 13,
  kLoadModel = 14,
  kUnloadModel = 15,
};
inline constexpr int kNumRpcMethods = 16;
// The method's name in the label ("Classify", "ModelInfer", ...).
const char* RpcMethodName(RpcMethod method);
// Whether a call of `method` is about one model (counted with model="<name>" or "unknown"); the others are
// server-wide (model="").
bool IsModelMethod(RpcMethod method);
// Whether `method` classifies (its latency is observed).
inline bool IsInferenceMethod(RpcMethod method) {
  return method == RpcMethod::kClassify || method == RpcMethod::kModelInfer;
}
// gRPC status codes 0 (OK) .. 16 (UNAUTHENTICATED).
inline constexpr int kNumStatusCodes = 17;

// GPU memory of one CUDA device (label device="cuda:N"), read from LibTorch's caching allocator. Thread-safe.
class DeviceMemoryGauges {
 public:
  // Sets both gauges from the allocator's current counts (a failed read leaves them as they were).
  void Update();

 private:
  friend class ServerMetrics;
  c10::Device device_ = c10::Device(c10::kCUDA, 0);
  prometheus::Gauge* allocated_ = nullptr;
  prometheus::Gauge* reserved_ = nullptr;
};

// The metrics of one model (label model="<name>"). Thread-safe; all methods only observe.
class ModelMetrics {
 public:
  // Time from receipt to answer of a successful Classify or ModelInfer.
  void ObserveLatency(absl::Duration total) { latency_->Observe(absl::ToDoubleSeconds(total)); }
  // Admission to batch start of one request.
  void ObserveQueueDelay(absl::Duration delay) { queue_delay_->Observe(absl::ToDoubleSeconds(delay)); }
  // Forward time of the batch that ran one request.
  void ObserveCompute(absl::Duration compute) { compute_->Observe(absl::ToDoubleSeconds(compute)); }
  // One request run although its caller had given up before its batch started.
  void CountExecutedAfterCancel() { executed_after_cancel_->Increment(); }
  // Forward time spent for callers who had already left (their share of a batch, from when they left to when
  // their work stopped).
  void AddComputeAfterCallerLeft(absl::Duration compute) {
    compute_after_caller_left_->Increment(absl::ToDoubleSeconds(compute));
  }
  // Requests in one batch run.
  void ObserveBatchSize(int64_t requests) { batch_size_->Observe(static_cast<double>(requests)); }
  // Tokens of one packed batch run.
  void ObserveBatchTokens(int64_t tokens) { batch_tokens_->Observe(static_cast<double>(tokens)); }
  // Tokens of one admitted request.
  void ObserveRequestTokens(int64_t tokens) { request_tokens_->Observe(static_cast<double>(tokens)); }
  // One request refused at admission for `reason` (kNone is ignored).
  void CountRejection(AdmissionRejection reason);
  // One admitted request's budget choice, by why it was chosen (requests lowered again at their batch's start
  // count once more, as lowered_at_batch_start).
  void CountBudgetChoice(BudgetReason reason) { budget_choices_[static_cast<size_t>(reason)]->Increment(); }
  // measured / predicted compute of one batch (the cost model's error).
  void ObservePredictionRatio(double ratio) { prediction_ratio_->Observe(ratio); }
  // The slack admission planned with last (LanePlanner, PlanningSlack).
  void SetPlanningSlack(absl::Duration slack) { planning_slack_->Set(absl::ToDoubleSeconds(slack)); }
  // The budget of one admitted request: as requested (resolved against the model's defaults and presets; full
  // attention, or expert count m and expert width k), and as applied to its input (m and k at most its tokens).
  void ObserveBudget(const models::AttentionBudget& requested, const models::AttentionBudget& applied);
  // Adds to this model's queue depth and queued compute units (may be negative).
  void AddQueued(int64_t tasks, int64_t compute_units) {
    queue_depth_->Increment(static_cast<double>(tasks));
    queue_compute_units_->Increment(static_cast<double>(compute_units));
  }
  // Routing and pruning statistics of one request that ran MiTA, for `layer` in [0, layers); other layers
  // are ignored.
  void ObserveLayer(int64_t layer, double load_imbalance, double routing_entropy, double pruned_key_fraction);
  // Reads the GPU memory of the model's device into its gauges (after each batch); nothing on the CPU.
  void ObserveDeviceMemory() {
    if (device_memory_ != nullptr) device_memory_->Update();
  }

  const std::string& name() const { return name_; }
  int64_t layers() const { return static_cast<int64_t>(layers_.size()); }
  const std::string& device() const { return device_; }

 private:
  friend class ServerMetrics;
  struct Layer {
    prometheus::Histogram* load_imbalance = nullptr;
    prometheus::Histogram* routing_entropy = nullptr;
    prometheus::Histogram* pruned_key_fraction = nullptr;
  };
  using CodeCounters = std::array<prometheus::Counter*, kNumStatusCodes>;
  std::string name_;
  std::string device_;
  // mita_requests_total{method, model=name_, code} for Classify and GetModel (indexed by RpcMethod).
  std::array<CodeCounters, kNumRpcMethods> requests_{};
  prometheus::Histogram* latency_ = nullptr;
  prometheus::Histogram* queue_delay_ = nullptr;
  prometheus::Histogram* compute_ = nullptr;
  prometheus::Histogram* batch_size_ = nullptr;
  prometheus::Histogram* batch_tokens_ = nullptr;
  prometheus::Histogram* request_tokens_ = nullptr;
  std::array<prometheus::Counter*, kNumAdmissionRejections> rejections_{};
  prometheus::Histogram* expert_count_ = nullptr;
  prometheus::Histogram* expert_width_ = nullptr;
  prometheus::Histogram* applied_expert_count_ = nullptr;
  prometheus::Histogram* applied_expert_width_ = nullptr;
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Gauge* queue_compute_units_ = nullptr;
  prometheus::Counter* full_attention_ = nullptr;
  std::array<prometheus::Counter*, kNumBudgetReasons> budget_choices_{};  // by BudgetReason
  prometheus::Histogram* prediction_ratio_ = nullptr;
  prometheus::Gauge* planning_slack_ = nullptr;
  prometheus::Counter* executed_after_cancel_ = nullptr;
  prometheus::Counter* compute_after_caller_left_ = nullptr;
  std::vector<Layer> layers_;
  DeviceMemoryGauges* device_memory_ = nullptr;  // the model's CUDA device; null on the CPU
};

// The metrics of one client of the budget policy (label client="<name>": a name from the policy file, or
// "default"; server/policy/client_policy.h). Thread-safe.
class ClientMetrics {
 public:
  // One inference call of this client answered with `code` (counted when gRPC is done with it).
  void CountRequest(absl::StatusCode code);
  // Compute units (models::ComputeUnits) of one request admitted to its lane, as charged to the client's quota.
  void AddComputeUnits(int64_t compute_units) { compute_units_->Increment(static_cast<double>(compute_units)); }
  // One request refused because the client was over its quota.
  void CountQuotaRefusal() { quota_refusals_->Increment(); }
  // One request refused by the client's rules; `rule` is a rule name of server/policy/budget_rules.h (a fixed set).
  void CountPolicyRefusal(const std::string& rule) ABSL_LOCKS_EXCLUDED(mu_);
  // Creates the series of `rule` at 0, so that it is exported before the first refusal.
  void DeclarePolicyRule(const std::string& rule) ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& name() const { return name_; }

 private:
  friend class ServerMetrics;
  std::string name_;
  std::array<prometheus::Counter*, kNumStatusCodes> requests_{};
  prometheus::Counter* compute_units_ = nullptr;
  prometheus::Counter* quota_refusals_ = nullptr;
  prometheus::Family<prometheus::Counter>* policy_refusals_family_ = nullptr;
  absl::Mutex mu_;
  std::map<std::string, prometheus::Counter*> policy_refusals_ ABSL_GUARDED_BY(mu_);
};

// All server metrics, registered once in one prometheus::Registry. Thread-safe.
class ServerMetrics {
 public:
  // A hosted model: its name (from the repository), its number of attention layers, and its device ("cpu",
  // "cuda:N": ClassifierDescription::device).
  struct ModelInfo {
    std::string name;
    int64_t layers = 0;
    std::string device = "cpu";
  };

  // Registers every family and adds `models` (AddModel).
  explicit ServerMetrics(const std::vector<ModelInfo>& models);

  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // Creates the series of model `info.name` (the GPU memory families only once a model is on a CUDA device: one
  // series per such device) and returns its metrics; a model added before is returned as it is, unless `info` has
  // more layers or another device (then a new object over the same series; the old one stays valid). Models are
  // added at start and as the repository loads them; their names come from the repository, never from a request.
  ModelMetrics* AddModel(const ModelInfo& info);

  // The metrics of model `name`, or nullptr when it was never added. Not for the hot path (a map lookup under a
  // lock): resolve once and keep the pointer.
  ModelMetrics* ForModel(const std::string& name);

  // A load of `model` version `version` from the repository ended: mita_model_loads_total{model, result} and, when
  // `ok`, mita_model_load_seconds{model, version} = `took`.
  void ObserveModelLoad(const std::string& model, int64_t version, bool ok, absl::Duration took);
  // mita_model_ready{model, version}: 1 while the version serves requests.
  void SetModelReady(const std::string& model, int64_t version, bool ready);
  // mita_model_unloads_total{model}: a version unloaded after its requests finished.
  void CountModelUnload(const std::string& model);

  // The metrics of the budget policy's client `name`, its series created on first use. `name` must come from the
  // policy (a client's name or "default"), never from a request: the label set stays as bounded as the policy.
  ClientMetrics* ForClient(const std::string& name) ABSL_LOCKS_EXCLUDED(clients_mu_);
  // Counts one answered RPC. `model` is nullptr for an unknown model (counted as model="unknown"), and
  // ignored for server-wide methods (model=""). Codes outside 0..16 count as UNKNOWN.
  void CountRequest(RpcMethod method, const ModelMetrics* model, absl::StatusCode code);

  // A call is counted when gRPC is done with it (UnaryCallReactor::OnDone), which can be just after its client has
  // the answer. CallFinished notes a call whose status went to gRPC; CallCounted (after CountRequest) one counted.
  void CallFinished();
  void CallCounted();
  // Waits until every call noted by CallFinished is counted, at most `bound`; returns whether they all are. For
  // readers of the counts that have their answers (tests).
  bool AwaitFinishedCallsCounted(absl::Duration bound = absl::Seconds(30)) const;

  // Sets mita_preparation_memory_bytes.
  void SetPreparationMemory(int64_t bytes) { preparation_memory_->Set(static_cast<double>(bytes)); }

  // Sets mita_heap_kept_free_bytes, and mita_heap_returned_bytes_total to `returned_bytes`, a running total
  // (kernels::FreedMemoryLimit::Stats).
  void SetHeapMemory(int64_t kept_free_bytes, int64_t returned_bytes);

  // Counts a call that arrived as a retry: its client's retry policy re-sent it after an earlier attempt failed
  // (gRPC metadata grpc-previous-rpc-attempts > 0), mita_retried_calls_total.
  void CountRetriedCall() { retried_calls_->Increment(); }
  // mita_retried_calls_total so far.
  int64_t retried_calls() const { return static_cast<int64_t>(retried_calls_->Value()); }

  // The registry to serve (MetricsHttpServer) or collect in tests.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  using CodeCounters = std::array<prometheus::Counter*, kNumStatusCodes>;
  // The families a model's series are added to (AddModel), and the repository's.
  struct Families {
    prometheus::Family<prometheus::Counter>* requests = nullptr;
    prometheus::Family<prometheus::Histogram>* latency = nullptr;
    prometheus::Family<prometheus::Histogram>* queue_delay = nullptr;
    prometheus::Family<prometheus::Histogram>* compute = nullptr;
    prometheus::Family<prometheus::Histogram>* batch_size = nullptr;
    prometheus::Family<prometheus::Gauge>* queue_depth = nullptr;
    prometheus::Family<prometheus::Gauge>* queue_compute_units = nullptr;
    prometheus::Family<prometheus::Counter>* rejected = nullptr;
    prometheus::Family<prometheus::Counter>* budget_choices = nullptr;
    prometheus::Family<prometheus::Histogram>* prediction_ratio = nullptr;
    prometheus::Family<prometheus::Gauge>* planning_slack = nullptr;
    prometheus::Family<prometheus::Histogram>* request_tokens = nullptr;
    prometheus::Family<prometheus::Histogram>* batch_tokens = nullptr;
    prometheus::Family<prometheus::Histogram>* expert_count = nullptr;
    prometheus::Family<prometheus::Histogram>* expert_width = nullptr;
    prometheus::Family<prometheus::Histogram>* applied_expert_count = nullptr;
    prometheus::Family<prometheus::Histogram>* applied_expert_width = nullptr;
    prometheus::Family<prometheus::Counter>* full_attention = nullptr;
    prometheus::Family<prometheus::Counter>* executed_after_cancel = nullptr;
    prometheus::Family<prometheus::Counter>* compute_after_caller_left = nullptr;
    prometheus::Family<prometheus::Histogram>* load_imbalance = nullptr;
    prometheus::Family<prometheus::Histogram>* routing_entropy = nullptr;
    prometheus::Family<prometheus::Histogram>* pruned_key_fraction = nullptr;
    prometheus::Family<prometheus::Gauge>* gpu_allocated = nullptr;  // registered with the first CUDA model
    prometheus::Family<prometheus::Gauge>* gpu_reserved = nullptr;
    prometheus::Family<prometheus::Gauge>* model_ready = nullptr;
    prometheus::Family<prometheus::Gauge>* model_load_seconds = nullptr;
    prometheus::Family<prometheus::Counter>* model_loads = nullptr;
    prometheus::Family<prometheus::Counter>* model_unloads = nullptr;
  };
  // mita_requests_total's counters of `method` about `model`, one per code.
  CodeCounters CodeCountersFor(RpcMethod method, const std::string& model);

  std::shared_ptr<prometheus::Registry> registry_;
  Families families_;
  absl::Mutex models_mu_;
  std::map<std::string, std::unique_ptr<ModelMetrics>> models_ ABSL_GUARDED_BY(models_mu_);
  // Objects AddModel replaced, kept for the runners that hold them.
  std::vector<std::unique_ptr<ModelMetrics>> replaced_models_ ABSL_GUARDED_BY(models_mu_);
  std::map<std::string, std::unique_ptr<DeviceMemoryGauges>> devices_ ABSL_GUARDED_BY(models_mu_);  // by device
  // mita_requests_total with model="unknown" (model methods) and model="" (server-wide ones), by RpcMethod.
  std::array<CodeCounters, kNumRpcMethods> other_requests_{};
  prometheus::Gauge* preparation_memory_ = nullptr;
  prometheus::Gauge* heap_kept_free_ = nullptr;
  prometheus::Counter* heap_returned_ = nullptr;
  prometheus::Counter* retried_calls_ = nullptr;
  absl::Mutex heap_mu_;  // SetHeapMemory's read and increment of heap_returned_
  // The families of the budget policy's clients, and each client's series.
  prometheus::Family<prometheus::Counter>* client_requests_ = nullptr;
  prometheus::Family<prometheus::Counter>* client_compute_units_ = nullptr;
  prometheus::Family<prometheus::Counter>* client_quota_refusals_ = nullptr;
  prometheus::Family<prometheus::Counter>* client_policy_refusals_ = nullptr;
  absl::Mutex clients_mu_;
  std::map<std::string, std::unique_ptr<ClientMetrics>> clients_ ABSL_GUARDED_BY(clients_mu_);
  mutable absl::Mutex uncounted_mu_;
  int64_t uncounted_calls_ ABSL_GUARDED_BY(uncounted_mu_) = 0;  // finished, not yet counted
};

}  // namespace mita::server
