// PreparationMemory: the byte budget that admits input preparation (decoding, tokenizing) by its working memory.
#include <atomic>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/engine/preparation_pool.h"

namespace mita::server {
namespace {

using ::testing::HasSubstr;

TEST(PreparationMemoryTest, MoreThanTheCapacityIsRefusedNamingTheFlag) {
  PreparationMemory memory(int64_t{64} << 20, "flag --preparation_memory_bytes");
  const absl::Status status = memory.Acquire(int64_t{200} << 20, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("needs about 200.0 MiB of working memory, more than the 64.0 MiB that preparation may use "
                        "(flag --preparation_memory_bytes)"));
  EXPECT_EQ(memory.in_use(), 0);
  EXPECT_TRUE(memory.Acquire(int64_t{64} << 20, nullptr).ok()) << "exactly the capacity fits";
  EXPECT_EQ(memory.in_use(), int64_t{64} << 20);
}

TEST(PreparationMemoryTest, ConcurrentTakersStayWithinTheCapacity) {
  constexpr int64_t kCapacity = 100;
  PreparationMemory memory(kCapacity, "test");
  std::atomic<int64_t> held{0};
  std::atomic<int64_t> most{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const int64_t bytes = 30 + (t * 7 + i) % 31;
        ASSERT_TRUE(memory.Acquire(bytes, nullptr).ok());
        const int64_t now = held.fetch_add(bytes) + bytes;
        int64_t seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
        std::this_thread::yield();
        held.fetch_sub(bytes);
        memory.Release(bytes);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_LE(most.load(), kCapacity);
  EXPECT_GT(most.load(), 60) << "two takers held memory at once";
  EXPECT_EQ(memory.in_use(), 0);
}

TEST(PreparationMemoryTest, WaitersAreServedInArrivalOrder) {
  PreparationMemory memory(100, "test");
  ASSERT_TRUE(memory.Acquire(80, nullptr).ok());
  absl::Mutex mu;
  std::vector<char> order;
  std::thread large([&] {
    ASSERT_TRUE(memory.Acquire(50, nullptr).ok());
    absl::MutexLock lock(&mu);
    order.push_back('L');
  });
  absl::SleepFor(absl::Milliseconds(300));  // the large one waits first
  std::thread small([&] {
    // 10 would fit in the 20 free, but the large one came first.
    ASSERT_TRUE(memory.Acquire(10, nullptr).ok());
    absl::MutexLock lock(&mu);
    order.push_back('S');
  });
  absl::SleepFor(absl::Milliseconds(300));
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(order.empty()) << "nobody overtook the waiting large taker";
  }
  memory.Release(80);
  large.join();
  small.join();
  ASSERT_EQ(order.size(), 2u);
  EXPECT_EQ(order[0], 'L');
  EXPECT_EQ(memory.in_use(), 60);
}

TEST(PreparationMemoryTest, AWaiterWhoseCallerLeftStopsWaitingAndBlocksNoOne) {
  PreparationMemory memory(100, "test");
  ASSERT_TRUE(memory.Acquire(100, nullptr).ok());
  std::atomic<int> asked{0};
  const absl::Status stopped = memory.Acquire(50, [&]() -> absl::Status {
    return ++asked >= 3 ? absl::CancelledError("the caller left") : absl::OkStatus();
  });
  EXPECT_EQ(stopped.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(asked.load(), 3);
  EXPECT_EQ(memory.in_use(), 100);
  memory.Release(100);
  EXPECT_TRUE(memory.Acquire(70, nullptr).ok()) << "the abandoned waiter left the queue";
}

}  // namespace
}  // namespace mita::server
