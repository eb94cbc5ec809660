// The budget policy per client under load (issue 36): a low-priority client sending at 4x its compute quota beside
// an interactive client at a steady rate, on an in-process server with the embedded image model. Open-loop senders
// (a call every 1/rate seconds, whatever the answers) over mita.v1 with bearer tokens. Checks:
//   - the interactive client's p99 latency with the low-priority client beside it is within 1.5x of its p99 alone
//     (20 s alone, then 20 s beside; up to 3 such pairs, passing on the first within 1.5x: a shared CI machine may
//     stall the process for a second, which a p99 of 500 calls shows);
//   - the low-priority client's admitted compute (mita_client_compute_units_total) over the steady part of the run
//     (after its burst is spent) is within 5% of its quota;
//   - no call is lost: every interactive call is OK, every low-priority call OK or RESOURCE_EXHAUSTED for its quota
//     or its priority's share of the queue, and every call sent is answered.
// The figures are printed (docs/serving.md, "Budget policy per client under load").
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/percentile.h"
#include "gtest/gtest.h"
#include "mita/v1/mita.grpc.pb.h"
#include "server/engine/model_registry.h"
#include "server/policy/client_policy.h"
#include "server/policy/policy_holder.h"
#include "tests/server_test_util.h"
#include "tests/test_util.h"

namespace mita::server {
namespace {

constexpr char kModel[] = "fashion-mnist-vit";
constexpr char kInteractiveToken[] = "interactive-t0ken";
constexpr char kBulkToken[] = "bulk-t0ken";
// One image at the model's default budget (9x16): 50 tokens x (9 + 16) compute units.
constexpr double kImageComputeUnits = 50 * 25;
// The interactive client's steady rate, and the low-priority client's quota (in images per second) and its rate.
constexpr double kInteractiveRate = 25;
constexpr double kBulkQuotaImages = 12;
constexpr double kBulkQuota = kBulkQuotaImages * kImageComputeUnits;  // compute units per second
constexpr double kBulkBurst = 2 * kBulkQuota;
constexpr double kBulkRate = 4 * kBulkQuotaImages;
const absl::Duration kWarmUp = absl::Seconds(3);
const absl::Duration kPhase = absl::Seconds(20);
constexpr int kAttempts = 3;
// The low-priority client's burst is spent after kBulkBurst / (4 - 1) quota-seconds; its rate is measured after.
const absl::Duration kBulkSettle = absl::Seconds(3);

// The answers one sender got.
struct Tally {
  absl::Mutex mu;
  std::vector<double> latencies_ms ABSL_GUARDED_BY(mu);      // OK calls
  std::map<std::string, int64_t> codes ABSL_GUARDED_BY(mu);  // code name (and refusal kind) -> calls
  int64_t sent ABSL_GUARDED_BY(mu) = 0;
  int64_t answered ABSL_GUARDED_BY(mu) = 0;
};

// One asynchronous Classify call, alive until its callback.
struct Call {
  grpc::ClientContext context;
  v1::ClassifyRequest request;
  v1::ClassifyResponse response;
  absl::Time sent;
};

// Sends Classify calls with `token` at `rate` per second from now until `end` (open loop), recording into `tally`.
void Send(v1::MitaService::Stub* stub, const std::string& token, const std::vector<std::string>& images, double rate,
          absl::Time end, Tally* tally) {
  const absl::Time start = absl::Now();
  for (int64_t i = 0;; ++i) {
    const absl::Time at = start + absl::Seconds(static_cast<double>(i) / rate);
    if (at >= end) break;
    absl::SleepFor(at - absl::Now());
    auto* call = new Call;
    call->request.set_model(kModel);
    call->request.set_image(images[static_cast<size_t>(i) % images.size()]);
    call->context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    call->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    call->sent = absl::Now();
    {
      absl::MutexLock lock(&tally->mu);
      ++tally->sent;
    }
    stub->async()->Classify(&call->context, &call->request, &call->response, [call, tally](grpc::Status status) {
      const double ms = absl::ToDoubleMilliseconds(absl::Now() - call->sent);
      std::string code = absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()));
      if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        code += absl::StrContains(status.error_message(), "over its quota") ? " (quota)"
                : absl::StrContains(status.error_message(), "low-priority") ? " (low-priority queue share)"
                                                                            : " (other)";
      }
      {
        absl::MutexLock lock(&tally->mu);
        if (status.ok()) tally->latencies_ms.push_back(ms);
        ++tally->codes[code];
        ++tally->answered;
      }
      delete call;
    });
  }
}

// Waits until every call `tally` sent is answered (at most 60 s).
void AwaitAnswers(Tally* tally) {
  absl::MutexLock lock(&tally->mu);
  tally->mu.AwaitWithTimeout(
      absl::Condition(
          +[](Tally* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu) { return t->answered == t->sent; }, tally),
      absl::Seconds(60));
}

std::string Codes(Tally& tally) {
  absl::MutexLock lock(&tally.mu);
  std::string text;
  for (const auto& [code, count] : tally.codes) absl::StrAppend(&text, text.empty() ? "" : ", ", code, " ", count);
  return text;
}

double P99(Tally& tally) {
  absl::MutexLock lock(&tally.mu);
  std::vector<double> values = tally.latencies_ms;
  return Percentile(values, 99);
}

// The `count` longest latencies, longest first, as text.
std::string Slowest(Tally& tally, size_t count) {
  absl::MutexLock lock(&tally.mu);
  std::vector<double> values = tally.latencies_ms;
  std::sort(values.rbegin(), values.rend());
  std::string text;
  for (size_t i = 0; i < std::min(count, values.size()); ++i)
    absl::StrAppendFormat(&text, "%s%.1f", i ? " " : "", values[i]);
  return text;
}

double P50(Tally& tally) {
  absl::MutexLock lock(&tally.mu);
  std::vector<double> values = tally.latencies_ms;
  return Percentile(values, 50);
}

TEST(ClientPolicyLoadTest, LowPriorityClientAtFourTimesItsQuotaBesideAnInteractiveOne) {
  absl::StatusOr<std::unique_ptr<ModelRegistry>> registry =
      ModelRegistry::LoadFromDirectory(test_util::RepositoryPath());
  ASSERT_TRUE(registry.ok()) << registry.status();
  const std::string policy_path = test_util::MakeTempDirectory("client_policy_load") + "/policy.json";
  test_util::WriteFile(policy_path, absl::StrCat(R"({"clients": [
        {"name": "interactive", "token_sha256": ")",
                                                 policy::Sha256Hex(kInteractiveToken), R"(",
         "priority": "interactive"},
        {"name": "bulk", "token_sha256": ")",
                                                 policy::Sha256Hex(kBulkToken), R"(", "priority": "batch",
         "quota": {"compute_units_per_second": )",
                                                 kBulkQuota, R"(, "burst_compute_units": )", kBulkBurst, R"(}}]})"));
  absl::StatusOr<std::unique_ptr<policy::ClientPolicyHolder>> holder = policy::ClientPolicyHolder::Load(policy_path);
  ASSERT_TRUE(holder.ok()) << holder.status();
  test_util::InProcessServerOptions options;
  options.front_end.client_policy = holder->get();
  test_util::InProcessServer server(registry->get(), options);
  ASSERT_TRUE(server.status().ok()) << server.status();
  auto channel = grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials());
  std::unique_ptr<v1::MitaService::Stub> stub = v1::MitaService::NewStub(channel);
  absl::StatusOr<test_util::TestImages> images = test_util::FashionMnistTestPngs(32);
  ASSERT_TRUE(images.ok()) << images.status();

  // Warm-up (not measured).
  Tally warm_up;
  Send(stub.get(), kInteractiveToken, images->pngs, kInteractiveRate, absl::Now() + kWarmUp, &warm_up);
  AwaitAnswers(&warm_up);

  // Up to kAttempts pairs of phases: the interactive client alone, then beside the low-priority one. The quota and
  // the answers are checked in every attempt; the latency comparison passes when one attempt's p99s are within
  // 1.5x (a shared CI machine may stall a process for a second, which a p99 of a few hundred calls shows).
  bool latency_held = false;
  for (int attempt = 1; attempt <= kAttempts && !latency_held; ++attempt) {
    Tally alone;
    Send(stub.get(), kInteractiveToken, images->pngs, kInteractiveRate, absl::Now() + kPhase, &alone);
    AwaitAnswers(&alone);

    // Both clients: the low-priority one at 4x its quota (its bucket full again after the phase alone).
    Tally beside;
    Tally bulk;
    const absl::Time end = absl::Now() + kPhase;
    std::thread bulk_sender([&] { Send(stub.get(), kBulkToken, images->pngs, kBulkRate, end, &bulk); });
    double settled_units = 0;
    absl::Time settled_at;
    std::thread meter([&] {
      absl::SleepFor(kBulkSettle);
      settled_at = absl::Now();
      settled_units =
          test_util::MetricValue(*server.metrics().registry(), "mita_client_compute_units_total", {{"client", "bulk"}});
    });
    Send(stub.get(), kInteractiveToken, images->pngs, kInteractiveRate, end, &beside);
    bulk_sender.join();
    meter.join();
    const absl::Time sent_until = absl::Now();
    const double final_units =
        test_util::MetricValue(*server.metrics().registry(), "mita_client_compute_units_total", {{"client", "bulk"}});
    AwaitAnswers(&beside);
    AwaitAnswers(&bulk);

    const double alone_p99 = P99(alone);
    const double beside_p99 = P99(beside);
    const double bulk_rate = (final_units - settled_units) / absl::ToDoubleSeconds(sent_until - settled_at);
    std::printf(
        "attempt %d\n"
        "interactive alone: %.0f calls/s for %.0f s, p50 %.2f ms, p99 %.2f ms (%s)\n"
        "interactive beside bulk: p50 %.2f ms, p99 %.2f ms (%s); p99 ratio %.2f (must be <= 1.5)\n"
        "bulk: %.0f calls/s at 4x its quota of %.0f compute units/s (burst %.0f): admitted %.0f compute units/s "
        "after %.0f s, %.2f%% off the quota (must be within 5%%); %s\n"
        "slowest interactive calls alone (ms): %s\nslowest interactive calls beside bulk (ms): %s\n",
        attempt, kInteractiveRate, absl::ToDoubleSeconds(kPhase), P50(alone), alone_p99, Codes(alone).c_str(),
        P50(beside), beside_p99, Codes(beside).c_str(), beside_p99 / alone_p99, kBulkRate, kBulkQuota, kBulkBurst,
        bulk_rate, absl::ToDoubleSeconds(kBulkSettle), 100 * (bulk_rate - kBulkQuota) / kBulkQuota, Codes(bulk).c_str(),
        Slowest(alone, 10).c_str(), Slowest(beside, 10).c_str());
    std::fflush(stdout);

    // No call lost: every call answered; the interactive ones OK; the low-priority ones OK or refused for its
    // quota or its priority's share of the queue.
    for (Tally* tally : {&alone, &beside, &bulk}) {
      absl::MutexLock lock(&tally->mu);
      EXPECT_EQ(tally->answered, tally->sent);
    }
    {
      absl::MutexLock lock(&alone.mu);
      EXPECT_EQ(alone.codes["OK"], alone.sent);
    }
    {
      absl::MutexLock lock(&beside.mu);
      EXPECT_EQ(beside.codes["OK"], beside.sent);
    }
    {
      absl::MutexLock lock(&bulk.mu);
      EXPECT_EQ(bulk.codes["OK"] + bulk.codes["RESOURCE_EXHAUSTED (quota)"] +
                    bulk.codes["RESOURCE_EXHAUSTED (low-priority queue share)"],
                bulk.sent);
      EXPECT_GT(bulk.codes["RESOURCE_EXHAUSTED (quota)"], 0);
    }
    EXPECT_NEAR(bulk_rate, kBulkQuota, 0.05 * kBulkQuota);
    latency_held = beside_p99 <= 1.5 * alone_p99;
  }
  EXPECT_TRUE(latency_held) << "the interactive p99 beside the low-priority client exceeded 1.5x its p99 alone in "
                            << kAttempts << " attempts (figures above)";
}

}  // namespace
}  // namespace mita::server
