// mita.v1.MitaService: Classify (validated and preprocessed in the handler thread, then batched per model),
// ListModels and GetModel. Synchronous gRPC API.
//
// Request path of Classify:
//   handler thread: look up the model (NOT_FOUND) -> check the input kind and the image (INVALID_ARGUMENT
//   naming the field) -> resolve the budget and top_n (INVALID_ARGUMENT with the allowed values) -> decode
//   and preprocess the image (INVALID_ARGUMENT "field image: ...") -> submit a task to the model's
//   DynamicBatcher (RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE while draining) -> wait.
//   batch thread: drop tasks whose call was cancelled (CANCELLED) or whose deadline has passed
//   (DEADLINE_EXCEEDED, not run) -> stack the images [B, C, H, W] -> VitClassifier::Forward with per-item
//   budgets and statistics -> softmax, top-N -> complete each task.
// Errors are absl::Status inside and converted once, by ToGrpcStatus, when a handler returns. A bad request
// never yields INTERNAL; INTERNAL means a server fault (e.g. the model failed on validated input).
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mita/v1/mita.grpc.pb.h"
#include "mita/v1/mita.pb.h"
#include "models/model_config.h"
#include "server/batcher.h"
#include "server/clock.h"
#include "server/message_limits.h"
#include "server/metrics.h"
#include "server/model_registry.h"

namespace mita::server {

// Service limits and batching policy.
struct ServiceOptions {
  // Batching policy of every model's batcher (one batcher per model).
  BatcherOptions batching;
  // Largest accepted encoded image, bytes (ImageLimits.max_encoded_bytes). Keep it below the server's gRPC
  // receive limit, which rejects larger messages before the handler runs (RESOURCE_EXHAUSTED).
  int64_t max_encoded_image_bytes = int64_t{4} << 20;
  // When set, Classify requests and every response over its limits get RESOURCE_EXHAUSTED naming the limit
  // and its flag (server/message_limits.h).
  std::shared_ptr<const MessageSizeGuard> message_size;
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
  // Runs one batch on a batch thread.
  void ProcessBatch(const ModelSlot& slot, Batch<Task> batch);

  const ModelRegistry* const registry_;
  ServerMetrics* const metrics_;
  const ServiceOptions options_;
  const Clock* const clock_;
  std::map<std::string, std::unique_ptr<ModelSlot>> slots_;  // immutable after Create
};

}  // namespace mita::server
