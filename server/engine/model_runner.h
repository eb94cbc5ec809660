// One hosted model's execution: it routes each prepared request to a lane (server/engine/lane.h: one, or a second
// for long inputs), runs each released batch (Classifier::Run on the packed items with the lanes' budget choices),
// and answers every request of it, counting what it ran. Internal to InferenceEngine.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "models/classifier.h"
#include "server/engine/lane.h"
#include "server/metrics/metrics.h"
#include "server/planning/batcher.h"
#include "server/planning/clock.h"
#include "server/planning/cost_calibration.h"
#include "server/planning/cost_model.h"
#include "server/planning/lane_planner.h"

namespace mita::server {

// The cost figures GetModel reports (mita.v1 CostProfile).
struct CostSummary {
  CostProfile profile;
  // The correction now applied, and one batch's fixed cost.
  double correction = 1;
  absl::Duration batch_overhead;
  // Token count of `predicted` (ClassifierDescription::reference_tokens), and one such input's predicted compute
  // alone in a batch at each budget of the model's accuracy order (in that order).
  int64_t reference_tokens = 0;
  std::vector<absl::Duration> predicted;
};

class ModelRunner {
 public:
  // Starts the model's lanes with `options`. `classifier`, `metrics` and `clock` must outlive the runner.
  // `long_input_tokens` > 0: inputs of more tokens go to a second lane with one batch thread, so that a long
  // input's forward never holds up shorter requests (they run beside it); made only for a model whose inputs can
  // be that long. Each lane has the queue limits of `options`. `profile`: the cost profile each lane predicts with
  // (each learns its own correction); `planning`: how its lanes plan. `intra_op_threads` > 0: the threads one
  // lane's forwards share, each of its batch threads running on intra_op_threads / its batch threads (at least
  // 1): the long-input lane's one thread on all of them; 0: every forward as the process set it. Errors:
  // INVALID_ARGUMENT for invalid options, or when one input of a fixed size has more tokens than
  // options.max_batch_tokens.
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(const models::Classifier* classifier,
                                                             ModelMetrics* metrics, const BatcherOptions& options,
                                                             const Clock* clock, int64_t long_input_tokens,
                                                             CostProfile profile, PlanningOptions planning,
                                                             int intra_op_threads = 0);

  const models::Classifier& classifier() const { return *classifier_; }

  // Queues a prepared request in its lane (Lane::Admit: planned, then queued); takes `*task` on success and fills
  // `*ticket`. Counts the admitted request's budget and tokens, or the refusal by reason. Errors: Lane::Admit's.
  absl::Status Admit(std::unique_ptr<BatchTask>* task, QueueTicket* ticket);

  // Before the input of a request ending at `end` is prepared (its latency target's end or deadline, the
  // earlier; `target_binds` when the target's): refused, with the refusal counted by reason, when no lane could
  // meet it even with the cheapest input (fewest tokens of the lane, cheapest budget of the model), so that a
  // request predicted to miss costs no decoding or tokenizing. Errors: Lane::AdmitBeforePreparation's.
  absl::Status AdmitBeforePreparation(absl::Time end, bool target_binds);

  // The cost model's figures now.
  CostSummary cost_summary() const;

  // Stops admitting and releases what is queued without waiting for batches to fill (returns at once).
  void BeginShutdown();
  // Runs what is queued and joins the batch threads.
  void Shutdown();

  // Lanes (1, or 2 with a long-input lane).
  size_t num_lanes() const { return lanes_.size(); }

 private:
  ModelRunner(const models::Classifier* classifier, ModelMetrics* metrics, const Clock* clock, CostProfile profile);

  // The lane of an input of `tokens` tokens.
  Lane& LaneFor(int64_t tokens) const;
  // Runs one batch of `lane` on a batch thread and answers every request in it.
  void ProcessBatch(Lane& lane, Batch<BatchTask> batch);

  const models::Classifier* const classifier_;
  ModelMetrics* const metrics_;
  const Clock* const clock_;
  const CostProfile profile_;
  // lanes_[0]: every input, or those of at most long_input_tokens_ tokens; lanes_[1]: the longer ones.
  std::vector<std::unique_ptr<Lane>> lanes_;
  int64_t long_input_tokens_ = 0;
  // Per lane, the cheapest inputs it takes (AdmitBeforePreparation's bound).
  std::vector<std::vector<CostItem>> cheapest_inputs_;
};

// The status every request of a batch (`requests` requests, `tokens` tokens, on `device`: "cpu", "cuda:0") gets
// when the model's forward failed with `forward`. The requests were validated, so the fault is the server's:
// INTERNAL "model 'NAME' failed: ...", except out of memory (RESOURCE_EXHAUSTED from models/ and
// kernels/aten_errors.h: the host's, or a CUDA device's c10::OutOfMemoryError), which stays RESOURCE_EXHAUSTED
// "model 'NAME' ran out of memory on cuda:0 for this batch of 2 requests, 98304 tokens (...); retry later or
// with a smaller budget". The batch thread goes on with the next batch.
absl::Status BatchFailure(absl::string_view model, absl::string_view device, int64_t requests, int64_t tokens,
                          const absl::Status& forward);

}  // namespace mita::server
