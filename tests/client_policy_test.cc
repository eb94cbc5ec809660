// Tests of the budget policy per client (server/policy/): the policy file's parsing and each kind of bad file with
// its message, the compute quota on a manual clock (rate and burst exact), the policy in force and its reload (a good
// file swapped in, a bad one keeping the old and saying why, quotas surviving), and a client's rules applied to
// requests for the embedded image model's knobs.
#include "server/policy/client_policy.h"

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/budget.h"
#include "server/planning/clock.h"
#include "server/policy/budget_rules.h"
#include "server/policy/compute_quota.h"
#include "server/policy/policy_holder.h"
#include "tests/test_util.h"

namespace mita::server::policy {
namespace {

using ::testing::HasSubstr;

// SHA-256 of "frontend-token" and of "free-token".
const std::string kFrontendSha = Sha256Hex("frontend-token");
const std::string kFreeSha = Sha256Hex("free-token");

std::string GoodPolicy() {
  return absl::StrCat(R"({
    "clients": [
      {"name": "frontend", "token_sha256": ")",
                      kFrontendSha, R"(", "priority": "interactive"},
      {"name": "nightly", "certificate_subject": "CN=nightly,O=Example", "priority": "batch",
       "quota": {"compute_units_per_second": 20000, "burst_compute_units": 40000}},
      {"name": "free", "token_sha256": ")",
                      kFreeSha, R"(", "presets": ["fast", "balanced"],
       "max_expert_count": 9, "max_expert_width": 16, "full_attention_max_tokens": 0, "default_preset": "fast",
       "priority": 3}
    ],
    "default": {"priority": "normal", "full_attention_max_tokens": 1024}
  })");
}

TEST(Sha256Test, KnownDigest) {
  // printf %s abc | sha256sum
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(ClientPolicyTest, ParsesEveryRule) {
  absl::StatusOr<ClientPolicy> policy = ClientPolicy::Parse(GoodPolicy(), "policy.json");
  ASSERT_TRUE(policy.ok()) << policy.status();
  ASSERT_EQ(policy->clients().size(), 3u);
  const PolicyClient& frontend = policy->clients()[0];
  EXPECT_EQ(frontend.name, "frontend");
  EXPECT_EQ(frontend.token_sha256, kFrontendSha);
  EXPECT_EQ(frontend.rules.priority, kInteractivePriority);
  EXPECT_FALSE(frontend.rules.presets.has_value());
  EXPECT_FALSE(frontend.rules.quota.has_value());
  const PolicyClient& nightly = policy->clients()[1];
  EXPECT_EQ(nightly.certificate_subject, "CN=nightly,O=Example");
  EXPECT_EQ(nightly.rules.priority, kBatchPriority);
  ASSERT_TRUE(nightly.rules.quota.has_value());
  EXPECT_EQ(nightly.rules.quota->compute_units_per_second, 20000);
  EXPECT_EQ(nightly.rules.quota->burst_compute_units, 40000);
  const PolicyClient& free = policy->clients()[2];
  EXPECT_THAT(*free.rules.presets, ::testing::ElementsAre("fast", "balanced"));
  EXPECT_EQ(*free.rules.max_expert_count, 9);
  EXPECT_EQ(*free.rules.max_expert_width, 16);
  EXPECT_EQ(*free.rules.full_attention_max_tokens, 0);
  EXPECT_EQ(free.rules.default_preset, "fast");
  EXPECT_EQ(free.rules.priority, 3);
  EXPECT_EQ(*policy->default_rules().full_attention_max_tokens, 1024);
  EXPECT_TRUE(policy->lists_tokens());
  EXPECT_EQ(policy->FindByTokenSha256(kFreeSha), &free);
  EXPECT_EQ(policy->FindByCertificateSubject("CN=nightly,O=Example"), &nightly);
  EXPECT_EQ(policy->FindByTokenSha256(Sha256Hex("someone else")), nullptr);
}

TEST(ClientPolicyTest, EmptyPolicyRestrictsNobody) {
  absl::StatusOr<ClientPolicy> policy = ClientPolicy::Parse("{}", "empty.json");
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_TRUE(policy->clients().empty());
  EXPECT_FALSE(policy->lists_tokens());
  EXPECT_FALSE(policy->default_rules().quota.has_value());
  EXPECT_EQ(policy->default_rules().priority, kNormalPriority);
}

// Each bad file is INVALID_ARGUMENT naming the file, the client and the key.
TEST(ClientPolicyTest, BadFilesNameTheFileTheClientAndTheKey) {
  const std::string token = absl::StrCat("\"token_sha256\": \"", kFreeSha, "\"");
  struct Case {
    std::string text;
    std::string message;
  };
  const Case cases[] = {
      {"not json", "client policy 'p.json': top level: not valid JSON"},
      {"[]", "top level: must be a JSON object (got array)"},
      {R"({"clients": [], "extra": 1})", "top level: key 'extra': unknown key; allowed: clients, default"},
      {R"({"clients": {}})", "top level: key 'clients': must be a list (got object)"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token, R"(, "max_expert_widht": 16}]})"),
       "client 'free': key 'max_expert_widht': unknown key; allowed:"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token, R"(, "max_expert_width": "16"}]})"),
       "client 'free': key 'max_expert_width': must be an integer >= 1 (got string)"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token, R"(, "max_expert_count": 0}]})"),
       "client 'free': key 'max_expert_count': 0 is out of range: allowed >= 1"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token, R"(, "full_attention_max_tokens": -1}]})"),
       "client 'free': key 'full_attention_max_tokens': -1 is out of range: allowed >= 0"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token, R"(, "priority": "urgent"}]})"),
       "client 'free': key 'priority': unknown priority \"urgent\"; use interactive, normal, batch or an integer"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token, R"(, "priority": 11}]})"),
       "client 'free': key 'priority': 11 is out of range: allowed [-10, 10]"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token,
                    R"(, "quota": {"compute_units_per_second": 0, "burst_compute_units": 5}}]})"),
       "client 'free': key 'quota.compute_units_per_second': 0 is out of range: allowed > 0"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token, R"(, "quota": {"compute_units_per_second": 5}}]})"),
       "client 'free': key 'quota.burst_compute_units': missing"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token, R"(, "quota": {"rate": 5}}]})"),
       "client 'free': key 'quota.rate': unknown key"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token, R"(, "presets": "fast"}]})"),
       "client 'free': key 'presets': must be a list of preset names (got string)"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token,
                    R"(, "presets": ["fast"], "default_preset": "accurate"}]})"),
       "client 'free': key 'default_preset': \"accurate\" is not one of its presets: fast"},
      {absl::StrCat(R"({"clients": [{"name": "Free!", )", token, R"(}]})"),
       "client 'Free!': key 'name': must match [a-z0-9_-]{1,32} (it is a metric label)"},
      {absl::StrCat(R"({"clients": [{"name": "default", )", token, R"(}]})"),
       "client 'default': key 'name': \"default\" is reserved"},
      {absl::StrCat(R"({"clients": [{)", token, R"(}]})"), "client #1: key 'name': missing"},
      {R"({"clients": [{"name": "free"}]})", "client 'free': has no identity: give token_sha256"},
      {R"({"clients": [{"name": "free", "token_sha256": "abc"}]})",
       "client 'free': key 'token_sha256': must be the token's SHA-256 as 64 hex digits"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token,
                    R"(}, {"name": "free", "certificate_subject": "CN=x"}]})"),
       "client 'free': key 'name': a client of this name is listed already"},
      {absl::StrCat(R"({"clients": [{"name": "free", )", token, R"(}, {"name": "paid", )", token, R"(}]})"),
       "client 'paid': key 'token_sha256': the same token identifies client 'free'"},
      {R"({"clients": [{"name": "a", "certificate_subject": "CN=x"}, {"name": "b", "certificate_subject": "CN=x"}]})",
       "client 'b': key 'certificate_subject': the same subject identifies client 'a'"},
      {R"({"default": {"token_sha256": "00"}})", "client 'default': key 'token_sha256': unknown key"},
  };
  for (const Case& bad : cases) {
    absl::StatusOr<ClientPolicy> policy = ClientPolicy::Parse(bad.text, "p.json");
    ASSERT_FALSE(policy.ok()) << bad.text;
    EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument) << bad.text;
    EXPECT_THAT(std::string(policy.status().message()), HasSubstr(bad.message)) << bad.text;
    EXPECT_THAT(std::string(policy.status().message()), HasSubstr("client policy 'p.json': ")) << bad.text;
  }
}

TEST(ClientPolicyTest, MissingFileIsNotFound) {
  absl::StatusOr<ClientPolicy> policy = ClientPolicy::FromFile("/nonexistent/policy.json");
  EXPECT_EQ(policy.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(policy.status().message()), HasSubstr("/nonexistent/policy.json"));
}

// The bucket fills at exactly the rate, up to exactly the burst, and tells how long until it holds a unit.
TEST(ComputeQuotaTest, RateAndBurstAreExact) {
  ManualClock clock(absl::FromUnixSeconds(1000));
  ComputeQuota quota(ClientRules::Quota{1000, 4000}, &clock);
  EXPECT_DOUBLE_EQ(quota.level(), 4000);
  EXPECT_EQ(quota.TimeUntilAdmitted(), absl::ZeroDuration());
  quota.Charge(4000);
  EXPECT_DOUBLE_EQ(quota.level(), 0);
  // One unit takes 1 ms at 1000 units/s.
  EXPECT_EQ(quota.TimeUntilAdmitted(), absl::Milliseconds(1));
  // A charge beyond the level is a debt: 500 units take 501 ms to repay to one unit.
  quota.Charge(500);
  EXPECT_DOUBLE_EQ(quota.level(), -500);
  EXPECT_EQ(quota.TimeUntilAdmitted(), absl::Milliseconds(501));
  clock.Advance(absl::Milliseconds(250));
  EXPECT_DOUBLE_EQ(quota.level(), -250);
  clock.Advance(absl::Milliseconds(251));
  EXPECT_NEAR(quota.level(), 1, 1e-9);
  EXPECT_EQ(quota.TimeUntilAdmitted(), absl::ZeroDuration());
  // Never above the burst, however long it waits.
  clock.Advance(absl::Hours(1));
  EXPECT_DOUBLE_EQ(quota.level(), 4000);
  // A refund gives back what was charged, at most up to the burst.
  quota.Charge(3000);
  quota.Refund(5000);
  EXPECT_DOUBLE_EQ(quota.level(), 4000);
  // Reconfigured: the level stays, capped by the new burst; the new rate applies.
  quota.Reconfigure(ClientRules::Quota{100, 2000});
  EXPECT_DOUBLE_EQ(quota.level(), 2000);
  quota.Charge(2100);
  EXPECT_EQ(quota.TimeUntilAdmitted(), absl::Milliseconds(1010));
}

// Over a long run on a manual clock, a client charging as fast as it is let in gets rate x time + burst at most.
TEST(ComputeQuotaTest, LongRunHoldsTheRate) {
  ManualClock clock(absl::FromUnixSeconds(0));
  ComputeQuota quota(ClientRules::Quota{20000, 40000}, &clock);
  int64_t charged = 0;
  const absl::Time end = clock.Now() + absl::Seconds(100);
  while (clock.Now() < end) {
    if (quota.TimeUntilAdmitted() == absl::ZeroDuration()) {
      quota.Charge(2500);
      charged += 2500;
    }
    clock.Advance(absl::Milliseconds(3));
  }
  EXPECT_LE(charged, 20000 * 100 + 40000 + 2500);
  EXPECT_GE(charged, 20000 * 100);
}

TEST(CheckQuotaTest, OverQuotaSaysWhenToRetry) {
  ManualClock clock(absl::FromUnixSeconds(0));
  ClientAdmission client;
  client.name = "batch";
  client.quota = std::make_shared<ComputeQuota>(ClientRules::Quota{20000, 40000}, &clock);
  EXPECT_TRUE(CheckQuota(client).ok());
  client.quota->Charge(40000 + 2399);
  const absl::Status status = CheckQuota(client);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(),
            "client 'batch' is over its quota of 20000 compute units/s (burst 40000); retry in 120 ms");
  clock.Advance(absl::Milliseconds(120));
  EXPECT_TRUE(CheckQuota(client).ok());
  ClientAdmission unlimited;
  unlimited.name = "free";
  EXPECT_TRUE(CheckQuota(unlimited).ok());
}

TEST(ClientPolicyHolderTest, IdentifiesByTokenThenCertificateElseDefault) {
  const std::string folder = test_util::MakeTempDirectory("policy_identify");
  const std::string path = folder + "/policy.json";
  test_util::WriteFile(path, GoodPolicy());
  ManualClock clock;
  absl::StatusOr<std::unique_ptr<ClientPolicyHolder>> holder = ClientPolicyHolder::Load(path, &clock);
  ASSERT_TRUE(holder.ok()) << holder.status();
  const std::string frontend_token = "frontend-token";
  const std::string other_token = "other-token";
  const std::string subject = "CN=nightly,O=Example";
  const std::string other_subject = "CN=other";
  EXPECT_EQ((*holder)->Identify(&frontend_token, nullptr)->name, "frontend");
  EXPECT_EQ((*holder)->Identify(&frontend_token, &subject)->name, "frontend");
  EXPECT_EQ((*holder)->Identify(&other_token, &subject)->name, "nightly");
  EXPECT_EQ((*holder)->Identify(nullptr, &subject)->name, "nightly");
  EXPECT_EQ((*holder)->Identify(&other_token, &other_subject)->name, "default");
  EXPECT_EQ((*holder)->Identify(nullptr, nullptr)->name, "default");
  EXPECT_EQ(*(*holder)->Identify(nullptr, nullptr)->rules.full_attention_max_tokens, 1024);
  EXPECT_TRUE((*holder)->IsPolicyToken(frontend_token));
  EXPECT_FALSE((*holder)->IsPolicyToken(other_token));
  EXPECT_THAT((*holder)->client_names(), ::testing::ElementsAre("default", "frontend", "nightly", "free"));
}

TEST(ClientPolicyHolderTest, ReloadSwapsAGoodFileAndKeepsTheOldForABadOne) {
  const std::string folder = test_util::MakeTempDirectory("policy_reload");
  const std::string path = folder + "/policy.json";
  test_util::WriteFile(path, GoodPolicy());
  ManualClock clock;
  absl::StatusOr<std::unique_ptr<ClientPolicyHolder>> loaded = ClientPolicyHolder::Load(path, &clock);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ClientPolicyHolder& holder = **loaded;
  const std::string subject = "CN=nightly,O=Example";
  EXPECT_EQ(*holder.ReloadIfChanged(), false);  // unchanged
  // The nightly client spends part of its bucket; a call identified now keeps its version's rules.
  std::shared_ptr<const ClientAdmission> before = holder.Identify(nullptr, &subject);
  before->quota->Charge(30000);

  // A good file: swapped in; nightly's bucket keeps its level under the new rate and burst; a new client appears.
  test_util::WriteFile(path, absl::StrCat(R"({"clients": [
      {"name": "nightly", "certificate_subject": "CN=nightly,O=Example", "priority": "batch", "max_expert_width": 8,
       "quota": {"compute_units_per_second": 10000, "burst_compute_units": 20000}},
      {"name": "reports", "token_sha256": ")",
                                          kFreeSha, R"("}]})"));
  absl::StatusOr<bool> swapped = holder.ReloadIfChanged();
  ASSERT_TRUE(swapped.ok()) << swapped.status();
  EXPECT_TRUE(*swapped);
  std::shared_ptr<const ClientAdmission> after = holder.Identify(nullptr, &subject);
  EXPECT_EQ(after->quota, before->quota);
  EXPECT_DOUBLE_EQ(after->quota->level(), 10000);
  EXPECT_EQ(after->quota->quota().compute_units_per_second, 10000);
  EXPECT_EQ(*after->rules.max_expert_width, 8);
  EXPECT_FALSE(before->rules.max_expert_width.has_value());
  const std::string free_token = "free-token";
  EXPECT_EQ(holder.Identify(&free_token, nullptr)->name, "reports");
  const std::string frontend_token = "frontend-token";
  EXPECT_EQ(holder.Identify(&frontend_token, nullptr)->name, "default");
  EXPECT_THAT(holder.client_names(), ::testing::ElementsAre("default", "frontend", "nightly", "free", "reports"));

  // A bad file: the policy in force stays, and the reload says why, once.
  test_util::WriteFile(path, R"({"clients": [{"name": "reports", "token_sha256": "xyz"}]})");
  absl::StatusOr<bool> refused = holder.ReloadIfChanged();
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr(absl::StrCat("client policy '", path, "': client 'reports': key 'token_sha256'")));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("the client policy in force stays"));
  EXPECT_EQ(*holder.ReloadIfChanged(), false);
  EXPECT_EQ(holder.Identify(&free_token, nullptr)->name, "reports");
  EXPECT_EQ(*holder.Identify(nullptr, &subject)->rules.max_expert_width, 8);

  // A removed file: kept too, said once.
  std::remove(path.c_str());
  EXPECT_EQ(holder.ReloadIfChanged().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*holder.ReloadIfChanged(), false);
  EXPECT_EQ(holder.Identify(&free_token, nullptr)->name, "reports");
}

// The knobs of the embedded image model (models/repository/fashion-mnist-vit/config.json): m in [1, 50], k in
// [1, 50], default 9x16, presets fast 4x8, balanced 9x16, accurate 16x32, accuracy order 16x32, 9x16, full, 4x8.
models::BudgetKnobs ImageKnobs() {
  models::BudgetKnobs knobs;
  knobs.min_expert_count = 1;
  knobs.max_expert_count = 50;
  knobs.min_expert_width = 1;
  knobs.max_expert_width = 50;
  knobs.default_budget = {false, 9, 16};
  knobs.presets = {{"fast", {false, 4, 8}}, {"balanced", {false, 9, 16}}, {"accurate", {false, 16, 32}}};
  knobs.accuracy_order = {{"accurate", {false, 16, 32}, 0.8828},
                          {"balanced", {false, 9, 16}, 0.8823},
                          {"full", {true, 0, 0}, 0.8794},
                          {"fast", {false, 4, 8}, 0.8789}};
  return knobs;
}

ClientAdmission Free() {
  ClientAdmission client;
  client.name = "free";
  client.rules.presets = std::vector<std::string>{"fast", "balanced"};
  client.rules.max_expert_count = 9;
  client.rules.max_expert_width = 16;
  client.rules.full_attention_max_tokens = 0;
  client.rules.default_preset = "fast";
  return client;
}

TEST(BudgetRulesTest, FixedBudgetsOutsideTheRulesArePermissionDeniedNamingTheRule) {
  const models::BudgetKnobs knobs = ImageKnobs();
  const ClientAdmission free = Free();
  struct Case {
    models::BudgetRequest request;
    PolicyRule rule;
    std::string message;
  };
  models::BudgetRequest accurate;
  accurate.choice = models::BudgetRequest::Choice::kPreset;
  accurate.preset = "accurate";
  models::BudgetRequest wide;
  wide.choice = models::BudgetRequest::Choice::kExperts;
  wide.expert_count = 9;
  wide.expert_width = 32;
  models::BudgetRequest many;
  many.choice = models::BudgetRequest::Choice::kExperts;
  many.expert_count = 16;
  many.expert_width = 8;
  models::BudgetRequest full;
  full.choice = models::BudgetRequest::Choice::kFullAttention;
  const Case cases[] = {
      {accurate, PolicyRule::kPreset, "client 'free' may not use preset 'accurate' (policy: presets fast, balanced)"},
      {wide, PolicyRule::kExpertWidth, "client 'free' may use expert width up to 16; asked 32"},
      {many, PolicyRule::kExpertCount, "client 'free' may use expert count up to 9; asked 16"},
      {full, PolicyRule::kFullAttention,
       "client 'free' may not use full attention (policy: full_attention_max_tokens 0)"},
  };
  for (const Case& denied : cases) {
    models::BudgetRequest request = denied.request;
    PolicyRule rule = PolicyRule::kPreset;
    const absl::Status status = AdmitBudgetRequest(free, knobs, &request, &rule);
    EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << denied.message;
    EXPECT_EQ(status.message(), denied.message);
    EXPECT_EQ(rule, denied.rule) << denied.message;
  }
  // Within the rules: an explicit 9x16, and a preset it may use.
  models::BudgetRequest within;
  within.choice = models::BudgetRequest::Choice::kExperts;
  within.expert_count = 9;
  within.expert_width = 16;
  PolicyRule rule;
  EXPECT_TRUE(AdmitBudgetRequest(free, knobs, &within, &rule).ok());
  // A budget the model refuses is the model's error, not the policy's.
  models::BudgetRequest unknown;
  unknown.choice = models::BudgetRequest::Choice::kPreset;
  unknown.preset = "nonesuch";
  EXPECT_TRUE(AdmitBudgetRequest(free, knobs, &unknown, &rule).ok());
}

TEST(BudgetRulesTest, ClientDefaultPresetReplacesTheModelsDefault) {
  const models::BudgetKnobs knobs = ImageKnobs();
  const ClientAdmission free = Free();
  for (models::BudgetRequest::Choice choice :
       {models::BudgetRequest::Choice::kDefault, models::BudgetRequest::Choice::kPreset}) {
    models::BudgetRequest request;
    request.choice = choice;  // kPreset with "" is the default too
    PolicyRule rule;
    ASSERT_TRUE(AdmitBudgetRequest(free, knobs, &request, &rule).ok());
    EXPECT_EQ(request.choice, models::BudgetRequest::Choice::kPreset);
    EXPECT_EQ(request.preset, "fast");
  }
  // Without a default preset, the model's default ("default") must be among its presets.
  ClientAdmission strict = Free();
  strict.rules.default_preset.clear();
  models::BudgetRequest request;
  PolicyRule rule;
  const absl::Status status = AdmitBudgetRequest(strict, knobs, &request, &rule);
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(status.message(), "client 'free' may not use preset 'default' (policy: presets fast, balanced)");
}

TEST(BudgetRulesTest, LatencyTargetIsPlannedWithinThePolicy) {
  const models::BudgetKnobs knobs = ImageKnobs();
  const ClientAdmission free = Free();
  models::BudgetRequest request;
  request.choice = models::BudgetRequest::Choice::kLatencyTarget;
  request.latency_target = absl::Milliseconds(50);
  PolicyRule rule;
  ASSERT_TRUE(AdmitBudgetRequest(free, knobs, &request, &rule).ok());
  // The item as Prepare makes it at 50 tokens: the whole order, most accurate first.
  models::BatchItem item;
  item.tokens = 50;
  item.latency_target = true;
  for (const models::DeclaredBudget& declared : knobs.accuracy_order) {
    item.allowed_budgets.push_back(
        {models::ApplyBudget(declared.budget, 50), declared.name == "full" ? std::string() : declared.name});
  }
  item.budget = item.allowed_budgets.front();
  item.requested_budget = knobs.accuracy_order.front().budget;
  item.compute_units = models::ComputeUnits(50, item.budget.budget);
  ASSERT_TRUE(AdmitPreparedItem(free, knobs, request, &item, &rule).ok());
  // accurate (a preset it may not use) and full attention are gone; balanced and fast are left.
  ASSERT_EQ(item.allowed_budgets.size(), 2u);
  EXPECT_EQ(item.allowed_budgets[0].preset, "balanced");
  EXPECT_EQ(item.allowed_budgets[1].preset, "fast");
  EXPECT_EQ(item.budget.preset, "balanced");
  EXPECT_EQ(item.requested_budget, (models::AttentionBudget{false, 9, 16}));
  EXPECT_EQ(item.compute_units, 50 * 25);

  // Nothing left: PERMISSION_DENIED listing each budget's rule.
  ClientAdmission none = Free();
  none.rules.presets = std::vector<std::string>{};
  models::BudgetRequest target = request;
  const absl::Status status = AdmitBudgetRequest(none, knobs, &target, &rule);
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(rule, PolicyRule::kLatencyTarget);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("client 'free' may use none of the budgets its latency target allows: accurate: client "
                        "'free' may not use preset 'accurate' (policy: presets none)"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("full: client 'free' may not use full attention"));
}

TEST(BudgetRulesTest, FullAttentionUpToATokenCount) {
  const models::BudgetKnobs knobs = ImageKnobs();
  ClientAdmission reader;
  reader.name = "reader";
  reader.rules.full_attention_max_tokens = 40;
  models::BudgetRequest request;
  request.choice = models::BudgetRequest::Choice::kFullAttention;
  PolicyRule rule;
  ASSERT_TRUE(AdmitBudgetRequest(reader, knobs, &request, &rule).ok());
  models::BatchItem item;
  item.tokens = 50;
  item.requested_budget = {true, 0, 0};
  item.budget = {{true, 0, 0}, ""};
  const absl::Status status = AdmitPreparedItem(reader, knobs, request, &item, &rule);
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(status.message(),
            "client 'reader' may use full attention up to 40 tokens (policy: full_attention_max_tokens); the input "
            "has 50");
  EXPECT_EQ(rule, PolicyRule::kFullAttentionTokens);
  item.tokens = 40;
  EXPECT_TRUE(AdmitPreparedItem(reader, knobs, request, &item, &rule).ok());
}

}  // namespace
}  // namespace mita::server::policy
