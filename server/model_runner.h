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
#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/clock.h"
#include "server/cost_calibration.h"
#include "server/cost_model.h"
#include "server/latency_planner.h"
#include "server/metrics.h"
#include "server/pending_request.h"

namespace mita::server {

// Answers requests: InferenceEngine's Complete (answer once, bookkeeping).
class RequestCompleter {
 public:
  virtual ~RequestCompleter() = default;
  virtual void Complete(PendingRequest& request, absl::StatusOr<InferenceResult> result) = 0;
};

// How a runner predicts and uses compute times (docs/serving.md "Latency targets").
struct PlanningOptions {
  // The model's cost profile (server/cost_calibration.h).
  CostProfile cost_profile;
  // Answer at once, DEADLINE_EXCEEDED, a request whose predicted queue wait plus compute at the least accurate
  // budget it allows would pass its deadline (mita-server --deadline_admission).
  bool deadline_admission = true;
  // Admission and latency targets plan with time left less this percentile of the lane's recent lateness
  // (PlanningSlack); 0: with the prediction alone.
  int slack_percentile = 99;
};

// The cost figures GetModel reports (mita.v1 CostProfile).
struct CostSummary {
  CostProfile profile;
  // The correction now applied, and one batch's fixed cost.
  double correction = 1;
  absl::Duration batch_overhead;
  // Token count of `predicted`, and one such input's predicted compute alone in a batch at each budget of the
  // model's accuracy order (in that order).
  int64_t reference_tokens = 0;
  std::vector<absl::Duration> predicted;
};

class ModelRunner {
 public:
  // Starts the model's batcher with `options`. `classifier`, `metrics`, `clock` and `completer` must outlive the
  // runner. `long_input_tokens` > 0: inputs of more tokens go to a second lane, a batcher of their own with one
  // batch thread, so that a long document's forward never holds up shorter requests (they run beside it); made
  // only for a document model whose documents can be that long. Each lane has the queue limits of `options`.
  // `planning`: the cost profile the runner predicts with and whether it refuses predicted misses at admission.
  // Errors: INVALID_ARGUMENT for invalid options, or when one input of an image model has more tokens than
  // options.max_batch_tokens.
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(const models::Classifier* classifier,
                                                             ModelMetrics* metrics,
                                                             const BatcherOptions& options, const Clock* clock,
                                                             RequestCompleter* completer,
                                                             int64_t long_input_tokens = 0,
                                                             PlanningOptions planning = PlanningOptions());

  const models::Classifier& classifier() const { return *classifier_; }
  ModelMetrics* metrics() const { return metrics_; }

  // Queues a prepared request (takes `*task` on success; `*ticket` receives its ticket for TakeBack), observing
  // its budget and tokens; on refusal counts the rejection by reason. A request with a latency target gets the
  // most accurate budget it allows whose predicted queue wait plus compute meets the target (or its deadline;
  // ChooseBudget), less the lane's planning slack (PlanningSlack). Errors: the batcher's (RESOURCE_EXHAUSTED naming the limit, UNAVAILABLE while draining,
  // INVALID_ARGUMENT); with deadline admission, DEADLINE_EXCEEDED when even the least accurate allowed budget is
  // predicted to pass the deadline, RESOURCE_EXHAUSTED when it would pass the latency target (each naming the
  // predicted time and the time left).
  // The cost model's figures now.
  CostSummary cost_summary() const;
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
              RequestCompleter* completer, PlanningOptions planning)
      : classifier_(classifier),
        metrics_(metrics),
        clock_(clock),
        completer_(completer),
        planning_(std::move(planning)),
        cost_(CostShapeOf(classifier->description()), planning_.cost_profile.coefficients,
              planning_.cost_profile.correction) {}

  // Runs one batch of lane `lane` on a batch thread and answers every request in it.
  void ProcessBatch(size_t lane, Batch<BatchTask> batch);
  // Degradation at batch start: lowers the budgets of latency-target requests of the batch that `start` finds
  // behind their plan, so that the batch's predicted compute fits their (and the others') time left (LowerToFit).
  void LowerLateBudgets(absl::Span<BatchTask* const> tasks, absl::Time start);

  // Predicted wait of a request admitted now to `lane` before its batch starts: the running batches' predicted
  // remainder, the queued tasks' predicted compute and their batches' fixed cost, shared by the lane's batch
  // threads. The batcher's max_queue_delay is not counted: later arrivals may fill the batch sooner, and a batch
  // that starts late is caught by LowerLateBudgets.
  absl::Duration PredictedWait(size_t lane, absl::Time now) const;
  // Predicted compute the requests admitted after one admitted now to `lane` add to its batch: the lane's
  // recent batch size, less the queued tasks ahead of it in its batch, times the recent compute per task (a
  // request waits for its whole batch, which under load fills with later arrivals). The recent batch size fades
  // toward 1 with the time since the lane's last batch start (LaneLoad::BatchSizeAt), so a lane that went quiet
  // after a burst does not plan with the burst's batches forever (a refused request starts no batch).
  absl::Duration PredictedBatchFill(size_t lane, absl::Time now) const;
  // What admission to `lane` subtracts from a request's time left: the lane's PlanningSlack (0 when
  // planning_.slack_percentile is 0).
  absl::Duration PlanningSlackOf(size_t lane, absl::Time now);
  // Records how late against its prediction each planned task of `tasks` was answered at `answered`.
  void ObserveLateness(size_t lane, absl::Span<BatchTask* const> tasks, absl::Time answered);
  // Predicted compute of `item` alone in a batch at `budget`, and its share of a batch without the fixed cost.
  absl::Duration PredictedCompute(const models::BatchItem& item, const models::AttentionBudget& budget) const;

  // What the runner knows of each lane's queued and running work, for PredictedWait.
  struct LaneLoad {
    BatcherOptions options;
    absl::Duration queued_compute;  // predicted, without batches' fixed costs
    int64_t queued_tasks = 0;
    std::vector<absl::Time> running_ends;  // predicted end of each running batch
    // Moving averages (weight 0.2) over the batches started: requests per batch, predicted compute per request
    // without the batch's fixed cost; and when the last batch started.
    double recent_batch_size = 1;
    absl::Duration recent_task_compute;
    absl::Time last_batch_start = absl::InfinitePast();
    // recent_batch_size faded toward 1 (an idle lane's batch) by exp(-(now - last_batch_start) / kRecentFade).
    double BatchSizeAt(absl::Time now) const;
    // How late the lane's planned requests were answered against their predictions.
    PlanningSlack slack;
  };

  const models::Classifier* const classifier_;
  ModelMetrics* const metrics_;
  const Clock* const clock_;
  RequestCompleter* const completer_;
  const PlanningOptions planning_;
  CostModel cost_;
  mutable absl::Mutex load_mu_;
  std::vector<LaneLoad> load_ ABSL_GUARDED_BY(load_mu_);
  static constexpr uint64_t kLanes = 2;
  // The planned requests per lane whose lateness the slack is taken over: the last 512 answered in 2 s.
  static constexpr size_t kSlackWindow = 512;
  static constexpr absl::Duration kSlackHorizon = absl::Seconds(2);
  // The time constant with which a lane's recent batch size fades when no batch starts: the slack's horizon.
  static constexpr absl::Duration kRecentFade = kSlackHorizon;
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
