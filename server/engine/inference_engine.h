// The one request path every front end uses. A front end translates its request into an InferenceRequest
// (inference_request.h) and submits it; the engine answers it exactly once (its Request, request.h). Who admits
// what, in order:
//
//   1. Submit (front end's thread): draining (UNAVAILABLE) -> the model and version (NOT_FOUND) -> top_n
//      (INVALID_ARGUMENT) -> the client's budget rules (PERMISSION_DENIED naming the rule; its default preset for
//      the model's default) and quota (RESOURCE_EXHAUSTED with the time to wait; server/policy/budget_rules.h) ->
//      the deadline (DEADLINE_EXCEEDED) -> the lanes' planner for the cheapest input (ModelRunner::
//      AdmitBeforePreparation: DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED when no input could be answered in time) ->
//      the preparation queue (PreparationPool, RESOURCE_EXHAUSTED when --preparation_queue_capacity requests wait)
//   2. preparation thread: the input's working memory (PreparationMemory: waits for room, RESOURCE_EXHAUSTED over
//      --preparation_memory_bytes) -> Classifier::Prepare (input kind, budget, decode or tokenize:
//      INVALID_ARGUMENT with field problems) -> the client's rules that need the token count (full attention up
//      to a length; a latency target's budgets narrowed to the allowed ones: PERMISSION_DENIED when none is left)
//      -> the client's quota charged the item's compute units (given back if the lane refuses it)
//   3. its lane (ModelRunner routes, Lane plans then queues): the planner (a budget for a latency target;
//      DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED when predicted to miss its deadline or target) -> the queue
//      (BatchQueue: RESOURCE_EXHAUSTED naming --queue_capacity or --queue_compute_units, UNAVAILABLE while
//      draining)
//   4. batch thread (ModelRunner): requests whose caller left are answered and never run -> Classifier::Run on
//      the packed batch -> top classes -> each request answered
//   The caller leaving (InferenceCall::Cancel, from gRPC's OnCancel) is Request::Cancel: not started, it is
//   answered at once (CANCELLED, or DEADLINE_EXCEEDED when its deadline is why) and never run; started, its result
//   is discarded.
//
// Errors are absl::Status values with structured field problems (models/request_error.h) that the front end
// words in its own vocabulary. A bad request never yields INTERNAL; INTERNAL means a server fault.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "models/classifier.h"
#include "server/engine/inference_request.h"
#include "server/engine/model_registry.h"
#include "server/engine/model_runner.h"
#include "server/engine/preparation_pool.h"
#include "server/engine/request.h"
#include "server/metrics/metrics.h"
#include "server/planning/batcher.h"
#include "server/planning/clock.h"

namespace mita::server {

// Limits and batching policy of the engine.
struct EngineOptions {
  // Batching policy and admission limits of every model's batcher (one batcher per model).
  BatcherOptions batching;
  // Largest accepted encoded image, bytes. Keep it below the server's gRPC receive limit, which rejects larger
  // messages before any handler runs.
  int64_t max_encoded_image_bytes = int64_t{4} << 20;
  // Threads preparing inputs (decoding, tokenizing); 0: the hardware concurrency.
  int preparation_threads = 0;
  // Requests waiting for a preparation thread before new ones get RESOURCE_EXHAUSTED.
  int64_t preparation_queue_capacity = 1024;
  std::string preparation_queue_capacity_source = "flag --preparation_queue_capacity";
  // Working memory all preparations together may take (decoding images, tokenizing), bytes; an input is
  // admitted to preparation by its header's estimate (Classifier::PreparationBytes) and waits for room.
  int64_t preparation_memory_bytes = int64_t{1} << 30;
  // Inputs of more tokens run in a lane of their own (ModelRunner), beside shorter requests instead of ahead of
  // them; 0: one lane (mita-server --long_document_tokens).
  int64_t long_document_tokens = 8192;
  std::string preparation_memory_bytes_source = "flag --preparation_memory_bytes";
  // Each model's cost profile by name (server/planning/cost_calibration.h); a model without one uses its prior.
  std::map<std::string, CostProfile> cost_profiles;
  // How the lanes plan (server/planning/lane_planner.h).
  PlanningOptions planning;
  // Batch threads of the models named here, by name (mita-server --batch_threads=N,MODEL=N); the others have
  // batching.num_batch_threads.
  std::map<std::string, int> batch_threads_by_model;
  // The intra-op threads one lane's forwards share (mita-server --torch_threads): each of a lane's batch threads
  // runs on intra_op_threads / its batch threads, at least 1 (ModelRunner::Create); 0: as the process set them.
  int intra_op_threads = 0;

  // Batch threads of model `name`: its entry of batch_threads_by_model, else batching.num_batch_threads.
  int BatchThreadsOf(const std::string& name) const {
    auto threads = batch_threads_by_model.find(name);
    return threads != batch_threads_by_model.end() ? threads->second : batching.num_batch_threads;
  }
};

// One version of a model as the engine serves it: its package and the runner of its lanes. Front ends hold it
// (FindModel) while they read its description; a request holds it until it is answered, so a version replaced or
// unloaded meanwhile finishes its requests on its own weights and is freed after the last (ReleaseRetired).
class ServedModel {
 public:
  ServedModel(std::string name, int64_t version, std::shared_ptr<const models::ModelPackage> package,
              std::unique_ptr<ModelRunner> runner)
      : name_(std::move(name)), version_(version), package_(std::move(package)), runner_(std::move(runner)) {}
  const std::string& name() const { return name_; }
  // The version number (>= 1; a package without version folders is version 1).
  int64_t version() const { return version_; }
  const models::ClassifierDescription& description() const { return package_->classifier->description(); }
  ModelRunner& runner() const { return *runner_; }

 private:
  const std::string name_;
  const int64_t version_;
  const std::shared_ptr<const models::ModelPackage> package_;
  const std::unique_ptr<ModelRunner> runner_;
};
using ModelHandle = std::shared_ptr<const ServedModel>;

// A submitted request, for its caller: Cancel() says the caller stopped waiting. Thread-safe.
class InferenceCall {
 public:
  explicit InferenceCall(std::shared_ptr<Request> request) : request_(std::move(request)) {}
  // The caller gave up (its call was cancelled, or its deadline passed): Request::Cancel. Idempotent.
  void Cancel() { request_->Cancel(); }

 private:
  const std::shared_ptr<Request> request_;
};

class InferenceEngine final {
 public:
  // Serves every model of `registry` as version 1 (nullptr: none yet; ServeVersion adds models). `registry`,
  // `metrics` and `clock` must outlive the engine. Errors: INVALID_ARGUMENT for invalid options.
  static absl::StatusOr<std::unique_ptr<InferenceEngine>> Create(const ModelRegistry* registry,
                                                                 ServerMetrics* metrics, EngineOptions options,
                                                                 const Clock* clock = RealClock::Get());
  // Shutdown().
  ~InferenceEngine();

  // Starts answering `request`: `done` is called exactly once, with the result or the error (see the file
  // comment for the codes), on this thread or another. The returned call lets the caller give up.
  // `model`: the version the front end resolved (FindModel) to translate the request, which then runs on it even
  // if it was replaced meanwhile; nullptr: the engine resolves request.model and request.model_version.
  std::unique_ptr<InferenceCall> Submit(InferenceRequest request, InferenceDone done, ModelHandle model = nullptr);

  // Version `version` of model `name`; version 0: its highest served version. Errors: INVALID_ARGUMENT (a
  // RequestField::kModel problem) for an empty name; NOT_FOUND "model 'x' not found; available: a, b", or "model
  // 'x' has no version 3; served: 1, 2".
  absl::StatusOr<ModelHandle> FindModel(const std::string& name, int64_t version = 0) const;
  // The highest served version of every model, sorted by name.
  std::vector<ModelHandle> models() const;
  // The cost figures of model `name`'s highest served version (GetModel). Errors: FindModel's.
  absl::StatusOr<CostSummary> CostSummaryOf(const std::string& name) const;
  // The served versions of model `name`, ascending (empty when it is not served).
  std::vector<int64_t> versions(const std::string& name) const;

  // Starts serving `package` as version `version` (>= 1) of model `name` with cost profile `profile`: new requests
  // for the model's highest version, or for this one, go to it from now on. A version of the same number already
  // served is retired (its admitted requests finish on it). Errors: ModelRunner::Create's (INVALID_ARGUMENT);
  // UNAVAILABLE while draining.
  absl::Status ServeVersion(const std::string& name, int64_t version, std::shared_ptr<const models::ModelPackage> package,
                            CostProfile profile);
  // Stops routing new requests to the versions of `name` not in `keep` (all of them when `keep` is empty) and
  // returns them, ascending. Their admitted requests finish on them; ReleaseRetired frees them.
  std::vector<int64_t> RetireVersions(const std::string& name, const std::set<int64_t>& keep);
  // Frees every retired version whose requests are all answered, waiting for them until `deadline`: its lanes stop
  // and its package is released (and the freed heap returned to the system). Returns the (model, version) pairs
  // freed; a version still in use at `deadline` stays retired for a later call.
  std::vector<std::pair<std::string, int64_t>> ReleaseRetired(absl::Time deadline);
  // The limits an input meets (images: max_encoded_image_bytes; documents: max_tokens, the smaller of the
  // model's and max_batch_tokens, applied in Prepare).
  const models::InputLimits& input_limits() const { return input_limits_; }
  const EngineOptions& options() const { return options_; }

  // Starts draining: from now on Submit answers UNAVAILABLE ("the server is shutting down") before doing any
  // work, and the batchers release what is queued without waiting for batches to fill. Submitted requests
  // still finish. Returns at once; idempotent.
  void BeginDrain();
  // Waits until every submitted request has been answered or `deadline` passes; whether it became idle.
  bool WaitUntilIdle(absl::Time deadline);
  // Stops accepting work, runs everything already submitted, and joins the threads. Idempotent.
  void Shutdown();

  // Requests admitted to a batcher since start, and how many of them were answered OK or with an error
  // (cancelled, deadline passed, model failure). admitted - ok - failed are still in flight.
  struct AdmissionCounts {
    int64_t admitted = 0;
    int64_t ok = 0;
    int64_t failed = 0;
  };
  AdmissionCounts admission_counts() const;

 private:
  InferenceEngine(ServerMetrics* metrics, EngineOptions options, const Clock* clock);

  // Prepares `request` for `runner` and hands it to its lane, on a preparation thread.
  void Prepare(const std::shared_ptr<Request>& request, ModelRunner* runner);
  // FindModel under models_mu_.
  absl::StatusOr<std::shared_ptr<ServedModel>> FindLocked(const std::string& name, int64_t version) const
      ABSL_SHARED_LOCKS_REQUIRED(models_mu_);
  // The client's budget rules and quota before any work (server/policy/budget_rules.h: AdmitBudgetRequest, then
  // CheckQuota), counted per client; OK for a request without a client. May rewrite request->budget (the client's
  // default preset).
  absl::Status AdmitClient(const ModelRunner& runner, InferenceRequest* request);
  // The client's rules on the prepared `*item` (AdmitPreparedItem), counted per client.
  absl::Status AdmitPreparedForClient(const ModelRunner& runner, const InferenceRequest& request,
                                      models::BatchItem* item);
  // A request was answered (Request's bookkeeping hook): in flight and admission counts.
  void Answered(bool admitted, bool ok);

  ServerMetrics* const metrics_;
  const EngineOptions options_;
  const Clock* const clock_;
  models::InputLimits input_limits_;
  mutable absl::Mutex models_mu_;
  // The served versions of each model, by version.
  std::map<std::string, std::map<int64_t, std::shared_ptr<ServedModel>>> served_ ABSL_GUARDED_BY(models_mu_);
  // Versions no longer served whose requests may still run (ReleaseRetired frees them).
  std::vector<std::shared_ptr<ServedModel>> retired_ ABSL_GUARDED_BY(models_mu_);
  std::unique_ptr<PreparationPool> preparation_;
  std::unique_ptr<PreparationMemory> preparation_memory_;
  std::atomic<bool> draining_{false};
  absl::Mutex in_flight_mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(in_flight_mu_) = 0;  // submitted, not yet answered
  std::atomic<int64_t> admitted_{0};
  std::atomic<int64_t> admitted_ok_{0};
  std::atomic<int64_t> admitted_failed_{0};
};

// The model list ServerMetrics is built for: every package of `registry`, with its attention layers.
std::vector<ServerMetrics::ModelInfo> MetricsModelInfos(const ModelRegistry& registry);

// Resolves top_n: 0 -> min(5, classes). Errors: INVALID_ARGUMENT (a RequestField::kTopN problem, "-1 is out of
// range: allowed [0, 10] (0 means 5)") when top_n < 0 or > classes.
absl::StatusOr<int64_t> ResolveTopN(int64_t top_n, int64_t classes);

}  // namespace mita::server
