// The planner of one lane (see lane_planner.h).
#include "server/planning/lane_planner.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace mita::server {
namespace {

// The planned requests whose lateness the slack is taken over: the last 512 answered in 2 s.
constexpr size_t kSlackWindow = 512;
constexpr absl::Duration kSlackHorizon = absl::Seconds(2);
// Weight of one batch in the moving averages of batch size and compute per request.
constexpr double kBatchWeight = 0.2;
// The time constant with which a lane's recent batch size fades toward 1 while no batch starts: the slack's
// horizon.
constexpr absl::Duration kRecentFade = kSlackHorizon;

std::string Milliseconds(absl::Duration duration) {
  return absl::StrCat(absl::ToInt64Milliseconds(duration), " ms");
}

// The refusal of a request predicted to answer too late: `prediction` (what was predicted, worded), the slack it
// planned with, and `left` (its time left): RESOURCE_EXHAUSTED when its latency target binds, else
// DEADLINE_EXCEEDED; `*rejection` its reason.
absl::Status Refusal(const std::string& prediction, absl::Duration slack, bool target_binds, absl::Duration left,
                     AdmissionRejection* rejection) {
  *rejection =
      target_binds ? AdmissionRejection::kLatencyTargetUnmeetable : AdmissionRejection::kDeadlineUnmeetable;
  const std::string predicted = absl::StrCat(
      prediction,
      slack > absl::ZeroDuration()
          ? absl::StrCat(" and recent answers came up to ", Milliseconds(slack), " later than predicted,")
          : "");
  if (target_binds) {
    return absl::ResourceExhaustedError(
        absl::StrCat(predicted, " but the latency target leaves ", Milliseconds(left),
                     "; it was not run (retry later, or with a larger target or a lower floor)"));
  }
  return absl::DeadlineExceededError(
      absl::StrCat(predicted, " but the deadline is in ", Milliseconds(left), "; it was not run"));
}

}  // namespace

LanePlanner::LanePlanner(CostModel* cost, BatcherOptions batching, PlanningOptions options)
    : cost_(cost), batching_(std::move(batching)), options_(options) {
  if (options_.slack_percentile > 0) {
    slack_ = PlanningSlack(options_.slack_percentile / 100.0, kSlackWindow, kSlackHorizon);
  }
}

absl::Duration LanePlanner::PredictedCompute(int64_t tokens, const models::AttentionBudget& budget) const {
  const CostItem item{tokens, budget};
  return cost_->Predict(absl::MakeConstSpan(&item, 1));
}

absl::Duration LanePlanner::PredictedWait(const QueueLoad& queued, absl::Time now) const {
  absl::Duration work = queued.predicted_compute;
  const int64_t batches = (queued.tasks + batching_.max_batch_size - 1) / batching_.max_batch_size;
  work += cost_->BatchOverhead() * batches;
  for (const absl::Time end : running_ends_) work += std::max(end - now, absl::ZeroDuration());
  return work / std::max(1, batching_.num_batch_threads);
}

double LanePlanner::BatchSizeAt(absl::Time now) const {
  if (now <= last_batch_start_) return recent_batch_size_;
  const double fade = std::exp(-absl::FDivDuration(now - last_batch_start_, kRecentFade));
  return 1 + (recent_batch_size_ - 1) * fade;
}

absl::Duration LanePlanner::PredictedBatchFill(const QueueLoad& queued, absl::Time now) const {
  const int64_t batch = std::min<int64_t>(batching_.max_batch_size, std::llround(BatchSizeAt(now)));
  const int64_t ahead_in_batch = queued.tasks % batching_.max_batch_size;
  return recent_task_compute_ * std::max<int64_t>(0, batch - 1 - ahead_in_batch);
}

absl::Status LanePlanner::Admit(const PlanningRequest& request, const QueueLoad& queued, absl::Time now,
                                PlannedBudget* plan, AdmissionRejection* rejection) {
  *plan = PlannedBudget{};
  *rejection = AdmissionRejection::kNone;
  const bool bounded = request.end != absl::InfiniteFuture();
  if (request.latency_target || (options_.deadline_admission && bounded)) {
    const absl::Duration wait = PredictedWait(queued, now);
    const absl::Duration fill = PredictedBatchFill(queued, now);
    const absl::Duration slack = options_.slack_percentile > 0 ? slack_.SlackAt(now) : absl::ZeroDuration();
    plan->slack = slack;
    plan->planned_at = now;
    const BudgetChoice choice =
        ChooseBudget(request.allowed, wait, request.end - now - slack, [&](const models::AttentionBudget& budget) {
          return PredictedCompute(request.tokens, budget) + fill;
        });
    if (!choice.meets && options_.deadline_admission && bounded) {
      return Refusal(absl::StrCat("predicted ", Milliseconds(choice.predicted), " to answer (queue wait ",
                                  Milliseconds(wait), " + compute ", Milliseconds(choice.compute), " at ",
                                  models::BudgetName(request.allowed[choice.index]),
                                  request.latency_target ? ", the least accurate budget allowed)" : ")"),
                     slack, request.target_binds, request.end - now, rejection);
    }
    if (request.latency_target) {
      plan->choice = choice.index;
      plan->reason = choice.index == 0 ? BudgetReason::kMostAccurate : BudgetReason::kLoweredAtAdmission;
    }
    plan->predicted = choice.predicted;
  }
  plan->share = PredictedCompute(request.tokens, request.allowed[plan->choice]) - cost_->BatchOverhead();
  return absl::OkStatus();
}

absl::Status LanePlanner::AdmitBeforePreparation(absl::Time end, bool target_binds, absl::Span<const CostItem> cheapest,
                                                 const QueueLoad& queued, absl::Time now,
                                                 AdmissionRejection* rejection) {
  *rejection = AdmissionRejection::kNone;
  if (!options_.deadline_admission || end == absl::InfiniteFuture()) return absl::OkStatus();
  absl::Duration least_compute = cheapest.empty() ? absl::ZeroDuration() : absl::InfiniteDuration();
  for (const CostItem& item : cheapest) {
    least_compute = std::min(least_compute, PredictedCompute(item.tokens, item.budget));
  }
  const absl::Duration wait = PredictedWait(queued, now);
  const absl::Duration compute = least_compute + PredictedBatchFill(queued, now);
  const absl::Duration slack = options_.slack_percentile > 0 ? slack_.SlackAt(now) : absl::ZeroDuration();
  if (wait + compute <= end - now - slack) return absl::OkStatus();
  return Refusal(absl::StrCat("predicted at least ", Milliseconds(wait + compute), " to answer (queue wait ",
                              Milliseconds(wait), " + compute ", Milliseconds(compute), " for the cheapest input)"),
                 slack, target_binds, end - now, rejection);
}

std::vector<size_t> LanePlanner::StartBatch(absl::Span<const StartingMember> members, absl::Time start,
                                            StartedBatch* started) {
  std::vector<size_t> choices;
  for (const StartingMember& member : members) choices.push_back(member.choice);
  const bool any_target = std::any_of(members.begin(), members.end(), [](const StartingMember& member) {
    return member.latency_target && member.allowed.size() > 1;
  });
  if (any_target) {
    std::vector<BatchMember> batch;
    for (const StartingMember& member : members) {
      batch.push_back(BatchMember{member.tokens, member.allowed, std::min(member.choice, member.allowed.size() - 1),
                                  member.end == absl::InfiniteFuture() ? absl::InfiniteDuration()
                                                                       : member.end - start});
    }
    if (LowerToFit(batch, [this](absl::Span<const CostItem> items) { return cost_->Predict(items); }) > 0) {
      for (size_t i = 0; i < batch.size(); ++i) choices[i] = batch[i].choice;
    }
  }
  started->start = start;
  started->items.clear();
  for (size_t i = 0; i < members.size(); ++i) {
    started->items.push_back(CostItem{members[i].tokens, members[i].allowed[choices[i]]});
  }
  started->predicted = cost_->Predict(started->items);
  running_ends_.push_back(start + started->predicted);
  const double size = static_cast<double>(members.size());
  recent_batch_size_ = (1 - kBatchWeight) * BatchSizeAt(start) + kBatchWeight * size;
  last_batch_start_ = std::max(last_batch_start_, start);
  if (!members.empty()) {
    recent_task_compute_ = (1 - kBatchWeight) * recent_task_compute_ +
                           kBatchWeight * (started->predicted - cost_->BatchOverhead()) / size;
  }
  return choices;
}

double LanePlanner::FinishBatch(const StartedBatch& started, absl::Duration compute, bool learn) {
  const auto running = std::find(running_ends_.begin(), running_ends_.end(), started.start + started.predicted);
  if (running != running_ends_.end()) running_ends_.erase(running);
  return learn ? cost_->Observe(started.items, compute) : 0;
}

void LanePlanner::ObserveLateness(absl::Time at, absl::Duration lateness) {
  if (options_.slack_percentile > 0) slack_.Observe(at, lateness);
}

}  // namespace mita::server
