// One request's lifecycle (see request.h).
#include "server/engine/request.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"

namespace mita::server {

Request::Request(InferenceRequest request, const Clock* clock, InferenceDone done,
                 std::function<void(bool admitted, bool ok)> on_answered)
    : request_(std::move(request)),
      clock_(clock),
      receipt_(clock->Now()),
      done_(std::move(done)),
      on_answered_(std::move(on_answered)) {}

Request::Departure Request::LeftAt(absl::Time now) const {
  bool cancelled = false;
  absl::Time cancelled_at = absl::InfiniteFuture();
  {
    absl::MutexLock lock(&mu_);
    cancelled = cancelled_;
    cancelled_at = cancelled_at_;
  }
  const absl::Time deadline = request_.deadline;
  const bool near_deadline = deadline != absl::InfiniteFuture() && cancelled_at >= deadline - kDeadlineClockSlack;
  if (deadline <= now && (!cancelled || near_deadline)) return Departure{deadline, true};
  if (cancelled) return Departure{cancelled_at, near_deadline};
  return Departure{};
}

absl::Status Request::LeftStatus(Missed missed, const Departure& departure, absl::Time now) const {
  std::string queued;
  if (missed == Missed::kBatch) {
    absl::MutexLock lock(&mu_);
    queued = absl::StrCat(" after ", absl::ToInt64Microseconds(now - queued_at_), " us in the queue,");
  }
  const char* what = "";
  switch (missed) {
    case Missed::kPreparation:
      what = " before its input was prepared; it was not run";
      break;
    case Missed::kPreparing:
      what = " while its input was prepared; it was not run";
      break;
    case Missed::kBatch:
      what = " before the request's batch started; it was not run";
      break;
    case Missed::kWork:
      what = " while its batch ran; its work was stopped";
      break;
    case Missed::kResult:
      what = " while its batch ran; the result was discarded";
      break;
  }
  if (departure.by_deadline) return absl::DeadlineExceededError(absl::StrCat("the deadline passed", queued, what));
  return absl::CancelledError(absl::StrCat("the call was cancelled", queued, what));
}

absl::Status Request::CallerWaits(Missed missed) const {
  const absl::Time now = clock_->Now();
  const Departure departure = LeftAt(now);
  return departure.left() ? LeftStatus(missed, departure, now) : absl::OkStatus();
}

absl::Time Request::PlannedEnd(bool latency_target, bool* target_binds) const {
  const absl::Duration target = request_.budget.latency_target;
  *target_binds = false;
  if (!latency_target || target <= absl::ZeroDuration()) return request_.deadline;
  const absl::Time target_end = receipt_ + target;
  *target_binds = target_end < request_.deadline;
  return std::min(request_.deadline, target_end);
}

void Request::Cancel() {
  std::optional<QueueTicket> ticket;
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return;
    cancelled_ = true;
    cancelled_at_ = clock_->Now();
    ticket = ticket_;
  }
  if (Advance(Stage::kWaiting, Stage::kGivenUp)) {
    // Its input is never read (the front end may free it once the request is answered).
    Answer(CallerWaits(Missed::kPreparation));
    return;
  }
  // Queued: taken back now. Being prepared or admitted: Queued takes it back (or its refusal answers it).
  // Started: its batch finishes and Answer discards the result.
  if (ticket.has_value()) Withdraw(*ticket);
}

void Request::BeginQueueing() {
  {
    absl::MutexLock lock(&mu_);
    queued_at_ = clock_->Now();
  }
  admitted_.store(true);
  // kQueued before the lane sees it: a batch thread starts it only from kQueued.
  Advance(Stage::kPreparing, Stage::kQueued);
}

void Request::Queued(QueueTicket ticket) {
  bool cancelled = false;
  {
    absl::MutexLock lock(&mu_);
    ticket_ = ticket;
    cancelled = cancelled_;
  }
  // Cancelled while it was being admitted: Cancel could not know the ticket yet.
  if (cancelled) Withdraw(ticket);
}

void Request::Refused(absl::Status status) {
  admitted_.store(false);
  Answer(std::move(status));
}

void Request::Withdraw(const QueueTicket& ticket) {
  // Frees its queue slot now rather than at batch formation; the task's hold on this request goes with it.
  std::unique_ptr<BatchTask> withdrawn = ticket.lane->Cancel(ticket.id);
  if (!Advance(Stage::kQueued, Stage::kGivenUp)) return;  // started, or answered
  const absl::Time now = clock_->Now();
  Answer(LeftStatus(Missed::kBatch, LeftAt(now), now));
}

bool Request::Start(absl::Time now, bool* expired) {
  const Departure departure = LeftAt(now);
  *expired = departure.left() && departure.by_deadline;
  if (!departure.left()) return Advance(Stage::kQueued, Stage::kStarted);
  if (Advance(Stage::kQueued, Stage::kGivenUp)) Answer(LeftStatus(Missed::kBatch, departure, now));
  return false;
}

void Request::Answer(absl::StatusOr<InferenceResult> result) {
  if (answered_.exchange(true)) return;
  if (result.ok()) {
    // The batch ran to the end, but the caller is gone (its client, its deadline, or the server stopping at the
    // drain timeout): the answer is not delivered.
    const absl::Time now = clock_->Now();
    const Departure departure = LeftAt(now);
    if (departure.left()) {
      result = LeftStatus(Missed::kResult, departure, now);
    } else {
      result->total = now - receipt_;
    }
  }
  const bool ok = result.ok();
  done_(std::move(result));
  on_answered_(admitted_.load(), ok);
}

}  // namespace mita::server
