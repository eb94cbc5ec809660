// One request on its way through the InferenceEngine (inference_engine.h): its stage, its cancellation, and its
// completion, which happens exactly once whoever completes it (a preparation thread, a batch thread, or the
// caller giving up). Internal to server/.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "models/classifier.h"
#include "server/inference_request.h"

namespace mita::server {

class ModelRunner;

// Called once with the request's outcome.
using InferenceDone = std::function<void(absl::StatusOr<InferenceResult>)>;

// Where a request is. Transitions are compare-and-swaps, so that exactly one party moves a request out of a
// stage: kWaiting -> kPreparing (a preparation thread) or kGivenUp (the caller left); kQueued -> kStarted (a batch
// thread) or kGivenUp. Work on a request never starts after it was given up.
enum class RequestStage : int {
  kWaiting = 0,    // in the preparation queue; its input was not read yet
  kPreparing = 1,  // a preparation thread is reading its input
  kQueued = 2,     // prepared, handed to its model's batcher
  kStarted = 3,    // its batch is running
  kGivenUp = 4,    // its caller left before it started; it was answered at once
};

struct PendingRequest {
  // gRPC cancels a call whose deadline passed by its own clock, which can run slightly ahead of the deadline
  // seen here: a cancellation that close to the deadline is the deadline.
  static constexpr absl::Duration kDeadlineClockSlack = absl::Milliseconds(5);

  PendingRequest(InferenceRequest request_in, ModelRunner* runner_in, absl::Time receipt_in, InferenceDone done_in)
      : request(std::move(request_in)), runner(runner_in), receipt(receipt_in), done(std::move(done_in)) {}

  // Moves the stage from `from` to `to`; false when it was not at `from`.
  bool Advance(RequestStage from, RequestStage to) {
    int expected = static_cast<int>(from);
    return stage.compare_exchange_strong(expected, static_cast<int>(to));
  }
  RequestStage current_stage() const { return static_cast<RequestStage>(stage.load()); }

  // When the caller stopped waiting (cancelled, or its deadline passed), as seen at `now`; InfiniteFuture() when
  // it still waits. `*deadline_passed` (optional) says whether the deadline is why.
  absl::Time LeftAt(absl::Time now, bool* deadline_passed = nullptr) {
    bool was_cancelled = false;
    absl::Time cancel_time = absl::InfiniteFuture();
    {
      absl::MutexLock lock(&mu);
      was_cancelled = cancelled;
      cancel_time = cancelled_at;
    }
    const absl::Time deadline = request.deadline;
    absl::Time left = absl::InfiniteFuture();
    bool by_deadline = false;
    if (deadline <= now && (!was_cancelled || cancel_time >= deadline - kDeadlineClockSlack)) {
      left = deadline;
      by_deadline = true;
    } else if (was_cancelled) {
      left = cancel_time;
      by_deadline = deadline != absl::InfiniteFuture() && cancel_time >= deadline - kDeadlineClockSlack;
    }
    if (deadline_passed != nullptr) *deadline_passed = by_deadline;
    return left;
  }

  const InferenceRequest request;
  ModelRunner* const runner;
  const absl::Time receipt;
  const InferenceDone done;
  int64_t top_n = 0;  // resolved (>= 1)
  std::atomic<int> stage{static_cast<int>(RequestStage::kWaiting)};
  // Set by the first call to Complete.
  std::atomic<bool> completed{false};
  // Whether the request reached its batcher (for the admission counts).
  std::atomic<bool> admitted{false};

  absl::Mutex mu;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  absl::Time cancelled_at ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();  // when Cancel was called
  uint64_t ticket ABSL_GUARDED_BY(mu) = 0;  // the batcher's ticket; 0 before admission
};

// What a model's batcher queues: the prepared item and the request it answers.
struct BatchTask {
  models::BatchItem item;
  std::shared_ptr<PendingRequest> request;
  // Set at admission (ModelRunner::Admit): why item.budget was chosen, the queue wait plus compute predicted for
  // it, and its predicted share of a batch's compute (for the lane's predicted wait).
  BudgetReason budget_reason = BudgetReason::kRequested;
  absl::Duration predicted = absl::ZeroDuration();
  absl::Duration queued_compute = absl::ZeroDuration();
  // When a planned request (latency target or deadline admission) was admitted; InfinitePast otherwise.
  absl::Time admitted_at = absl::InfinitePast();

  // Batcher units (server/batcher.h).
  int64_t tokens() const { return item.tokens; }
  int64_t compute_units() const { return item.compute_units; }
};

}  // namespace mita::server
