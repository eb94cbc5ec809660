// One hosted model's batching and execution: its DynamicBatcher (server/batcher.h) and the batch threads' work
// (drop what nobody waits for, run the packed batch, answer each request). Internal to InferenceEngine.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "models/classifier.h"
#include "server/batcher.h"
#include "server/clock.h"
#include "server/metrics.h"
#include "server/pending_request.h"

namespace mita::server {

// Answers requests: InferenceEngine's Complete (answer once, bookkeeping).
class RequestCompleter {
 public:
  virtual ~RequestCompleter() = default;
  virtual void Complete(PendingRequest& request, absl::StatusOr<InferenceResult> result) = 0;
};

class ModelRunner {
 public:
  // Starts the model's batcher with `options`. `classifier`, `metrics`, `clock` and `completer` must outlive the
  // runner. `long_input_tokens` > 0: inputs of more tokens go to a second lane, a batcher of their own with one
  // batch thread, so that a long document's forward never holds up shorter requests (they run beside it); made
  // only for a document model whose documents can be that long. Each lane has the queue limits of `options`.
  // Errors: INVALID_ARGUMENT for invalid options, or when one input of an image model has more tokens than
  // options.max_batch_tokens.
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(const models::Classifier* classifier,
                                                             ModelMetrics* metrics,
                                                             const BatcherOptions& options, const Clock* clock,
                                                             RequestCompleter* completer,
                                                             int64_t long_input_tokens = 0);

  const models::Classifier& classifier() const { return *classifier_; }
  ModelMetrics* metrics() const { return metrics_; }

  // Queues a prepared request (takes `*task` on success; `*ticket` receives its ticket for TakeBack), observing
  // its budget and tokens; on refusal counts the rejection by reason. Errors: the batcher's
  // (RESOURCE_EXHAUSTED naming the limit, UNAVAILABLE while draining, INVALID_ARGUMENT).
  absl::Status Admit(std::unique_ptr<BatchTask>* task, uint64_t* ticket);

  // The task with `ticket`, taken back out of the queue; nullptr when a batch thread already has it.
  std::unique_ptr<BatchTask> TakeBack(uint64_t ticket);

  // Stops admitting and releases what is queued without waiting for batches to fill (returns at once).
  void BeginShutdown();
  // Runs what is queued and joins the batch threads.
  void Shutdown();

  // Lanes (1, or 2 with a long-input lane).
  size_t num_lanes() const { return lanes_.size(); }

 private:
  ModelRunner(const models::Classifier* classifier, ModelMetrics* metrics, const Clock* clock,
              RequestCompleter* completer)
      : classifier_(classifier), metrics_(metrics), clock_(clock), completer_(completer) {}

  // Runs one batch on a batch thread and answers every request in it.
  void ProcessBatch(Batch<BatchTask> batch);

  const models::Classifier* const classifier_;
  ModelMetrics* const metrics_;
  const Clock* const clock_;
  RequestCompleter* const completer_;
  static constexpr uint64_t kLanes = 2;
  // lanes_[0]: every input, or those of at most long_input_tokens_ tokens; lanes_[1]: the longer ones.
  std::vector<std::unique_ptr<DynamicBatcher<BatchTask>>> lanes_;
  int64_t long_input_tokens_ = 0;
};

// The status every request of a batch (`requests` requests, `tokens` tokens, on `device`: "cpu", "cuda:0") gets
// when the model's forward failed with `forward`. The requests were validated, so the fault is the server's:
// INTERNAL "model 'NAME' failed: ...", except out of memory (RESOURCE_EXHAUSTED from models/ and
// kernels/aten_errors.h: the host's, or a CUDA device's c10::OutOfMemoryError), which stays RESOURCE_EXHAUSTED
// "model 'NAME' ran out of memory on cuda:0 for this batch of 2 requests, 98304 tokens (...); retry later or
// with a smaller budget". The batch thread goes on with the next batch.
absl::Status BatchFailure(absl::string_view model, absl::string_view device, int64_t requests, int64_t tokens,
                          const absl::Status& forward);

// DEADLINE_EXCEEDED for a request whose deadline passed after `queued` in the queue, before its batch.
absl::Status QueuedDeadlineExceeded(absl::Duration queued);

}  // namespace mita::server
