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
// A queued task can be taken back before it is batched (Remove / Cancel with the ticket Enqueue / Submit
// gave it): a caller that gives up (cancelled call, passed deadline) frees its queue slot at once instead of
// at batch formation.
//
// Policy: tasks are batched in FIFO order. A batch is the longest prefix of the queue whose total size fits
// in max_batch_size. It is released when it is full (its size equals max_batch_size, or the next task would
// not fit) or when its oldest task has waited max_queue_delay; while draining, at once.
//
// The Task type needs only:
//   int64_t size() const;  // units: 1 per request now; a later version counts tokens. >= 1.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/clock.h"

namespace mita::server {

// Batching policy and limits. Sizes are in task units (Task::size()).
struct BatcherOptions {
  // Largest batch, units. A task larger than this is rejected (INVALID_ARGUMENT).
  int64_t max_batch_size = 16;
  // Longest time the oldest queued task waits for its batch to fill before a partial batch is released.
  absl::Duration max_queue_delay = absl::Milliseconds(2);
  // Most units waiting in the queue (not yet taken into a batch); beyond it Enqueue fails fast with
  // RESOURCE_EXHAUSTED.
  int64_t queue_capacity = 256;
  // Threads that form and process batches (DynamicBatcher only).
  int num_batch_threads = 1;
  // Where the limits come from, for error messages (e.g. "flag --queue_capacity").
  std::string queue_capacity_source = "flag --queue_capacity";
  std::string max_batch_size_source = "flag --max_batch_size";
};

// Checks the options. Errors: INVALID_ARGUMENT naming the option and its allowed range.
inline absl::Status ValidateBatcherOptions(const BatcherOptions& options) {
  if (options.max_batch_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_batch_size ", options.max_batch_size, " must be >= 1 (", options.max_batch_size_source, ")"));
  }
  if (options.queue_capacity < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("queue_capacity ", options.queue_capacity, " must be >= 1 (", options.queue_capacity_source, ")"));
  }
  if (options.max_queue_delay < absl::ZeroDuration() || options.max_queue_delay == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_queue_delay ", absl::FormatDuration(options.max_queue_delay), " must be finite and >= 0"));
  }
  if (options.num_batch_threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_batch_threads ", options.num_batch_threads, " must be >= 1"));
  }
  return absl::OkStatus();
}

// A batch released by the queue: tasks in FIFO order.
template <typename Task>
struct Batch {
  std::vector<std::unique_ptr<Task>> tasks;
  // When each task was enqueued, parallel to `tasks`.
  std::vector<absl::Time> enqueue_times;
  // Total size, units.
  int64_t size = 0;
  // When the batch was released (the `now` passed to TakeBatch).
  absl::Time formed_at;

  int64_t num_tasks() const { return static_cast<int64_t>(tasks.size()); }
  bool empty() const { return tasks.empty(); }
};

// Change in the queue depth, reported to a listener (e.g. for a gauge).
struct QueueDepthChange {
  int64_t tasks_delta = 0;  // tasks added (> 0) or taken (< 0)
  int64_t units_delta = 0;  // units added or taken
  int64_t tasks = 0;        // tasks queued after the change
  int64_t units = 0;        // units queued after the change
};
using QueueDepthListener = std::function<void(const QueueDepthChange&)>;

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
  // `*task` untouched. Errors: RESOURCE_EXHAUSTED when the task does not fit in the remaining queue capacity
  // (fails fast, names the capacity, e.g. "queue is full: 64 of 64 queued units (flag --queue_capacity)");
  // INVALID_ARGUMENT when the task is null, its size is < 1, or it is larger than max_batch_size.
  // `ticket` (optional) receives the task's ticket for Remove: unique within this queue.
  absl::Status Enqueue(std::unique_ptr<Task>* task, absl::Time now, uint64_t* ticket = nullptr) {
    if (task == nullptr || *task == nullptr) return absl::InvalidArgumentError("task is null");
    const int64_t size = (*task)->size();
    if (size < 1) return absl::InvalidArgumentError(absl::StrCat("task size ", size, " must be >= 1"));
    if (size > options_.max_batch_size) {
      return absl::InvalidArgumentError(absl::StrCat("task of ", size, " units is larger than the maximum batch size ",
                                                     options_.max_batch_size, " (", options_.max_batch_size_source,
                                                     ")"));
    }
    if (queued_units_ + size > options_.queue_capacity) {
      return absl::ResourceExhaustedError(
          absl::StrCat("queue is full: ", queued_units_, " of ", options_.queue_capacity, " queued units",
                       size > 1 ? absl::StrCat(", the task needs ", size) : std::string(), " (",
                       options_.queue_capacity_source, ")"));
    }
    const uint64_t assigned = next_ticket_++;
    entries_.push_back(Entry{std::move(*task), size, now, assigned});
    queued_units_ += size;
    if (ticket != nullptr) *ticket = assigned;
    return absl::OkStatus();
  }

  // Takes the task with `ticket` out of the queue and returns it; nullptr when it is not queued any more
  // (already taken into a batch, or removed). O(queued tasks).
  std::unique_ptr<Task> Remove(uint64_t ticket) {
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->ticket != ticket) continue;
      std::unique_ptr<Task> task = std::move(it->task);
      queued_units_ -= it->size;
      entries_.erase(it);
      return task;
    }
    return nullptr;
  }

  // Releases the next batch if it is due at `now`: it is full (its size equals max_batch_size or the next
  // task would not fit), or its oldest task has waited >= max_queue_delay, or `flush` is set (draining).
  // Returns nullopt when the queue is empty or the batch is not due yet.
  std::optional<Batch<Task>> TakeBatch(absl::Time now, bool flush = false) {
    if (entries_.empty()) return std::nullopt;
    const auto [count, units, full] = NextBatchExtent();
    const bool waited_enough = now - entries_.front().enqueue_time >= options_.max_queue_delay;
    if (!full && !waited_enough && !flush) return std::nullopt;
    Batch<Task> batch;
    batch.tasks.reserve(count);
    batch.enqueue_times.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      batch.tasks.push_back(std::move(entries_.front().task));
      batch.enqueue_times.push_back(entries_.front().enqueue_time);
      entries_.pop_front();
    }
    batch.size = units;
    batch.formed_at = now;
    queued_units_ -= units;
    return batch;
  }

  // The earliest time at which TakeBatch will release a batch if nothing is enqueued meanwhile:
  // absl::InfiniteFuture() when the queue is empty; the oldest task's enqueue time (already due) when the
  // next batch is full; otherwise the oldest task's enqueue time + max_queue_delay.
  absl::Time NextDeadline() const {
    if (entries_.empty()) return absl::InfiniteFuture();
    const absl::Time oldest = entries_.front().enqueue_time;
    return std::get<2>(NextBatchExtent()) ? oldest : oldest + options_.max_queue_delay;
  }

  // Units queued (sum of the queued tasks' sizes).
  int64_t queued_units() const { return queued_units_; }
  // Tasks queued.
  int64_t num_queued_tasks() const { return static_cast<int64_t>(entries_.size()); }
  bool empty() const { return entries_.empty(); }
  const BatcherOptions& options() const { return options_; }

 private:
  struct Entry {
    std::unique_ptr<Task> task;
    int64_t size;
    absl::Time enqueue_time;
    uint64_t ticket;
  };

  // (tasks, units, full) of the batch TakeBatch would release now. Requires a non-empty queue.
  std::tuple<size_t, int64_t, bool> NextBatchExtent() const {
    size_t count = 0;
    int64_t units = 0;
    while (count < entries_.size() && units + entries_[count].size <= options_.max_batch_size) {
      units += entries_[count].size;
      ++count;
    }
    const bool full = units == options_.max_batch_size || count < entries_.size();
    return {count, units, full};
  }

  const BatcherOptions options_;
  std::deque<Entry> entries_;
  int64_t queued_units_ = 0;
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
  // held: it must be cheap and must not call into the batcher.
  // Errors: INVALID_ARGUMENT for invalid options or a null `process`.
  static absl::StatusOr<std::unique_ptr<DynamicBatcher>> Create(BatcherOptions options, ProcessBatchFn process,
                                                                const Clock* clock = RealClock::Get(),
                                                                QueueDepthListener depth_listener = nullptr) {
    if (absl::Status status = ValidateBatcherOptions(options); !status.ok()) return status;
    if (!process) return absl::InvalidArgumentError("process callback is null");
    if (clock == nullptr) return absl::InvalidArgumentError("clock is null");
    std::unique_ptr<DynamicBatcher> batcher(
        new DynamicBatcher(std::move(options), std::move(process), clock, std::move(depth_listener)));
    batcher->Start();
    return batcher;
  }

  // Shuts down (drains) if Shutdown() was not called.
  ~DynamicBatcher() { Shutdown(); }

  DynamicBatcher(const DynamicBatcher&) = delete;
  DynamicBatcher& operator=(const DynamicBatcher&) = delete;

  // Queues `*task`. On success takes ownership (`*task` becomes null); on failure leaves `*task` untouched.
  // Errors: UNAVAILABLE after Shutdown() began; RESOURCE_EXHAUSTED when the queue is full (names the
  // capacity); INVALID_ARGUMENT for a null task or a bad size (see BatchQueue::Enqueue).
  // `ticket` (optional) receives the ticket with which Cancel takes the task back.
  absl::Status Submit(std::unique_ptr<Task>* task, uint64_t* ticket = nullptr) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("shutting down: no new work is accepted");
    const int64_t units = (task != nullptr && *task != nullptr) ? (*task)->size() : 0;
    absl::Status status = queue_.Enqueue(task, clock_->Now(), ticket);
    if (!status.ok()) return status;
    ReportDepthChange(1, units);
    cv_.Signal();
    return absl::OkStatus();
  }

  // Takes the task with `ticket` (from Submit) out of the queue, updating the queue depth at once, and
  // returns it so that the caller completes it; nullptr when it is no longer queued (a batch thread took it
  // and will process it). Thread-safe.
  std::unique_ptr<Task> Cancel(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    std::unique_ptr<Task> task = queue_.Remove(ticket);
    if (task != nullptr) {
      ReportDepthChange(-1, -task->size());
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

  // Units queued, not yet taken into a batch.
  int64_t queued_units() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return queue_.queued_units();
  }
  // Tasks queued, not yet taken into a batch.
  int64_t num_queued_tasks() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return queue_.num_queued_tasks();
  }
  const BatcherOptions& options() const { return options_; }

 private:
  DynamicBatcher(BatcherOptions options, ProcessBatchFn process, const Clock* clock, QueueDepthListener listener)
      : options_(options),
        queue_(std::move(options)),
        process_(std::move(process)),
        clock_(clock),
        listener_(std::move(listener)) {}

  void Start() ABSL_LOCKS_EXCLUDED(join_mu_) {
    absl::MutexLock join_lock(&join_mu_);
    for (int i = 0; i < options_.num_batch_threads; ++i) threads_.emplace_back([this] { Run(); });
  }

  void ReportDepthChange(int64_t tasks_delta, int64_t units_delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!listener_) return;
    listener_(QueueDepthChange{tasks_delta, units_delta, queue_.num_queued_tasks(), queue_.queued_units()});
  }

  // One batch thread: take due batches and process them; sleep until the next deadline or a Submit.
  void Run() ABSL_LOCKS_EXCLUDED(mu_) {
    mu_.Lock();
    while (true) {
      const absl::Time now = clock_->Now();
      std::optional<Batch<Task>> batch = queue_.TakeBatch(now, /*flush=*/stopping_);
      if (batch.has_value()) {
        ReportDepthChange(-batch->num_tasks(), -batch->size);
        // Another batch may be due already; let an idle thread look at it.
        if (!queue_.empty()) cv_.Signal();
        mu_.Unlock();
        process_(std::move(*batch));
        mu_.Lock();
        continue;
      }
      if (stopping_ && queue_.empty()) break;
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
  absl::Mutex join_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(join_mu_);
};

}  // namespace mita::server
