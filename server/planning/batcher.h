// A dynamic batcher, generic over its task type. It knows nothing of models or gRPC.
//
// Modelled on TensorFlow's batching library (tensorflow/core/kernels/batching_util/batch_scheduler.h and
// shared_batch_scheduler.h): a task only knows its size, the queue is bounded and fails fast, and the clock
// is injected so that the batching policy is tested without sleeping.
//
// Two layers:
//   * BatchQueue<Task>: the batching policy, pure and deterministic (no threads, no locks, time passed in).
//   * DynamicBatcher<Task>: N batch threads on top of a BatchQueue (absl::Mutex / absl::CondVar), which hand
//     each released batch to a processing callback. Shutdown() drains: it stops accepting (UNAVAILABLE),
//     processes everything already queued, and joins the threads.
//
// Units. Every task declares three sizes, so that one 64K-token document is not treated like a 1K-token one:
//   * tokens: what the task adds to a packed batch (a document: its tokens; an image: patches + cls). Batches
//     are bounded by task count (max_batch_size) and by tokens (max_batch_tokens).
//   * compute units: the attention work the task costs, tokens x attention width, where the attention width
//     is the keys each query attends over: M + k for MiTA (M = expert count: M shared-expert outputs, plus the
//     k keys of its routed expert; docs/design.md section 2, cost O(N (M + k) d) per head) and N for full
//     attention (so N^2). The queue is bounded in compute units (queue_compute_units) and, as a bookkeeping
//     bound, in tasks (queue_capacity).
//   * predicted compute: the task's predicted share of its batch's compute time (server/planning/lane.h), so that
//     the queue's own sums are the lane's ledger of queued work: nothing else counts what is queued.
// The batcher only adds these numbers up; what they mean is the caller's (models/budget.h ComputeUnits).
//
// Admission (Enqueue / Submit), one check for every limit, failing fast: a task that would take the queue
// over queue_capacity tasks or queue_compute_units compute units is refused with RESOURCE_EXHAUSTED naming
// the limit, and so is a task that alone costs more than queue_compute_units (it could never be admitted);
// a task with more tokens than max_batch_tokens is INVALID_ARGUMENT (it could never form a batch). The
// reason of a refusal is reported as an AdmissionRejection (for a metric by reason).
//
// A queued task can be taken back before it is batched (Cancel, with the ticket Enqueue / Submit gave it): a
// caller that gives up (cancelled call, passed deadline) frees its queue slot at once instead of at batch
// formation.
//
// Policy: tasks are batched in priority order, higher first, and FIFO within a priority (a task without a priority
// has priority 0, so a queue of such tasks is FIFO). A batch is the longest prefix of the queue that holds at most
// max_batch_size tasks and max_batch_tokens tokens. It is released when it is full (max_batch_size tasks, or
// max_batch_tokens tokens, or the next task would not fit) or when the oldest queued task has waited
// max_queue_delay; while draining, at once. Admission favours priority: a task of negative priority (a client's
// "batch" priority, server/policy/client_policy.h) is refused (RESOURCE_EXHAUSTED) when it would take the queue over
// low_priority_queue_share of queue_capacity or of queue_compute_units, so that room is left for the others.
//
// The Task type needs only:
//   int64_t tokens() const;                     // tokens in a packed batch, >= 1
//   int64_t compute_units() const;              // tokens x attention width, >= 1
//   absl::Duration predicted_compute() const;   // its predicted share of a batch's compute, >= 0
// and may have:
//   int priority() const;                       // higher is batched first; 0 when absent
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/planning/clock.h"

namespace mita::server {

// Batching policy and limits (units: see the top of this file).
struct BatcherOptions {
  // Largest batch, tasks (requests).
  int64_t max_batch_size = 16;
  // Largest batch, tokens (Task::tokens() summed). A task with more tokens is rejected (INVALID_ARGUMENT).
  // 131072: a 64K-token document shares its batch with others up to as many tokens again.
  int64_t max_batch_tokens = int64_t{1} << 17;
  // Longest time the oldest queued task waits for its batch to fill before a partial batch is released.
  absl::Duration max_queue_delay = absl::Milliseconds(2);
  // Most tasks waiting in the queue (not yet taken into a batch): a bound on bookkeeping and memory; the
  // work queued is bounded by queue_compute_units.
  int64_t queue_capacity = 256;
  // Most compute units (Task::compute_units() summed) waiting in the queue. 2^32 = one 65,536-token
  // document under full attention (65536 x 65536), or about 200 such documents under MiTA with
  // M + k = 320, or 3.4 million 50-token images at M + k = 25 (then queue_capacity binds first).
  int64_t queue_compute_units = int64_t{1} << 32;
  // The share of queue_capacity and of queue_compute_units that tasks of negative priority may fill, in (0, 1].
  double low_priority_queue_share = 0.5;
  // Threads that form and process batches (DynamicBatcher only).
  int num_batch_threads = 1;
  // Where the limits come from, for error messages (e.g. "flag --queue_capacity").
  std::string queue_capacity_source = "flag --queue_capacity";
  std::string queue_compute_units_source = "flag --queue_compute_units";
  std::string max_batch_size_source = "flag --max_batch_size";
  std::string max_batch_tokens_source = "flag --max_batch_tokens";
};

// Why admission refused a task (the label of a rejection metric). kNone: admitted, or refused for another
// reason (INVALID_ARGUMENT for a bad task).
enum class AdmissionRejection {
  kNone = 0,
  // The queue holds queue_capacity tasks already (RESOURCE_EXHAUSTED).
  kQueueTasks = 1,
  // The task's compute units do not fit in what is left of queue_compute_units (RESOURCE_EXHAUSTED).
  kQueueComputeUnits = 2,
  // The task alone costs more than queue_compute_units: it can never be admitted (RESOURCE_EXHAUSTED).
  kTaskOverQueueComputeUnits = 3,
  // The batcher is shutting down (UNAVAILABLE).
  kShuttingDown = 4,
  // Refused before the batcher by the lane's deadline-aware admission (server/planning/lane.h): the request's
  // predicted queue wait plus compute at the least accurate budget it allows passes its deadline
  // (DEADLINE_EXCEEDED), or its latency target (RESOURCE_EXHAUSTED).
  kDeadlineUnmeetable = 5,
  kLatencyTargetUnmeetable = 6,
  // A task of negative priority would take the queue over low_priority_queue_share of its tasks or compute units
  // (RESOURCE_EXHAUSTED).
  kLowPriorityQueueShare = 7,
};
inline constexpr int kNumAdmissionRejections = 8;

// A short name for metrics labels: "none", "queue_tasks", "queue_compute_units",
// "task_over_queue_compute_units", "shutting_down", "deadline_unmeetable", "latency_target_unmeetable",
// "low_priority_queue_share".
inline const char* AdmissionRejectionName(AdmissionRejection reason) {
  switch (reason) {
    case AdmissionRejection::kNone:
      return "none";
    case AdmissionRejection::kQueueTasks:
      return "queue_tasks";
    case AdmissionRejection::kQueueComputeUnits:
      return "queue_compute_units";
    case AdmissionRejection::kTaskOverQueueComputeUnits:
      return "task_over_queue_compute_units";
    case AdmissionRejection::kShuttingDown:
      return "shutting_down";
    case AdmissionRejection::kDeadlineUnmeetable:
      return "deadline_unmeetable";
    case AdmissionRejection::kLatencyTargetUnmeetable:
      return "latency_target_unmeetable";
    case AdmissionRejection::kLowPriorityQueueShare:
      return "low_priority_queue_share";
  }
  return "none";
}

// Checks the options. Errors: INVALID_ARGUMENT naming the option and its allowed range.
inline absl::Status ValidateBatcherOptions(const BatcherOptions& options) {
  if (options.max_batch_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_batch_size ", options.max_batch_size, " must be >= 1 (", options.max_batch_size_source, ")"));
  }
  if (options.max_batch_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_batch_tokens ", options.max_batch_tokens, " must be >= 1 (",
                                                   options.max_batch_tokens_source, ")"));
  }
  if (options.queue_capacity < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("queue_capacity ", options.queue_capacity, " must be >= 1 (", options.queue_capacity_source, ")"));
  }
  if (options.queue_compute_units < 1) {
    return absl::InvalidArgumentError(absl::StrCat("queue_compute_units ", options.queue_compute_units,
                                                   " must be >= 1 (", options.queue_compute_units_source, ")"));
  }
  if (options.max_queue_delay < absl::ZeroDuration() || options.max_queue_delay == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_queue_delay ", absl::FormatDuration(options.max_queue_delay), " must be finite and >= 0"));
  }
  if (!(options.low_priority_queue_share > 0 && options.low_priority_queue_share <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("low_priority_queue_share ", options.low_priority_queue_share,
                                                   " must be in (0, 1]"));
  }
  if (options.num_batch_threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_batch_threads ", options.num_batch_threads, " must be >= 1"));
  }
  return absl::OkStatus();
}

// Whether Task has `int priority() const` (else its tasks have priority 0).
template <typename Task, typename = void>
struct TaskHasPriority : std::false_type {};
template <typename Task>
struct TaskHasPriority<Task, std::void_t<decltype(std::declval<const Task&>().priority())>> : std::true_type {};

// A task's priority: Task::priority() when it has one, else 0.
template <typename Task>
int TaskPriority(const Task& task) {
  if constexpr (TaskHasPriority<Task>::value) {
    return static_cast<int>(task.priority());
  } else {
    return 0;
  }
}

// A batch released by the queue: tasks in queue order (priority, then FIFO).
template <typename Task>
struct Batch {
  std::vector<std::unique_ptr<Task>> tasks;
  // When each task was enqueued, parallel to `tasks`.
  std::vector<absl::Time> enqueue_times;
  // Total tokens (Task::tokens() summed).
  int64_t tokens = 0;
  // Total compute units (Task::compute_units() summed).
  int64_t compute_units = 0;
  // Total predicted compute (Task::predicted_compute() summed).
  absl::Duration predicted_compute;
  // When the batch was released (the `now` passed to TakeBatch).
  absl::Time formed_at;

  int64_t num_tasks() const { return static_cast<int64_t>(tasks.size()); }
  bool empty() const { return tasks.empty(); }
};

// What a queue holds: the sums of its tasks' units (Task: see the top of this file).
struct QueueLoad {
  int64_t tasks = 0;
  int64_t tokens = 0;
  int64_t compute_units = 0;
  absl::Duration predicted_compute;
};

// Change in the queue depth, reported to a listener (e.g. for a gauge).
struct QueueDepthChange {
  int64_t tasks_delta = 0;          // tasks added (> 0) or taken (< 0)
  int64_t compute_units_delta = 0;  // compute units added or taken
  int64_t tasks = 0;                // tasks queued after the change
  int64_t compute_units = 0;        // compute units queued after the change
};
using QueueDepthListener = std::function<void(const QueueDepthChange&)>;

// What a batch thread does once it has found nothing queued for `after` since its last batch (e.g. give back what
// its batches held: server/engine/lane.cc); `run` is called once per such idle spell, on that thread, with no
// batcher lock held. Unset `run`: nothing.
struct BatchThreadIdle {
  absl::Duration after = absl::ZeroDuration();
  std::function<void()> run;
};

// The batching policy: a bounded FIFO queue of tasks from which batches are taken. Deterministic: time is
// passed in by the caller. Not thread-safe (DynamicBatcher guards it with a mutex).
template <typename Task>
class BatchQueue {
 public:
  // `options` must be valid (ValidateBatcherOptions).
  explicit BatchQueue(BatcherOptions options) : options_(std::move(options)) {}

  BatchQueue(const BatchQueue&) = delete;
  BatchQueue& operator=(const BatchQueue&) = delete;

  // Adds `*task`, enqueued at `now`. On success takes ownership (`*task` becomes null); on failure leaves
  // `*task` untouched. Errors: RESOURCE_EXHAUSTED when the task does not fit in the remaining queue capacity,
  // in tasks or in compute units, or costs more than the whole compute-unit capacity (fails fast, names the
  // limit, e.g. "queue is full: 64 of 64 queued tasks (flag --queue_capacity)" or "queue is full: 900 of 1000
  // queued compute units, the request needs 200 (flag --queue_compute_units)"); INVALID_ARGUMENT when the
  // task is null, its tokens or compute units are < 1, or its tokens exceed max_batch_tokens.
  // `rejection` (optional) receives the reason of a RESOURCE_EXHAUSTED refusal, kNone otherwise.
  // `ticket` (optional) receives the task's ticket for Cancel: unique within this queue.
  absl::Status Enqueue(std::unique_ptr<Task>* task, absl::Time now, AdmissionRejection* rejection = nullptr,
                       uint64_t* ticket = nullptr) {
    if (rejection != nullptr) *rejection = AdmissionRejection::kNone;
    if (task == nullptr || *task == nullptr) return absl::InvalidArgumentError("task is null");
    const int64_t tokens = (*task)->tokens();
    const int64_t compute_units = (*task)->compute_units();
    if (tokens < 1) return absl::InvalidArgumentError(absl::StrCat("task of ", tokens, " tokens: must be >= 1"));
    if (compute_units < 1) {
      return absl::InvalidArgumentError(absl::StrCat("task of ", compute_units, " compute units: must be >= 1"));
    }
    if (tokens > options_.max_batch_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("request of ", tokens,
                                                     " tokens is larger than the maximum batch of ",
                                                     options_.max_batch_tokens, " tokens (",
                                                     options_.max_batch_tokens_source, ")"));
    }
    auto refuse = [rejection](AdmissionRejection reason, std::string message) {
      if (rejection != nullptr) *rejection = reason;
      return absl::ResourceExhaustedError(std::move(message));
    };
    if (compute_units > options_.queue_compute_units) {
      return refuse(AdmissionRejection::kTaskOverQueueComputeUnits,
                    absl::StrCat("request needs ", compute_units, " compute units (tokens x attention width), more "
                                 "than the queue's capacity of ", options_.queue_compute_units, " (",
                                 options_.queue_compute_units_source, "); use a smaller budget or a shorter input"));
    }
    if (num_queued_tasks() + 1 > options_.queue_capacity) {
      return refuse(AdmissionRejection::kQueueTasks,
                    absl::StrCat("queue is full: ", num_queued_tasks(), " of ", options_.queue_capacity,
                                 " queued requests (", options_.queue_capacity_source, ")"));
    }
    if (queued_compute_units_ + compute_units > options_.queue_compute_units) {
      return refuse(AdmissionRejection::kQueueComputeUnits,
                    absl::StrCat("queue is full: ", queued_compute_units_, " of ", options_.queue_compute_units,
                                 " queued compute units, the request needs ", compute_units, " (",
                                 options_.queue_compute_units_source, ")"));
    }
    const int priority = TaskPriority(**task);
    if (priority < 0) {
      const double share = options_.low_priority_queue_share;
      const auto task_room = static_cast<int64_t>(share * static_cast<double>(options_.queue_capacity));
      const auto compute_room = static_cast<int64_t>(share * static_cast<double>(options_.queue_compute_units));
      if (num_queued_tasks() + 1 > task_room || queued_compute_units_ + compute_units > compute_room) {
        return refuse(AdmissionRejection::kLowPriorityQueueShare,
                      absl::StrCat("queue is too full for a low-priority request (priority ", priority, "): ",
                                   num_queued_tasks(), " requests and ", queued_compute_units_,
                                   " compute units queued; low priority may fill ", task_room, " requests (",
                                   options_.queue_capacity_source, ") and ", compute_room, " compute units (",
                                   options_.queue_compute_units_source, ")"));
      }
    }
    const uint64_t assigned = next_ticket_++;
    const absl::Duration predicted = (*task)->predicted_compute();
    // After every task of the same or a higher priority: FIFO within a priority.
    auto position = entries_.end();
    while (position != entries_.begin() && std::prev(position)->priority < priority) --position;
    entries_.insert(position, Entry{std::move(*task), tokens, compute_units, predicted, now, assigned, priority});
    queued_tokens_ += tokens;
    queued_compute_units_ += compute_units;
    queued_predicted_compute_ += predicted;
    if (ticket != nullptr) *ticket = assigned;
    return absl::OkStatus();
  }

  // Takes the task with `ticket` out of the queue and returns it; nullptr when it is not queued any more
  // (already taken into a batch, or removed). O(queued tasks).
  std::unique_ptr<Task> Cancel(uint64_t ticket) {
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->ticket != ticket) continue;
      std::unique_ptr<Task> task = std::move(it->task);
      queued_tokens_ -= it->tokens;
      queued_compute_units_ -= it->compute_units;
      queued_predicted_compute_ -= it->predicted_compute;
      entries_.erase(it);
      return task;
    }
    return nullptr;
  }

  // Releases the next batch if it is due at `now`: it is full (max_batch_size tasks, max_batch_tokens tokens,
  // or the next task would not fit), or its oldest task has waited >= max_queue_delay, or `flush` is set
  // (draining).
  // Returns nullopt when the queue is empty or the batch is not due yet.
  std::optional<Batch<Task>> TakeBatch(absl::Time now, bool flush = false) {
    if (entries_.empty()) return std::nullopt;
    const Extent extent = NextBatchExtent();
    const bool waited_enough = now - OldestEnqueueTime() >= options_.max_queue_delay;
    if (!extent.full && !waited_enough && !flush) return std::nullopt;
    Batch<Task> batch;
    batch.tasks.reserve(extent.count);
    batch.enqueue_times.reserve(extent.count);
    for (size_t i = 0; i < extent.count; ++i) {
      batch.compute_units += entries_.front().compute_units;
      batch.predicted_compute += entries_.front().predicted_compute;
      batch.tasks.push_back(std::move(entries_.front().task));
      batch.enqueue_times.push_back(entries_.front().enqueue_time);
      entries_.pop_front();
    }
    batch.tokens = extent.tokens;
    batch.formed_at = now;
    queued_tokens_ -= batch.tokens;
    queued_compute_units_ -= batch.compute_units;
    queued_predicted_compute_ -= batch.predicted_compute;
    return batch;
  }

  // The earliest time at which TakeBatch will release a batch if nothing is enqueued meanwhile:
  // absl::InfiniteFuture() when the queue is empty; the oldest task's enqueue time (already due) when the
  // next batch is full; otherwise the oldest task's enqueue time + max_queue_delay.
  absl::Time NextDeadline() const {
    if (entries_.empty()) return absl::InfiniteFuture();
    const absl::Time oldest = OldestEnqueueTime();
    return NextBatchExtent().full ? oldest : oldest + options_.max_queue_delay;
  }

  // Tokens queued (sum of the queued tasks' tokens).
  int64_t queued_tokens() const { return queued_tokens_; }
  // Compute units queued (sum of the queued tasks' compute units).
  int64_t queued_compute_units() const { return queued_compute_units_; }
  // Tasks queued.
  int64_t num_queued_tasks() const { return static_cast<int64_t>(entries_.size()); }
  // Every sum at once.
  QueueLoad load() const {
    return QueueLoad{num_queued_tasks(), queued_tokens_, queued_compute_units_, queued_predicted_compute_};
  }
  bool empty() const { return entries_.empty(); }
  const BatcherOptions& options() const { return options_; }

 private:
  struct Entry {
    std::unique_ptr<Task> task;
    int64_t tokens;
    int64_t compute_units;
    absl::Duration predicted_compute;
    absl::Time enqueue_time;
    uint64_t ticket;
    int priority;
  };
  // When the longest-waiting queued task was enqueued (not always the first: a later one of lower priority may
  // wait behind newer ones of higher priority). Requires a non-empty queue.
  absl::Time OldestEnqueueTime() const {
    absl::Time oldest = entries_.front().enqueue_time;
    for (const Entry& entry : entries_) oldest = std::min(oldest, entry.enqueue_time);
    return oldest;
  }

  // The batch TakeBatch would release now: its task count and tokens, and whether it is full.
  struct Extent {
    size_t count = 0;
    int64_t tokens = 0;
    bool full = false;
  };

  // The longest prefix of the queue (priority, then FIFO order) within max_batch_size tasks and max_batch_tokens
  // tokens. Requires a non-empty queue (and every task fits alone, which Enqueue checks).
  Extent NextBatchExtent() const {
    Extent extent;
    while (extent.count < entries_.size() && static_cast<int64_t>(extent.count) < options_.max_batch_size &&
           extent.tokens + entries_[extent.count].tokens <= options_.max_batch_tokens) {
      extent.tokens += entries_[extent.count].tokens;
      ++extent.count;
    }
    extent.full = extent.count < entries_.size() || static_cast<int64_t>(extent.count) == options_.max_batch_size ||
                  extent.tokens == options_.max_batch_tokens;
    return extent;
  }

  const BatcherOptions options_;
  std::deque<Entry> entries_;
  int64_t queued_tokens_ = 0;
  int64_t queued_compute_units_ = 0;
  absl::Duration queued_predicted_compute_;
  uint64_t next_ticket_ = 1;
};

// Runs `num_batch_threads` threads that take batches from a BatchQueue as they become due and hand them to
// a processing callback. Thread-safe.
template <typename Task>
class DynamicBatcher {
 public:
  // Processes one batch. Runs on a batch thread, without any batcher lock held; owns the tasks and must
  // complete every one of them (the batcher does not look at them again). Must not throw.
  using ProcessBatchFn = std::function<void(Batch<Task> batch)>;

  // Starts the batch threads. `clock` must outlive the batcher; the threads wait in real time for
  // (deadline - clock->Now()), so a clock that does not follow real time only makes sense with flushing.
  // `depth_listener` (optional) is called after every change of the queue depth, with the batcher's lock
  // held: it must be cheap and must not call into the batcher. `idle` (optional): what a batch thread does when
  // the queue has stayed empty for `idle.after` (real time) since its last batch.
  // Errors: INVALID_ARGUMENT for invalid options, a null `process` or a negative `idle.after`.
  static absl::StatusOr<std::unique_ptr<DynamicBatcher>> Create(BatcherOptions options, ProcessBatchFn process,
                                                                const Clock* clock = RealClock::Get(),
                                                                QueueDepthListener depth_listener = nullptr,
                                                                BatchThreadIdle idle = {}) {
    if (absl::Status status = ValidateBatcherOptions(options); !status.ok()) return status;
    if (!process) return absl::InvalidArgumentError("process callback is null");
    if (clock == nullptr) return absl::InvalidArgumentError("clock is null");
    if (idle.after < absl::ZeroDuration()) return absl::InvalidArgumentError("idle.after must be >= 0");
    std::unique_ptr<DynamicBatcher> batcher(new DynamicBatcher(std::move(options), std::move(process), clock,
                                                               std::move(depth_listener), std::move(idle)));
    batcher->Start();
    return batcher;
  }

  // Shuts down (drains) if Shutdown() was not called.
  ~DynamicBatcher() { Shutdown(); }

  DynamicBatcher(const DynamicBatcher&) = delete;
  DynamicBatcher& operator=(const DynamicBatcher&) = delete;

  // Queues `*task`. On success takes ownership (`*task` becomes null); on failure leaves `*task` untouched.
  // Errors: UNAVAILABLE after Shutdown() began; RESOURCE_EXHAUSTED when the queue is full, in tasks or compute
  // units (names the limit); INVALID_ARGUMENT for a null task or bad sizes (see BatchQueue::Enqueue).
  // `rejection` (optional) receives the reason of a RESOURCE_EXHAUSTED or UNAVAILABLE refusal.
  // `ticket` (optional) receives the ticket with which Cancel takes the task back.
  absl::Status Submit(std::unique_ptr<Task>* task, AdmissionRejection* rejection = nullptr,
                      uint64_t* ticket = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      if (rejection != nullptr) *rejection = AdmissionRejection::kShuttingDown;
      return absl::UnavailableError("shutting down: no new work is accepted");
    }
    const int64_t compute_units = (task != nullptr && *task != nullptr) ? (*task)->compute_units() : 0;
    absl::Status status = queue_.Enqueue(task, clock_->Now(), rejection, ticket);
    if (!status.ok()) return status;
    ReportDepthChange(1, compute_units);
    cv_.Signal();
    return absl::OkStatus();
  }

  // Takes the task with `ticket` (from Submit) out of the queue, updating the queue depth at once, and
  // returns it so that the caller completes it; nullptr when it is no longer queued (a batch thread took it
  // and will process it). Thread-safe.
  std::unique_ptr<Task> Cancel(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    std::unique_ptr<Task> task = queue_.Cancel(ticket);
    if (task != nullptr) {
      ReportDepthChange(-1, -task->compute_units());
      // The next batch's deadline may have changed.
      cv_.Signal();
    }
    return task;
  }

  // Stops accepting work (Submit then fails with UNAVAILABLE) and makes the batch threads release what is
  // queued without waiting for batches to fill; returns at once. Idempotent and thread-safe.
  void BeginShutdown() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    cv_.SignalAll();
  }

  // BeginShutdown(), then waits until every queued task is processed and joins the batch threads. Blocks
  // until done; idempotent and thread-safe. Must not be called from the processing callback.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_, join_mu_) {
    BeginShutdown();
    absl::MutexLock join_lock(&join_mu_);
    for (std::thread& thread : threads_) {
      if (thread.joinable()) thread.join();
    }
  }

  // Tokens queued, not yet taken into a batch.
  int64_t queued_tokens() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return queue_.queued_tokens();
  }
  // Compute units queued, not yet taken into a batch.
  int64_t queued_compute_units() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return queue_.queued_compute_units();
  }
  // Tasks queued, not yet taken into a batch.
  int64_t num_queued_tasks() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return queue_.num_queued_tasks();
  }
  // What is queued, not yet taken into a batch: every sum at one moment.
  QueueLoad load() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return queue_.load();
  }
  const BatcherOptions& options() const { return options_; }

 private:
  DynamicBatcher(BatcherOptions options, ProcessBatchFn process, const Clock* clock, QueueDepthListener listener,
                 BatchThreadIdle idle)
      : options_(options),
        queue_(std::move(options)),
        process_(std::move(process)),
        clock_(clock),
        listener_(std::move(listener)),
        idle_(std::move(idle)) {}

  void Start() ABSL_LOCKS_EXCLUDED(join_mu_) {
    absl::MutexLock join_lock(&join_mu_);
    for (int i = 0; i < options_.num_batch_threads; ++i) threads_.emplace_back([this] { Run(); });
  }

  void ReportDepthChange(int64_t tasks_delta, int64_t compute_units_delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!listener_) return;
    listener_(QueueDepthChange{tasks_delta, compute_units_delta, queue_.num_queued_tasks(),
                               queue_.queued_compute_units()});
  }

  // One batch thread: take due batches and process them; sleep until the next deadline or a Submit (after
  // `idle_.after` of an empty queue since its last batch, run `idle_.run` once).
  void Run() ABSL_LOCKS_EXCLUDED(mu_) {
    mu_.Lock();
    bool idle_pending = false;  // a batch ran since the last idle_.run
    while (true) {
      const absl::Time now = clock_->Now();
      std::optional<Batch<Task>> batch = queue_.TakeBatch(now, /*flush=*/stopping_);
      if (batch.has_value()) {
        ReportDepthChange(-batch->num_tasks(), -batch->compute_units);
        // Another batch may be due already; let an idle thread look at it.
        if (!queue_.empty()) cv_.Signal();
        mu_.Unlock();
        process_(std::move(*batch));
        mu_.Lock();
        idle_pending = static_cast<bool>(idle_.run);
        continue;
      }
      if (stopping_ && queue_.empty()) break;
      if (idle_pending && queue_.empty()) {
        if (cv_.WaitWithTimeout(&mu_, idle_.after) && queue_.empty() && !stopping_) {
          idle_pending = false;
          mu_.Unlock();
          idle_.run();
          mu_.Lock();
        }
        continue;
      }
      const absl::Time deadline = queue_.NextDeadline();
      if (deadline == absl::InfiniteFuture()) {
        cv_.Wait(&mu_);
      } else {
        cv_.WaitWithTimeout(&mu_, deadline - now);
      }
    }
    mu_.Unlock();
  }

  const BatcherOptions options_;
  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  BatchQueue<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  const ProcessBatchFn process_;
  const Clock* const clock_;
  const QueueDepthListener listener_;
  const BatchThreadIdle idle_;
  absl::Mutex join_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(join_mu_);
};

}  // namespace mita::server
