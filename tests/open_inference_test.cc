// The Open Inference Protocol front end (server/frontend/open_inference_service.h) end to end over loopback: a client generated
// from proto/kserve/grpc_predict_v2.proto classifies real Fashion-MNIST test images (PNG) with the embedded
// model at chosen budgets. The reference is mita.v1 Classify on the same server with the same budget (an
// independent request path into the same batcher) and the ground-truth labels; the translation of documents
// (BYTES text, INT64 token ids) is tested on the translation functions.
//
// The model repository is $MITA_MODEL_REPOSITORY when set, else $MITA_SOURCE_DIR/models/repository.
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kserve/grpc_predict_v2.grpc.pb.h"
#include "mita/v1/mita.grpc.pb.h"
#include "server/engine/inference_engine.h"
#include "server/engine/model_registry.h"
#include "server/frontend/open_inference_service.h"
#include "server/metrics/metrics.h"
#include "tests/server_test_util.h"
#include "tests/test_util.h"
#include "tools/fashion_mnist.h"

namespace mita::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kModel[] = "fashion-mnist-vit";
constexpr int kImages = 48;
constexpr int64_t kMaxImageBytes = int64_t{1} << 20;

using test_util::RepositoryPath;

// A ModelInfer request for one encoded image with typed contents.
inference::ModelInferRequest ImageRequest(const std::string& image) {
  inference::ModelInferRequest request;
  request.set_model_name(kModel);
  auto* input = request.add_inputs();
  input->set_name("image");
  input->set_datatype("BYTES");
  input->add_shape(1);
  input->mutable_contents()->add_bytes_contents(image);
  return request;
}

void SetInt(inference::ModelInferRequest& request, const std::string& name, int64_t value) {
  (*request.mutable_parameters())[name].set_int64_param(value);
}

void SetString(inference::ModelInferRequest& request, const std::string& name, const std::string& value) {
  (*request.mutable_parameters())[name].set_string_param(value);
}

// mita_requests_total{method="Classify", model=kModel, code=`code`} read from the registry.
// Calls of `method` about `model` answered with `code`, in mita_requests_total.
double CallCount(const ServerMetrics& metrics, const std::string& method, const std::string& code,
                 const std::string& model = kModel) {
  metrics.AwaitFinishedCallsCounted();
  return test_util::MetricValue(*metrics.registry(), "mita_requests_total",
                                {{"method", method}, {"model", model}, {"code", code}});
}

const inference::ModelInferResponse::InferOutputTensor* FindOutput(const inference::ModelInferResponse& response,
                                                                   const std::string& name) {
  for (const auto& output : response.outputs()) {
    if (output.name() == name) return &output;
  }
  return nullptr;
}

class OpenInferenceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<ModelRegistry>> registry = ModelRegistry::LoadFromDirectory(RepositoryPath());
    ASSERT_TRUE(registry.ok()) << registry.status();
    registry_ = registry->release();
    test_util::InProcessServerOptions options;
    options.engine.batching.max_batch_size = 8;
    options.engine.batching.max_queue_delay = absl::Milliseconds(2);
    options.engine.batching.queue_capacity = 64;
    options.engine.max_encoded_image_bytes = kMaxImageBytes;
    options.open_inference = true;
    options.reflection = true;
    server_ = new test_util::InProcessServer(registry_, options);
    ASSERT_TRUE(server_->status().ok()) << server_->status();
    metrics_ = &server_->metrics();
    kserve_ = server_->open_inference();
    channel_ = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
    stub_ = inference::GRPCInferenceService::NewStub(*channel_).release();
    v1_stub_ = v1::MitaService::NewStub(*channel_).release();

    absl::StatusOr<test_util::TestImages> test_images = test_util::FashionMnistTestPngs(kImages);
    ASSERT_TRUE(test_images.ok()) << test_images.status();
    images_ = test_images->pngs;
    labels_ = test_images->labels;
  }

  static void TearDownTestSuite() {
    delete stub_;
    delete v1_stub_;
    delete channel_;
    delete server_;
    server_ = nullptr;
    kserve_ = nullptr;
    metrics_ = nullptr;
    delete registry_;
  }

  void SetUp() override { ASSERT_NE(stub_, nullptr) << "suite set-up failed"; }

  static grpc::Status Infer(const inference::ModelInferRequest& request, inference::ModelInferResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return stub_->ModelInfer(&context, request, response);
  }

  // mita.v1 Classify of the same image with all classes returned: the reference.
  static v1::ClassifyResponse Classify(const std::string& image, const v1::Budget& budget) {
    v1::ClassifyRequest request;
    request.set_model(kModel);
    request.set_image(image);
    *request.mutable_budget() = budget;
    request.set_top_n(10);
    v1::ClassifyResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    const grpc::Status status = v1_stub_->Classify(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  // Expects ModelInfer of `request` to fail with `code` and a message containing `text`.
  static void ExpectError(const inference::ModelInferRequest& request, grpc::StatusCode code,
                          const std::string& text) {
    inference::ModelInferResponse response;
    const grpc::Status status = Infer(request, &response);
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(text));
  }

  static ModelRegistry* registry_;
  static test_util::InProcessServer* server_;
  static ServerMetrics* metrics_;
  static OpenInferenceService* kserve_;
  static std::shared_ptr<grpc::Channel>* channel_;
  static inference::GRPCInferenceService::Stub* stub_;
  static v1::MitaService::Stub* v1_stub_;
  static std::vector<std::string> images_;
  static std::vector<int> labels_;
};

ModelRegistry* OpenInferenceTest::registry_ = nullptr;
test_util::InProcessServer* OpenInferenceTest::server_ = nullptr;
ServerMetrics* OpenInferenceTest::metrics_ = nullptr;
OpenInferenceService* OpenInferenceTest::kserve_ = nullptr;
std::shared_ptr<grpc::Channel>* OpenInferenceTest::channel_ = nullptr;
inference::GRPCInferenceService::Stub* OpenInferenceTest::stub_ = nullptr;
v1::MitaService::Stub* OpenInferenceTest::v1_stub_ = nullptr;
std::vector<std::string> OpenInferenceTest::images_;
std::vector<int> OpenInferenceTest::labels_;

// Real images at a chosen budget: the scores equal mita.v1's for the same budget, the labels are the
// best-first top-N, the applied budget is echoed, and the accuracy is the model's.
TEST_F(OpenInferenceTest, ClassifiesRealImagesWithAChosenBudget) {
  v1::Budget budget;
  budget.mutable_experts()->set_expert_count(16);
  budget.mutable_experts()->set_expert_width(32);
  int correct = 0;
  for (int i = 0; i < kImages; ++i) {
    inference::ModelInferRequest request = ImageRequest(images_[i]);
    request.set_id(absl::StrCat("request-", i));
    SetInt(request, "mita_expert_count", 16);
    SetInt(request, "mita_expert_width", 32);
    SetInt(request, "mita_top_n", 3);
    inference::ModelInferResponse response;
    const grpc::Status status = Infer(request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.model_name(), kModel);
    EXPECT_EQ(response.model_version(), "1");
    EXPECT_EQ(response.id(), absl::StrCat("request-", i));

    const auto* scores = FindOutput(response, "scores");
    const auto* labels = FindOutput(response, "labels");
    ASSERT_NE(scores, nullptr);
    ASSERT_NE(labels, nullptr);
    EXPECT_EQ(scores->datatype(), "FP32");
    EXPECT_THAT(scores->shape(), ElementsAre(10));
    ASSERT_EQ(scores->contents().fp32_contents_size(), 10);
    EXPECT_EQ(labels->datatype(), "BYTES");
    EXPECT_THAT(labels->shape(), ElementsAre(3));
    ASSERT_EQ(labels->contents().bytes_contents_size(), 3);

    const v1::ClassifyResponse reference = Classify(images_[i], budget);
    ASSERT_EQ(reference.classes_size(), 10);
    double sum = 0;
    for (const v1::ClassScore& score : reference.classes()) {
      EXPECT_NEAR(scores->contents().fp32_contents(score.index()), score.score(), 1e-5) << "image " << i;
      sum += scores->contents().fp32_contents(score.index());
    }
    EXPECT_NEAR(sum, 1.0, 1e-4);
    // The labels are the best three of the scores, best first.
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(labels->contents().bytes_contents(j), reference.classes(j).label()) << "image " << i;
    }
    int best = 0;
    for (int c = 1; c < 10; ++c) {
      if (scores->contents().fp32_contents(c) > scores->contents().fp32_contents(best)) best = c;
    }
    EXPECT_EQ(labels->contents().bytes_contents(0), datasets::FashionMnistLabels()[static_cast<size_t>(best)]);
    correct += best == labels_[i] ? 1 : 0;

    const auto& parameters = response.parameters();
    EXPECT_EQ(parameters.at("mita_attention").string_param(), "mita");
    EXPECT_EQ(parameters.at("mita_expert_count").int64_param(), 16);
    EXPECT_EQ(parameters.at("mita_expert_width").int64_param(), 32);
    EXPECT_EQ(parameters.count("mita_preset"), 0u) << "an explicit budget has no preset";
    EXPECT_EQ(parameters.at("mita_top_n").int64_param(), 3);
    EXPECT_EQ(parameters.at("mita_token_count").int64_param(), 50);
    EXPECT_GE(parameters.at("mita_batch_size").int64_param(), 1);
    EXPECT_GT(parameters.at("mita_compute_us").int64_param(), 0);
    EXPECT_GE(parameters.at("mita_total_us").int64_param(), parameters.at("mita_compute_us").int64_param());
  }
  // The model's accuracy at (16, 32) on the 10,000 test images is 0.883 (README); 48 images give a noisy
  // estimate, so the bound only catches a broken translation (chance is 0.1).
  EXPECT_GE(correct, 36) << correct << " of " << kImages;
}

// A real document over the Open Inference Protocol, to the embedded document model (models/repository/
// linux-doc-mita): as BYTES text and as INT64 token ids (the model's own tokenizer), each with scores equal to
// mita.v1 Classify of the same text at the same budget, and the applied (length-clamped) budget echoed.
TEST_F(OpenInferenceTest, ClassifiesARealDocumentAsTextAndAsTokenIds) {
  constexpr char kDocumentModel[] = "linux-doc-mita";
  absl::StatusOr<std::unique_ptr<models::DocumentClassifier>> model =
      models::LoadDocumentClassifier(test_util::RepositoryPath() + "/" + kDocumentModel);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string text = test_util::ReadFile(test_util::SourceDirectory() + "/docs/long_documents.md");
  ASSERT_FALSE(text.empty());
  absl::StatusOr<std::vector<int64_t>> ids = (*model)->tokenizer()->Encode(text);
  ASSERT_TRUE(ids.ok()) << ids.status();
  const int64_t num_classes = static_cast<int64_t>((*model)->description().labels.size());

  v1::ClassifyRequest reference_request;
  reference_request.set_model(kDocumentModel);
  reference_request.mutable_document()->set_text(text);
  reference_request.mutable_budget()->mutable_experts()->set_expert_count(8);
  reference_request.mutable_budget()->mutable_experts()->set_expert_width(32);
  reference_request.set_top_n(num_classes);
  v1::ClassifyResponse reference;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    const grpc::Status status = v1_stub_->Classify(&context, reference_request, &reference);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_EQ(reference.token_count(), static_cast<int64_t>(ids->size()));

  for (const bool as_token_ids : {false, true}) {
    inference::ModelInferRequest request;
    request.set_model_name(kDocumentModel);
    auto* input = request.add_inputs();
    if (as_token_ids) {
      input->set_name("token_ids");
      input->set_datatype("INT64");
      input->add_shape(static_cast<int64_t>(ids->size()));
      for (int64_t id : *ids) input->mutable_contents()->add_int64_contents(id);
    } else {
      input->set_name("text");
      input->set_datatype("BYTES");
      input->add_shape(1);
      input->mutable_contents()->add_bytes_contents(text);
    }
    SetInt(request, "mita_expert_count", 8);
    SetInt(request, "mita_expert_width", 32);
    inference::ModelInferResponse response;
    const grpc::Status status = Infer(request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const auto* scores = FindOutput(response, "scores");
    ASSERT_NE(scores, nullptr);
    ASSERT_EQ(scores->contents().fp32_contents_size(), num_classes);
    for (const v1::ClassScore& score : reference.classes()) {
      EXPECT_NEAR(scores->contents().fp32_contents(score.index()), score.score(), 1e-5)
          << (as_token_ids ? "token ids" : "text");
    }
    EXPECT_EQ(response.parameters().at("mita_token_count").int64_param(), static_cast<int64_t>(ids->size()));
    EXPECT_EQ(response.parameters().at("mita_expert_count").int64_param(), 8);
    EXPECT_EQ(response.parameters().at("mita_expert_width").int64_param(), 32);
  }
}

TEST_F(OpenInferenceTest, DefaultBudgetPresetAndFullAttentionAreEchoed) {
  struct Case {
    std::function<void(inference::ModelInferRequest&)> set;
    std::function<void(v1::Budget&)> reference;
    std::string attention;
    int64_t expert_count;
    int64_t expert_width;
    std::string preset;
  };
  const std::vector<Case> cases = {
      {[](inference::ModelInferRequest&) {}, [](v1::Budget&) {}, "mita", 9, 16, "default"},
      {[](inference::ModelInferRequest& r) { SetString(r, "mita_preset", "fast"); },
       [](v1::Budget& b) { b.set_preset("fast"); }, "mita", 4, 8, "fast"},
      {[](inference::ModelInferRequest& r) { SetString(r, "mita_attention", "full"); },
       [](v1::Budget& b) { b.mutable_full_attention(); }, "full", -1, -1, ""},
      {[](inference::ModelInferRequest& r) { SetInt(r, "mita_expert_width", 8); },
       [](v1::Budget& b) { b.mutable_experts()->set_expert_width(8); }, "mita", 9, 8, ""},
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& test = cases[c];
    inference::ModelInferRequest request = ImageRequest(images_[c]);
    test.set(request);
    inference::ModelInferResponse response;
    const grpc::Status status = Infer(request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const auto& parameters = response.parameters();
    EXPECT_EQ(parameters.at("mita_attention").string_param(), test.attention) << c;
    if (test.expert_count > 0) {
      EXPECT_EQ(parameters.at("mita_expert_count").int64_param(), test.expert_count) << c;
      EXPECT_EQ(parameters.at("mita_expert_width").int64_param(), test.expert_width) << c;
    } else {
      EXPECT_EQ(parameters.count("mita_expert_count"), 0u) << c;
    }
    if (test.preset.empty()) {
      EXPECT_EQ(parameters.count("mita_preset"), 0u) << c;
    } else {
      EXPECT_EQ(parameters.at("mita_preset").string_param(), test.preset) << c;
    }
    EXPECT_EQ(parameters.at("mita_top_n").int64_param(), 5) << "default top-N";
    v1::Budget budget;
    test.reference(budget);
    const v1::ClassifyResponse reference = Classify(images_[c], budget);
    const auto* scores = FindOutput(response, "scores");
    ASSERT_NE(scores, nullptr);
    for (const v1::ClassScore& score : reference.classes()) {
      EXPECT_NEAR(scores->contents().fp32_contents(score.index()), score.score(), 1e-5) << c;
    }
  }
}

// A latency target through the server: for a target of a minute on an idle server the applied budget is the
// first of the model's accuracy order (reason "most_accurate", with the time predicted for it), as over mita.v1
// for the same target; a fixed budget's reason is "requested". An unknown floor is the engine's error in this protocol's names.
TEST_F(OpenInferenceTest, LatencyTargetsAndTheBudgetReasonAreEchoed) {
  absl::StatusOr<const models::ModelPackage*> package = registry_->Lookup(kModel);
  ASSERT_TRUE(package.ok()) << package.status();
  const std::vector<models::DeclaredBudget>& order = (*package)->classifier->description().knobs.accuracy_order;
  ASSERT_FALSE(order.empty());

  inference::ModelInferRequest fixed = ImageRequest(images_[2]);
  SetString(fixed, "mita_preset", "fast");
  inference::ModelInferResponse response;
  grpc::Status status = Infer(fixed, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.parameters().at("mita_budget_reason").string_param(), "requested");
  EXPECT_GE(response.parameters().at("mita_predicted_us").int64_param(), 0);

  inference::ModelInferRequest target = ImageRequest(images_[3]);
  SetInt(target, "mita_latency_target_ms", 60000);
  status = Infer(target, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const auto& parameters = response.parameters();
  const models::AttentionBudget& first = order.front().budget;
  EXPECT_EQ(parameters.at("mita_attention").string_param(), first.full_attention ? "full" : "mita");
  if (!first.full_attention) {
    EXPECT_EQ(parameters.at("mita_expert_count").int64_param(), first.expert_count);
    EXPECT_EQ(parameters.at("mita_expert_width").int64_param(), first.expert_width);
  }
  EXPECT_EQ(parameters.at("mita_budget_reason").string_param(), "most_accurate");
  EXPECT_GT(parameters.at("mita_predicted_us").int64_param(), 0) << "a latency target is planned with a prediction";
  EXPECT_LE(parameters.at("mita_predicted_us").int64_param(), 60000 * 1000);
  v1::Budget budget;
  budget.mutable_latency_target()->set_target_ms(60000);
  const v1::ClassifyResponse reference = Classify(images_[3], budget);
  EXPECT_EQ(parameters.at("mita_attention").string_param(), reference.budget().full_attention() ? "full" : "mita");
  EXPECT_EQ(reference.budget().reason(), v1::BUDGET_REASON_MOST_ACCURATE);
  const auto* scores = FindOutput(response, "scores");
  ASSERT_NE(scores, nullptr);
  for (const v1::ClassScore& score : reference.classes()) {
    EXPECT_NEAR(scores->contents().fp32_contents(score.index()), score.score(), 1e-5);
  }

  std::vector<std::string> names;
  for (const models::DeclaredBudget& declared : order) names.push_back(declared.name);
  inference::ModelInferRequest bad_floor = ImageRequest(images_[3]);
  SetInt(bad_floor, "mita_latency_target_ms", 0);
  SetString(bad_floor, "mita_budget_floor", "turbo");
  ExpectError(bad_floor, grpc::StatusCode::INVALID_ARGUMENT,
              absl::StrCat("parameter mita_budget_floor: unknown budget 'turbo'; the model's budgets, most accurate "
                           "first: ",
                           absl::StrJoin(names, ", ")));
}

// raw_input_contents (what Triton's client sends): a 4-byte little-endian length, then the bytes. The answer
// comes in raw_output_contents (FP32 little-endian; BYTES length-prefixed, as Triton's clients read them) and
// equals the typed form; a requested output limits the outputs.
TEST_F(OpenInferenceTest, RawInputContentsAndRequestedOutputs) {
  const std::string& image = images_[5];
  inference::ModelInferRequest typed = ImageRequest(image);
  inference::ModelInferRequest raw = typed;
  raw.mutable_inputs(0)->clear_contents();
  std::string element;
  const uint32_t length = static_cast<uint32_t>(image.size());
  for (int b = 0; b < 4; ++b) element.push_back(static_cast<char>((length >> (8 * b)) & 0xff));
  element += image;
  raw.add_raw_input_contents(element);
  raw.add_outputs()->set_name("scores");
  inference::ModelInferResponse typed_response;
  inference::ModelInferResponse raw_response;
  ASSERT_TRUE(Infer(typed, &typed_response).ok());
  const grpc::Status status = Infer(raw, &raw_response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(raw_response.outputs_size(), 1);
  EXPECT_EQ(raw_response.outputs(0).name(), "scores");
  const auto* typed_scores = FindOutput(typed_response, "scores");
  ASSERT_NE(typed_scores, nullptr);
  EXPECT_EQ(raw_response.outputs(0).contents().fp32_contents_size(), 0);
  ASSERT_EQ(raw_response.raw_output_contents_size(), 1);
  const std::string& scores = raw_response.raw_output_contents(0);
  ASSERT_EQ(scores.size(), 4u * 10);
  for (int c = 0; c < 10; ++c) {
    uint32_t bits = 0;
    for (int b = 3; b >= 0; --b) bits = bits << 8 | static_cast<unsigned char>(scores[4 * c + b]);
    float value = 0;
    std::memcpy(&value, &bits, sizeof(value));
    EXPECT_FLOAT_EQ(value, typed_scores->contents().fp32_contents(c)) << c;
  }

  // Both outputs, raw: the labels as 4-byte little-endian lengths and bytes, the typed labels in order.
  raw.clear_outputs();
  ASSERT_TRUE(Infer(raw, &raw_response).ok());
  ASSERT_EQ(raw_response.raw_output_contents_size(), 2);
  const auto* typed_labels = FindOutput(typed_response, "labels");
  ASSERT_NE(typed_labels, nullptr);
  ASSERT_EQ(raw_response.outputs(1).name(), "labels");
  const std::string& labels = raw_response.raw_output_contents(1);
  size_t offset = 0;
  for (const std::string& expected : typed_labels->contents().bytes_contents()) {
    ASSERT_LE(offset + 4, labels.size());
    uint32_t size = 0;
    for (int b = 3; b >= 0; --b) size = size << 8 | static_cast<unsigned char>(labels[offset + b]);
    offset += 4;
    ASSERT_LE(offset + size, labels.size());
    EXPECT_EQ(labels.substr(offset, size), expected);
    offset += size;
  }
  EXPECT_EQ(offset, labels.size());
  EXPECT_EQ(typed_labels->contents().bytes_contents_size(), raw_response.outputs(1).shape(0));
}

TEST_F(OpenInferenceTest, BadRequestsGetTheMitaV1CodesWithProtocolNames) {
  const std::string& image = images_[0];
  {
    inference::ModelInferRequest request = ImageRequest(image);
    SetInt(request, "mita_expert_count", 10);
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "parameter mita_expert_count: 10 is not allowed: use one of 1, 4, 9, 16, 25, 36, 49");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    SetInt(request, "mita_expert_width", 51);
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "parameter mita_expert_width: 51 is out of range: allowed [1, 50]");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    SetInt(request, "mita_expert_count", 0);
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "parameter mita_expert_count: 0 is not allowed: use one of 1, 4, 9");
  }
  {
    // Both knobs wrong: both named, as over mita.v1.
    inference::ModelInferRequest request = ImageRequest(image);
    SetInt(request, "mita_expert_width", -3);
    SetInt(request, "mita_expert_count", -3);
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "(leave it out for the model's default); "
                "parameter mita_expert_width: -3 is out of range: allowed [1, 50] (leave it out for the model's "
                "default)");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "parameter mita_expert_count: -3 is not allowed: use one of 1, 4, 9");
  }
  {
    // Inputs are checked against what the model declares (ModelMetadata): an input named 'image' to the
    // document model, 'text' to the image model, or any other name is not one of its inputs; never routed by
    // its datatype alone.
    inference::ModelInferRequest request = ImageRequest(image);
    request.set_model_name("linux-doc-mita");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "input 'image' is not an input of model 'linux-doc-mita'; its inputs: text (BYTES [1]), token_ids "
                "(INT64 [-1])");
    request = ImageRequest("some text");
    request.mutable_inputs(0)->set_name("text");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "input 'text' is not an input of model 'fashion-mnist-vit'; its inputs: image (BYTES [1])");
    request = ImageRequest(image);
    request.mutable_inputs(0)->set_name("INPUT0");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT, "input 'INPUT0' is not an input of model");
  }
  {
    // The declared shape, rank included: [1] for an image, not [1, 1] or [].
    for (const std::vector<int64_t>& shape : {std::vector<int64_t>{1, 1}, std::vector<int64_t>{}}) {
      inference::ModelInferRequest request = ImageRequest(image);
      request.mutable_inputs(0)->clear_shape();
      for (int64_t dimension : shape) request.mutable_inputs(0)->add_shape(dimension);
      ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT, "does not match the declared [1]");
    }
  }
  {
    // An empty document has mita.v1's wording, in this protocol's names.
    inference::ModelInferRequest request;
    request.set_model_name("linux-doc-mita");
    auto* input = request.add_inputs();
    input->set_name("token_ids");
    input->set_datatype("INT64");
    input->add_shape(0);
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "input 'token_ids': the document is empty; a document needs at least 1 token");
    input->set_name("text");
    input->set_datatype("BYTES");
    input->set_shape(0, 1);
    input->mutable_contents()->add_bytes_contents("");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "input 'text': the document is empty; a document needs at least 1 token");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    SetString(request, "mita_expert_count", "16");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "parameter mita_expert_count: must be an int64_param, got string_param");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    SetString(request, "mita_preset", "turbo");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "parameter mita_preset: unknown preset 'turbo'; available: accurate, balanced, fast");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    SetString(request, "mita_attention", "sparse");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT, "parameter mita_attention: 'sparse' is not one of");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    SetString(request, "mita_preset", "fast");
    SetInt(request, "mita_expert_count", 4);
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT, "parameters: set one budget");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    SetInt(request, "mita_latency_target_ms", -5);
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "parameter mita_latency_target_ms: -5 is out of range: allowed >= 0 (0 means the call's deadline)");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    SetInt(request, "mita_expertcount", 4);
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT, "parameter mita_expertcount is not known; available:");
  }
  {
    // Parameters without the mita_ prefix belong to other clients and are ignored.
    inference::ModelInferRequest request = ImageRequest(image);
    SetString(request, "content_type", "str");
    inference::ModelInferResponse response;
    EXPECT_TRUE(Infer(request, &response).ok());
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    SetInt(request, "mita_top_n", 11);
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT, "parameter mita_top_n: 11 is out of range: allowed [0, 10] (0 means 5)");
  }
  {
    inference::ModelInferRequest request = ImageRequest("not an image");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT, "input 'image': ");
  }
  {
    inference::ModelInferRequest request = ImageRequest("");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT, "input 'image': empty");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    request.mutable_inputs(0)->mutable_contents()->add_bytes_contents(image);
    request.mutable_inputs(0)->set_shape(0, 2);
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "input 'image': shape [2] does not match the declared [1] (one input per request");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    request.mutable_inputs(0)->set_datatype("UINT8");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "input 'image': datatype 'UINT8' is not the declared BYTES");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    request.add_inputs()->CopyFrom(request.inputs(0));
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT, "inputs: 2 tensors");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    request.add_outputs()->set_name("logits");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "outputs: unknown output 'logits'; available: scores, labels");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    request.mutable_inputs(0)->clear_contents();
    request.add_raw_input_contents(std::string("\xff\x00\x00\x00" "abc", 7));
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT, "raw BYTES element of 255 bytes is longer than the 3");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    request.set_model_name("missing");
    ExpectError(request, grpc::StatusCode::NOT_FOUND, "model 'missing' not found; available: fashion-mnist-vit");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    request.set_model_version("2");
    ExpectError(request, grpc::StatusCode::NOT_FOUND, "model 'fashion-mnist-vit' has no version 2; served: 1");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    request.set_model_version("v1");
    ExpectError(request, grpc::StatusCode::INVALID_ARGUMENT,
                "model_version: 'v1' is not a version number (1, 2, ...; empty for the latest)");
  }
  {
    inference::ModelInferRequest request = ImageRequest(image);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() - std::chrono::seconds(1));
    inference::ModelInferResponse response;
    EXPECT_EQ(stub_->ModelInfer(&context, request, &response).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
}

// Every call is counted once under its own method name: ModelInfer rejected by the translation, by the engine,
// or answered, and the metadata and readiness calls.
TEST_F(OpenInferenceTest, CallsAreCountedUnderTheirOwnMethodNames) {
  const double invalid_before = CallCount(*metrics_, "ModelInfer", "INVALID_ARGUMENT");
  const double ok_before = CallCount(*metrics_, "ModelInfer", "OK");
  const double classify_before = CallCount(*metrics_, "Classify", "OK");
  inference::ModelInferRequest bad_datatype = ImageRequest(images_[1]);
  bad_datatype.mutable_inputs(0)->set_datatype("FP32");
  inference::ModelInferRequest bad_budget = ImageRequest(images_[1]);
  SetInt(bad_budget, "mita_expert_count", 3);
  inference::ModelInferResponse response;
  EXPECT_EQ(Infer(bad_datatype, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Infer(bad_budget, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Infer(ImageRequest(images_[1]), &response).ok());
  EXPECT_EQ(CallCount(*metrics_, "ModelInfer", "INVALID_ARGUMENT") - invalid_before, 2);
  EXPECT_EQ(CallCount(*metrics_, "ModelInfer", "OK") - ok_before, 1);
  EXPECT_EQ(CallCount(*metrics_, "Classify", "OK") - classify_before, 0);
  const double live_before = CallCount(*metrics_, "ServerLive", "OK", "");
  const double ready_before = CallCount(*metrics_, "ModelReady", "OK");
  const double unknown_before = CallCount(*metrics_, "ModelMetadata", "NOT_FOUND", "unknown");
  {
    grpc::ClientContext context;
    inference::ServerLiveResponse live;
    EXPECT_TRUE(stub_->ServerLive(&context, {}, &live).ok());
  }
  {
    grpc::ClientContext context;
    inference::ModelReadyRequest request;
    request.set_name(kModel);
    inference::ModelReadyResponse ready;
    EXPECT_TRUE(stub_->ModelReady(&context, request, &ready).ok());
  }
  {
    grpc::ClientContext context;
    inference::ModelMetadataRequest request;
    request.set_name("nosuch");
    inference::ModelMetadataResponse metadata;
    EXPECT_EQ(stub_->ModelMetadata(&context, request, &metadata).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  EXPECT_EQ(CallCount(*metrics_, "ServerLive", "OK", "") - live_before, 1);
  EXPECT_EQ(CallCount(*metrics_, "ModelReady", "OK") - ready_before, 1);
  EXPECT_EQ(CallCount(*metrics_, "ModelMetadata", "NOT_FOUND", "unknown") - unknown_before, 1);
}

TEST_F(OpenInferenceTest, HealthAndMetadata) {
  {
    grpc::ClientContext context;
    inference::ServerLiveResponse response;
    ASSERT_TRUE(stub_->ServerLive(&context, {}, &response).ok());
    EXPECT_TRUE(response.live());
  }
  auto server_ready = [] {
    grpc::ClientContext context;
    inference::ServerReadyResponse response;
    EXPECT_TRUE(stub_->ServerReady(&context, {}, &response).ok());
    return response.ready();
  };
  auto model_ready = [](const std::string& name, const std::string& version) {
    grpc::ClientContext context;
    inference::ModelReadyRequest request;
    request.set_name(name);
    request.set_version(version);
    inference::ModelReadyResponse response;
    const grpc::Status status = stub_->ModelReady(&context, request, &response);
    return std::make_pair(status.error_code(), response.ready());
  };
  EXPECT_TRUE(server_ready());
  EXPECT_EQ(model_ready(kModel, ""), std::make_pair(grpc::StatusCode::OK, true));
  EXPECT_EQ(model_ready(kModel, "1"), std::make_pair(grpc::StatusCode::OK, true));
  EXPECT_EQ(model_ready(kModel, "7").first, grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(model_ready("missing", "").first, grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(model_ready("", "").first, grpc::StatusCode::INVALID_ARGUMENT);
  // Draining: not ready, still live.
  kserve_->SetReady(false);
  EXPECT_FALSE(server_ready());
  EXPECT_EQ(model_ready(kModel, ""), std::make_pair(grpc::StatusCode::OK, false));
  kserve_->SetReady(true);
  EXPECT_TRUE(server_ready());

  {
    grpc::ClientContext context;
    inference::ServerMetadataResponse response;
    ASSERT_TRUE(stub_->ServerMetadata(&context, {}, &response).ok());
    EXPECT_EQ(response.name(), "mita-serve");
    EXPECT_EQ(response.version(), "test");
    EXPECT_THAT(response.extensions(), ElementsAre("model_configuration"));
  }
  {
    // Triton's ModelConfig: no batch dimension, the declared input and outputs in Triton's types, the knobs.
    grpc::ClientContext context;
    inference::ModelConfigRequest request;
    request.set_name(kModel);
    inference::ModelConfigResponse response;
    ASSERT_TRUE(stub_->ModelConfig(&context, request, &response).ok());
    const inference::ModelConfig& config = response.config();
    EXPECT_EQ(config.name(), kModel);
    EXPECT_EQ(config.max_batch_size(), 0);
    ASSERT_EQ(config.input_size(), 1);
    EXPECT_EQ(config.input(0).name(), "image");
    EXPECT_EQ(config.input(0).data_type(), inference::TYPE_STRING);
    EXPECT_THAT(config.input(0).dims(), ElementsAre(1));
    EXPECT_FALSE(config.input(0).optional());
    ASSERT_EQ(config.output_size(), 2);
    EXPECT_EQ(config.output(0).data_type(), inference::TYPE_FP32);
    EXPECT_THAT(config.output(0).dims(), ElementsAre(10));
    ASSERT_TRUE(config.parameters().contains(kParametersMetadataKey));
    const nlohmann::json knobs = nlohmann::json::parse(config.parameters().at(kParametersMetadataKey).string_value());
    EXPECT_EQ(knobs["mita_expert_count"]["default"], 9);
    request.set_name("missing");
    grpc::ClientContext missing_context;
    EXPECT_EQ(stub_->ModelConfig(&missing_context, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  }

  grpc::ClientContext context;
  inference::ModelMetadataRequest request;
  request.set_name(kModel);
  inference::ModelMetadataResponse response;
  ASSERT_TRUE(stub_->ModelMetadata(&context, request, &response).ok());
  EXPECT_EQ(response.name(), kModel);
  EXPECT_THAT(response.versions(), ElementsAre("1"));
  ASSERT_EQ(response.inputs_size(), 1);
  EXPECT_EQ(response.inputs(0).name(), "image");
  EXPECT_EQ(response.inputs(0).datatype(), "BYTES");
  ASSERT_EQ(response.outputs_size(), 2);
  EXPECT_EQ(response.outputs(0).name(), "scores");
  EXPECT_EQ(response.outputs(0).datatype(), "FP32");
  EXPECT_THAT(response.outputs(0).shape(), ElementsAre(10));
  EXPECT_EQ(response.outputs(1).name(), "labels");
  EXPECT_EQ(response.outputs(1).datatype(), "BYTES");

  // The knobs, in the initial metadata, agree with mita.v1 GetModel.
  auto it = context.GetServerInitialMetadata().find(kParametersMetadataKey);
  ASSERT_NE(it, context.GetServerInitialMetadata().end());
  const nlohmann::json knobs = nlohmann::json::parse(std::string(it->second.data(), it->second.size()));
  grpc::ClientContext v1_context;
  v1::GetModelRequest get;
  get.set_name(kModel);
  v1::ModelMetadata v1_metadata;
  ASSERT_TRUE(v1_stub_->GetModel(&v1_context, get, &v1_metadata).ok());
  EXPECT_EQ(knobs["mita_expert_count"]["allowed"].get<std::vector<int64_t>>(),
            std::vector<int64_t>(v1_metadata.knobs().allowed_expert_counts().begin(),
                                 v1_metadata.knobs().allowed_expert_counts().end()));
  EXPECT_EQ(knobs["mita_expert_count"]["allowed"].get<std::vector<int64_t>>(),
            (std::vector<int64_t>{1, 4, 9, 16, 25, 36, 49}));
  EXPECT_EQ(knobs["mita_expert_count"]["default"].get<int64_t>(), 9);
  EXPECT_EQ(knobs["mita_expert_width"]["min"].get<int64_t>(), 1);
  EXPECT_EQ(knobs["mita_expert_width"]["max"].get<int64_t>(), 50);
  EXPECT_EQ(knobs["mita_expert_width"]["default"].get<int64_t>(), 16);
  EXPECT_EQ(knobs["mita_preset"]["allowed"].get<std::vector<std::string>>(),
            (std::vector<std::string>{"accurate", "balanced", "fast"}));
  EXPECT_EQ(knobs["mita_preset"]["budgets"]["fast"]["mita_expert_count"].get<int64_t>(), 4);
  EXPECT_EQ(knobs["mita_preset"]["budgets"]["fast"]["mita_expert_width"].get<int64_t>(), 8);
  EXPECT_EQ(knobs["mita_attention"]["allowed"].get<std::vector<std::string>>(),
            (std::vector<std::string>{"mita", "full"}));
  EXPECT_EQ(knobs["mita_top_n"]["max"].get<int64_t>(), 10);
  // The accuracy order, as the model declares it (names, budgets, accuracy), and the latency target's range.
  absl::StatusOr<const models::ModelPackage*> package = registry_->Lookup(kModel);
  ASSERT_TRUE(package.ok()) << package.status();
  const std::vector<models::DeclaredBudget>& order = (*package)->classifier->description().knobs.accuracy_order;
  const nlohmann::json& declared = knobs["mita_budget_floor"]["accuracy_order"];
  ASSERT_EQ(declared.size(), order.size());
  ASSERT_FALSE(order.empty());
  for (size_t i = 0; i < order.size(); ++i) {
    EXPECT_EQ(declared[i]["name"].get<std::string>(), order[i].name) << i;
    EXPECT_EQ(knobs["mita_budget_floor"]["allowed"][i].get<std::string>(), order[i].name) << i;
    EXPECT_DOUBLE_EQ(declared[i]["accuracy"].get<double>(), order[i].accuracy) << i;
    if (order[i].budget.full_attention) {
      EXPECT_EQ(declared[i]["mita_attention"].get<std::string>(), "full") << i;
      EXPECT_FALSE(declared[i].contains("mita_expert_count")) << i;
    } else {
      EXPECT_EQ(declared[i]["mita_expert_count"].get<int64_t>(), order[i].budget.expert_count) << i;
      EXPECT_EQ(declared[i]["mita_expert_width"].get<int64_t>(), order[i].budget.expert_width) << i;
    }
  }
  EXPECT_EQ(knobs["mita_latency_target_ms"]["min"].get<int64_t>(), 0);
  // Where the model runs, as GetModel says.
  EXPECT_EQ(knobs["device"].get<std::string>(), v1_metadata.device());
  EXPECT_EQ(knobs["device"].get<std::string>(), "cpu");
  EXPECT_EQ(knobs["weights_dtype"].get<std::string>(), "float32");

  grpc::ClientContext missing_context;
  request.set_name("missing");
  EXPECT_EQ(stub_->ModelMetadata(&missing_context, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
}

// grpcurl-style discovery: the reflection service lists the Open Inference Protocol service.
// ServerReflectionRequest {list_services = 7: ""} encoded by hand over a raw bidirectional call
// (test_util::ReflectionListServices).
TEST_F(OpenInferenceTest, ReflectionListsTheInferenceService) {
  absl::StatusOr<std::string> bytes = test_util::ReflectionListServices(*channel_);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_THAT(*bytes, HasSubstr("inference.GRPCInferenceService"));
  EXPECT_THAT(*bytes, HasSubstr("mita.v1.MitaService"));
}

// The translation of document inputs, on its own against a document model's description: BYTES text, INT64
// token ids typed and raw, the budget and truncation parameters.
TEST(OpenInferenceTranslationTest, DocumentsBecomeTextOrTokenIds) {
  models::ClassifierDescription model;
  model.name = "doc";
  model.input_kind = models::InputKind::kDocument;
  model.document = models::DocumentInputDescription{4096, 256, "bytes"};
  for (int i = 0; i < 4; ++i) model.labels.push_back(absl::StrCat("class", i));

  inference::ModelInferRequest text;
  text.set_model_name("doc");
  auto* input = text.add_inputs();
  input->set_name("text");
  input->set_datatype("BYTES");
  input->add_shape(1);
  input->mutable_contents()->add_bytes_contents("A long document.");
  (*text.mutable_parameters())["mita_truncate"].set_bool_param(true);
  (*text.mutable_parameters())["mita_expert_count"].set_int64_param(8);
  {
    TranslatedInferRequest translated;
    ASSERT_TRUE(ToInferenceRequest(text, model, &translated).ok());
    const InferenceRequest& request = translated.request;
    EXPECT_EQ(request.model, "doc");
    EXPECT_EQ(request.input.kind, models::ClassifierInput::Kind::kText);
    EXPECT_EQ(request.input.bytes, "A long document.");
    EXPECT_TRUE(request.input.truncate);
    EXPECT_EQ(request.budget.choice, models::BudgetRequest::Choice::kExperts);
    EXPECT_EQ(request.budget.expert_count, 8);
    EXPECT_EQ(request.budget.expert_width, 0) << "0: the model's default";
    EXPECT_EQ(request.top_n, 4);
  }

  // INT64 token ids, typed and raw (8 bytes little-endian each), shape [T].
  const std::vector<int64_t> ids = {101, 2023, 7, 102, int64_t{1} << 40};
  inference::ModelInferRequest tokens;
  tokens.set_model_name("doc");
  input = tokens.add_inputs();
  input->set_name("token_ids");
  input->set_datatype("INT64");
  input->add_shape(static_cast<int64_t>(ids.size()));
  for (int64_t id : ids) input->mutable_contents()->add_int64_contents(id);
  {
    TranslatedInferRequest translated;
    ASSERT_TRUE(ToInferenceRequest(tokens, model, &translated).ok());
    EXPECT_EQ(translated.request.input.kind, models::ClassifierInput::Kind::kTokenIds);
    EXPECT_THAT(translated.request.input.token_ids, ::testing::ElementsAreArray(ids));
  }

  inference::ModelInferRequest raw = tokens;
  raw.mutable_inputs(0)->clear_contents();
  std::string bytes;
  for (int64_t id : ids) {
    for (int b = 0; b < 8; ++b) bytes.push_back(static_cast<char>((static_cast<uint64_t>(id) >> (8 * b)) & 0xff));
  }
  raw.add_raw_input_contents(bytes);
  {
    TranslatedInferRequest translated;
    ASSERT_TRUE(ToInferenceRequest(raw, model, &translated).ok());
    EXPECT_THAT(translated.request.input.token_ids, ::testing::ElementsAreArray(ids));
  }

  // Errors: a shape that disagrees with the elements; INT64 for an image model.
  raw.mutable_inputs(0)->set_shape(0, 4);
  {
    TranslatedInferRequest translated;
    EXPECT_THAT(std::string(ToInferenceRequest(raw, model, &translated).message()),
                HasSubstr("input 'token_ids': shape [4] with 5 elements"));
  }
  models::ClassifierDescription image_model = model;
  image_model.input_kind = models::InputKind::kImage;
  image_model.document.reset();
  {
    TranslatedInferRequest translated;
    EXPECT_EQ(ToInferenceRequest(tokens, image_model, &translated).code(), absl::StatusCode::kInvalidArgument);
  }

  const inference::ModelMetadataResponse metadata = ToModelMetadataResponse(model, {1, 3});
  EXPECT_THAT(metadata.versions(), ElementsAre("1", "3"));
  ASSERT_EQ(metadata.inputs_size(), 2);
  EXPECT_EQ(metadata.inputs(0).name(), "text");
  EXPECT_EQ(metadata.inputs(1).name(), "token_ids");
  EXPECT_EQ(metadata.inputs(1).datatype(), "INT64");
  // ModelConfig marks both optional: a request sends one of them.
  const inference::ModelConfigResponse config = ToModelConfigResponse(model);
  ASSERT_EQ(config.config().input_size(), 2);
  EXPECT_TRUE(config.config().input(0).optional());
  EXPECT_EQ(config.config().input(0).data_type(), inference::TYPE_STRING);
  EXPECT_TRUE(config.config().input(1).optional());
  EXPECT_EQ(config.config().input(1).data_type(), inference::TYPE_INT64);
  EXPECT_THAT(config.config().input(1).dims(), ElementsAre(-1));
}

// The latency-target parameters: a target (0: the call's deadline) with an optional floor becomes a
// kLatencyTarget budget request; a floor alone, a negative target, or a target beside a parameter that names a
// budget is INVALID_ARGUMENT, worded as at the server's edge (WordForOpenInference).
TEST(OpenInferenceTranslationTest, LatencyTargetParameters) {
  models::ClassifierDescription model;
  model.name = "images";
  model.input_kind = models::InputKind::kImage;
  for (int i = 0; i < 3; ++i) model.labels.push_back(absl::StrCat("class", i));
  auto request_with = [](std::function<void(inference::ModelInferRequest&)> set) {
    inference::ModelInferRequest request;
    request.set_model_name("images");
    auto* input = request.add_inputs();
    input->set_name("image");
    input->set_datatype("BYTES");
    input->add_shape(1);
    input->mutable_contents()->add_bytes_contents("png bytes");
    set(request);
    return request;
  };
  {
    TranslatedInferRequest translated;
    const absl::Status status = ToInferenceRequest(request_with([](inference::ModelInferRequest& r) {
                                                     SetInt(r, "mita_latency_target_ms", 250);
                                                     SetString(r, "mita_budget_floor", "fast");
                                                   }),
                                                   model, &translated);
    ASSERT_TRUE(status.ok()) << status;
    const models::BudgetRequest& budget = translated.request.budget;
    EXPECT_EQ(budget.choice, models::BudgetRequest::Choice::kLatencyTarget);
    EXPECT_EQ(budget.latency_target, absl::Milliseconds(250));
    EXPECT_EQ(budget.floor, "fast");
  }
  {
    // 0: the call's deadline; no floor: the accuracy order's last budget. A uint64_param is taken too.
    TranslatedInferRequest translated;
    const absl::Status status = ToInferenceRequest(
        request_with([](inference::ModelInferRequest& r) {
          (*r.mutable_parameters())["mita_latency_target_ms"].set_uint64_param(0);
          SetInt(r, "mita_top_n", 2);
        }),
        model, &translated);
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_EQ(translated.request.budget.choice, models::BudgetRequest::Choice::kLatencyTarget);
    EXPECT_EQ(translated.request.budget.latency_target, absl::ZeroDuration());
    EXPECT_EQ(translated.request.budget.floor, "");
  }
  const std::vector<std::pair<std::function<void(inference::ModelInferRequest&)>, std::string>> errors = {
      {[](inference::ModelInferRequest& r) { SetString(r, "mita_budget_floor", "fast"); },
       "parameter mita_budget_floor: needs mita_latency_target_ms (a floor bounds the budget the server chooses for "
       "a latency target)"},
      {[](inference::ModelInferRequest& r) { SetInt(r, "mita_latency_target_ms", -1); },
       "parameter mita_latency_target_ms: -1 is out of range: allowed >= 0 (0 means the call's deadline)"},
      {[](inference::ModelInferRequest& r) {
         SetInt(r, "mita_latency_target_ms", 100);
         SetString(r, "mita_preset", "fast");
       },
       "parameter mita_latency_target_ms: the server chooses the budget for a latency target: leave out "
       "mita_preset (or mita_budget_floor to bound its choice)"},
      {[](inference::ModelInferRequest& r) {
         SetInt(r, "mita_latency_target_ms", 100);
         SetInt(r, "mita_expert_width", 8);
         SetInt(r, "mita_expert_count", 4);
         SetString(r, "mita_attention", "mita");
       },
       "parameter mita_latency_target_ms: the server chooses the budget for a latency target: leave out "
       "mita_expert_count, mita_expert_width, mita_attention (or mita_budget_floor to bound its choice)"},
      {[](inference::ModelInferRequest& r) {
         SetInt(r, "mita_latency_target_ms", 100);
         SetString(r, "mita_attention", "full");
       },
       "parameter mita_latency_target_ms: the server chooses the budget for a latency target: leave out "
       "mita_attention (or mita_budget_floor to bound its choice)"},
      {[](inference::ModelInferRequest& r) { SetString(r, "mita_latency_target_ms", "100"); },
       "parameter mita_latency_target_ms: must be an int64_param, got string_param"},
      {[](inference::ModelInferRequest& r) {
         SetInt(r, "mita_latency_target_ms", 100);
         SetInt(r, "mita_budget_floor", 3);
       },
       "parameter mita_budget_floor: must be a string_param, got int64_param"},
  };
  for (size_t i = 0; i < errors.size(); ++i) {
    TranslatedInferRequest translated;
    const absl::Status status = WordForOpenInference(ToInferenceRequest(request_with(errors[i].first), model, &translated));
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << i;
    EXPECT_EQ(status.message(), errors[i].second) << i;
  }
}

// The response echoes why its budget ran and the time predicted for it, as the engine set them.
TEST(OpenInferenceTranslationTest, TheBudgetReasonAndPredictedTimeAreEchoed) {
  models::ClassifierDescription model;
  model.name = "images";
  model.input_kind = models::InputKind::kImage;
  for (int i = 0; i < 3; ++i) model.labels.push_back(absl::StrCat("class", i));
  inference::ModelInferRequest request;
  request.set_model_name("images");
  const std::vector<std::pair<BudgetReason, std::string>> reasons = {
      {BudgetReason::kRequested, "requested"},
      {BudgetReason::kMostAccurate, "most_accurate"},
      {BudgetReason::kLoweredAtAdmission, "lowered_at_admission"},
      {BudgetReason::kLoweredAtBatchStart, "lowered_at_batch_start"}};
  for (size_t i = 0; i < reasons.size(); ++i) {
    InferenceResult result;
    result.model = &model;
    result.classes = {{1, 0.7f}, {0, 0.2f}, {2, 0.1f}};
    result.budget = models::ResolvedBudget{models::AttentionBudget{false, 4, 8}, ""};
    result.budget_reason = reasons[i].first;
    result.predicted = absl::Microseconds(1234 + 1000 * static_cast<int64_t>(i));
    absl::StatusOr<inference::ModelInferResponse> response = ToModelInferResponse(request, result);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->parameters().at("mita_budget_reason").string_param(), reasons[i].second) << i;
    EXPECT_EQ(response->parameters().at("mita_predicted_us").int64_param(), 1234 + 1000 * static_cast<int64_t>(i));
    EXPECT_EQ(response->parameters().at("mita_expert_count").int64_param(), 4);
  }
}

// One structured error, worded by each front end in its own vocabulary; statuses without field problems pass
// through unchanged.
TEST(OpenInferenceTranslationTest, EachFrontEndWordsFieldProblemsInItsOwnNames) {
  using models::RequestField;
  const absl::Status knobs =
      models::InvalidRequest({{RequestField::kExpertCount, -1, "10 is not allowed: use one of 1, 4"},
                              {RequestField::kExpertWidth, -1, "51 is out of range: allowed [1, 50]"}});
  EXPECT_EQ(WordForOpenInference(knobs).message(),
            "parameter mita_expert_count: 10 is not allowed: use one of 1, 4; "
            "parameter mita_expert_width: 51 is out of range: allowed [1, 50]");
  EXPECT_EQ(WordForMitaV1(knobs).message(),
            "field budget.experts.expert_count: 10 is not allowed: use one of 1, 4; "
            "field budget.experts.expert_width: 51 is out of range: allowed [1, 50]");
  EXPECT_EQ(WordForOpenInference(knobs).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status id = models::InvalidRequest(RequestField::kDocumentTokenIds, "300 is out of range", 7);
  EXPECT_EQ(WordForOpenInference(id).message(), "input 'token_ids' element 7: 300 is out of range");
  EXPECT_EQ(WordForMitaV1(id).message(), "field document.token_ids.ids[7]: 300 is out of range");
  const absl::Status preset = models::InvalidRequest(RequestField::kPreset, "unknown preset 'x'; available: fast");
  EXPECT_EQ(WordForOpenInference(preset).message(), "parameter mita_preset: unknown preset 'x'; available: fast");
  EXPECT_EQ(WordForMitaV1(preset).message(), "field budget.preset: unknown preset 'x'; available: fast");
  const absl::Status image = models::InvalidRequest(RequestField::kImage, "cannot decode");
  EXPECT_EQ(WordForOpenInference(image).message(), "input 'image': cannot decode");
  EXPECT_EQ(WordForMitaV1(image).message(), "field image: cannot decode");
  const absl::Status top_n = models::InvalidRequest(RequestField::kTopN, "11 is out of range: allowed [0, 10]");
  EXPECT_EQ(WordForOpenInference(top_n).message(), "parameter mita_top_n: 11 is out of range: allowed [0, 10]");
  EXPECT_EQ(WordForMitaV1(top_n).message(), "field top_n: 11 is out of range: allowed [0, 10]");
  // Every field has a name in both vocabularies.
  for (int field = 0; field <= static_cast<int>(RequestField::kTruncate); ++field) {
    const models::FieldProblem problem{static_cast<RequestField>(field), -1, "x"};
    EXPECT_NE(OpenInferenceFieldName(problem), "request") << field;
    EXPECT_NE(MitaV1FieldName(problem), "request") << field;
  }
  const absl::Status plain = absl::NotFoundError("model 'x' not found");
  EXPECT_EQ(WordForOpenInference(plain), plain);
  EXPECT_EQ(WordForMitaV1(plain), plain);
}

}  // namespace
}  // namespace mita::server
