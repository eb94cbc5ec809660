// Latency targets and deadline-aware admission (server/planning/latency_planner.h, server/planning/lane_planner.h,
// server/engine/lane.h): the cost model's
// fit, budget choice at the boundary, floors, degradation at batch start and its order, mixed-budget batches, and
// that no request runs with a budget it did not allow. The engine runs on a ManualClock with a scripted
// classifier whose batches take the time the test says, so every prediction is known exactly: the cost profile's
// only non-zero coefficients are 2^-6 s per batch and 2^-16 s per token x (m + k) (and per token^2 for full
// attention), for a model of one layer and embed_dim 1.
#include <ATen/Parallel.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/tensor.h>

#include <atomic>
#include <cmath>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "models/budget.h"
#include "models/classifier.h"
#include "models/model_package.h"
#include "server/planning/clock.h"
#include "server/planning/cost_calibration.h"
#include "models/cost_features.h"
#include "server/engine/inference_engine.h"
#include "server/engine/model_registry.h"
#include "server/planning/cost_model.h"
#include "server/planning/latency_planner.h"
#include "tests/server_test_util.h"
#include "tests/test_util.h"

namespace mita {
namespace {

using models::AttentionBudget;
using server::BudgetReason;
using test_util::ExpectStatus;
using test_util::MetricValue;

constexpr char kModel[] = "scripted-doc";
constexpr double kBatchSeconds = 1.0 / 64;           // 15.625 ms
constexpr double kUnitSeconds = 1.0 / (1 << 16);     // per token x (m + k)

AttentionBudget Experts(int64_t m, int64_t k) { return AttentionBudget{false, m, k}; }

// The test's own arithmetic of a batch's time (the reference the server's predictions are checked against).
absl::Duration ReferenceCompute(const std::vector<std::pair<int64_t, AttentionBudget>>& items) {
  double seconds = kBatchSeconds;
  for (const auto& [tokens, budget] : items) {
    const AttentionBudget applied = models::ApplyBudget(budget, tokens);
    seconds += kUnitSeconds * static_cast<double>(tokens) *
               static_cast<double>(applied.full_attention ? tokens : applied.expert_count + applied.expert_width);
  }
  return absl::Seconds(seconds);
}

// Predictions equal the reference up to rounding (durations have quarter-nanosecond steps).
void ExpectMicroseconds(absl::Duration actual, absl::Duration expected) {
  EXPECT_NEAR(absl::ToDoubleMicroseconds(actual), absl::ToDoubleMicroseconds(expected), 0.01);
}

server::CostProfile ScriptedProfile() {
  server::CostProfile profile;
  profile.coefficients = server::CostFeatures{kBatchSeconds, 0, 0, kUnitSeconds, 0, kUnitSeconds};
  profile.source = "loaded";
  return profile;
}

// A document classifier whose batches take scripted time on a ManualClock: the next scripted duration, else the
// reference time. It records each batch's applied budgets, and can hold batches until released.
class ScriptedClassifier : public models::Classifier {
 public:
  explicit ScriptedClassifier(server::ManualClock* clock) : clock_(clock) {
    description_.name = kModel;
    description_.architecture = "scripted";
    description_.input_kind = models::InputKind::kDocument;
    description_.document = models::DocumentInputDescription{4096, 1000, "bytes"};
    description_.labels = {"a", "b"};
    description_.layers = 1;
    description_.heads = 1;
    description_.embed_dim = 1;
    description_.max_input_tokens = 4096;
    description_.reference_tokens = 64;
    models::BudgetKnobs& knobs = description_.knobs;
    knobs.min_expert_count = 1;
    knobs.max_expert_count = 64;
    knobs.min_expert_width = 1;
    knobs.max_expert_width = 128;
    knobs.default_budget = Experts(32, 64);
    knobs.accuracy_order = {{"32x64", Experts(32, 64), 0.9}, {"16x32", Experts(16, 32), 0.8},
                            {"8x16", Experts(8, 16), 0.7}};
  }

  const models::ClassifierDescription& description() const override { return description_; }

  absl::StatusOr<models::ClassifierOutput> Run(absl::Span<const models::BatchItem* const> items, bool,
                                               const models::ItemCheck&) const override {
    std::vector<std::pair<int64_t, AttentionBudget>> batch;
    for (const models::BatchItem* item : items) batch.emplace_back(item->tokens, item->budget.budget);
    absl::Duration duration;
    {
      absl::MutexLock lock(&mu_);
      batches_.push_back(batch);
      mu_.Await(absl::Condition(+[](bool* hold) { return !*hold; }, &hold_));
      duration = scripted_.empty() ? ReferenceCompute(batch) : scripted_.front();
      if (!scripted_.empty()) scripted_.pop_front();
    }
    clock_->Advance(duration);
    models::ClassifierOutput output;
    output.logits = at::zeros({static_cast<int64_t>(items.size()), 2});
    output.statistics.resize(items.size());
    output.stopped.resize(items.size());
    return output;
  }

  void Hold(bool hold) {
    absl::MutexLock lock(&mu_);
    hold_ = hold;
  }
  void Script(absl::Duration duration) {
    absl::MutexLock lock(&mu_);
    scripted_.push_back(duration);
  }
  // Waits (real time, bounded) until `count` batches have entered Run.
  bool WaitForBatches(size_t count) {
    absl::MutexLock lock(&mu_);
    struct Args {
      const std::vector<std::vector<std::pair<int64_t, AttentionBudget>>>* batches;
      size_t count;
    } args{&batches_, count};
    return mu_.AwaitWithTimeout(absl::Condition(+[](Args* a) { return a->batches->size() >= a->count; }, &args),
                                absl::Seconds(20));
  }
  std::vector<std::vector<std::pair<int64_t, AttentionBudget>>> batches() const {
    absl::MutexLock lock(&mu_);
    return batches_;
  }
  // Inputs prepared so far.
  int64_t preparations() const { return preparations_.load(); }

 protected:
  absl::StatusOr<PreparedInput> PrepareInput(const models::ClassifierInput& input, const models::InputLimits&,
                                             const models::StopCheck&) const override {
    preparations_.fetch_add(1);
    PreparedInput prepared;
    std::vector<int64_t> ids(input.token_ids.begin(), input.token_ids.end());
    prepared.input = at::tensor(ids, at::kLong);
    prepared.tokens = static_cast<int64_t>(ids.size());
    prepared.input_tokens = prepared.tokens;
    return prepared;
  }
  absl::StatusOr<int64_t> InputPreparationBytes(const models::ClassifierInput&,
                                                const models::InputLimits&) const override {
    return 0;
  }
  PreparedInput SyntheticInput(int64_t tokens) const override {
    return PreparedInput{at::zeros({tokens}, at::kLong), tokens, tokens};
  }

 private:
  server::ManualClock* const clock_;
  models::ClassifierDescription description_;
  mutable absl::Mutex mu_;
  mutable bool hold_ ABSL_GUARDED_BY(mu_) = false;
  mutable std::deque<absl::Duration> scripted_ ABSL_GUARDED_BY(mu_);
  mutable std::vector<std::vector<std::pair<int64_t, AttentionBudget>>> batches_ ABSL_GUARDED_BY(mu_);
  mutable std::atomic<int64_t> preparations_{0};
};

// One request's outcome.
struct Outcome {
  absl::Notification done;
  absl::StatusOr<server::InferenceResult> result = absl::UnknownError("not answered");
};

class LatencyTargetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto classifier = std::make_unique<ScriptedClassifier>(&clock_);
    classifier_ = classifier.get();
    std::vector<models::ModelPackage> packages;
    packages.push_back(models::ModelPackage{kModel, std::move(classifier)});
    absl::StatusOr<std::unique_ptr<server::ModelRegistry>> registry =
        server::ModelRegistry::FromPackages(std::move(packages));
    ASSERT_TRUE(registry.ok()) << registry.status();
    registry_ = *std::move(registry);
    metrics_ = std::make_unique<server::ServerMetrics>(server::MetricsModelInfos(*registry_));
    server::EngineOptions options;
    options.batching.max_queue_delay = absl::ZeroDuration();
    options.batching.max_batch_size = 16;
    options.preparation_threads = 1;
    options.long_document_tokens = 0;
    options.cost_profiles[kModel] = ScriptedProfile();
    absl::StatusOr<std::unique_ptr<server::InferenceEngine>> engine =
        server::InferenceEngine::Create(registry_.get(), metrics_.get(), options, &clock_);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
  }

  void TearDown() override {
    if (classifier_ != nullptr) classifier_->Hold(false);
    engine_.reset();
  }

  // Submits a document of `tokens` tokens with `budget`, answering into the returned outcome.
  std::shared_ptr<Outcome> Submit(int64_t tokens, models::BudgetRequest budget,
                                  absl::Duration deadline = absl::InfiniteDuration()) {
    auto outcome = std::make_shared<Outcome>();
    auto ids = std::make_shared<std::vector<int64_t>>(tokens, 7);
    server::InferenceRequest request;
    request.model = kModel;
    request.input.kind = models::ClassifierInput::Kind::kTokenIds;
    request.input.token_ids = *ids;
    request.budget = std::move(budget);
    request.deadline = deadline == absl::InfiniteDuration() ? absl::InfiniteFuture() : clock_.Now() + deadline;
    calls_.push_back(engine_->Submit(std::move(request), [outcome, ids](absl::StatusOr<server::InferenceResult> r) {
      outcome->result = std::move(r);
      outcome->done.Notify();
    }));
    return outcome;
  }

  // Waits (real time, bounded) until `tasks` requests are queued in the model's batcher.
  bool WaitForQueued(double tasks) {
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (absl::Now() < give_up) {
      if (MetricValue(*metrics_->registry(), "mita_queue_depth", {{"model", kModel}}) == tasks) return true;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return false;
  }

  static models::BudgetRequest Target(absl::Duration target, std::string floor = "") {
    models::BudgetRequest budget;
    budget.choice = models::BudgetRequest::Choice::kLatencyTarget;
    budget.latency_target = target;
    budget.floor = std::move(floor);
    return budget;
  }
  static models::BudgetRequest Fixed(int64_t m, int64_t k) {
    models::BudgetRequest budget;
    budget.choice = models::BudgetRequest::Choice::kExperts;
    budget.expert_count = m;
    budget.expert_width = k;
    return budget;
  }

  server::ManualClock clock_{absl::FromUnixSeconds(1000)};
  ScriptedClassifier* classifier_ = nullptr;
  std::unique_ptr<server::ModelRegistry> registry_;
  std::unique_ptr<server::ServerMetrics> metrics_;
  std::unique_ptr<server::InferenceEngine> engine_;
  std::vector<std::unique_ptr<server::InferenceCall>> calls_;
};

// With nothing queued, a target equal to (or above) the most accurate budget's predicted compute gets it; 1 ms
// less gets the next one. 64 tokens: 32x64 predicts 15.625 + 93.75 = 109.375 ms, 16x32 62.5 ms, 8x16 39.0625 ms.
TEST_F(LatencyTargetTest, ChoosesTheMostAccurateBudgetThatMeetsTheTargetAtTheBoundary) {
  struct Case {
    int64_t target_ms;
    AttentionBudget expected;
    BudgetReason reason;
  };
  for (const Case& c : {Case{110, Experts(32, 64), BudgetReason::kMostAccurate},
                        Case{109, Experts(16, 32), BudgetReason::kLoweredAtAdmission},
                        Case{63, Experts(16, 32), BudgetReason::kLoweredAtAdmission},
                        Case{62, Experts(8, 16), BudgetReason::kLoweredAtAdmission}}) {
    std::shared_ptr<Outcome> outcome = Submit(64, Target(absl::Milliseconds(c.target_ms)));
    ASSERT_TRUE(outcome->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
    ASSERT_TRUE(outcome->result.ok()) << c.target_ms << ": " << outcome->result.status();
    EXPECT_EQ(outcome->result->budget.budget, c.expected) << "target " << c.target_ms << " ms";
    EXPECT_EQ(outcome->result->budget_reason, c.reason) << "target " << c.target_ms << " ms";
    ExpectMicroseconds(outcome->result->predicted, ReferenceCompute({{64, c.expected}}));
  }
  // Below the floor's own compute: answered at once, never run below the floor.
  std::shared_ptr<Outcome> impossible = Submit(64, Target(absl::Milliseconds(39)));
  ASSERT_TRUE(impossible->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ExpectStatus(impossible->result.status(), absl::StatusCode::kResourceExhausted,
               "predicted 39 ms to answer (queue wait 0 ms + compute 39 ms at MiTA m=8 k=16, the least accurate "
               "budget allowed) but the latency target leaves 39 ms; it was not run");
  EXPECT_EQ(classifier_->batches().size(), 4u) << "the refused request never ran";
  EXPECT_EQ(MetricValue(*metrics_->registry(), "mita_rejected_requests_total",
                        {{"model", kModel}, {"reason", "latency_target_unmeetable"}}),
            1);
  EXPECT_EQ(MetricValue(*metrics_->registry(), "mita_budget_choices_total",
                        {{"model", kModel}, {"reason", "lowered_at_admission"}}),
            3);
}

// A request running (held) makes the queue wait known: 128 tokens at 32x64 predict 203.125 ms.
TEST_F(LatencyTargetTest, QueueWaitLowersToTheFloorAndRefusesWhatCannotBeMet) {
  classifier_->Hold(true);
  std::shared_ptr<Outcome> running = Submit(128, Fixed(32, 64));
  ASSERT_TRUE(classifier_->WaitForBatches(1));
  // A fixed budget with a 300 ms deadline: 203 ms wait + 203 ms compute is too late.
  std::shared_ptr<Outcome> late = Submit(128, Fixed(32, 64), absl::Milliseconds(300));
  ASSERT_TRUE(late->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ExpectStatus(late->result.status(), absl::StatusCode::kDeadlineExceeded,
               "predicted 406 ms to answer (queue wait 203 ms + compute 203 ms at MiTA m=32 k=64) but the deadline "
               "is in 300 ms; it was not run");
  // A 300 ms target with floor 16x32: 203.125 + 15.625 + 93.75 = 312.5 ms at the floor: refused.
  std::shared_ptr<Outcome> floored = Submit(128, Target(absl::Milliseconds(300), "16x32"));
  ASSERT_TRUE(floored->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ExpectStatus(floored->result.status(), absl::StatusCode::kResourceExhausted,
               "predicted 312 ms to answer (queue wait 203 ms + compute 109 ms at MiTA m=16 k=32, the least "
               "accurate budget allowed) but the latency target leaves 300 ms");
  // The same without a floor: 8x16 fits (265.625 ms).
  std::shared_ptr<Outcome> lowered = Submit(128, Target(absl::Milliseconds(300)));
  ASSERT_TRUE(WaitForQueued(1));
  // The call's deadline as the target (target 0): 265.625 ms wait (the running batch, the queued 8x16 request
  // and its batch's fixed cost) + 203.125 ms at 32x64 = 468.75 ms <= 500 ms.
  std::shared_ptr<Outcome> by_deadline = Submit(128, Target(absl::ZeroDuration()), absl::Milliseconds(500));
  ASSERT_TRUE(WaitForQueued(2));
  classifier_->Hold(false);
  for (const auto& outcome : {running, lowered, by_deadline}) {
    ASSERT_TRUE(outcome->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  }
  ASSERT_TRUE(lowered->result.ok()) << lowered->result.status();
  EXPECT_EQ(lowered->result->budget.budget, Experts(8, 16));
  EXPECT_EQ(lowered->result->budget_reason, BudgetReason::kLoweredAtAdmission);
  ExpectMicroseconds(lowered->result->predicted, absl::Milliseconds(265.625));
  ASSERT_TRUE(by_deadline->result.ok()) << by_deadline->result.status();
  EXPECT_EQ(by_deadline->result->budget.budget, Experts(32, 64));
  EXPECT_EQ(by_deadline->result->budget_reason, BudgetReason::kMostAccurate);
  ExpectMicroseconds(by_deadline->result->predicted, absl::Milliseconds(468.75));
  EXPECT_EQ(MetricValue(*metrics_->registry(), "mita_rejected_requests_total",
                        {{"model", kModel}, {"reason", "deadline_unmeetable"}}),
            1);
}

// Refused before preparation only what no input could meet: behind a running batch predicted at 203.125 ms, the
// cheapest input (1 token: 15.625 ms + 1 unit) would answer at 218.77 ms at the earliest, so a 200 ms deadline or
// latency target is refused without its input being prepared. A 250 ms deadline is prepared, and then refused by
// admission on its own compute (203.125 ms at 32x64).
TEST_F(LatencyTargetTest, RefusesBeforePreparationOnlyWhatNoInputCouldMeet) {
  classifier_->Hold(true);
  std::shared_ptr<Outcome> running = Submit(128, Fixed(32, 64));
  ASSERT_TRUE(classifier_->WaitForBatches(1));
  const int64_t prepared = classifier_->preparations();
  std::shared_ptr<Outcome> by_deadline = Submit(128, Fixed(32, 64), absl::Milliseconds(200));
  ASSERT_TRUE(by_deadline->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ExpectStatus(by_deadline->result.status(), absl::StatusCode::kDeadlineExceeded,
               "predicted at least 218 ms to answer (queue wait 203 ms + compute 15 ms for the cheapest input) but "
               "the deadline is in 200 ms; it was not run");
  std::shared_ptr<Outcome> by_target = Submit(128, Target(absl::Milliseconds(200)));
  ASSERT_TRUE(by_target->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ExpectStatus(by_target->result.status(), absl::StatusCode::kResourceExhausted,
               "predicted at least 218 ms to answer (queue wait 203 ms + compute 15 ms for the cheapest input) but "
               "the latency target leaves 200 ms; it was not run (retry later");
  EXPECT_EQ(classifier_->preparations(), prepared) << "neither input was prepared";

  std::shared_ptr<Outcome> prepared_then_refused = Submit(128, Fixed(32, 64), absl::Milliseconds(250));
  ASSERT_TRUE(prepared_then_refused->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ExpectStatus(prepared_then_refused->result.status(), absl::StatusCode::kDeadlineExceeded,
               "predicted 406 ms to answer (queue wait 203 ms + compute 203 ms at MiTA m=32 k=64) but the deadline "
               "is in 250 ms; it was not run");
  EXPECT_EQ(classifier_->preparations(), prepared + 1);
  EXPECT_EQ(MetricValue(*metrics_->registry(), "mita_rejected_requests_total",
                        {{"model", kModel}, {"reason", "deadline_unmeetable"}}),
            2);
  EXPECT_EQ(MetricValue(*metrics_->registry(), "mita_rejected_requests_total",
                        {{"model", kModel}, {"reason", "latency_target_unmeetable"}}),
            1);
  classifier_->Hold(false);
  ASSERT_TRUE(running->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_TRUE(running->result.ok()) << running->result.status();
}

// Degradation at batch start: two target requests admitted at 32x64 behind a batch predicted at 203 ms that takes
// 600 ms. At their batch's start (t = 600 ms, 400 ms left of their 1000 ms targets) the batch predicts 484 ms
// (x the online correction the slow batch caused); lowering the 256-token request one step saves the most and
// is enough (about 297 ms), so it runs at 16x32 beside the 64-token one at 32x64, in one mixed-budget batch.
TEST_F(LatencyTargetTest, LowersTheCostliestRequestFirstWhenItsBatchStartsLate) {
  classifier_->Hold(true);
  classifier_->Script(absl::Milliseconds(600));
  std::shared_ptr<Outcome> running = Submit(128, Fixed(32, 64));
  ASSERT_TRUE(classifier_->WaitForBatches(1));
  std::shared_ptr<Outcome> long_one = Submit(256, Target(absl::Milliseconds(1000)));
  ASSERT_TRUE(WaitForQueued(1));
  std::shared_ptr<Outcome> short_one = Submit(64, Target(absl::Milliseconds(1000)));
  ASSERT_TRUE(WaitForQueued(2));
  classifier_->Hold(false);
  for (const auto& outcome : {running, long_one, short_one}) {
    ASSERT_TRUE(outcome->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
    ASSERT_TRUE(outcome->result.ok()) << outcome->result.status();
  }
  EXPECT_EQ(long_one->result->budget.budget, Experts(16, 32));
  EXPECT_EQ(long_one->result->budget_reason, BudgetReason::kLoweredAtBatchStart);
  EXPECT_EQ(short_one->result->budget.budget, Experts(32, 64));
  EXPECT_EQ(short_one->result->budget_reason, BudgetReason::kMostAccurate);
  const auto batches = classifier_->batches();
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_THAT(batches[1], ::testing::ElementsAre(std::make_pair(int64_t{256}, Experts(16, 32)),
                                                 std::make_pair(int64_t{64}, Experts(32, 64))));
  EXPECT_LE(long_one->result->total, absl::Milliseconds(1000)) << "the lowered batch finished within the target";
  EXPECT_EQ(MetricValue(*metrics_->registry(), "mita_budget_choices_total",
                        {{"model", kModel}, {"reason", "lowered_at_batch_start"}}),
            1);
  EXPECT_EQ(MetricValue(*metrics_->registry(), "mita_compute_prediction_ratio", {{"model", kModel}}), 2)
      << "both batches observed";
}

// Random targets, floors, deadlines and batch times: every answered request ran with a budget its floor allows,
// with a reason that matches it, and every refusal is DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED.
TEST_F(LatencyTargetTest, NoRequestRunsWithABudgetItDidNotAllow) {
  const std::vector<std::string> names = {"32x64", "16x32", "8x16"};
  const std::vector<AttentionBudget> order = {Experts(32, 64), Experts(16, 32), Experts(8, 16)};
  std::mt19937 random(5);
  struct Sent {
    std::shared_ptr<Outcome> outcome;
    size_t floor;
    bool target;
  };
  std::vector<Sent> sent;
  for (int round = 0; round < 8; ++round) {
    classifier_->Hold(true);
    classifier_->Script(absl::Milliseconds(std::uniform_int_distribution<int>(10, 800)(random)));
    const size_t batches_before = classifier_->batches().size();
    sent.push_back({Submit(128, Fixed(32, 64)), 0, false});
    ASSERT_TRUE(classifier_->WaitForBatches(batches_before + 1));
    for (int i = 0; i < 6; ++i) {
      const size_t floor = std::uniform_int_distribution<size_t>(0, 2)(random);
      const int64_t tokens = std::uniform_int_distribution<int64_t>(64, 512)(random);
      const absl::Duration target = absl::Milliseconds(std::uniform_int_distribution<int>(0, 1500)(random));
      const absl::Duration deadline = absl::Milliseconds(std::uniform_int_distribution<int>(100, 3000)(random));
      sent.push_back({Submit(tokens, Target(target, floor == 2 ? "" : names[floor]), deadline), floor, true});
    }
    classifier_->Hold(false);
    for (const Sent& s : sent) ASSERT_TRUE(s.outcome->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  }
  int answered = 0, refused = 0;
  for (const Sent& s : sent) {
    if (!s.outcome->result.ok()) {
      const absl::StatusCode code = s.outcome->result.status().code();
      EXPECT_TRUE(code == absl::StatusCode::kDeadlineExceeded || code == absl::StatusCode::kResourceExhausted)
          << s.outcome->result.status();
      ++refused;
      continue;
    }
    ++answered;
    const server::InferenceResult& result = *s.outcome->result;
    const auto it = std::find(order.begin(), order.end(), result.budget.budget);
    ASSERT_NE(it, order.end()) << models::BudgetName(result.budget.budget);
    const size_t index = static_cast<size_t>(it - order.begin());
    EXPECT_LE(index, s.floor) << "ran below its floor";
    if (!s.target) {
      EXPECT_EQ(result.budget_reason, BudgetReason::kRequested);
    } else if (result.budget_reason == BudgetReason::kMostAccurate) {
      EXPECT_EQ(index, 0u);
    } else {
      EXPECT_GT(index, 0u) << server::BudgetReasonName(result.budget_reason);
    }
  }
  EXPECT_GT(answered, 0);
  std::cout << "random rounds: " << answered << " answered, " << refused << " refused\n";
}

// A floor names a budget of the order by its order name, a preset naming the same budget, or its text.
// Admission plans with the lane's recent lateness: a batch scripted 50 ms longer than predicted leaves a 50 ms
// slack (the 99th percentile of one or two answers is the largest), so a 150 ms target that fits 32x64 by the
// prediction alone (109.375 ms, x the online correction the slow batch caused) gets 16x32 (62.5 ms x it), and an
// 80 ms target no longer fits even 8x16 (39.0625 ms x it).
TEST_F(LatencyTargetTest, AdmissionPlansWithTheRecentLateness) {
  classifier_->Script(ReferenceCompute({{64, Experts(32, 64)}}) + absl::Milliseconds(50));
  std::shared_ptr<Outcome> slow = Submit(64, Target(absl::Seconds(1)));
  ASSERT_TRUE(slow->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(slow->result.ok()) << slow->result.status();
  EXPECT_EQ(slow->result->budget.budget, Experts(32, 64));

  const double correction = engine_->CostSummaryOf(kModel)->correction;
  ASSERT_GT(correction, 1);
  ASSERT_GT(ReferenceCompute({{64, Experts(32, 64)}}) * correction, absl::Milliseconds(100));
  std::shared_ptr<Outcome> lowered = Submit(64, Target(absl::Milliseconds(150)));
  ASSERT_TRUE(lowered->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(lowered->result.ok()) << lowered->result.status();
  EXPECT_EQ(lowered->result->budget.budget, Experts(16, 32));
  EXPECT_EQ(lowered->result->budget_reason, BudgetReason::kLoweredAtAdmission);
  ExpectMicroseconds(lowered->result->predicted, ReferenceCompute({{64, Experts(16, 32)}}) * correction);
  EXPECT_NEAR(MetricValue(*metrics_->registry(), "mita_planning_slack_seconds", {{"model", kModel}}), 0.050, 1e-9);

  const int64_t floor_ms = absl::ToInt64Milliseconds(ReferenceCompute({{64, Experts(8, 16)}}) *
                                                     engine_->CostSummaryOf(kModel)->correction);
  std::shared_ptr<Outcome> refused = Submit(64, Target(absl::Milliseconds(80)));
  ASSERT_TRUE(refused->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ExpectStatus(refused->result.status(), absl::StatusCode::kResourceExhausted,
               absl::StrCat("predicted ", floor_ms, " ms to answer (queue wait 0 ms + compute ", floor_ms,
                            " ms at MiTA m=8 k=16, the least accurate budget allowed) and recent answers came up "
                            "to 50 ms later than predicted, but the latency target leaves 80 ms; it was not run"));
  EXPECT_EQ(classifier_->batches().size(), 2u) << "the refused request never ran";

  // The slack's answers expire after 2 s: a slack that refuses everything does not stay.
  clock_.Advance(absl::Seconds(2) + absl::Milliseconds(1));
  std::shared_ptr<Outcome> after = Submit(64, Target(absl::Milliseconds(150)));
  ASSERT_TRUE(after->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(after->result.ok()) << after->result.status();
  EXPECT_EQ(after->result->budget.budget, Experts(32, 64)) << "planned with no slack";
  EXPECT_EQ(MetricValue(*metrics_->registry(), "mita_planning_slack_seconds", {{"model", kModel}}), 0);
}

// The batch fill fades with time when no batch starts (issue 33's lock-up: a refused request starts no batch, so
// estimates that moved only at batch start kept refusing a reachable target forever). A burst of one batch of 1
// and one of 15 (64 tokens at 32x64: 93.75 ms of compute each) leaves a recent batch size of 0.8 + 0.2 x 15 = 3.8
// and a recent compute per request of 0.8 x 0.2 x 93.75 + 0.2 x 93.75 = 33.75 ms. Right after it (1.42 s after the
// batch of 15 started) the size has faded to 1 + 2.8 exp(-0.71) = 2.38, so a request admitted now expects one
// later arrival in its batch (+33.75 ms): a 110 ms target is lowered to 16x32 (62.5 + 33.75 ms). 3 s later
// (exp(-2.21): 1.31, rounded to 1) it expects none and gets 32x64 (109.375 ms).
TEST_F(LatencyTargetTest, TheBatchFillFadesWhenNoBatchStarts) {
  classifier_->Hold(true);
  std::vector<std::shared_ptr<Outcome>> burst{Submit(64, Fixed(32, 64))};
  ASSERT_TRUE(classifier_->WaitForBatches(1));
  for (int i = 0; i < 15; ++i) burst.push_back(Submit(64, Fixed(32, 64)));
  ASSERT_TRUE(WaitForQueued(15));
  classifier_->Hold(false);
  for (const auto& outcome : burst) {
    ASSERT_TRUE(outcome->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
    ASSERT_TRUE(outcome->result.ok()) << outcome->result.status();
  }
  ASSERT_EQ(classifier_->batches().size(), 2u);
  ASSERT_EQ(classifier_->batches()[1].size(), 15u);

  std::shared_ptr<Outcome> lowered = Submit(64, Target(absl::Milliseconds(110)));
  ASSERT_TRUE(lowered->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(lowered->result.ok()) << lowered->result.status();
  EXPECT_EQ(lowered->result->budget.budget, Experts(16, 32));
  EXPECT_EQ(lowered->result->budget_reason, BudgetReason::kLoweredAtAdmission);
  ExpectMicroseconds(lowered->result->predicted,
                     ReferenceCompute({{64, Experts(16, 32)}}) + absl::Milliseconds(33.75));

  clock_.Advance(absl::Seconds(3));
  std::shared_ptr<Outcome> admitted = Submit(64, Target(absl::Milliseconds(110)));
  ASSERT_TRUE(admitted->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(admitted->result.ok()) << admitted->result.status();
  EXPECT_EQ(admitted->result->budget.budget, Experts(32, 64));
  EXPECT_EQ(admitted->result->budget_reason, BudgetReason::kMostAccurate);
  ExpectMicroseconds(admitted->result->predicted, ReferenceCompute({{64, Experts(32, 64)}}));
}

// The slack with planning_slack_percentile 0: the prediction alone (the same 150 ms target keeps 32x64).
TEST_F(LatencyTargetTest, NoSlackWithPercentileZero) {
  server::EngineOptions options;
  options.batching.max_queue_delay = absl::ZeroDuration();
  options.preparation_threads = 1;
  options.long_document_tokens = 0;
  options.cost_profiles[kModel] = ScriptedProfile();
  options.planning.slack_percentile = 0;
  engine_.reset();
  absl::StatusOr<std::unique_ptr<server::InferenceEngine>> engine =
      server::InferenceEngine::Create(registry_.get(), metrics_.get(), options, &clock_);
  ASSERT_TRUE(engine.ok()) << engine.status();
  engine_ = *std::move(engine);
  classifier_->Script(ReferenceCompute({{64, Experts(32, 64)}}) + absl::Milliseconds(50));
  std::shared_ptr<Outcome> slow = Submit(64, Target(absl::Seconds(1)));
  ASSERT_TRUE(slow->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  std::shared_ptr<Outcome> next = Submit(64, Target(absl::Milliseconds(150)));
  ASSERT_TRUE(next->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(next->result.ok()) << next->result.status();
  EXPECT_EQ(next->result->budget.budget, Experts(32, 64));
  EXPECT_EQ(MetricValue(*metrics_->registry(), "mita_planning_slack_seconds", {{"model", kModel}}), 0);
}

// The planner never locks up (the replay, in the scripted model's units): three rounds of one long
// document and then four more in one batch leave the long lane's recent batches at 2-4 requests of about a second
// each. A 300-token document with a 150 ms target fits alone at 8x16 (125.5 ms), but a planner that expects its
// batch to fill like those refuses it for ever: a refused request starts no batch, so batch-driven averages never
// change. The lane's recent batch size fades toward 1 with the time since its last batch started (2 s time
// constant): within a few seconds of the long batches the target is admitted, and stays so.
TEST_F(LatencyTargetTest, LongBatchesDoNotLockTheTargetOut) {
  server::EngineOptions options;
  options.batching.max_queue_delay = absl::ZeroDuration();
  options.preparation_threads = 1;
  options.long_document_tokens = 256;  // 300 tokens and more: the long lane
  options.cost_profiles[kModel] = ScriptedProfile();
  engine_.reset();
  absl::StatusOr<std::unique_ptr<server::InferenceEngine>> engine =
      server::InferenceEngine::Create(registry_.get(), metrics_.get(), options, &clock_);
  ASSERT_TRUE(engine.ok()) << engine.status();
  engine_ = *std::move(engine);
  size_t batches = 0;
  for (int round = 0; round < 3; ++round) {
    classifier_->Hold(true);
    std::vector<std::shared_ptr<Outcome>> long_ones = {Submit(4096, Fixed(8, 16))};
    ASSERT_TRUE(classifier_->WaitForBatches(++batches));
    for (int i = 0; i < 4; ++i) long_ones.push_back(Submit(2048, Fixed(8, 16)));
    ASSERT_TRUE(WaitForQueued(4));
    classifier_->Hold(false);
    ASSERT_TRUE(classifier_->WaitForBatches(++batches));
    for (const auto& outcome : long_ones) {
      ASSERT_TRUE(outcome->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
      ASSERT_TRUE(outcome->result.ok()) << outcome->result.status();
    }
    EXPECT_EQ(classifier_->batches().back().size(), 4u) << "the four long documents share a batch";
  }
  const absl::Time long_batches_ended = clock_.Now();
  absl::Time first_admitted = absl::InfiniteFuture();
  int admitted = 0;
  for (int i = 0; i < 20; ++i) {
    std::shared_ptr<Outcome> target = Submit(300, Target(absl::Milliseconds(150)));
    ASSERT_TRUE(target->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
    if (target->result.ok()) {
      ++admitted;
      if (first_admitted == absl::InfiniteFuture()) first_admitted = clock_.Now();
      EXPECT_EQ(target->result->budget.budget, Experts(8, 16));
      EXPECT_LE(target->result->total, absl::Milliseconds(150));
    } else {
      EXPECT_EQ(target->result.status().code(), absl::StatusCode::kResourceExhausted) << target->result.status();
    }
    clock_.Advance(absl::Milliseconds(500));
  }
  ASSERT_NE(first_admitted, absl::InfiniteFuture()) << "the 150 ms target was refused for 10 s after the long batches";
  EXPECT_LE(first_admitted - long_batches_ended, absl::Seconds(3));
  EXPECT_GE(admitted, 15) << "admitted once, it stays admitted";
}

// A third input kind, scripted here and unknown to the server: no image or document description, variable
// length, token ids as "readings". The server calibrates its cost model from its synthetic inputs and cost
// features, gives it a long lane by its longest input alone, plans latency targets for it and quotes its costs:
// nothing in server/ branches on the kind.
class ReadingsClassifier : public models::Classifier {
 public:
  ReadingsClassifier() {
    description_.name = "readings";
    description_.architecture = "scripted_readings";
    description_.input_kind = models::InputKind::kOther;
    description_.labels = {"calm", "storm"};
    description_.layers = 1;
    description_.heads = 1;
    description_.embed_dim = 8;
    description_.max_input_tokens = 1024;
    description_.reference_tokens = 512;
    models::BudgetKnobs& knobs = description_.knobs;
    knobs.min_expert_count = 1;
    knobs.max_expert_count = 16;
    knobs.min_expert_width = 1;
    knobs.max_expert_width = 64;
    knobs.default_budget = Experts(8, 32);
    knobs.accuracy_order = {{"8x32", Experts(8, 32), 0.9}, {"4x8", Experts(4, 8), 0.8}};
  }

  const models::ClassifierDescription& description() const override { return description_; }
  absl::Status CheckInputKind(const models::ClassifierInput& input) const override {
    if (input.kind == models::ClassifierInput::Kind::kTokenIds) return absl::OkStatus();
    return absl::InvalidArgumentError("readings come as token ids");
  }
  // Its own cost: one feature, its readings x (m + k), besides the batch's fixed cost.
  models::CostFeatures BatchCostFeatures(absl::Span<const models::CostItem> items) const override {
    models::CostFeatures features{};
    if (items.empty()) return features;
    features[0] = 1;
    for (const models::CostItem& item : items) {
      features[1] += static_cast<double>(item.tokens * (item.budget.expert_count + item.budget.expert_width));
    }
    return features;
  }
  models::CostFeatures PriorCostCoefficients() const override { return models::CostFeatures{1e-3, 1e-7}; }

  // 1 ms per batch and 0.1 us per reading x (m + k), in real time.
  absl::StatusOr<models::ClassifierOutput> Run(absl::Span<const models::BatchItem* const> items, bool,
                                               const models::ItemCheck&) const override {
    last_intra_op_threads_.store(at::get_num_threads());
    // One parallel region (an elementwise op over two chunks of LibTorch's grain), as a forward runs hundreds.
    at::ones({int64_t{1} << 16}).add_(1);
    threads_in_last_batch_.store(test_util::ProcessThreadCount());
    absl::Duration duration = absl::Milliseconds(1);
    for (const models::BatchItem* item : items) {
      duration += absl::Nanoseconds(100 * item->tokens *
                                    (item->budget.budget.expert_count + item->budget.budget.expert_width));
    }
    absl::SleepFor(duration);
    models::ClassifierOutput output;
    output.logits = at::zeros({static_cast<int64_t>(items.size()), 2});
    output.statistics.resize(items.size());
    output.stopped.resize(items.size());
    return output;
  }

 protected:
  absl::StatusOr<PreparedInput> PrepareInput(const models::ClassifierInput& input, const models::InputLimits&,
                                             const models::StopCheck&) const override {
    at::ones({int64_t{1} << 16}).add_(1);  // a parallel region, as decoding an image may run
    std::vector<int64_t> ids(input.token_ids.begin(), input.token_ids.end());
    return PreparedInput{at::tensor(ids, at::kLong), static_cast<int64_t>(ids.size()),
                         static_cast<int64_t>(ids.size())};
  }
  absl::StatusOr<int64_t> InputPreparationBytes(const models::ClassifierInput&,
                                                const models::InputLimits&) const override {
    return 0;
  }
  PreparedInput SyntheticInput(int64_t tokens) const override {
    return PreparedInput{at::zeros({tokens}, at::kLong), tokens, tokens};
  }

 public:
  // The intra-op threads (at::get_num_threads) of the thread that ran the last batch.
  int last_intra_op_threads() const { return last_intra_op_threads_.load(); }
  // The process's threads while the last batch ran, after its parallel region.
  int threads_in_last_batch() const { return threads_in_last_batch_.load(); }

 private:
  models::ClassifierDescription description_;
  mutable std::atomic<int> last_intra_op_threads_{0};
  mutable std::atomic<int> threads_in_last_batch_{0};
};

// The readings classifier served alone by an engine with `options`; Classify submits `readings` readings and waits
// (real time, bounded) for the answer.
class ReadingsServer {
 public:
  ReadingsServer(std::unique_ptr<ReadingsClassifier> classifier, const server::EngineOptions& options) {
    std::vector<models::ModelPackage> packages;
    packages.push_back(models::ModelPackage{"readings", std::move(classifier)});
    absl::StatusOr<std::unique_ptr<server::ModelRegistry>> registry =
        server::ModelRegistry::FromPackages(std::move(packages));
    EXPECT_TRUE(registry.ok()) << registry.status();
    if (!registry.ok()) return;
    registry_ = *std::move(registry);
    metrics_ = std::make_unique<server::ServerMetrics>(server::MetricsModelInfos(*registry_));
    absl::StatusOr<std::unique_ptr<server::InferenceEngine>> engine =
        server::InferenceEngine::Create(registry_.get(), metrics_.get(), options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (engine.ok()) engine_ = *std::move(engine);
  }

  // Null when the engine could not be made (the constructor reported why).
  server::InferenceEngine* engine() const { return engine_.get(); }

  absl::StatusOr<server::InferenceResult> Classify(int64_t readings, models::BudgetRequest budget,
                                                   absl::Time deadline = absl::InfiniteFuture()) {
    server::InferenceRequest request;
    request.model = "readings";
    request.input.kind = models::ClassifierInput::Kind::kTokenIds;
    request.input.token_ids = std::vector<int64_t>(static_cast<size_t>(readings), 1);
    request.budget = std::move(budget);
    request.deadline = deadline;
    Outcome outcome;
    std::unique_ptr<server::InferenceCall> call =
        engine_->Submit(std::move(request), [&outcome](absl::StatusOr<server::InferenceResult> result) {
          outcome.result = std::move(result);
          outcome.done.Notify();
        });
    if (!outcome.done.WaitForNotificationWithTimeout(absl::Seconds(20))) {
      return absl::DeadlineExceededError("no answer within 20 s");
    }
    return outcome.result;
  }

 private:
  std::unique_ptr<server::ModelRegistry> registry_;
  std::unique_ptr<server::ServerMetrics> metrics_;
  std::unique_ptr<server::InferenceEngine> engine_;
};

TEST(ThirdInputKindTest, IsCalibratedPlannedAndQuotedWithoutTheServerKnowingIt) {
  auto owned = std::make_unique<ReadingsClassifier>();
  const ReadingsClassifier* classifier = owned.get();
  absl::StatusOr<server::CostProfile> profile =
      server::CalibrateCostModel(*classifier, absl::Seconds(2), 16, 1 << 17);
  ASSERT_TRUE(profile.ok()) << profile.status();
  EXPECT_EQ(profile->source, "calibrated");
  EXPECT_GE(profile->calibration_batches, 2);
  EXPECT_GT(profile->coefficients[1], 0) << "its own feature has a cost";

  server::EngineOptions options;
  options.preparation_threads = 1;
  options.long_document_tokens = 256;  // its longest input is 1024 readings: a long lane
  options.cost_profiles["readings"] = *profile;
  ReadingsServer served(std::move(owned), options);
  ASSERT_NE(served.engine(), nullptr);

  absl::StatusOr<server::CostSummary> summary = served.engine()->CostSummaryOf("readings");
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->reference_tokens, 512);
  ASSERT_EQ(summary->predicted.size(), 2u);
  EXPECT_GT(summary->predicted[0], summary->predicted[1]) << "8x32 costs more than 4x8";

  auto classify = [&](int64_t readings, absl::Duration target) {
    models::BudgetRequest budget;
    budget.choice = models::BudgetRequest::Choice::kLatencyTarget;
    budget.latency_target = target;
    return served.Classify(readings, budget, absl::Now() + absl::Seconds(30));
  };
  for (const int64_t readings : {100, 1000}) {  // the short lane and the long one
    absl::StatusOr<server::InferenceResult> relaxed = classify(readings, absl::Seconds(10));
    ASSERT_TRUE(relaxed.ok()) << readings << ": " << relaxed.status();
    EXPECT_EQ(relaxed->budget.budget, Experts(8, 32));
    EXPECT_EQ(relaxed->budget_reason, BudgetReason::kMostAccurate);
    EXPECT_GT(relaxed->predicted, absl::ZeroDuration());
    // Refused before preparation: no input of either lane, at the cheapest budget, meets 100 us (the slack of the
    // answers before it may be named between the two parts).
    const absl::Status refused = classify(readings, absl::Microseconds(100)).status();
    ExpectStatus(refused, absl::StatusCode::kResourceExhausted, " for the cheapest input)");
    ExpectStatus(refused, absl::StatusCode::kResourceExhausted, "but the latency target leaves");
  }
}

// An engine of one preparation thread and one batch thread per lane, a long lane from 256 readings, and
// `intra_op_threads` intra-op threads.
server::EngineOptions LaneThreadsOptions(int intra_op_threads) {
  server::EngineOptions options;
  options.preparation_threads = 1;
  options.long_document_tokens = 256;
  options.batching.num_batch_threads = 1;
  options.intra_op_threads = intra_op_threads;
  return options;
}

// A lane's batch threads share the intra-op threads (ModelRunner::Create): with 6 of them and the model's 2 batch
// threads (its own count, over the engine's 1), a short input's forward runs on 3, the long-input lane's one thread
// on all 6 (counts no process here runs by default); the submitting thread's count stays.
TEST(LaneThreadsTest, EachBatchThreadRunsOnItsLanesShareOfTheIntraOpThreads) {
  auto owned = std::make_unique<ReadingsClassifier>();
  const ReadingsClassifier* classifier = owned.get();
  server::EngineOptions options = LaneThreadsOptions(6);
  options.batch_threads_by_model["readings"] = 2;  // mita-server --batch_threads=1,readings=2
  ReadingsServer served(std::move(owned), options);
  ASSERT_NE(served.engine(), nullptr);
  const int own_threads = at::get_num_threads();
  for (const auto& [readings, threads] : {std::pair<int64_t, int>{100, 3}, {1000, 6}, {200, 3}}) {
    const absl::StatusOr<server::InferenceResult> result = served.Classify(readings, models::BudgetRequest{});
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(classifier->last_intra_op_threads(), threads) << readings << " readings";
  }
  EXPECT_EQ(at::get_num_threads(), own_threads);
}

// A batch thread whose lane's queue stays empty ends its OpenMP team (server::kIdleBatchThreadKeepsTeamFor): each
// batch below runs a parallel region on 2 threads, one of them a worker that must be gone soon after the answer.
// Were it kept, every lane that ever ran a batch would keep one, and libgomp would let no worker spin. The
// preparation threads, whose preparation runs a parallel region too, start no team (one intra-op thread each).
TEST(LaneThreadsTest, AnIdleBatchThreadEndsItsOpenMpWorkers) {
  auto owned = std::make_unique<ReadingsClassifier>();
  const ReadingsClassifier* classifier = owned.get();
  ReadingsServer served(std::move(owned), LaneThreadsOptions(2));
  ASSERT_NE(served.engine(), nullptr);
  const int idle = test_util::ProcessThreadCount();
  for (const int64_t readings : {100, 1000, 100}) {  // the short lane, the long one, the short one again
    const absl::StatusOr<server::InferenceResult> result = served.Classify(readings, models::BudgetRequest{});
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(classifier->threads_in_last_batch(), idle + 1) << readings << " readings: the batch thread's worker";
    EXPECT_EQ(test_util::WaitForProcessThreadCountAtMost(idle, absl::Seconds(10)), idle)
        << "an OpenMP worker outlived the answer to " << readings << " readings";
  }
}

// The slack is the nearest-rank quantile of the last `window` lateness values, checked against a sort.
TEST(PlanningSlackTest, NearestRankQuantileOfTheWindow) {
  const absl::Time start = absl::FromUnixSeconds(1000);
  server::PlanningSlack slack(0.99, 100, absl::Seconds(2));
  EXPECT_EQ(slack.SlackAt(start), absl::ZeroDuration());
  std::vector<int> values(250);
  for (int i = 0; i < 250; ++i) values[i] = (i * 37) % 250 - 20;  // a permutation of -20 .. 229 ms
  std::vector<double> reference;
  for (int i = 0; i < 250; ++i) {
    slack.Observe(start + absl::Milliseconds(i), absl::Milliseconds(values[i]));
    reference.assign(values.begin() + std::max(0, i - 99), values.begin() + i + 1);
    std::sort(reference.begin(), reference.end());
    const size_t rank = static_cast<size_t>(std::ceil(0.99 * reference.size()));
    const double expected = std::max(0.0, reference[rank - 1]);
    ASSERT_NEAR(absl::ToDoubleMilliseconds(slack.SlackAt(start + absl::Milliseconds(i))), expected, 1e-6)
        << "after " << i + 1 << " values";
  }
  // 2 s after the 200th value (at start + 199 ms) only the last 50 remain.
  reference.assign(values.begin() + 200, values.end());
  std::sort(reference.begin(), reference.end());
  EXPECT_NEAR(absl::ToDoubleMilliseconds(slack.SlackAt(start + absl::Milliseconds(2199) + absl::Microseconds(1))),
              std::max(0.0, reference[static_cast<size_t>(std::ceil(0.99 * 50)) - 1]), 1e-6);
  EXPECT_EQ(slack.SlackAt(start + absl::Seconds(3)), absl::ZeroDuration()) << "every answer expired";
  server::PlanningSlack early(0.99, 100, absl::Seconds(2));
  early.Observe(start, absl::Milliseconds(-5));
  EXPECT_EQ(early.SlackAt(start), absl::ZeroDuration()) << "answered sooner than predicted: no slack";
}

TEST(AllowedBudgetsTest, FloorByOrderNamePresetOrText) {
  models::BudgetKnobs knobs;
  knobs.min_expert_count = 1;
  knobs.max_expert_count = 64;
  knobs.max_expert_width = 128;
  knobs.default_budget = Experts(32, 64);
  knobs.presets = {{"balanced", Experts(16, 32)}};
  knobs.accuracy_order = {{"default", Experts(32, 64), 0.9}, {"balanced", Experts(16, 32), 0.8},
                          {"8x16", Experts(8, 16), 0.7}};
  auto allowed = [&](const std::string& floor) {
    models::BudgetRequest request;
    request.choice = models::BudgetRequest::Choice::kLatencyTarget;
    request.floor = floor;
    return models::AllowedBudgets(knobs, request);
  };
  for (const auto& [floor, count] : std::vector<std::pair<std::string, size_t>>{
           {"", 3}, {"default", 1}, {"32x64", 1}, {"balanced", 2}, {"16x32", 2}, {"8x16", 3}}) {
    absl::StatusOr<std::vector<models::ResolvedBudget>> budgets = allowed(floor);
    ASSERT_TRUE(budgets.ok()) << floor << ": " << budgets.status();
    EXPECT_EQ(budgets->size(), count) << floor;
  }
  ExpectStatus(allowed("full").status(), absl::StatusCode::kInvalidArgument,
               "budget floor: unknown budget 'full'; the model's budgets, most accurate first: default, balanced, 8x16");
}

TEST(CostModelTest, FitRecoversTheCoefficientsOfExactSamples) {
  // A transformer of 2 layers, d = 64.
  const server::CostFeatures truth{2e-3, 5e-5, 1e-9, 3e-9, 0, 2e-9};
  std::vector<server::CostSample> samples;
  for (int64_t tokens : {128, 512, 2048, 8192}) {
    for (int64_t batch : {1, 4}) {
      for (const AttentionBudget& budget : {Experts(8, 32), Experts(16, 64), AttentionBudget{true, 0, 0}}) {
        std::vector<server::CostItem> items(static_cast<size_t>(batch), server::CostItem{tokens, budget});
        server::CostSample sample;
        sample.features = models::TransformerCostFeatures(2, 64, items);
        for (int i = 0; i < server::kNumCostFeatures; ++i) sample.seconds += truth[i] * sample.features[i];
        samples.push_back(sample);
      }
    }
  }
  absl::StatusOr<server::CostFeatures> fitted = server::FitCostCoefficients(samples);
  ASSERT_TRUE(fitted.ok()) << fitted.status();
  for (const server::CostSample& sample : samples) {
    double predicted = 0;
    for (int i = 0; i < server::kNumCostFeatures; ++i) predicted += (*fitted)[i] * sample.features[i];
    EXPECT_NEAR(predicted / sample.seconds, 1.0, 0.02);
  }
  ExpectStatus(server::FitCostCoefficients({}).status(), absl::StatusCode::kInvalidArgument, "no timed batches");
}

TEST(CostModelTest, OnlineCorrectionMovesTowardTheMeasuredRatio) {
  server::CostModel model(
      [](absl::Span<const server::CostItem> items) { return models::TransformerCostFeatures(1, 1, items); },
      server::CostFeatures{1e-3, 0, 0, 0, 0, 0});
  const std::vector<server::CostItem> items = {server::CostItem{10, Experts(1, 1)}};
  EXPECT_EQ(model.Predict(items), absl::Milliseconds(1));
  EXPECT_DOUBLE_EQ(model.Observe(items, absl::Milliseconds(2)), 2.0);
  EXPECT_NEAR(model.correction(), std::exp(0.1 * std::log(2.0)), 1e-12);
  for (int i = 0; i < 200; ++i) model.Observe(items, absl::Milliseconds(2));
  EXPECT_NEAR(model.correction(), 2.0, 1e-6);
}

TEST(LatencyPlannerTest, LowerToFitSkipsMembersItCannotServe) {
  const server::PredictBatch predict = [](absl::Span<const server::CostItem> items) {
    absl::Duration total = absl::Milliseconds(10);
    for (const server::CostItem& item : items) total += absl::Milliseconds(item.budget.expert_count);
    return total;
  };
  // A fixed member with 5 ms left cannot be served (the batch takes >= 10 ms); the target member has 100 ms
  // and the batch already fits it, so nothing is lowered for the hopeless one.
  std::vector<server::BatchMember> members(2);
  members[0] = {1, {Experts(30, 1)}, 0, absl::Milliseconds(5)};
  members[1] = {1, {Experts(50, 1), Experts(20, 1)}, 0, absl::Milliseconds(100)};
  EXPECT_EQ(server::LowerToFit(members, predict), 0);
  EXPECT_EQ(members[1].choice, 0u);
  members[1].time_left = absl::Milliseconds(80);
  EXPECT_EQ(server::LowerToFit(members, predict), 1);
  EXPECT_EQ(members[1].choice, 1u);
}

// An accuracy order may rank a dearer budget (full attention at 64K tokens) below a cheaper one: the step skips
// it to the next cheaper budget.
TEST(LatencyPlannerTest, LowerToFitStepsOverADearerBudget) {
  const server::PredictBatch predict = [](absl::Span<const server::CostItem> items) {
    absl::Duration total;
    for (const server::CostItem& item : items) {
      total += item.budget.full_attention ? absl::Seconds(10) : absl::Milliseconds(item.budget.expert_count);
    }
    return total;
  };
  std::vector<server::BatchMember> members(1);
  members[0] = {1, {Experts(64, 1), AttentionBudget{true, 0, 0}, Experts(16, 1)}, 0, absl::Milliseconds(20)};
  EXPECT_EQ(server::LowerToFit(members, predict), 1);
  EXPECT_EQ(members[0].choice, 2u);
}

// The start-up sweep on the embedded image model: bounded by its limit, and enough batches for the fit.
TEST(CostCalibrationTest, SweepIsBoundedByItsLimit) {
  absl::StatusOr<models::ModelPackage> package =
      models::LoadModelPackage(test_util::SourceDirectory() + "/models/repository/fashion-mnist-vit");
  ASSERT_TRUE(package.ok()) << package.status();
  absl::StatusOr<server::CostProfile> none = server::CalibrateCostModel(*package->classifier, absl::ZeroDuration(), 16,
                                                                        1 << 17);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->source, "prior");
  EXPECT_EQ(none->calibration_batches, 0);
  EXPECT_EQ(none->coefficients, package->classifier->PriorCostCoefficients());
  // 1 ms is less than two runs of the cheapest batch by the prior: nothing is timed.
  absl::StatusOr<server::CostProfile> tiny =
      server::CalibrateCostModel(*package->classifier, absl::Milliseconds(1), 16, 1 << 17);
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  EXPECT_EQ(tiny->calibration_batches, 0);
  EXPECT_EQ(tiny->source, "prior");
  // The whole sweep takes about 1 s on the idle machine; the limit leaves room for a loaded one (a batch slowed
  // by other work raises the ratio that skips later batches).
  const absl::Duration limit = absl::Seconds(20);
  absl::StatusOr<server::CostProfile> swept = server::CalibrateCostModel(*package->classifier, limit, 16, 1 << 17);
  ASSERT_TRUE(swept.ok()) << swept.status();
  EXPECT_EQ(swept->source, "calibrated");
  EXPECT_GE(swept->calibration_batches, server::kNumCostFeatures);
  EXPECT_LE(swept->calibration_time, limit + absl::Seconds(1));
  EXPECT_GT(swept->coefficients[0] + swept->coefficients[1] + swept->coefficients[2], 0)
      << "the fit gives the image model a cost";
  std::cout << "fashion-mnist-vit sweep: " << swept->calibration_batches << " batches in "
            << absl::FormatDuration(swept->calibration_time) << ", median fit error " << swept->fit_error << "\n";
}

// texlive-doc-mita declares no full attention in its accuracy order; a request may still name it, so the sweep
// times it too and its prediction at 16K tokens is far above the default budget's (it once cost 0: 150 ms
// predicted against 8.7 s measured).
TEST(CostCalibrationTest, FullAttentionOutsideTheOrderIsStillCosted) {
  absl::StatusOr<models::ModelPackage> package =
      models::LoadModelPackage(test_util::SourceDirectory() + "/models/repository/texlive-doc-mita");
  ASSERT_TRUE(package.ok()) << package.status();
  const models::ClassifierDescription& model = package->classifier->description();
  for (const models::DeclaredBudget& declared : model.knobs.accuracy_order) {
    ASSERT_FALSE(declared.budget.full_attention) << "the test needs an order without full attention";
  }
  absl::StatusOr<server::CostProfile> swept =
      server::CalibrateCostModel(*package->classifier, absl::Seconds(2), 16, 1 << 17);
  ASSERT_TRUE(swept.ok()) << swept.status();
  EXPECT_GT(swept->coefficients[5], 0) << "full attention's feature has a cost";
  const server::CostModel cost(
      [&package](absl::Span<const server::CostItem> items) { return package->classifier->BatchCostFeatures(items); },
      swept->coefficients, swept->correction);
  const std::vector<server::CostItem> full = {server::CostItem{16384, AttentionBudget{true, 0, 0}}};
  const std::vector<server::CostItem> mita = {
      server::CostItem{16384, models::ApplyBudget(model.knobs.default_budget, 16384)}};
  EXPECT_GT(cost.Predict(full), 5 * cost.Predict(mita));
}

TEST(CostProfileFileTest, RoundTripsAndRefusesAnotherShape) {
  models::ClassifierDescription model;
  model.name = "m";
  model.embed_dim = 96;
  model.layers = 4;
  server::CostProfile profile;
  profile.coefficients = server::CostFeatures{1e-3, 2e-5, 3e-9, 4e-9, 5e-9, 6e-9};
  profile.correction = 1.25;
  const std::string json = server::CostProfilesToJson({{"m", profile}}, {{"m", &model}});
  absl::StatusOr<server::CostProfile> loaded = server::FindCostProfile(json, "p.json", model);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->coefficients, profile.coefficients);
  EXPECT_EQ(loaded->correction, 1.25);
  EXPECT_EQ(loaded->source, "loaded");
  models::ClassifierDescription other = model;
  other.embed_dim = 64;
  ExpectStatus(server::FindCostProfile(json, "p.json", other).status(), absl::StatusCode::kInvalidArgument,
               "p.json: the profile of model 'm' was saved for cpu float32 d=96 L=4; the model runs as cpu float32 "
               "d=64 L=4");
  other.name = "n";
  ExpectStatus(server::FindCostProfile(json, "p.json", other).status(), absl::StatusCode::kInvalidArgument,
               "p.json: no profile of model 'n'");
  ExpectStatus(server::FindCostProfile("{", "p.json", model).status(), absl::StatusCode::kInvalidArgument,
               "p.json: not a cost profile file");
}

}  // namespace
}  // namespace mita
