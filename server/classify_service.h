// mita.v1.MitaService: Classify (validated and preprocessed in the handler thread, then batched per model),
// ListModels and GetModel. Synchronous gRPC API.
//
// Request path of Classify (one function, ClassifyService::HandleClassify, that other front ends reuse):
//   handler thread: look up the model (NOT_FOUND) -> check the input kind (INVALID_ARGUMENT "field input:
//   ..." for an image sent to a document model and vice versa) -> resolve the budget and top_n
//   (INVALID_ARGUMENT with the allowed values) -> image models: decode and preprocess the image
//   (INVALID_ARGUMENT "field image: ..."); document models: validate UTF-8 and tokenize the text, or
//   range-check the token ids, apply the length limit or truncation (TokenizeDocument), and clamp the budget
//   to the document (models::ApplyDocumentBudget) -> submit a task to the model's DynamicBatcher (admission:
//   RESOURCE_EXHAUSTED when the queue is full in requests or compute units, UNAVAILABLE while draining;
//   counted in mita_rejected_requests_total by reason) -> wait for the result; when the deadline passes or
//   the call is cancelled while the task is still queued, take it back out of the queue at once (its slot
//   and the queue-depth gauge are freed then, not at batch formation) and answer DEADLINE_EXCEEDED /
//   CANCELLED.
//   Admission units (server/batcher.h): a task's tokens are the tokens it adds to the packed batch (image:
//   patches + cls; document: its tokens after truncation); its compute units are tokens x attention width
//   (M + k for MiTA, N for full attention).
//   batch thread: drop tasks whose call was cancelled (CANCELLED) or whose deadline has passed
//   (DEADLINE_EXCEEDED, not run) -> image models: stack the images [B, C, H, W] -> VitClassifier::Forward;
//   document models: pack the token ids back to back [T] (no padding) -> DocumentClassifier::Forward with
//   the B lengths; both with per-item budgets and statistics -> softmax, top-N -> complete each task.
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
#include "models/model_package.h"
#include "models/tokenizer.h"
#include "server/batcher.h"
#include "server/clock.h"
#include "server/message_limits.h"
#include "server/metrics.h"
#include "server/model_registry.h"
#include "server/security.h"

namespace mita::server {

// Service limits and batching policy.
struct ServiceOptions {
  // Batching policy and admission limits of every model's batcher (one batcher per model): batches bounded
  // by requests (max_batch_size) and tokens (max_batch_tokens), the queue by compute units
  // (queue_compute_units) and requests (queue_capacity).
  BatcherOptions batching;
  // Largest accepted encoded image, bytes (ImageLimits.max_encoded_bytes). Keep it below the server's gRPC
  // receive limit, which rejects larger messages before the handler runs (RESOURCE_EXHAUSTED).
  int64_t max_encoded_image_bytes = int64_t{4} << 20;
  // When set, Classify requests and every response over its limits get RESOURCE_EXHAUSTED naming the limit
  // and its flag (server/message_limits.h).
  std::shared_ptr<const MessageSizeGuard> message_size;
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

// As ResolveBudget, for a document model: experts -> models::ValidateDocumentBudget (expert_count in
// [1, max_expert_count], expert_width in [1, max_expert_width]). The budget applied to a document is then
// models::ApplyDocumentBudget(budget, tokens) (m and k at most the document's tokens N).
absl::StatusOr<ResolvedBudget> ResolveDocumentBudget(const models::DocumentConfig& config,
                                                     const v1::ClassifyRequest& request);

// What a document may be: at most max_tokens tokens (named by max_tokens_source in errors, e.g. "the
// model's max_tokens" or "flag --max_batch_tokens"), token ids in [0, vocab_size).
struct DocumentLimits {
  int64_t max_tokens = 0;
  std::string max_tokens_source;
  int64_t vocab_size = 0;
};

// A request's document as token ids.
struct TokenizedDocument {
  std::vector<int64_t> token_ids;  // 1 .. max_tokens ids, in [0, vocab_size)
  int64_t input_tokens = 0;        // tokens before truncation (>= token_ids.size())
};

// Validates and tokenizes a request's document (DESIGN.md section 4): text is checked as UTF-8 and encoded
// with `tokenizer`; token ids are range-checked against limits.vocab_size. A document longer than
// limits.max_tokens is cut to its first max_tokens tokens when document.truncate is set.
// Errors, all INVALID_ARGUMENT naming the field: neither text nor ids ("field document: ..."); invalid UTF-8
// ("field document.text: invalid UTF-8 at byte offset 3"); an empty document or text without tokens ("...
// the document is empty; a document needs at least 1 token"); an id out of range ("field
// document.token_ids.ids[7]: 300 is out of range: allowed [0, 255]"); too long without truncate ("field
// document.text: the document has 70000 tokens, over the limit of 65536 tokens (the model's max_tokens); set
// document.truncate ..."). `tokenizer` may be null only for token-id documents.
absl::StatusOr<TokenizedDocument> TokenizeDocument(const v1::Document& document, const models::Tokenizer* tokenizer,
                                                   const DocumentLimits& limits);

// Attention layers of a package's model (image or document): the layer label range of its metrics.
int64_t AttentionLayers(const models::ModelPackage& package);

// The model list ServerMetrics is built for: every package of `registry`, with its attention layers.
std::vector<ServerMetrics::ModelInfo> MetricsModelInfos(const ModelRegistry& registry);

// Resolves top_n: 0 -> min(5, num_classes). Errors: INVALID_ARGUMENT "field top_n: ..." with the range when
// top_n < 0 or > num_classes.
absl::StatusOr<int64_t> ResolveTopN(int64_t top_n, int64_t num_classes);

// Compute units of one request (server/batcher.h): tokens x attention width, where the width is
// expert_count + expert_width (M + k: the M shared-expert outputs and the k keys of the query's routed
// expert, DESIGN.md section 2) under MiTA and `tokens` (N) under full attention. `budget` is the budget
// applied to the input.
int64_t ComputeUnits(int64_t tokens, const models::AttentionBudget& budget);

// The metadata GetModel returns for `package` served with `options`: input kind (IMAGE or DOCUMENT) with its
// limits (ImageLimits, or DocumentLimits whose max_tokens is min(model max_tokens, max_batch_tokens)),
// labels, and knobs (allowed ranges, default budget, presets).
v1::ModelMetadata BuildModelMetadata(const models::ModelPackage& package, const ServiceOptions& options);

// The status every request of a batch gets when the model's forward pass failed with `forward`. The requests
// were validated, so the fault is the server's: INTERNAL "model 'NAME' failed: ...", except out of memory
// (RESOURCE_EXHAUSTED from models/ and kernels/aten_errors.h), which stays RESOURCE_EXHAUSTED "model 'NAME' ran
// out of memory for this batch (...); retry later or with a smaller budget".
absl::Status BatchFailure(absl::string_view model, const absl::Status& forward);

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

  // The whole Classify request path without gRPC types, for every front end (the mita.v1 handler above,
  // and others such as a KServe v2 service): finds the model, validates, admits, waits for the batch and
  // builds the response (timing.total_us included), and counts the request in the metrics
  // (mita_requests_total{method="Classify"} and the latency of successful ones).
  // `deadline`: the call's deadline (absl::InfiniteFuture() for none). `cancelled`: tells whether the caller
  // gave up (may be null). Errors: the service's error mapping (mita.proto): INVALID_ARGUMENT, NOT_FOUND,
  // RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED; INTERNAL only for a server fault.
  absl::StatusOr<v1::ClassifyResponse> HandleClassify(const v1::ClassifyRequest& request, absl::Time deadline,
                                                      std::function<bool()> cancelled);
  grpc::Status ListModels(grpc::ServerContext* context, const v1::ListModelsRequest* request,
                          v1::ListModelsResponse* response) override;
  grpc::Status GetModel(grpc::ServerContext* context, const v1::GetModelRequest* request,
                        v1::ModelMetadata* response) override;

  // The limits and batching policy the service was built with.
  const ServiceOptions& options() const { return options_; }

  // The bearer-token check of every front end on this service (mita.v1 here, the Open Inference Protocol in
  // server/kserve_service.h): OK without an authenticator (ServiceOptions::authenticator); else its verdict on
  // the call (UNAUTHENTICATED), counting a rejection under `method` with model "unknown".
  absl::Status Authenticate(const grpc::ServerContext& context, RpcMethod method) const;

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
  // Fill `*task` (input, applied budget, tokens, top_n) and `*preset` (the preset name to echo) from an
  // image / document request, in the handler thread. Errors: INVALID_ARGUMENT naming the field;
  // DEADLINE_EXCEEDED when the deadline passed before the work (decoding, tokenizing) started.
  absl::Status PrepareImageTask(const ModelSlot& slot, const v1::ClassifyRequest& request, absl::Time deadline,
                                Task* task, std::string* preset) const;
  absl::Status PrepareDocumentTask(const ModelSlot& slot, const v1::ClassifyRequest& request, absl::Time deadline,
                                   Task* task, std::string* preset) const;
  // Submits `*task` to the slot's batcher (`*ticket`: its ticket for Cancel); on success observes its budget and tokens, on refusal counts the
  // rejection by reason. Errors: the batcher's (RESOURCE_EXHAUSTED, UNAVAILABLE, INVALID_ARGUMENT).
  absl::Status Admit(const ModelSlot& slot, std::unique_ptr<Task>* task, uint64_t* ticket);
  // Waits for the result of the task queued with `ticket` (submitted at `submitted`). When the deadline
  // passes or the call is cancelled first (seen by WatchCancellations), takes the task out of the queue (or,
  // if a batch thread already holds it, makes sure it is not started) and returns DEADLINE_EXCEEDED /
  // CANCELLED; returns the batch thread's status otherwise, except CANCELLED "... the result was discarded"
  // when the call was cancelled after its batch started (the work ran, but its answer cannot be delivered).
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
