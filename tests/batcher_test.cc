// Tests of the dynamic batcher: the batching policy (BatchQueue) with a manual clock and no sleeps, and the
// threaded DynamicBatcher end to end without timing assertions.
#include "server/planning/batcher.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/planning/clock.h"

namespace mita::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A task of `tokens` tokens costing `compute_units` compute units (default: one unit per token).
struct FakeTask {
  int id = 0;
  int64_t token_count = 1;
  int64_t compute_unit_count = -1;  // -1: token_count
  int64_t tokens() const { return token_count; }
  int64_t compute_units() const { return compute_unit_count < 0 ? token_count : compute_unit_count; }
  // 1 ms per compute unit.
  absl::Duration predicted_compute() const { return absl::Milliseconds(compute_units()); }
};

std::unique_ptr<FakeTask> MakeTask(int id, int64_t tokens = 1, int64_t compute_units = -1) {
  return std::make_unique<FakeTask>(FakeTask{id, tokens, compute_units});
}

// Batches of at most `max_batch_size` tasks (tokens unbounded unless set), a queue of at most
// `queue_capacity` tasks (compute units unbounded unless set).
BatcherOptions Options(int64_t max_batch_size, absl::Duration max_queue_delay, int64_t queue_capacity) {
  BatcherOptions options;
  options.max_batch_size = max_batch_size;
  options.max_batch_tokens = int64_t{1} << 40;
  options.max_queue_delay = max_queue_delay;
  options.queue_capacity = queue_capacity;
  options.queue_compute_units = int64_t{1} << 50;
  return options;
}

std::vector<int> Ids(const Batch<FakeTask>& batch) {
  std::vector<int> ids;
  for (const auto& task : batch.tasks) ids.push_back(task->id);
  return ids;
}

// Enqueues and expects success.
void Add(BatchQueue<FakeTask>& queue, int id, absl::Time now, int64_t tokens = 1, int64_t compute_units = -1) {
  std::unique_ptr<FakeTask> task = MakeTask(id, tokens, compute_units);
  ASSERT_TRUE(queue.Enqueue(&task, now).ok());
  EXPECT_EQ(task, nullptr);
}

TEST(BatchQueueTest, FullBatchIsReleasedImmediately) {
  ManualClock clock;
  BatchQueue<FakeTask> queue(Options(4, absl::Milliseconds(10), 100));
  for (int i = 0; i < 3; ++i) Add(queue, i, clock.Now());
  EXPECT_FALSE(queue.TakeBatch(clock.Now()).has_value());
  Add(queue, 3, clock.Now());
  EXPECT_EQ(queue.NextDeadline(), clock.Now());                         // due now
  std::optional<Batch<FakeTask>> batch = queue.TakeBatch(clock.Now());  // no time has passed
  ASSERT_TRUE(batch.has_value());
  EXPECT_THAT(Ids(*batch), ElementsAre(0, 1, 2, 3));
  EXPECT_EQ(batch->tokens, 4);
  EXPECT_EQ(batch->formed_at, clock.Now());
  EXPECT_TRUE(queue.empty());
  EXPECT_EQ(queue.NextDeadline(), absl::InfiniteFuture());
}

TEST(BatchQueueTest, OverfullQueueReleasesMaxSizeBatchesInOrder) {
  ManualClock clock;
  BatchQueue<FakeTask> queue(Options(3, absl::Milliseconds(10), 100));
  for (int i = 0; i < 7; ++i) Add(queue, i, clock.Now());
  std::optional<Batch<FakeTask>> first = queue.TakeBatch(clock.Now());
  std::optional<Batch<FakeTask>> second = queue.TakeBatch(clock.Now());
  ASSERT_TRUE(first.has_value());
  ASSERT_TRUE(second.has_value());
  EXPECT_THAT(Ids(*first), ElementsAre(0, 1, 2));
  EXPECT_THAT(Ids(*second), ElementsAre(3, 4, 5));
  // The 7th task is alone: it waits for its delay.
  EXPECT_FALSE(queue.TakeBatch(clock.Now()).has_value());
  clock.Advance(absl::Milliseconds(10));
  std::optional<Batch<FakeTask>> third = queue.TakeBatch(clock.Now());
  ASSERT_TRUE(third.has_value());
  EXPECT_THAT(Ids(*third), ElementsAre(6));
}

TEST(BatchQueueTest, PartialBatchReleasedExactlyAtMaxDelay) {
  ManualClock clock(absl::FromUnixSeconds(1000));
  const absl::Time start = clock.Now();
  BatchQueue<FakeTask> queue(Options(8, absl::Milliseconds(5), 100));
  Add(queue, 0, clock.Now());
  clock.Advance(absl::Milliseconds(1));
  Add(queue, 1, clock.Now());
  EXPECT_EQ(queue.NextDeadline(), start + absl::Milliseconds(5));  // set by the oldest task

  clock.Set(start + absl::Milliseconds(5) - absl::Nanoseconds(1));
  EXPECT_FALSE(queue.TakeBatch(clock.Now()).has_value()) << "released before the max queue delay";
  EXPECT_EQ(queue.num_queued_tasks(), 2);

  clock.Set(start + absl::Milliseconds(5));
  std::optional<Batch<FakeTask>> batch = queue.TakeBatch(clock.Now());
  ASSERT_TRUE(batch.has_value());
  EXPECT_THAT(Ids(*batch), ElementsAre(0, 1));
  EXPECT_THAT(batch->enqueue_times, ElementsAre(start, start + absl::Milliseconds(1)));
  EXPECT_EQ(batch->formed_at, start + absl::Milliseconds(5));
  EXPECT_TRUE(queue.empty());
}

TEST(BatchQueueTest, ZeroDelayReleasesAtOnce) {
  ManualClock clock;
  BatchQueue<FakeTask> queue(Options(8, absl::ZeroDuration(), 100));
  Add(queue, 0, clock.Now());
  std::optional<Batch<FakeTask>> batch = queue.TakeBatch(clock.Now());
  ASSERT_TRUE(batch.has_value());
  EXPECT_THAT(Ids(*batch), ElementsAre(0));
}

TEST(BatchQueueTest, FlushReleasesPartialBatchBeforeDelay) {
  ManualClock clock;
  BatchQueue<FakeTask> queue(Options(8, absl::Seconds(100), 100));
  Add(queue, 0, clock.Now());
  Add(queue, 1, clock.Now());
  EXPECT_FALSE(queue.TakeBatch(clock.Now()).has_value());
  std::optional<Batch<FakeTask>> batch = queue.TakeBatch(clock.Now(), /*flush=*/true);
  ASSERT_TRUE(batch.has_value());
  EXPECT_THAT(Ids(*batch), ElementsAre(0, 1));
  EXPECT_FALSE(queue.TakeBatch(clock.Now(), /*flush=*/true).has_value());
}

TEST(BatchQueueTest, FifoOrderAcrossManyBatches) {
  ManualClock clock;
  BatchQueue<FakeTask> queue(Options(4, absl::Milliseconds(1), 1000));
  std::vector<int> seen;
  int next_id = 0;
  for (int round = 0; round < 20; ++round) {
    const int count = 1 + round % 6;  // 1..6 tasks per round: partial and full batches
    for (int i = 0; i < count; ++i) Add(queue, next_id++, clock.Now());
    clock.Advance(absl::Microseconds(300));
    while (std::optional<Batch<FakeTask>> batch = queue.TakeBatch(clock.Now())) {
      EXPECT_LE(batch->num_tasks(), 4);
      for (int id : Ids(*batch)) seen.push_back(id);
    }
  }
  while (std::optional<Batch<FakeTask>> batch = queue.TakeBatch(clock.Now(), /*flush=*/true)) {
    for (int id : Ids(*batch)) seen.push_back(id);
  }
  ASSERT_EQ(static_cast<int>(seen.size()), next_id);
  for (int i = 0; i < next_id; ++i) EXPECT_EQ(seen[i], i);
}

TEST(BatchQueueTest, RejectsWhenFullNamingTheCapacity) {
  ManualClock clock;
  BatchQueue<FakeTask> queue(Options(16, absl::Milliseconds(2), 64));
  for (int i = 0; i < 64; ++i) Add(queue, i, clock.Now());
  std::unique_ptr<FakeTask> task = MakeTask(64);
  absl::Status status = queue.Enqueue(&task, clock.Now());
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(), "queue is full: 64 of 64 queued requests (flag --queue_capacity)");
  EXPECT_NE(task, nullptr) << "a rejected task stays with the caller";
  EXPECT_EQ(queue.num_queued_tasks(), 64);

  // Taking a batch frees capacity.
  ASSERT_TRUE(queue.TakeBatch(clock.Now()).has_value());
  EXPECT_TRUE(queue.Enqueue(&task, clock.Now()).ok());
}

TEST(BatchQueueTest, RejectsTaskThatDoesNotFitTheRemainingComputeUnits) {
  ManualClock clock;
  BatcherOptions options = Options(8, absl::Milliseconds(2), 100);
  options.queue_compute_units = 1000;
  options.queue_compute_units_source = "option queue_compute_units";
  BatchQueue<FakeTask> queue(options);
  Add(queue, 0, clock.Now(), /*tokens=*/10, /*compute_units=*/700);
  std::unique_ptr<FakeTask> task = MakeTask(1, 10, 400);
  AdmissionRejection rejection = AdmissionRejection::kNone;
  absl::Status status = queue.Enqueue(&task, clock.Now(), &rejection);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(),
            "queue is full: 700 of 1000 queued compute units, the request needs 400 (option queue_compute_units)");
  EXPECT_EQ(rejection, AdmissionRejection::kQueueComputeUnits);
  EXPECT_NE(task, nullptr);
  Add(queue, 2, clock.Now(), 10, 300);  // exactly fits
  EXPECT_EQ(queue.queued_compute_units(), 1000);
  EXPECT_EQ(queue.queued_tokens(), 20);
  EXPECT_EQ(queue.num_queued_tasks(), 2);
}

// The queue is bounded in compute units, not in requests: at the same capacity, one expensive task (a long
// document, a wide budget) fills it where many cheap ones still fit.
TEST(BatchQueueTest, QueueBoundIsInComputeUnitsNotRequests) {
  ManualClock clock;
  BatcherOptions options = Options(64, absl::Milliseconds(2), 1000);
  options.queue_compute_units = 65536 * 320;  // e.g. one 64K-token document at M + k = 320
  BatchQueue<FakeTask> expensive(options);
  Add(expensive, 0, clock.Now(), 65536, 65536 * 320);
  std::unique_ptr<FakeTask> one_more = MakeTask(1, 1024, 1024 * 320);
  AdmissionRejection rejection = AdmissionRejection::kNone;
  EXPECT_EQ(expensive.Enqueue(&one_more, clock.Now(), &rejection).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(rejection, AdmissionRejection::kQueueComputeUnits);

  BatchQueue<FakeTask> cheap(options);
  for (int i = 0; i < 64; ++i) Add(cheap, i, clock.Now(), 1024, 1024 * 320);  // 64 x 1K-token documents
  EXPECT_EQ(cheap.num_queued_tasks(), 64);
  EXPECT_EQ(cheap.queued_compute_units(), 65536 * 320);
  std::unique_ptr<FakeTask> full = MakeTask(64, 1, 1);
  EXPECT_EQ(cheap.Enqueue(&full, clock.Now(), &rejection).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(rejection, AdmissionRejection::kQueueComputeUnits);
}

TEST(BatchQueueTest, TaskCostingMoreThanTheWholeQueueIsRefused) {
  ManualClock clock;
  BatcherOptions options = Options(8, absl::Milliseconds(2), 100);
  options.queue_compute_units = 1000;
  BatchQueue<FakeTask> queue(options);
  std::unique_ptr<FakeTask> task = MakeTask(0, 10, 1001);
  AdmissionRejection rejection = AdmissionRejection::kNone;
  absl::Status status = queue.Enqueue(&task, clock.Now(), &rejection);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("request needs 1001 compute units"));
  EXPECT_THAT(status.message(), HasSubstr("capacity of 1000 (flag --queue_compute_units)"));
  EXPECT_EQ(rejection, AdmissionRejection::kTaskOverQueueComputeUnits);
  EXPECT_TRUE(queue.empty());
}

TEST(BatchQueueTest, RejectionReasonForTaskCount) {
  ManualClock clock;
  BatchQueue<FakeTask> queue(Options(8, absl::Milliseconds(2), 2));
  Add(queue, 0, clock.Now());
  Add(queue, 1, clock.Now());
  std::unique_ptr<FakeTask> task = MakeTask(2);
  AdmissionRejection rejection = AdmissionRejection::kNone;
  EXPECT_EQ(queue.Enqueue(&task, clock.Now(), &rejection).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(rejection, AdmissionRejection::kQueueTasks);
  EXPECT_STREQ(AdmissionRejectionName(rejection), "queue_tasks");
}

TEST(BatchQueueTest, BatchIsBoundedByTokens) {
  ManualClock clock;
  BatcherOptions options = Options(16, absl::Milliseconds(5), 100);
  options.max_batch_tokens = 1000;
  BatchQueue<FakeTask> queue(options);
  // Documents of 300, 500 and 400 tokens: the first two fit in 1000 tokens, the third does not, so the batch
  // {0, 1} is full at 800 tokens although it holds only 2 of 16 tasks.
  Add(queue, 0, clock.Now(), 300);
  Add(queue, 1, clock.Now(), 500);
  EXPECT_FALSE(queue.TakeBatch(clock.Now()).has_value());
  Add(queue, 2, clock.Now(), 400);
  std::optional<Batch<FakeTask>> batch = queue.TakeBatch(clock.Now());
  ASSERT_TRUE(batch.has_value());
  EXPECT_THAT(Ids(*batch), ElementsAre(0, 1));
  EXPECT_EQ(batch->tokens, 800);
  EXPECT_EQ(batch->compute_units, 800);
  // 400 + 600 = exactly 1000 tokens: full at once.
  Add(queue, 3, clock.Now(), 600);
  EXPECT_EQ(queue.NextDeadline(), clock.Now());
  batch = queue.TakeBatch(clock.Now());
  ASSERT_TRUE(batch.has_value());
  EXPECT_THAT(Ids(*batch), ElementsAre(2, 3));
  EXPECT_EQ(batch->tokens, 1000);
  // A single task of the whole token budget makes a batch alone; one token more can never be batched.
  Add(queue, 4, clock.Now(), 1000);
  batch = queue.TakeBatch(clock.Now());
  ASSERT_TRUE(batch.has_value());
  EXPECT_THAT(Ids(*batch), ElementsAre(4));
  std::unique_ptr<FakeTask> too_long = MakeTask(5, 1001);
  absl::Status status = queue.Enqueue(&too_long, clock.Now());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "request of 1001 tokens is larger than the maximum batch of 1000 tokens (flag --max_batch_tokens)");
}

TEST(BatchQueueTest, BatchIsBoundedByTaskCountAndTokensTogether) {
  ManualClock clock;
  BatcherOptions options = Options(3, absl::Milliseconds(5), 100);
  options.max_batch_tokens = 100;
  BatchQueue<FakeTask> queue(options);
  for (int i = 0; i < 5; ++i) Add(queue, i, clock.Now(), 10);  // 5 short tasks: 3 per batch by count
  std::optional<Batch<FakeTask>> batch = queue.TakeBatch(clock.Now());
  ASSERT_TRUE(batch.has_value());
  EXPECT_THAT(Ids(*batch), ElementsAre(0, 1, 2));
  EXPECT_EQ(batch->tokens, 30);
  EXPECT_FALSE(queue.TakeBatch(clock.Now()).has_value()) << "2 tasks, 20 tokens: not full";
  EXPECT_EQ(queue.queued_tokens(), 20);
}

TEST(BatchQueueTest, RejectsBadTaskSizes) {
  ManualClock clock;
  BatcherOptions options = Options(4, absl::Milliseconds(2), 100);
  options.max_batch_tokens = 4;
  BatchQueue<FakeTask> queue(options);
  std::unique_ptr<FakeTask> too_big = MakeTask(0, 5);
  absl::Status status = queue.Enqueue(&too_big, clock.Now());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("larger than the maximum batch of 4 tokens"));
  std::unique_ptr<FakeTask> empty = MakeTask(1, 0);
  EXPECT_EQ(queue.Enqueue(&empty, clock.Now()).code(), absl::StatusCode::kInvalidArgument);
  std::unique_ptr<FakeTask> free = MakeTask(1, 1, 0);
  EXPECT_EQ(queue.Enqueue(&free, clock.Now()).code(), absl::StatusCode::kInvalidArgument);
  std::unique_ptr<FakeTask> null;
  EXPECT_EQ(queue.Enqueue(&null, clock.Now()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(queue.Enqueue(nullptr, clock.Now()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(queue.empty());
  EXPECT_EQ(queue.queued_tokens(), 0);
  EXPECT_EQ(queue.queued_compute_units(), 0);
}

TEST(BatchQueueTest, TokenAndComputeUnitAccounting) {
  ManualClock clock;
  BatcherOptions options = Options(100, absl::Milliseconds(2), 100);
  options.max_batch_tokens = 10;
  BatchQueue<FakeTask> queue(options);
  Add(queue, 0, clock.Now(), 4, 40);
  Add(queue, 1, clock.Now(), 5, 55);
  EXPECT_EQ(queue.queued_tokens(), 9);
  EXPECT_EQ(queue.queued_compute_units(), 95);
  EXPECT_EQ(queue.num_queued_tasks(), 2);
  EXPECT_FALSE(queue.TakeBatch(clock.Now()).has_value());  // 9 of 10: not full, nothing has waited
  Add(queue, 2, clock.Now(), 3, 7);  // does not fit with the first two: the batch {0, 1} is full now
  EXPECT_EQ(queue.queued_tokens(), 12);
  EXPECT_EQ(queue.queued_compute_units(), 102);
  EXPECT_EQ(queue.NextDeadline(), clock.Now());
  std::optional<Batch<FakeTask>> batch = queue.TakeBatch(clock.Now());
  ASSERT_TRUE(batch.has_value());
  EXPECT_THAT(Ids(*batch), ElementsAre(0, 1));
  EXPECT_EQ(batch->tokens, 9);
  EXPECT_EQ(batch->compute_units, 95);
  EXPECT_EQ(queue.queued_tokens(), 3);
  EXPECT_EQ(queue.queued_compute_units(), 7);
  EXPECT_EQ(queue.num_queued_tasks(), 1);
  EXPECT_EQ(queue.NextDeadline(), clock.Now() + absl::Milliseconds(2));
  clock.Advance(absl::Milliseconds(2));
  batch = queue.TakeBatch(clock.Now());
  ASSERT_TRUE(batch.has_value());
  EXPECT_EQ(batch->tokens, 3);
  EXPECT_EQ(queue.queued_tokens(), 0);
  EXPECT_EQ(queue.queued_compute_units(), 0);
}

TEST(BatchQueueTest, CancelTakesAQueuedTaskBackAndFreesItsUnits) {
  ManualClock clock;
  // At most 3 queued tasks and 6 queued compute units.
  BatcherOptions options = Options(4, absl::Milliseconds(10), 3);
  options.queue_compute_units = 6;
  BatchQueue<FakeTask> queue(options);
  std::vector<uint64_t> tickets;
  for (int i = 0; i < 3; ++i) {
    std::unique_ptr<FakeTask> task = MakeTask(i, 2);
    uint64_t ticket = 0;
    ASSERT_TRUE(queue.Enqueue(&task, clock.Now(), nullptr, &ticket).ok());
    tickets.push_back(ticket);
  }
  EXPECT_EQ(tickets.size(), std::set<uint64_t>(tickets.begin(), tickets.end()).size()) << "tickets must be unique";
  // The queue is full (3 of 3 tasks, 6 of 6 compute units); removing the middle task frees its share of both.
  std::unique_ptr<FakeTask> extra = MakeTask(9, 2);
  EXPECT_EQ(queue.Enqueue(&extra, clock.Now()).code(), absl::StatusCode::kResourceExhausted);
  std::unique_ptr<FakeTask> removed = queue.Cancel(tickets[1]);
  ASSERT_NE(removed, nullptr);
  EXPECT_EQ(removed->id, 1);
  EXPECT_EQ(queue.queued_tokens(), 4);
  EXPECT_EQ(queue.queued_compute_units(), 4);
  EXPECT_EQ(queue.num_queued_tasks(), 2);
  EXPECT_EQ(queue.load().predicted_compute, absl::Milliseconds(4)) << "the queue sums predicted compute too";
  EXPECT_EQ(queue.Cancel(tickets[1]), nullptr) << "a ticket is removed once";
  ASSERT_TRUE(queue.Enqueue(&extra, clock.Now()).ok());
  // The batch (released at the max queue delay) skips the removed task: FIFO of what is left.
  clock.Advance(absl::Milliseconds(10));
  std::optional<Batch<FakeTask>> batch = queue.TakeBatch(clock.Now());
  ASSERT_TRUE(batch.has_value());
  EXPECT_THAT(Ids(*batch), ElementsAre(0, 2, 9));
  EXPECT_EQ(batch->predicted_compute, absl::Milliseconds(6));
  EXPECT_EQ(queue.load().predicted_compute, absl::ZeroDuration());
  EXPECT_EQ(queue.Cancel(tickets[0]), nullptr) << "a batched task cannot be removed";
}

// A task with a priority (server/policy/: a client's priority), one token and one compute unit.
struct PriorityTask {
  int id = 0;
  int level = 0;
  int64_t tokens() const { return 1; }
  int64_t compute_units() const { return 1; }
  absl::Duration predicted_compute() const { return absl::Milliseconds(1); }
  int priority() const { return level; }
};

std::vector<int> PriorityIds(const Batch<PriorityTask>& batch) {
  std::vector<int> ids;
  for (const auto& task : batch.tasks) ids.push_back(task->id);
  return ids;
}

// Batches take higher priorities first and keep FIFO order within a priority; a task without a priority is 0.
TEST(BatchQueueTest, BatchOrderFollowsPriorityThenArrival) {
  static_assert(TaskHasPriority<PriorityTask>::value);
  static_assert(!TaskHasPriority<FakeTask>::value);
  ManualClock clock;
  BatchQueue<PriorityTask> queue(Options(3, absl::Milliseconds(5), 64));
  // Arrival order: ids 0..7 with priorities -1, 0, 1, 0, -1, 1, 0, 1.
  const int priorities[] = {-1, 0, 1, 0, -1, 1, 0, 1};
  for (int id = 0; id < 8; ++id) {
    auto task = std::make_unique<PriorityTask>(PriorityTask{id, priorities[id]});
    ASSERT_TRUE(queue.Enqueue(&task, clock.Now()).ok());
    clock.Advance(absl::Microseconds(10));
  }
  std::vector<std::vector<int>> batches;
  while (std::optional<Batch<PriorityTask>> batch = queue.TakeBatch(clock.Now(), /*flush=*/true)) {
    batches.push_back(PriorityIds(*batch));
  }
  EXPECT_THAT(batches, ElementsAre(ElementsAre(2, 5, 7), ElementsAre(1, 3, 6), ElementsAre(0, 4)));
}

// A partial batch is due when the longest-waiting task (behind newer ones of higher priority) has waited
// max_queue_delay, not only when the first task of the queue has.
TEST(BatchQueueTest, PartialBatchIsDueByItsLongestWaitingTask) {
  ManualClock clock;
  BatchQueue<PriorityTask> queue(Options(4, absl::Milliseconds(5), 64));
  auto low = std::make_unique<PriorityTask>(PriorityTask{0, -1});
  ASSERT_TRUE(queue.Enqueue(&low, clock.Now()).ok());
  const absl::Time first = clock.Now();
  clock.Advance(absl::Milliseconds(3));
  auto high = std::make_unique<PriorityTask>(PriorityTask{1, 1});
  ASSERT_TRUE(queue.Enqueue(&high, clock.Now()).ok());
  EXPECT_EQ(queue.NextDeadline(), first + absl::Milliseconds(5));
  clock.Advance(absl::Milliseconds(1));
  EXPECT_FALSE(queue.TakeBatch(clock.Now()).has_value());
  clock.Advance(absl::Milliseconds(1));
  std::optional<Batch<PriorityTask>> batch = queue.TakeBatch(clock.Now());
  ASSERT_TRUE(batch.has_value());
  EXPECT_THAT(PriorityIds(*batch), ElementsAre(1, 0));
}

// Tasks of negative priority may fill only low_priority_queue_share of the queue; the others may fill the rest.
TEST(BatchQueueTest, LowPriorityFillsOnlyItsShareOfTheQueue) {
  ManualClock clock;
  BatcherOptions options = Options(4, absl::Milliseconds(5), 8);
  options.low_priority_queue_share = 0.5;
  BatchQueue<PriorityTask> queue(options);
  for (int id = 0; id < 4; ++id) {
    auto task = std::make_unique<PriorityTask>(PriorityTask{id, -1});
    ASSERT_TRUE(queue.Enqueue(&task, clock.Now()).ok()) << id;
  }
  auto refused = std::make_unique<PriorityTask>(PriorityTask{4, -1});
  AdmissionRejection rejection = AdmissionRejection::kNone;
  const absl::Status status = queue.Enqueue(&refused, clock.Now(), &rejection);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(rejection, AdmissionRejection::kLowPriorityQueueShare);
  EXPECT_EQ(status.message(),
            "queue is too full for a low-priority request (priority -1): 4 requests and 4 compute units queued; low "
            "priority may fill 4 requests (flag --queue_capacity) and 562949953421312 compute units (flag "
            "--queue_compute_units)");
  for (int id = 5; id < 9; ++id) {
    auto task = std::make_unique<PriorityTask>(PriorityTask{id, 0});
    ASSERT_TRUE(queue.Enqueue(&task, clock.Now()).ok()) << id;
  }
  EXPECT_EQ(queue.num_queued_tasks(), 8);
}

TEST(BatcherOptionsTest, Validation) {
  EXPECT_TRUE(ValidateBatcherOptions(BatcherOptions()).ok());
  BatcherOptions options;
  options.max_batch_size = 0;
  EXPECT_EQ(ValidateBatcherOptions(options).code(), absl::StatusCode::kInvalidArgument);
  options = BatcherOptions();
  options.queue_capacity = 0;
  EXPECT_EQ(ValidateBatcherOptions(options).code(), absl::StatusCode::kInvalidArgument);
  options = BatcherOptions();
  options.max_queue_delay = absl::Milliseconds(-1);
  EXPECT_EQ(ValidateBatcherOptions(options).code(), absl::StatusCode::kInvalidArgument);
  options = BatcherOptions();
  options.num_batch_threads = 0;
  EXPECT_EQ(ValidateBatcherOptions(options).code(), absl::StatusCode::kInvalidArgument);
  options = BatcherOptions();
  options.max_batch_tokens = 0;
  EXPECT_THAT(ValidateBatcherOptions(options).message(), HasSubstr("flag --max_batch_tokens"));
  options = BatcherOptions();
  options.queue_compute_units = 0;
  EXPECT_THAT(ValidateBatcherOptions(options).message(), HasSubstr("flag --queue_compute_units"));
  options = BatcherOptions();
  options.low_priority_queue_share = 0;
  EXPECT_THAT(ValidateBatcherOptions(options).message(), HasSubstr("low_priority_queue_share 0 must be in (0, 1]"));
}

// Records processed task ids; thread-safe.
class Recorder {
 public:
  void Process(Batch<FakeTask> batch) {
    absl::MutexLock lock(&mu_);
    batch_sizes_.push_back(batch.num_tasks());
    for (const auto& task : batch.tasks) ids_.push_back(task->id);
  }
  std::vector<int> ids() const {
    absl::MutexLock lock(&mu_);
    return ids_;
  }
  std::vector<int64_t> batch_sizes() const {
    absl::MutexLock lock(&mu_);
    return batch_sizes_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<int> ids_;
  std::vector<int64_t> batch_sizes_;
};

TEST(DynamicBatcherTest, EveryTaskIsProcessedExactlyOnce) {
  for (int threads : {1, 3}) {
    Recorder recorder;
    std::atomic<int64_t> depth{0};
    std::atomic<int64_t> depth_units{0};
    BatcherOptions options = Options(8, absl::Milliseconds(1), 10000);
    options.num_batch_threads = threads;
    auto batcher = DynamicBatcher<FakeTask>::Create(
        options, [&recorder](Batch<FakeTask> batch) { recorder.Process(std::move(batch)); }, RealClock::Get(),
        [&depth, &depth_units](const QueueDepthChange& change) {
          depth += change.tasks_delta;
          depth_units += change.compute_units_delta;
          EXPECT_EQ(depth.load(), change.tasks);
          EXPECT_EQ(depth_units.load(), change.compute_units);
        });
    ASSERT_TRUE(batcher.ok()) << batcher.status();
    constexpr int kSubmitters = 4;
    constexpr int kPerSubmitter = 250;
    std::vector<std::thread> submitters;
    for (int s = 0; s < kSubmitters; ++s) {
      submitters.emplace_back([&, s] {
        for (int i = 0; i < kPerSubmitter; ++i) {
          // Tasks of 1..3 tokens costing 7 compute units per token.
          std::unique_ptr<FakeTask> task = MakeTask(s * kPerSubmitter + i, 1 + i % 3, 7 * (1 + i % 3));
          ASSERT_TRUE((*batcher)->Submit(&task).ok());
        }
      });
    }
    for (std::thread& t : submitters) t.join();
    (*batcher)->Shutdown();
    std::vector<int> ids = recorder.ids();
    ASSERT_EQ(ids.size(), static_cast<size_t>(kSubmitters * kPerSubmitter));
    std::set<int> unique(ids.begin(), ids.end());
    EXPECT_EQ(unique.size(), ids.size()) << "a task was processed twice";
    EXPECT_EQ(*unique.begin(), 0);
    EXPECT_EQ(*unique.rbegin(), kSubmitters * kPerSubmitter - 1);
    for (int64_t size : recorder.batch_sizes()) {
      EXPECT_GE(size, 1);
      EXPECT_LE(size, 8);
    }
    EXPECT_EQ(depth.load(), 0);
    EXPECT_EQ(depth_units.load(), 0);
    EXPECT_EQ((*batcher)->queued_tokens(), 0);
    EXPECT_EQ((*batcher)->queued_compute_units(), 0);
  }
}

TEST(DynamicBatcherTest, ShutdownDrainsQueuedWorkAndThenRejects) {
  Recorder recorder;
  absl::Notification release;
  absl::Notification first_started;
  // A long delay: without draining, partial batches would wait an hour.
  BatcherOptions options = Options(4, absl::Hours(1), 100);
  auto batcher = DynamicBatcher<FakeTask>::Create(options, [&](Batch<FakeTask> batch) {
    if (!first_started.HasBeenNotified()) {
      first_started.Notify();
      release.WaitForNotification();
    }
    recorder.Process(std::move(batch));
  });
  ASSERT_TRUE(batcher.ok()) << batcher.status();
  // A full batch starts at once and blocks in the callback; the rest queue behind it.
  for (int i = 0; i < 4; ++i) {
    std::unique_ptr<FakeTask> task = MakeTask(i);
    ASSERT_TRUE((*batcher)->Submit(&task).ok());
  }
  first_started.WaitForNotification();
  for (int i = 4; i < 10; ++i) {
    std::unique_ptr<FakeTask> task = MakeTask(i);
    ASSERT_TRUE((*batcher)->Submit(&task).ok());
  }
  EXPECT_EQ((*batcher)->num_queued_tasks(), 6);
  // Shutdown begins while the batch thread is busy and six tasks are queued: four make a full batch, the
  // last two would wait an hour for their batch to fill if Shutdown did not flush them.
  std::thread shutdown([&] { (*batcher)->Shutdown(); });
  release.Notify();
  shutdown.join();
  std::unique_ptr<FakeTask> late = MakeTask(100);
  AdmissionRejection rejection = AdmissionRejection::kNone;
  absl::Status status = (*batcher)->Submit(&late, &rejection);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(rejection, AdmissionRejection::kShuttingDown);
  EXPECT_NE(late, nullptr);
  std::vector<int> ids = recorder.ids();
  std::set<int> unique(ids.begin(), ids.end());
  EXPECT_EQ(unique.size(), ids.size());
  for (int i = 0; i < 10; ++i) EXPECT_EQ(unique.count(i), 1u) << "task " << i << " was not drained";
  EXPECT_EQ((*batcher)->num_queued_tasks(), 0);
  (*batcher)->Shutdown();  // idempotent
}

TEST(DynamicBatcherTest, RejectsWhenQueueIsFull) {
  absl::Notification release;
  absl::Notification started;
  BatcherOptions options = Options(1, absl::ZeroDuration(), 2);
  auto batcher = DynamicBatcher<FakeTask>::Create(options, [&](Batch<FakeTask>) {
    if (!started.HasBeenNotified()) started.Notify();
    release.WaitForNotification();
  });
  ASSERT_TRUE(batcher.ok());
  std::unique_ptr<FakeTask> task = MakeTask(0);
  ASSERT_TRUE((*batcher)->Submit(&task).ok());
  started.WaitForNotification();  // task 0 is being processed; the queue is empty and the thread is busy
  for (int i = 1; i <= 2; ++i) {
    task = MakeTask(i);
    ASSERT_TRUE((*batcher)->Submit(&task).ok());
  }
  task = MakeTask(3);
  absl::Status status = (*batcher)->Submit(&task);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(), "queue is full: 2 of 2 queued requests (flag --queue_capacity)");
  release.Notify();
}

TEST(DynamicBatcherTest, CancelFreesTheQueueSlotAtOnceAndTheTaskIsNeverProcessed) {
  std::atomic<int64_t> depth{0};
  std::atomic<int> processed{0};
  // A batch of 4 with an hour of queue delay: a single task would sit in the queue for an hour.
  auto batcher = DynamicBatcher<FakeTask>::Create(
      Options(4, absl::Hours(1), 100), [&](Batch<FakeTask> batch) { processed += batch.num_tasks(); },
      RealClock::Get(), [&](const QueueDepthChange& change) { depth += change.tasks_delta; });
  ASSERT_TRUE(batcher.ok()) << batcher.status();
  std::unique_ptr<FakeTask> task = MakeTask(7);
  uint64_t ticket = 0;
  ASSERT_TRUE((*batcher)->Submit(&task, nullptr, &ticket).ok());
  EXPECT_EQ(depth.load(), 1);
  std::unique_ptr<FakeTask> back = (*batcher)->Cancel(ticket);
  ASSERT_NE(back, nullptr);
  EXPECT_EQ(back->id, 7);
  // The depth listener saw the removal synchronously, not at batch formation.
  EXPECT_EQ(depth.load(), 0);
  EXPECT_EQ((*batcher)->num_queued_tasks(), 0);
  EXPECT_EQ((*batcher)->Cancel(ticket), nullptr);
  (*batcher)->Shutdown();
  EXPECT_EQ(processed.load(), 0);
}

// The idle hook runs once per idle spell, on the batch thread, `after` the last batch: not while batches keep
// coming closer together than that, not again before another batch ran, not at all before the first.
TEST(DynamicBatcherTest, IdleHookRunsOnceWhenTheQueueStaysEmptyAfterABatch) {
  std::atomic<int> processed{0};
  std::atomic<int> idle_runs{0};
  std::atomic<std::thread::id> batch_thread;
  std::atomic<std::thread::id> idle_thread;
  std::atomic<int64_t> processed_when_idle{-1};
  constexpr absl::Duration kAfter = absl::Milliseconds(500);
  auto batcher = DynamicBatcher<FakeTask>::Create(
      Options(1, absl::ZeroDuration(), 100),
      [&](Batch<FakeTask> batch) {
        batch_thread = std::this_thread::get_id();
        processed += batch.num_tasks();
      },
      RealClock::Get(), nullptr,
      BatchThreadIdle{kAfter, [&] {
                        idle_thread = std::this_thread::get_id();
                        processed_when_idle = processed.load();
                        ++idle_runs;
                      }});
  ASSERT_TRUE(batcher.ok()) << batcher.status();
  absl::SleepFor(2 * kAfter);
  EXPECT_EQ(idle_runs.load(), 0) << "no batch has run yet";
  // Ten tasks 20 ms apart (a 25th of `after`): one idle spell, after the last.
  for (int i = 0; i < 10; ++i) {
    std::unique_ptr<FakeTask> task = MakeTask(i);
    ASSERT_TRUE((*batcher)->Submit(&task).ok());
    absl::SleepFor(kAfter / 25);
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (idle_runs.load() == 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  absl::SleepFor(2 * kAfter);
  EXPECT_EQ(idle_runs.load(), 1);
  EXPECT_EQ(processed_when_idle.load(), 10) << "the hook ran between batches of the stream";
  EXPECT_EQ(idle_thread.load(), batch_thread.load());
  std::unique_ptr<FakeTask> task = MakeTask(10);
  ASSERT_TRUE((*batcher)->Submit(&task).ok());
  while (idle_runs.load() == 1 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(idle_runs.load(), 2) << "a new spell after another batch";
  (*batcher)->Shutdown();
  EXPECT_EQ(processed.load(), 11);
  auto negative = DynamicBatcher<FakeTask>::Create(Options(1, absl::ZeroDuration(), 100), [](Batch<FakeTask>) {},
                                                   RealClock::Get(), nullptr,
                                                   BatchThreadIdle{absl::Milliseconds(-1), [] {}});
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DynamicBatcherTest, CreateRejectsBadOptions) {
  BatcherOptions options;
  options.num_batch_threads = 0;
  auto batcher = DynamicBatcher<FakeTask>::Create(options, [](Batch<FakeTask>) {});
  EXPECT_EQ(batcher.status().code(), absl::StatusCode::kInvalidArgument);
  auto no_callback = DynamicBatcher<FakeTask>::Create(BatcherOptions(), nullptr);
  EXPECT_EQ(no_callback.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mita::server
