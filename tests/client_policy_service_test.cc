// The budget policy per client through both front ends, on an in-process server with the embedded image model:
// callers identified by their bearer tokens (with --auth_token_file's token still valid), PERMISSION_DENIED naming
// the client and the rule over mita.v1 and the Open Inference Protocol, the client's default preset, a latency
// target planned within the policy, RESOURCE_EXHAUSTED with the time to wait for a client over its quota, a reload
// while serving, and the per-client metrics.
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kserve/grpc_predict_v2.grpc.pb.h"
#include "mita/v1/mita.grpc.pb.h"
#include "server/engine/model_registry.h"
#include "server/frontend/security.h"
#include "server/policy/client_policy.h"
#include "server/policy/policy_holder.h"
#include "tests/server_test_util.h"
#include "tests/test_util.h"

namespace mita::server {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;

constexpr char kModel[] = "fashion-mnist-vit";
constexpr char kServerToken[] = "server-t0ken";
constexpr char kFreeToken[] = "free-t0ken";
constexpr char kMeteredToken[] = "metered-t0ken";

std::string PolicyText(int64_t free_max_expert_width) {
  return absl::StrCat(R"({"clients": [
      {"name": "free", "token_sha256": ")",
                      policy::Sha256Hex(kFreeToken), R"(", "presets": ["fast", "balanced"],
       "max_expert_count": 9, "max_expert_width": )",
                      free_max_expert_width, R"(, "full_attention_max_tokens": 0,
       "default_preset": "fast", "priority": "batch"},
      {"name": "metered", "token_sha256": ")",
                      policy::Sha256Hex(kMeteredToken), R"(",
       "quota": {"compute_units_per_second": 1000, "burst_compute_units": 1000}}
    ]})");
}

class ClientPolicyServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<ModelRegistry>> registry =
        ModelRegistry::LoadFromDirectory(test_util::RepositoryPath());
    ASSERT_TRUE(registry.ok()) << registry.status();
    registry_ = registry->release();
    policy_path_ = new std::string(test_util::MakeTempDirectory("client_policy_service") + "/policy.json");
    test_util::WriteFile(*policy_path_, PolicyText(16));
    absl::StatusOr<std::unique_ptr<policy::ClientPolicyHolder>> holder =
        policy::ClientPolicyHolder::Load(*policy_path_);
    ASSERT_TRUE(holder.ok()) << holder.status();
    holder_ = holder->release();
    absl::StatusOr<std::unique_ptr<BearerTokenAuthenticator>> authenticator =
        BearerTokenAuthenticator::FromToken(kServerToken);
    ASSERT_TRUE(authenticator.ok()) << authenticator.status();
    authenticator_ = authenticator->release();
    test_util::InProcessServerOptions options;
    options.engine.batching.max_batch_size = 8;
    options.engine.batching.max_queue_delay = absl::Milliseconds(2);
    options.front_end.authenticator = authenticator_;
    options.front_end.client_policy = holder_;
    options.open_inference = true;
    server_ = new test_util::InProcessServer(registry_, options);
    ASSERT_TRUE(server_->status().ok()) << server_->status();
    auto channel = grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials());
    v1_stub_ = v1::MitaService::NewStub(channel).release();
    oip_stub_ = inference::GRPCInferenceService::NewStub(channel).release();
    absl::StatusOr<test_util::TestImages> images = test_util::FashionMnistTestPngs(4);
    ASSERT_TRUE(images.ok()) << images.status();
    images_ = new std::vector<std::string>(images->pngs);
  }

  static void TearDownTestSuite() {
    delete v1_stub_;
    delete oip_stub_;
    delete server_;
    delete holder_;
    delete authenticator_;
    delete registry_;
    delete images_;
    delete policy_path_;
  }

  void SetUp() override { ASSERT_NE(v1_stub_, nullptr) << "suite set-up failed"; }

  static grpc::Status Classify(const std::string& token, const v1::Budget& budget, v1::ClassifyResponse* response) {
    v1::ClassifyRequest request;
    request.set_model(kModel);
    request.set_image((*images_)[0]);
    *request.mutable_budget() = budget;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    return v1_stub_->Classify(&context, request, response);
  }

  // ModelInfer of an image with the string parameters `strings` and int parameters `ints`.
  static grpc::Status Infer(const std::string& token, const std::vector<std::pair<std::string, std::string>>& strings,
                            const std::vector<std::pair<std::string, int64_t>>& ints,
                            inference::ModelInferResponse* response) {
    inference::ModelInferRequest request;
    request.set_model_name(kModel);
    auto* input = request.add_inputs();
    input->set_name("image");
    input->set_datatype("BYTES");
    input->add_shape(1);
    input->mutable_contents()->add_bytes_contents((*images_)[1]);
    for (const auto& [name, value] : strings) (*request.mutable_parameters())[name].set_string_param(value);
    for (const auto& [name, value] : ints) (*request.mutable_parameters())[name].set_int64_param(value);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    return oip_stub_->ModelInfer(&context, request, response);
  }

  static double Metric(const std::string& name, const std::map<std::string, std::string>& labels) {
    return test_util::MetricValue(server_->registry(), name, labels);
  }

  static ModelRegistry* registry_;
  static std::string* policy_path_;
  static policy::ClientPolicyHolder* holder_;
  static BearerTokenAuthenticator* authenticator_;
  static test_util::InProcessServer* server_;
  static v1::MitaService::Stub* v1_stub_;
  static inference::GRPCInferenceService::Stub* oip_stub_;
  static std::vector<std::string>* images_;
};

ModelRegistry* ClientPolicyServiceTest::registry_ = nullptr;
std::string* ClientPolicyServiceTest::policy_path_ = nullptr;
policy::ClientPolicyHolder* ClientPolicyServiceTest::holder_ = nullptr;
BearerTokenAuthenticator* ClientPolicyServiceTest::authenticator_ = nullptr;
test_util::InProcessServer* ClientPolicyServiceTest::server_ = nullptr;
v1::MitaService::Stub* ClientPolicyServiceTest::v1_stub_ = nullptr;
inference::GRPCInferenceService::Stub* ClientPolicyServiceTest::oip_stub_ = nullptr;
std::vector<std::string>* ClientPolicyServiceTest::images_ = nullptr;

// The server's token and a policy token are credentials; another token is not (and is never echoed).
TEST_F(ClientPolicyServiceTest, PolicyTokensAreCredentialsBesideTheServerToken) {
  v1::ClassifyResponse response;
  EXPECT_TRUE(Classify(kServerToken, v1::Budget(), &response).ok());
  // The server's token is the default client: the model's default budget.
  EXPECT_EQ(response.budget().preset(), "default");
  EXPECT_TRUE(Classify(kFreeToken, v1::Budget(), &response).ok());
  const grpc::Status unknown = Classify("not-a-token", v1::Budget(), &response);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(unknown.error_message(), ::testing::Not(HasSubstr("not-a-token")));
  EXPECT_EQ(Classify("", v1::Budget(), &response).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  inference::ModelInferResponse infer;
  EXPECT_EQ(Infer("not-a-token", {}, {}, &infer).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Infer(kFreeToken, {}, {}, &infer).ok());
}

// A budget outside the client's rules is PERMISSION_DENIED naming the client and the rule, over both protocols.
TEST_F(ClientPolicyServiceTest, BudgetsOutsideTheRulesArePermissionDeniedOverBothFrontEnds) {
  const double denied_before =
      Metric("mita_client_requests_total", {{"client", "free"}, {"code", "PERMISSION_DENIED"}});
  v1::ClassifyResponse response;
  v1::Budget full;
  full.mutable_full_attention();
  grpc::Status status = Classify(kFreeToken, full, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(status.error_message(), "client 'free' may not use full attention (policy: full_attention_max_tokens 0)");
  v1::Budget wide;
  wide.mutable_experts()->set_expert_count(9);
  wide.mutable_experts()->set_expert_width(32);
  status = Classify(kFreeToken, wide, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(status.error_message(), "client 'free' may use expert width up to 16; asked 32");
  v1::Budget accurate;
  accurate.set_preset("accurate");
  status = Classify(kFreeToken, accurate, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(status.error_message(), "client 'free' may not use preset 'accurate' (policy: presets fast, balanced)");

  inference::ModelInferResponse infer;
  status = Infer(kFreeToken, {{"mita_attention", "full"}}, {}, &infer);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(status.error_message(), "client 'free' may not use full attention (policy: full_attention_max_tokens 0)");
  status = Infer(kFreeToken, {}, {{"mita_expert_width", 32}}, &infer);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(status.error_message(), "client 'free' may use expert width up to 16; asked 32");
  status = Infer(kFreeToken, {{"mita_preset", "accurate"}}, {}, &infer);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);

  // The default client (the server's token) may use all of them.
  EXPECT_TRUE(Classify(kServerToken, full, &response).ok());
  EXPECT_TRUE(Infer(kServerToken, {}, {{"mita_expert_width", 32}}, &infer).ok());

  EXPECT_EQ(Metric("mita_client_requests_total", {{"client", "free"}, {"code", "PERMISSION_DENIED"}}) - denied_before,
            6);
  EXPECT_GE(Metric("mita_client_policy_refusals_total", {{"client", "free"}, {"rule", "full_attention"}}), 2);
  EXPECT_GE(Metric("mita_client_policy_refusals_total", {{"client", "free"}, {"rule", "max_expert_width"}}), 2);
  EXPECT_GE(Metric("mita_client_policy_refusals_total", {{"client", "free"}, {"rule", "preset"}}), 2);
  EXPECT_GE(Metric("mita_client_requests_total", {{"client", "default"}, {"code", "OK"}}), 2);
}

// The client's default preset replaces the model's default; a latency target is planned within the rules.
TEST_F(ClientPolicyServiceTest, DefaultPresetAndLatencyTargetFollowThePolicy) {
  v1::ClassifyResponse response;
  ASSERT_TRUE(Classify(kFreeToken, v1::Budget(), &response).ok());
  EXPECT_EQ(response.budget().preset(), "fast");
  EXPECT_EQ(response.budget().expert_count(), 4);
  EXPECT_EQ(response.budget().expert_width(), 8);
  inference::ModelInferResponse infer;
  ASSERT_TRUE(Infer(kFreeToken, {}, {}, &infer).ok());
  EXPECT_EQ(infer.parameters().at("mita_preset").string_param(), "fast");
  EXPECT_EQ(infer.parameters().at("mita_expert_width").int64_param(), 8);

  // The order is accurate 16x32, balanced 9x16, full, fast 4x8: the free client plans among balanced and fast.
  v1::Budget target;
  target.mutable_latency_target()->set_target_ms(5000);
  ASSERT_TRUE(Classify(kFreeToken, target, &response).ok());
  EXPECT_FALSE(response.budget().full_attention());
  EXPECT_LE(response.budget().expert_count(), 9);
  EXPECT_LE(response.budget().expert_width(), 16);
  ASSERT_TRUE(Infer(kFreeToken, {}, {{"mita_latency_target_ms", 5000}}, &infer).ok());
  EXPECT_LE(infer.parameters().at("mita_expert_width").int64_param(), 16);
  // A target whose floor leaves only budgets outside the rules: PERMISSION_DENIED.
  target.mutable_latency_target()->set_floor("accurate");
  const grpc::Status status = Classify(kFreeToken, target, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(status.error_message(),
              HasSubstr("client 'free' may use none of the budgets its latency target allows: accurate: "));
}

// A client over its quota gets RESOURCE_EXHAUSTED with the time to wait, over both protocols, and is let in again
// once its bucket has refilled.
TEST_F(ClientPolicyServiceTest, OverQuotaIsResourceExhaustedWithTheTimeToWait) {
  // 1000 compute units/s, burst 1000; one image at the preset accurate (16x32) costs 50 x 48 = 2400, which leaves the
  // bucket 1400 in debt: the next requests are refused for 1.4 s (room for a loaded machine's slow calls).
  absl::SleepFor(absl::Milliseconds(1300));  // a full bucket whatever ran before
  const double admitted_before = Metric("mita_client_compute_units_total", {{"client", "metered"}});
  v1::ClassifyResponse response;
  v1::Budget accurate;
  accurate.set_preset("accurate");
  ASSERT_TRUE(Classify(kMeteredToken, accurate, &response).ok());
  grpc::Status status = Classify(kMeteredToken, v1::Budget(), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(),
              ContainsRegex("^client 'metered' is over its quota of 1000 compute units/s \\(burst 1000\\); retry in "
                            "[0-9]+ ms$"));
  inference::ModelInferResponse infer;
  status = Infer(kMeteredToken, {}, {}, &infer);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("client 'metered' is over its quota"));
  EXPECT_EQ(Metric("mita_client_compute_units_total", {{"client", "metered"}}) - admitted_before, 2400);
  EXPECT_GE(Metric("mita_client_quota_refusals_total", {{"client", "metered"}}), 2);
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_TRUE(Infer(kMeteredToken, {}, {}, &infer).ok());
}

// A new policy file is taken while serving; a bad one keeps the policy in force.
TEST_F(ClientPolicyServiceTest, ReloadWhileServing) {
  v1::Budget wide;
  wide.mutable_experts()->set_expert_count(9);
  wide.mutable_experts()->set_expert_width(32);
  v1::ClassifyResponse response;
  EXPECT_EQ(Classify(kFreeToken, wide, &response).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  test_util::WriteFile(*policy_path_, PolicyText(32));
  absl::StatusOr<bool> reloaded = holder_->ReloadIfChanged();
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_TRUE(*reloaded);
  EXPECT_TRUE(Classify(kFreeToken, wide, &response).ok());
  test_util::WriteFile(*policy_path_, "{\"clients\": 3}");
  EXPECT_EQ(holder_->ReloadIfChanged().status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Classify(kFreeToken, wide, &response).ok());
  test_util::WriteFile(*policy_path_, PolicyText(16));
  ASSERT_TRUE(holder_->ReloadIfChanged().ok());
  EXPECT_EQ(Classify(kFreeToken, wide, &response).error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

}  // namespace
}  // namespace mita::server
