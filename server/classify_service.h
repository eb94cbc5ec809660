// mita.v1.MitaService: Classify (validated and preprocessed in the handler thread, then batched per model),
// ListModels and GetModel. Synchronous gRPC API.
//
// Request path of Classify:
//   handler thread: look up the model (NOT_FOUND) -> check the input kind and the image (INVALID_ARGUMENT
//   naming the field) -> resolve the budget and top_n (INVALID_ARGUMENT with the allowed values) -> decode
//   and preprocess the image (INVALID_ARGUMENT "field image: ...") -> submit a task to the model's
//   DynamicBatcher (RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE while draining) -> wait for the
//   result; when the deadline passes or the call is cancelled while the task is still queued, take it back
//   out of the queue at once (its slot and the queue-depth gauge are freed then, not at batch formation)
//   and answer DEADLINE_EXCEEDED / CANCELLED.
//   batch thread: drop tasks whose call was cancelled (CANCELLED) or whose deadline has passed
//   (DEADLINE_EXCEEDED, not run) -> stack the images [B, C, H, W] -> VitClassifier::Forward with per-item
//   budgets and statistics -> softmax, top-N -> complete each task.
// Errors are absl::Status inside and converted once, by ToGrpcStatus, when a handler returns. A bad request
// never yields INTERNAL; INTERNAL means a server fault (e.g. the model failed on validated input).
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mita/v1/mita.grpc.pb.h"
#include "mita/v1/mita.pb.h"
#include "models/model_config.h"
#include "server/batcher.h"
#include "server/clock.h"
#include "server/metrics.h"
#include "server/model_registry.h"
#include "server/security.h"

namespace mita::server {

// Service limits and batching policy.
struct ServiceOptions {
  // Batching policy of every model's batcher (one batcher per model).
  BatcherOptions batching;
  // Largest accepted encoded image, bytes (ImageLimits.max_encoded_bytes). Keep it below the server's gRPC
  // receive limit, which rejects larger messages before the handler runs (RESOURCE_EXHAUSTED).
  int64_t max_encoded_image_bytes = int64_t{4} << 20;
  // How often the service's watcher thread looks whether the calls of queued requests were cancelled (gRPC's
  // synchronous API has no cancellation callback). A cancelled call's task leaves the queue within about
  // this time; deadlines are watched exactly.
  absl::Duration cancel_check_interval = absl::Milliseconds(2);
  // When set (not owned, must outlive the service), every mita.v1 call must carry its bearer token
  // (UNAUTHENTICATED otherwise, counted with model "unknown").
  const BearerTokenAuthenticator* authenticator = nullptr;
};

// The budget a request resolves to, and the preset name to echo ("default" when the request had none, the
// preset's name for a preset, "" for an explicit budget or full attention).
struct ResolvedBudget {
  models::AttentionBudget budget;
  std::string preset;
};

// Resolves a request's budget against a model's config: unset -> the default budget (preset "default");
// preset -> that preset; experts -> models::ValidateBudget; full attention.
// Errors: INVALID_ARGUMENT naming the field and the allowed values, e.g.
// "field budget.preset: unknown preset 'x'; available: accurate, balanced, fast".
absl::StatusOr<ResolvedBudget> ResolveBudget(const models::VitConfig& config, const v1::ClassifyRequest& request);

// Resolves top_n: 0 -> min(5, num_classes). Errors: INVALID_ARGUMENT "field top_n: ..." with the range when
// top_n < 0 or > num_classes.
absl::StatusOr<int64_t> ResolveTopN(int64_t top_n, int64_t num_classes);

// The metadata GetModel returns for `package`: input kind IMAGE with its limits, labels, and knobs.
v1::ModelMetadata BuildModelMetadata(const models::ModelPackage& package, int64_t max_encoded_image_bytes);

class ClassifyService final : public v1::MitaService::Service {
 public:
  // Starts one DynamicBatcher per model of `registry`. `registry`, `metrics` (built for the registry's
  // models) and `clock` must outlive the service.
  // Errors: INVALID_ARGUMENT for invalid batching options.
  static absl::StatusOr<std::unique_ptr<ClassifyService>> Create(const ModelRegistry* registry, ServerMetrics* metrics,
                                                                 ServiceOptions options,
                                                                 const Clock* clock = RealClock::Get());

  // Drains the batchers (Shutdown()).
  ~ClassifyService() override;

  grpc::Status Classify(grpc::ServerContext* context, const v1::ClassifyRequest* request,
                        v1::ClassifyResponse* response) override;
  grpc::Status ListModels(grpc::ServerContext* context, const v1::ListModelsRequest* request,
                          v1::ListModelsResponse* response) override;
  grpc::Status GetModel(grpc::ServerContext* context, const v1::GetModelRequest* request,
                        v1::ModelMetadata* response) override;

  // Stops accepting Classify work (UNAVAILABLE), runs everything already queued, and joins the batch
  // threads. Call after grpc::Server::Shutdown. Idempotent.
  void Shutdown();

  // Starts draining: from now on Classify answers UNAVAILABLE ("the server is shutting down") before doing
  // any work, and the batchers release what is queued without waiting for batches to fill. Admitted
  // requests still finish. Returns at once; idempotent.
  void BeginDrain();
  // Waits until no Classify call is in the service (admitted ones answered) or `deadline` passes. Returns
  // whether it became idle.
  bool WaitUntilIdle(absl::Time deadline);

  // Requests submitted to a batcher since start (admitted), and how many of them were answered OK or with
  // an error (cancelled, deadline passed, model failure). admitted - ok - failed are still in flight.
  struct AdmissionCounts {
    int64_t admitted = 0;
    int64_t ok = 0;
    int64_t failed = 0;
  };
  AdmissionCounts admission_counts() const;

 private:
  struct Task;
  struct TaskResult;
  struct ModelSlot {
    const models::ModelPackage* package = nullptr;
    ModelMetrics* metrics = nullptr;
    v1::ModelMetadata metadata;
    std::unique_ptr<DynamicBatcher<Task>> batcher;
  };

  ClassifyService(const ModelRegistry* registry, ServerMetrics* metrics, ServiceOptions options, const Clock* clock);

  // Classify without gRPC types: `deadline` is the call's deadline (absl::InfiniteFuture() for none),
  // `cancelled` tells whether the caller gave up. Fills everything but timing.total_us.
  absl::StatusOr<v1::ClassifyResponse> DoClassify(const ModelSlot& slot, const v1::ClassifyRequest& request,
                                                  absl::Time deadline, std::function<bool()> cancelled);
  // The slot of model `name`. On failure counts the RPC (`method`, model "unknown") and returns the
  // registry's error: INVALID_ARGUMENT for an empty name, NOT_FOUND for an unknown one.
  absl::StatusOr<const ModelSlot*> FindSlot(const std::string& name, RpcMethod method) const;
  // Waits for the result of the task queued with `ticket` (submitted at `submitted`). When the deadline
  // passes or the call is cancelled first (seen by WatchCancellations), takes the task out of the queue (or,
  // if a batch thread already holds it, makes sure it is not started) and returns DEADLINE_EXCEEDED /
  // CANCELLED; returns the batch thread's status otherwise.
  absl::Status WaitForResult(const ModelSlot& slot, uint64_t ticket, absl::Time deadline, absl::Time submitted,
                             const std::function<bool()>& cancelled, TaskResult& result);
  // Gives up on the task with `ticket`: takes it back out of the queue (kTakenBack: nobody else will answer
  // `result`), or marks it abandoned in a batch thread's hands so that it is never started (kAbandoned: the
  // batch thread completes it); kDecided when a batch thread had already started it (its result stands).
  enum class GiveUpOutcome { kTakenBack, kAbandoned, kDecided };
  GiveUpOutcome GiveUp(const ModelSlot& slot, uint64_t ticket, TaskResult& result);
  // The watcher thread: every cancel_check_interval, gives up on the queued requests whose call was
  // cancelled, answering their handlers at once when their task left the queue.
  void WatchCancellations();
  // OK without an authenticator; else its verdict on the call, counting a rejection under `method`.
  absl::Status Authenticate(const grpc::ServerContext& context, RpcMethod method) const;
  // Runs one batch on a batch thread.
  void ProcessBatch(const ModelSlot& slot, Batch<Task> batch);

  const ModelRegistry* const registry_;
  ServerMetrics* const metrics_;
  const ServiceOptions options_;
  const Clock* const clock_;
  std::map<std::string, std::unique_ptr<ModelSlot>> slots_;  // immutable after Create
  std::atomic<bool> draining_{false};
  absl::Mutex in_flight_mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(in_flight_mu_) = 0;  // Classify calls inside the service
  // Handlers waiting for a queued request, watched for cancellation: keyed by their TaskResult.
  struct Waiter {
    const ModelSlot* slot;
    uint64_t ticket;
    const std::function<bool()>* cancelled;
    TaskResult* result;
    absl::Time deadline;
    absl::Time submitted;
  };
  absl::Mutex watch_mu_;
  absl::CondVar watch_cv_;
  std::map<TaskResult*, Waiter*> waiters_ ABSL_GUARDED_BY(watch_mu_);
  bool stop_watching_ ABSL_GUARDED_BY(watch_mu_) = false;
  std::thread watcher_;
  std::atomic<int64_t> admitted_{0};
  std::atomic<int64_t> admitted_ok_{0};
  std::atomic<int64_t> admitted_failed_{0};
};

}  // namespace mita::server
