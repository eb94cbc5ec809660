// One request's lifecycle, from InferenceEngine::Submit to its one answer: its stage, whether and why its caller
// left (the one rule for it, LeftAt), its place in a lane's queue, and its final status. Every move out of a
// stage is one compare-and-swap, so work never starts after the caller left and exactly one party answers; the
// statuses of a caller that left (CANCELLED, DEADLINE_EXCEEDED) are worded here and nowhere else. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/engine/inference_request.h"
#include "server/engine/lane.h"
#include "server/planning/clock.h"

namespace mita::server {

// Called once with the request's outcome.
using InferenceDone = std::function<void(absl::StatusOr<InferenceResult>)>;

class Request {
 public:
  // Where a request is. kWaiting -> kPreparing (a preparation thread) or kGivenUp (the caller left); kPreparing
  // -> kQueued (handed to its lane); kQueued -> kStarted (a batch thread) or kGivenUp.
  enum class Stage : int {
    kWaiting = 0,    // in the preparation queue; its input was not read yet
    kPreparing = 1,  // a preparation thread is reading its input
    kQueued = 2,     // prepared, handed to its model's lane
    kStarted = 3,    // its batch is running
    kGivenUp = 4,    // its caller left before it started; it was answered then
  };

  // When and why the caller stopped waiting, as seen at some time.
  struct Departure {
    absl::Time at = absl::InfiniteFuture();  // InfiniteFuture: it still waits
    bool by_deadline = false;                // the deadline is why (not a cancellation)
    bool left() const { return at != absl::InfiniteFuture(); }
  };

  // What the caller missed when it left, for the wording of its status.
  enum class Missed {
    kPreparation,  // it left before its input was prepared (never read)
    kPreparing,    // it left while its input was prepared (preparation stopped)
    kBatch,        // it left while queued: its batch never ran it
    kWork,         // it left while its batch ran: its work stopped between layers
    kResult,       // it left while its batch ran to the end: the result was discarded
  };

  // `clock` must outlive the request; `on_answered(admitted, ok)` runs after `done` (the engine's bookkeeping).
  Request(InferenceRequest request, const Clock* clock, InferenceDone done,
          std::function<void(bool admitted, bool ok)> on_answered);

  const InferenceRequest& request() const { return request_; }
  absl::Time receipt() const { return receipt_; }
  // The resolved top_n (>= 1), set once before preparation.
  int64_t top_n() const { return top_n_; }
  void set_top_n(int64_t top_n) { top_n_ = top_n; }

  // When the caller stopped waiting as seen at `now` (cancelled, or its deadline passed). The one rule for it:
  // gRPC cancels a call whose deadline passed by its own clock, which can run slightly ahead of the deadline seen
  // here, so a cancellation within kDeadlineClockSlack of the deadline is the deadline.
  Departure LeftAt(absl::Time now) const;
  // OK while the caller waits (now); else its status for `missed` (CANCELLED or DEADLINE_EXCEEDED).
  absl::Status CallerWaits(Missed missed) const;

  // When a planned request must be answered: its latency target's end when `latency_target` and that is earlier
  // than its deadline, else its deadline (InfiniteFuture for none); `*target_binds` says which.
  absl::Time PlannedEnd(bool latency_target, bool* target_binds) const;

  // The caller left (gRPC's OnCancel: the client cancelled, or the deadline passed). A request waiting for
  // preparation is answered at once; a queued one is taken out of its lane's queue (Lane::Cancel) and answered;
  // one being prepared or admitted is answered once it is queued (Queued) or refused; a running one finishes and
  // its result is discarded (Answer). Idempotent.
  void Cancel();

  // A preparation thread takes the request (kWaiting -> kPreparing); false when its caller already left.
  bool BeginPreparing() { return Advance(Stage::kWaiting, Stage::kPreparing); }
  // Prepared: it is handed to its lane (kPreparing -> kQueued), counted as admitted.
  void BeginQueueing();
  // The lane queued it with `ticket`. When its caller left meanwhile, it is taken back and answered now.
  void Queued(QueueTicket ticket);
  // The lane refused it: answered with `status`, not counted as admitted.
  void Refused(absl::Status status);
  bool admitted() const { return admitted_.load(); }

  // A batch thread starts its work at `now` (kQueued -> kStarted), unless its caller has left: then it is
  // answered (kQueued -> kGivenUp; `*expired` says its deadline is why) and never runs. False when not started.
  bool Start(absl::Time now, bool* expired);
  Stage stage() const { return static_cast<Stage>(stage_.load()); }

  // Answers the request (only the first call counts): an OK result for a caller that left is discarded
  // (Missed::kResult); an OK result's `total` is set to the time since receipt.
  void Answer(absl::StatusOr<InferenceResult> result);

  static constexpr absl::Duration kDeadlineClockSlack = absl::Milliseconds(5);

 private:
  bool Advance(Stage from, Stage to) {
    int expected = static_cast<int>(from);
    return stage_.compare_exchange_strong(expected, static_cast<int>(to));
  }
  // The status of a caller that left (`departure`) having missed `missed`: the one wording of both codes.
  absl::Status LeftStatus(Missed missed, const Departure& departure, absl::Time now) const;
  // A queued request whose caller left: out of its lane's queue, then answered unless a batch started it.
  void Withdraw(const QueueTicket& ticket);

  const InferenceRequest request_;
  const Clock* const clock_;
  const absl::Time receipt_;
  const InferenceDone done_;
  const std::function<void(bool admitted, bool ok)> on_answered_;
  int64_t top_n_ = 0;
  std::atomic<int> stage_{static_cast<int>(Stage::kWaiting)};
  std::atomic<bool> answered_{false};
  std::atomic<bool> admitted_{false};
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time cancelled_at_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::optional<QueueTicket> ticket_ ABSL_GUARDED_BY(mu_);  // set once queued
  absl::Time queued_at_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
};

}  // namespace mita::server
