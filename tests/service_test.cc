// End-to-end test of the service over loopback: the real model package (models/repository), real
// Fashion-MNIST test images encoded as PNG, the client library, grpc.health.v1, and a /metrics scrape.
//
// The model repository is $MITA_MODEL_REPOSITORY when set (development with another package), else
// $MITA_SOURCE_DIR/models/repository.
#include <grpcpp/channel.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/percentile.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/percentile.h"
#include "client/mita_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/aten_errors.h"
#include "models/model_package.h"
#include "prometheus/metric_family.h"
#include "server/engine/inference_engine.h"
#include "server/engine/model_registry.h"
#include "server/frontend/grpc_status.h"
#include "server/frontend/mita_v1_service.h"
#include "server/metrics/metrics.h"
#include "tests/server_test_util.h"
#include "tests/test_util.h"
#include "tools/fashion_mnist.h"

namespace mita::server {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr char kModel[] = "fashion-mnist-vit";
constexpr int kImages = 64;                               // encoded test images kept
constexpr int64_t kMaxImageBytes = int64_t{1} << 20;      // encoded image limit of the test server
constexpr int kMaxReceiveBytes = (1 << 20) + (64 << 10);  // gRPC receive limit of the test server

// The value of the sample `series` (name and labels exactly as exposed, e.g.
// 'mita_batch_size_count{model="m"}') in a text exposition, or -1 when absent.
double SampleValue(const std::string& exposition, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (!absl::StartsWith(line, series) || line.size() <= series.size() || line[series.size()] != ' ') continue;
    double value = 0;
    if (absl::SimpleAtod(line.substr(series.size() + 1), &value)) return value;
  }
  return -1;
}

using test_util::ExpectStatus;
using test_util::HttpGet;
using test_util::MetricValue;
using test_util::RepositoryPath;
using test_util::SourceDirectory;
// A service with its own options and gRPC server on loopback, for tests that need other batching limits than
// the shared fixture's.
using TestServer = test_util::InProcessServer;

class ServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<ModelRegistry>> registry = ModelRegistry::LoadFromDirectory(RepositoryPath());
    ASSERT_TRUE(registry.ok()) << registry.status();
    registry_ = registry->release();
    absl::StatusOr<const models::ModelPackage*> package = registry_->Lookup(kModel);
    ASSERT_TRUE(package.ok()) << package.status();

    test_util::InProcessServerOptions options;
    options.engine.batching.max_batch_size = 8;
    // Long enough that concurrent callers share batches.
    options.engine.batching.max_queue_delay = absl::Milliseconds(50);
    options.engine.batching.queue_capacity = 64;
    options.engine.batching.num_batch_threads = 1;
    options.engine.max_encoded_image_bytes = kMaxImageBytes;
    options.max_receive_message_bytes = kMaxReceiveBytes;
    options.health = true;
    options.reflection = true;
    options.metrics_http = true;
    server_ = new test_util::InProcessServer(registry_, options);
    ASSERT_TRUE(server_->status().ok()) << server_->status();
    metrics_port_ = server_->metrics_port();
    ASSERT_GT(metrics_port_, 0);
    target_ = server_->target();
    client_ = &server_->client();

    absl::StatusOr<test_util::TestImages> test_images = test_util::FashionMnistTestPngs(kImages);
    ASSERT_TRUE(test_images.ok()) << test_images.status();
    images_ = test_images->pngs;
    labels_ = test_images->labels;
  }

  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    client_ = nullptr;
    delete registry_;
  }

  void SetUp() override { ASSERT_NE(client_, nullptr) << "suite set-up failed"; }

  static client::ClassifyOptions Options() {
    client::ClassifyOptions options;
    options.model = kModel;
    options.deadline = absl::Seconds(60);
    return options;
  }

  // Expects a successful response that is internally consistent.
  static void ExpectWellFormed(const v1::ClassifyResponse& response, int expected_classes) {
    EXPECT_EQ(response.model(), kModel);
    ASSERT_EQ(response.classes_size(), expected_classes);
    for (int i = 0; i < response.classes_size(); ++i) {
      const v1::ClassScore& score = response.classes(i);
      EXPECT_GE(score.index(), 0);
      EXPECT_LT(score.index(), 10);
      EXPECT_EQ(score.label(), datasets::FashionMnistLabels()[static_cast<size_t>(score.index())]);
      EXPECT_GE(score.score(), 0.0f);
      EXPECT_LE(score.score(), 1.0f);
      if (i > 0) {
        EXPECT_LE(score.score(), response.classes(i - 1).score());
      }
    }
    EXPECT_GT(response.timing().compute_us(), 0);
    EXPECT_GE(response.timing().queue_delay_us(), 0);
    EXPECT_GT(response.timing().total_us(), 0);
    EXPECT_GE(response.timing().total_us(), response.timing().queue_delay_us() + response.timing().compute_us());
    EXPECT_GE(response.timing().batch_size(), 1);
    EXPECT_LE(response.timing().batch_size(), 8);
    EXPECT_EQ(response.token_count(), 50);  // 7 x 7 patches + cls
  }

  static ModelRegistry* registry_;
  static test_util::InProcessServer* server_;
  static int metrics_port_;
  static std::string target_;
  static const client::MitaClient* client_;
  static std::vector<std::string> images_;
  static std::vector<int> labels_;
};

ModelRegistry* ServiceTest::registry_ = nullptr;
test_util::InProcessServer* ServiceTest::server_ = nullptr;
int ServiceTest::metrics_port_ = 0;
std::string ServiceTest::target_;
const client::MitaClient* ServiceTest::client_ = nullptr;
std::vector<std::string> ServiceTest::images_;
std::vector<int> ServiceTest::labels_;

TEST_F(ServiceTest, ClassifiesRealImagesWithTheDefaultBudget) {
  constexpr int kCount = 50;
  // Eight callers at a time, so that the run also exercises batching.
  std::vector<absl::StatusOr<v1::ClassifyResponse>> responses(kCount, absl::UnknownError("not run"));
  std::atomic<int> next{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 8; ++t) {
    callers.emplace_back([&] {
      for (int i = next++; i < kCount; i = next++) {
        client::ClassifyOptions options = Options();
        options.return_statistics = true;
        responses[static_cast<size_t>(i)] = client_->Classify(images_[static_cast<size_t>(i)], options);
      }
    });
  }
  for (std::thread& caller : callers) caller.join();

  int correct = 0;
  for (int i = 0; i < kCount; ++i) {
    const absl::StatusOr<v1::ClassifyResponse>& response = responses[static_cast<size_t>(i)];
    ASSERT_TRUE(response.ok()) << "image " << i << ": " << response.status();
    ExpectWellFormed(*response, 5);
    if (response->classes(0).index() == labels_[static_cast<size_t>(i)]) ++correct;
    EXPECT_FALSE(response->budget().full_attention());
    EXPECT_EQ(response->budget().expert_count(), 9);
    EXPECT_EQ(response->budget().expert_width(), 16);
    EXPECT_EQ(response->budget().preset(), "default");
    ASSERT_EQ(response->statistics_size(), 4);
    for (int layer = 0; layer < 4; ++layer) {
      const v1::LayerStatistics& stats = response->statistics(layer);
      EXPECT_EQ(stats.layer(), layer);
      ASSERT_EQ(stats.queries_per_expert_size(), 9);
      double queries = 0;
      for (float q : stats.queries_per_expert()) queries += q;
      EXPECT_NEAR(queries, 50.0, 1e-3) << "every query is routed to one expert";
      EXPECT_GT(stats.routing_entropy(), 0.0f);
      EXPECT_LE(stats.routing_entropy(), 1.0f + 1e-6f);
      EXPECT_GE(stats.pruned_key_fraction(), 0.0f);
      EXPECT_LT(stats.pruned_key_fraction(), 1.0f);
      EXPECT_GE(stats.load_imbalance(), 1.0f - 1e-6f);
      EXPECT_LE(stats.load_imbalance(), 9.0f + 1e-4f);
      EXPECT_GE(stats.expert_overlap_fraction(), 0.0f);
      EXPECT_LE(stats.expert_overlap_fraction(), 1.0f);
    }
  }
  const double accuracy = static_cast<double>(correct) / kCount;
  std::cout << "top-1 accuracy on " << kCount << " Fashion-MNIST test images: " << accuracy << "\n";
  EXPECT_GE(accuracy, 0.8);
}

TEST_F(ServiceTest, StatisticsOnlyWhenAsked) {
  absl::StatusOr<v1::ClassifyResponse> response = client_->Classify(images_[0], Options());
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->statistics_size(), 0);
}

TEST_F(ServiceTest, ExplicitBudgetAndPresetAreApplied) {
  client::ClassifyOptions options = Options();
  options.expert_count = 16;
  options.expert_width = 32;
  options.return_statistics = true;
  options.top_n = 3;
  absl::StatusOr<v1::ClassifyResponse> response = client_->Classify(images_[1], options);
  ASSERT_TRUE(response.ok()) << response.status();
  ExpectWellFormed(*response, 3);
  EXPECT_FALSE(response->budget().full_attention());
  EXPECT_EQ(response->budget().expert_count(), 16);
  EXPECT_EQ(response->budget().expert_width(), 32);
  EXPECT_EQ(response->budget().preset(), "");
  ASSERT_EQ(response->statistics_size(), 4);
  EXPECT_EQ(response->statistics(0).queries_per_expert_size(), 16);

  // Only the expert count: the expert width takes the model's default (16).
  options = Options();
  options.expert_count = 25;
  response = client_->Classify(images_[1], options);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->budget().expert_count(), 25);
  EXPECT_EQ(response->budget().expert_width(), 16);

  options = Options();
  options.preset = "fast";
  options.top_n = 10;
  response = client_->Classify(images_[2], options);
  ASSERT_TRUE(response.ok()) << response.status();
  ExpectWellFormed(*response, 10);
  EXPECT_EQ(response->budget().expert_count(), 4);
  EXPECT_EQ(response->budget().expert_width(), 8);
  EXPECT_EQ(response->budget().preset(), "fast");
  double total = 0;
  for (const v1::ClassScore& score : response->classes()) total += score.score();
  EXPECT_NEAR(total, 1.0, 1e-4) << "all ten probabilities";

  // The preset names "" (a proto3 string left empty) and "default" (what responses call the default budget) are
  // the model's default budget, m=9 k=16, not an unknown preset.
  for (const std::string name : {"", "default"}) {
    absl::StatusOr<v1::ClassifyRequest> request = client::BuildClassifyRequest(images_[2], Options());
    ASSERT_TRUE(request.ok()) << request.status();
    request->mutable_budget()->set_preset(name);
    ASSERT_EQ(request->budget().choice_case(), v1::Budget::kPreset);
    response = client_->ClassifyRaw(*request);
    ASSERT_TRUE(response.ok()) << "preset '" << name << "': " << response.status();
    EXPECT_EQ(response->budget().expert_count(), 9) << "preset '" << name << "'";
    EXPECT_EQ(response->budget().expert_width(), 16) << "preset '" << name << "'";
    EXPECT_EQ(response->budget().preset(), "default") << "preset '" << name << "'";
  }
}

TEST_F(ServiceTest, FullAttention) {
  int agree = 0;
  for (int i = 0; i < 10; ++i) {
    client::ClassifyOptions options = Options();
    options.full_attention = true;
    options.return_statistics = true;
    absl::StatusOr<v1::ClassifyResponse> full = client_->Classify(images_[static_cast<size_t>(i)], options);
    ASSERT_TRUE(full.ok()) << full.status();
    ExpectWellFormed(*full, 5);
    EXPECT_TRUE(full->budget().full_attention());
    EXPECT_EQ(full->budget().expert_count(), 0);
    EXPECT_EQ(full->budget().expert_width(), 0);
    EXPECT_EQ(full->statistics_size(), 0) << "no MiTA statistics under full attention";
    absl::StatusOr<v1::ClassifyResponse> mita = client_->Classify(images_[static_cast<size_t>(i)], Options());
    ASSERT_TRUE(mita.ok()) << mita.status();
    if (mita->classes(0).index() == full->classes(0).index()) ++agree;
  }
  // The same weights with full attention mostly agree with MiTA (docs/design.md section 2.7).
  EXPECT_GE(agree, 6);
}

TEST_F(ServiceTest, ConcurrentRequestsWithDifferentBudgetsShareBatches) {
  struct Caller {
    std::optional<int64_t> expert_count, expert_width;
    std::string preset;
    bool full = false;
  };
  const std::vector<Caller> callers = {{std::nullopt, std::nullopt, "", false},
                                       {std::nullopt, std::nullopt, "fast", false},
                                       {16, 32, "", false},
                                       {std::nullopt, std::nullopt, "", true},
                                       {4, 50, "", false},
                                       {1, 1, "", false},
                                       {49, 50, "", false},
                                       {std::nullopt, std::nullopt, "accurate", false}};
  int shared = 0;
  for (int round = 0; round < 5 && shared == 0; ++round) {
    std::vector<absl::StatusOr<v1::ClassifyResponse>> responses(callers.size(), absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (size_t c = 0; c < callers.size(); ++c) {
      threads.emplace_back([&, c] {
        client::ClassifyOptions options = Options();
        options.expert_count = callers[c].expert_count;
        options.expert_width = callers[c].expert_width;
        options.preset = callers[c].preset;
        options.full_attention = callers[c].full;
        options.return_statistics = true;
        responses[c] = client_->Classify(images_[c], options);
      });
    }
    for (std::thread& thread : threads) thread.join();
    for (size_t c = 0; c < callers.size(); ++c) {
      ASSERT_TRUE(responses[c].ok()) << responses[c].status();
      const v1::ClassifyResponse& response = *responses[c];
      ExpectWellFormed(response, 5);
      // Each request got its own budget, whatever it was batched with.
      EXPECT_EQ(response.budget().full_attention(), callers[c].full);
      if (callers[c].expert_count.has_value()) {
        EXPECT_EQ(response.budget().expert_count(), *callers[c].expert_count);
        EXPECT_EQ(response.budget().expert_width(), *callers[c].expert_width);
        ASSERT_EQ(response.statistics_size(), 4);
        EXPECT_EQ(response.statistics(0).queries_per_expert_size(), *callers[c].expert_count);
      }
      if (!callers[c].preset.empty()) {
        EXPECT_EQ(response.budget().preset(), callers[c].preset);
      }
      if (response.timing().batch_size() > 1) ++shared;
    }
  }
  EXPECT_GT(shared, 0) << "no two of 8 concurrent requests shared a batch";
}

TEST_F(ServiceTest, BadRequestsGetTheRightCodeAndNameTheField) {
  client::ClassifyOptions options = Options();
  // Corrupt and truncated image bytes.
  ExpectStatus(client_->Classify("definitely not an image", options).status(), absl::StatusCode::kInvalidArgument,
               "image");
  ExpectStatus(client_->Classify(images_[0].substr(0, images_[0].size() / 2), options).status(),
               absl::StatusCode::kInvalidArgument, "image");
  std::string corrupt = images_[0];
  for (size_t i = 40; i < corrupt.size(); i += 7) corrupt[i] = static_cast<char>(corrupt[i] ^ 0x5a);
  ExpectStatus(client_->Classify(corrupt, options).status(), absl::StatusCode::kInvalidArgument, "field image");
  // Empty image; no input; a document.
  ExpectStatus(client_->Classify("", options).status(), absl::StatusCode::kInvalidArgument, "field image: empty");
  v1::ClassifyRequest no_input;
  no_input.set_model(kModel);
  ExpectStatus(client_->ClassifyRaw(no_input).status(), absl::StatusCode::kInvalidArgument, "field input");
  v1::ClassifyRequest document;
  document.set_model(kModel);
  document.mutable_document()->set_text("a document");
  ExpectStatus(client_->ClassifyRaw(document).status(), absl::StatusCode::kInvalidArgument,
               "field input: model 'fashion-mnist-vit' takes an image");
  // Unknown model.
  options.model = "no-such-model";
  ExpectStatus(client_->Classify(images_[0], options).status(), absl::StatusCode::kNotFound,
               "model 'no-such-model' not found; available: fashion-mnist-vit");
  options.model = "../../etc/passwd";
  ExpectStatus(client_->Classify(images_[0], options).status(), absl::StatusCode::kNotFound, "not found");
  // Budgets out of range.
  options = Options();
  options.expert_count = 10;
  options.expert_width = 16;
  ExpectStatus(client_->Classify(images_[0], options).status(), absl::StatusCode::kInvalidArgument, "expert_count");
  options.expert_count = 9;
  options.expert_width = -1;
  ExpectStatus(client_->Classify(images_[0], options).status(), absl::StatusCode::kInvalidArgument,
               "field budget.experts.expert_width: -1 is out of range: allowed [1, 50]");
  options.expert_width = 51;
  ExpectStatus(client_->Classify(images_[0], options).status(), absl::StatusCode::kInvalidArgument, "expert_width");
  // Only the expert width set (the expert count takes the default): the error names the value sent.
  options = Options();
  options.expert_width = 51;
  ExpectStatus(client_->Classify(images_[0], options).status(), absl::StatusCode::kInvalidArgument,
               "field budget.experts.expert_width: 51 is out of range: allowed [1, 50]");
  // An empty model name.
  options = Options();
  options.model = "";
  ExpectStatus(client_->Classify(images_[0], options).status(), absl::StatusCode::kInvalidArgument,
               "the model name is empty; available: fashion-mnist-vit");
  options = Options();
  options.preset = "turbo";
  absl::Status preset = client_->Classify(images_[0], options).status();
  ExpectStatus(preset, absl::StatusCode::kInvalidArgument, "field budget.preset: unknown preset 'turbo'");
  EXPECT_THAT(std::string(preset.message()), HasSubstr("accurate, balanced, fast"));
  // top_n out of range.
  options = Options();
  options.top_n = -1;
  ExpectStatus(client_->Classify(images_[0], options).status(), absl::StatusCode::kInvalidArgument,
               "field top_n: -1 is out of range: allowed [0, 10] (0 means 5)");
  options.top_n = 11;
  ExpectStatus(client_->Classify(images_[0], options).status(), absl::StatusCode::kInvalidArgument, "field top_n");
  // An image over the service's encoded-size limit but under the gRPC receive limit.
  std::string large = images_[0] + std::string(kMaxImageBytes, '\0');
  ExpectStatus(client_->Classify(large, Options()).status(), absl::StatusCode::kInvalidArgument,
               "bytes is over the limit of 1048576 bytes");
  // A message over the gRPC receive limit: rejected by gRPC itself.
  std::string huge(static_cast<size_t>(kMaxReceiveBytes) + 1024, 'x');
  EXPECT_EQ(client_->Classify(huge, Options()).status().code(), absl::StatusCode::kResourceExhausted);
  // A deadline that cannot be met.
  options = Options();
  options.deadline = absl::Microseconds(1);
  EXPECT_EQ(client_->Classify(images_[0], options).status().code(), absl::StatusCode::kDeadlineExceeded);

  // After all of that the server still serves.
  absl::StatusOr<v1::ClassifyResponse> good = client_->Classify(images_[3], Options());
  ASSERT_TRUE(good.ok()) << good.status();
  ExpectWellFormed(*good, 5);
}

// Deadlines and cancellation while queued: tests/cancellation_test.cc (a 60 s max queue delay there, so the
// outcome does not depend on how fast a loaded machine runs the call; the 20 ms windows used here before
// failed under load).

// A model whose default is full attention says so (the embedded timm package), a MiTA default gives its budget.
TEST(ModelMetadataTest, AFullAttentionDefaultIsDeclaredAsSuch) {
  for (const auto& [name, full] : {std::pair<std::string, bool>{"timm-vit-fashion-mnist", true},
                                   std::pair<std::string, bool>{"fashion-mnist-vit", false}}) {
    SCOPED_TRACE(name);
    absl::StatusOr<models::ModelPackage> package = models::LoadModelPackage(RepositoryPath() + "/" + name);
    ASSERT_TRUE(package.ok()) << package.status();
    const v1::Knobs knobs = ToModelMetadata(package->classifier->description(), models::InputLimits{}).knobs();
    EXPECT_EQ(knobs.default_full_attention(), full);
    EXPECT_EQ(knobs.has_default_budget(), !full);
    if (!full) EXPECT_EQ(knobs.default_budget().expert_count(), 9);
  }
}

TEST_F(ServiceTest, GetModelDeclaresTheKnobs) {
  absl::StatusOr<v1::ModelMetadata> model = client_->GetModel(kModel);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->name(), kModel);
  EXPECT_EQ(model->architecture(), "mita_vit");
  EXPECT_EQ(model->input_kind(), v1::INPUT_KIND_IMAGE);
  EXPECT_EQ(model->image_limits().width(), 28);
  EXPECT_EQ(model->image_limits().height(), 28);
  EXPECT_EQ(model->image_limits().channels(), 1);
  EXPECT_GE(model->image_limits().max_width(), 28);
  EXPECT_GE(model->image_limits().max_height(), 28);
  EXPECT_EQ(model->image_limits().max_encoded_bytes(), kMaxImageBytes);
  EXPECT_THAT(model->labels(), ElementsAreArray(datasets::FashionMnistLabels()));
  const v1::Knobs& knobs = model->knobs();
  EXPECT_THAT(knobs.allowed_expert_counts(), ElementsAre(1, 4, 9, 16, 25, 36, 49));
  EXPECT_EQ(knobs.min_expert_count(), 1);
  EXPECT_EQ(knobs.max_expert_count(), 49);
  EXPECT_EQ(knobs.min_expert_width(), 1);
  EXPECT_EQ(knobs.max_expert_width(), 50);
  EXPECT_EQ(knobs.default_budget().expert_count(), 9);
  EXPECT_EQ(knobs.default_budget().expert_width(), 16);
  ASSERT_EQ(knobs.presets_size(), 3);
  EXPECT_EQ(knobs.presets(0).name(), "accurate");
  EXPECT_EQ(knobs.presets(0).budget().expert_count(), 16);
  EXPECT_EQ(knobs.presets(0).budget().expert_width(), 32);
  EXPECT_EQ(knobs.presets(1).name(), "balanced");
  EXPECT_EQ(knobs.presets(2).name(), "fast");
  EXPECT_EQ(knobs.presets(2).budget().expert_count(), 4);
  EXPECT_EQ(knobs.presets(2).budget().expert_width(), 8);
  EXPECT_TRUE(knobs.full_attention_supported());
  EXPECT_EQ(model->layers(), 4);
  EXPECT_EQ(model->heads(), 4);
  EXPECT_EQ(model->embed_dim(), 96);
  EXPECT_EQ(model->tokens_per_input(), 50);

  ExpectStatus(client_->GetModel("nope").status(), absl::StatusCode::kNotFound,
               "model 'nope' not found; available: fashion-mnist-vit");
  // Where it runs: the default placement.
  EXPECT_EQ(model->device(), "cpu");
  EXPECT_EQ(model->weights_dtype(), "float32");
}

TEST_F(ServiceTest, ListModels) {
  absl::StatusOr<v1::ListModelsResponse> models = client_->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_EQ(models->models_size(), static_cast<int>(registry_->size()));
  bool found = false;
  for (const v1::ModelMetadata& model : models->models()) {
    if (model.name() == kModel) {
      found = true;
      EXPECT_EQ(model.knobs().allowed_expert_counts_size(), 7);
    }
  }
  EXPECT_TRUE(found);
}

// grpc.health.v1.Health/Check over a raw call (test_util::HealthCheck): SERVING is "\x08\x01".
TEST_F(ServiceTest, HealthServiceReportsServing) {
  const auto check = test_util::HealthCheck;
  std::shared_ptr<grpc::Channel> channel = client_->channel();
  auto overall = check(channel, "");
  EXPECT_EQ(overall.first, grpc::StatusCode::OK);
  EXPECT_EQ(overall.second, std::string("\x08\x01", 2)) << "status: SERVING";
  auto service = check(channel, "mita.v1.MitaService");
  EXPECT_EQ(service.first, grpc::StatusCode::OK);
  EXPECT_EQ(service.second, std::string("\x08\x01", 2));
  EXPECT_EQ(check(channel, "no.such.Service").first, grpc::StatusCode::NOT_FOUND);
  // Names over 127 bytes need a length of two varint bytes: still a well-formed request, answered NOT_FOUND (a
  // one-byte length made it an unparsable message). gRPC's default health service, which the server used until
  // 2026-12-05, could not parse names over 200 bytes (INVALID_ARGUMENT on Check, INTERNAL on Watch); the server's
  // own looks up any name.
  for (size_t length : {127, 128, 200, 201, 5000}) {
    const auto [code, bytes] = check(channel, std::string(length, 's'));
    EXPECT_EQ(code, grpc::StatusCode::NOT_FOUND) << length << " bytes";
  }
}

// grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo (bidirectional stream) over a raw call
// (test_util::ReflectionListServices): the answer names the services.
TEST_F(ServiceTest, ReflectionListsTheService) {
  absl::StatusOr<std::string> bytes = test_util::ReflectionListServices(client_->channel());
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_THAT(*bytes, HasSubstr("mita.v1.MitaService"));
  EXPECT_THAT(*bytes, HasSubstr("grpc.health.v1.Health"));
}

TEST_F(ServiceTest, MetricsScrapeHasRoutingAndPruningSeries) {
  // Traffic of its own, so that the test does not depend on the others: MiTA (default and a preset), full
  // attention, an unknown model and a bad request.
  client::ClassifyOptions options = Options();
  ASSERT_TRUE(client_->Classify(images_[6], options).ok());
  options.preset = "fast";
  ASSERT_TRUE(client_->Classify(images_[7], options).ok());
  options = Options();
  options.full_attention = true;
  ASSERT_TRUE(client_->Classify(images_[8], options).ok());
  options = Options();
  options.model = "missing";
  EXPECT_FALSE(client_->Classify(images_[8], options).ok());
  EXPECT_FALSE(client_->Classify("", Options()).ok());
  ASSERT_TRUE(client_->ListModels().ok());
  server_->metrics().AwaitFinishedCallsCounted();  // calls are counted when gRPC is done with them

  absl::StatusOr<std::string> body = HttpGet(metrics_port_, "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  const std::string& text = *body;
  const std::string model = absl::StrCat("model=\"", kModel, "\"");
  for (const char* family : {"mita_attention_expert_load_imbalance", "mita_attention_routing_entropy",
                             "mita_attention_pruned_key_fraction"}) {
    for (int layer = 0; layer < 4; ++layer) {
      const std::string series = absl::StrCat(family, "_count{layer=\"", layer, "\",", model, "}");
      EXPECT_GT(SampleValue(text, series), 0) << series;
    }
  }
  // Entropy in [0, 1]: the sum of observations cannot exceed the count.
  const std::string entropy = absl::StrCat("mita_attention_routing_entropy_sum{layer=\"0\",", model, "}");
  const std::string entropy_count = absl::StrCat("mita_attention_routing_entropy_count{layer=\"0\",", model, "}");
  EXPECT_GT(SampleValue(text, entropy), 0);
  EXPECT_LE(SampleValue(text, entropy), SampleValue(text, entropy_count) + 1e-6);
  EXPECT_GT(SampleValue(text, absl::StrCat("mita_requests_total{code=\"OK\",method=\"Classify\",", model, "}")), 0);
  EXPECT_GT(
      SampleValue(text, absl::StrCat("mita_requests_total{code=\"INVALID_ARGUMENT\",method=\"Classify\",", model, "}")),
      0);
  EXPECT_GT(SampleValue(text, "mita_requests_total{code=\"NOT_FOUND\",method=\"Classify\",model=\"unknown\"}"), 0);
  EXPECT_GT(SampleValue(text, "mita_requests_total{code=\"OK\",method=\"ListModels\",model=\"\"}"), 0);
  EXPECT_GT(SampleValue(text, absl::StrCat("mita_request_latency_seconds_count{", model, "}")), 0);
  EXPECT_GT(SampleValue(text, absl::StrCat("mita_queue_delay_seconds_count{", model, "}")), 0);
  EXPECT_GT(SampleValue(text, absl::StrCat("mita_compute_seconds_count{", model, "}")), 0);
  EXPECT_GT(SampleValue(text, absl::StrCat("mita_batch_size_count{", model, "}")), 0);
  EXPECT_GT(SampleValue(text, absl::StrCat("mita_requested_expert_count_count{", model, "}")), 0);
  EXPECT_GT(SampleValue(text, absl::StrCat("mita_requested_expert_width_count{", model, "}")), 0);
  EXPECT_GT(SampleValue(text, absl::StrCat("mita_full_attention_requests_total{", model, "}")), 0);
  EXPECT_EQ(SampleValue(text, "mita_queue_depth{model=\"fashion-mnist-vit\"}"), 0)
      << "nothing is queued between requests";
  // No series is labelled with a model name taken from a request.
  EXPECT_THAT(text, ::testing::Not(HasSubstr("model=\"missing\"")));
}

// A gauge value read in-process from the registry (the first sample of `name`), or -1 when absent.
double GaugeValue(const prometheus::Registry& registry, const std::string& name) {
  for (const prometheus::MetricFamily& family : registry.Collect()) {
    if (family.name == name && !family.metric.empty()) return family.metric.front().gauge.value;
  }
  return -1;
}

// Sends `count` requests at once (one thread each) and returns every call's outcome and client latency.
struct BurstOutcome {
  std::vector<absl::Status> statuses;
  std::vector<double> latencies_ms;         // client side, parallel to statuses
  std::vector<double> server_latencies_ms;  // timing.total_us of successful calls (receipt to answer), else 0
};
BurstOutcome SendBurst(const client::MitaClient& client, const std::vector<std::string>& images, int count,
                       const client::ClassifyOptions& options) {
  BurstOutcome outcome;
  outcome.statuses.assign(static_cast<size_t>(count), absl::UnknownError("no answer"));
  outcome.latencies_ms.assign(static_cast<size_t>(count), 0);
  outcome.server_latencies_ms.assign(static_cast<size_t>(count), 0);
  absl::Notification go;
  std::vector<std::thread> threads;
  for (int i = 0; i < count; ++i) {
    threads.emplace_back([&, i] {
      go.WaitForNotification();
      const absl::Time start = absl::Now();
      absl::StatusOr<v1::ClassifyResponse> response =
          client.Classify(images[static_cast<size_t>(i) % images.size()], options);
      outcome.latencies_ms[static_cast<size_t>(i)] = absl::ToDoubleMilliseconds(absl::Now() - start);
      outcome.statuses[static_cast<size_t>(i)] = response.status();
      if (response.ok()) {
        outcome.server_latencies_ms[static_cast<size_t>(i)] = static_cast<double>(response->timing().total_us()) / 1e3;
      }
    });
  }
  go.Notify();
  for (std::thread& thread : threads) thread.join();
  return outcome;
}

// Issue 5, admission and overload: the queue is bounded in compute units; a burst of 10x its capacity gets
// exactly one answer per request, OK or an immediate RESOURCE_EXHAUSTED naming the limit, every rejection
// is counted by reason, and the gauges return to 0.
TEST_F(ServiceTest, BurstOfTenTimesCapacityGetsOneAnswerEach) {
  // One MiTA request at the default budget costs 50 tokens x (9 + 16) = 1250 compute units; the queue holds
  // 8 of them (10,000 units). The request-count bound (1000) never binds.
  constexpr int64_t kUnitsPerRequest = 50 * (9 + 16);
  constexpr int kCapacityRequests = 8;
  constexpr int kBurst = 10 * kCapacityRequests;
  EngineOptions options;
  options.batching.max_batch_size = 4;
  options.batching.max_queue_delay = absl::Milliseconds(2);
  options.batching.queue_capacity = 1000;
  options.batching.queue_compute_units = kCapacityRequests * kUnitsPerRequest;
  options.max_encoded_image_bytes = kMaxImageBytes;

  // Phase 1, deterministic: batches wait 2 s to fill and hold up to 1000 requests, so nothing leaves the
  // queue during the burst: exactly 8 are admitted, the other 72 are refused at once.
  {
    EngineOptions held = options;
    held.batching.max_batch_size = 1000;
    held.batching.max_queue_delay = absl::Seconds(2);
    TestServer server(registry_, held);
    ASSERT_TRUE(server.status().ok()) << server.status();
    BurstOutcome burst = SendBurst(server.client(), images_, kBurst, Options());
    int ok = 0, exhausted = 0;
    for (const absl::Status& status : burst.statuses) {
      if (status.ok()) {
        ++ok;
      } else {
        ASSERT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
        EXPECT_EQ(status.message(), "queue is full: 10000 of 10000 queued compute units, the request needs 1250 "
                                    "(flag --queue_compute_units)");
        ++exhausted;
      }
    }
    EXPECT_EQ(ok, kCapacityRequests);
    EXPECT_EQ(exhausted, kBurst - kCapacityRequests);
    EXPECT_EQ(MetricValue(server.registry(), "mita_rejected_requests_total",
                          {{"model", kModel}, {"reason", "queue_compute_units"}}),
              exhausted);
    EXPECT_EQ(MetricValue(server.registry(), "mita_requests_total",
                          {{"model", kModel}, {"code", "RESOURCE_EXHAUSTED"}}),
              exhausted);
    EXPECT_EQ(GaugeValue(server.registry(), "mita_queue_compute_units"), 0);
    EXPECT_EQ(GaugeValue(server.registry(), "mita_queue_depth"), 0);
  }

  // Phase 2, realistic: batches of 4 leave every 2 ms; a burst of 80 at once. Whatever the timing, each call
  // has exactly one answer, OK or RESOURCE_EXHAUSTED, and every rejection is counted.
  TestServer server(registry_, options);
  ASSERT_TRUE(server.status().ok()) << server.status();
  BurstOutcome burst = SendBurst(server.client(), images_, kBurst, Options());
  int ok = 0, exhausted = 0;
  std::vector<double> admitted_ms, admitted_server_ms;
  for (size_t i = 0; i < burst.statuses.size(); ++i) {
    const absl::Status& status = burst.statuses[i];
    if (status.ok()) {
      ++ok;
      admitted_ms.push_back(burst.latencies_ms[i]);
      admitted_server_ms.push_back(burst.server_latencies_ms[i]);
    } else {
      ASSERT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
      EXPECT_THAT(std::string(status.message()), HasSubstr("(flag --queue_compute_units)"));
      ++exhausted;
    }
  }
  EXPECT_EQ(ok + exhausted, kBurst);
  EXPECT_GE(ok, kCapacityRequests) << "at least a full queue's worth is admitted";
  EXPECT_EQ(MetricValue(server.registry(), "mita_rejected_requests_total", {{"model", kModel}}), exhausted);
  EXPECT_EQ(MetricValue(server.registry(), "mita_requests_total", {{"model", kModel}, {"code", "OK"}}), ok);
  EXPECT_EQ(GaugeValue(server.registry(), "mita_queue_compute_units"), 0);
  std::cout << "burst of " << kBurst << " requests at a queue of " << kCapacityRequests
            << " requests' compute units: " << ok << " admitted, " << exhausted
            << " RESOURCE_EXHAUSTED; client latency of admitted: p50 " << mita::Percentile(admitted_ms, 50)
            << " ms, p99 " << mita::Percentile(admitted_ms, 99) << " ms, max " << mita::Percentile(admitted_ms, 100)
            << " ms; in the server (receipt to answer): p50 " << mita::Percentile(admitted_server_ms, 50)
            << " ms, p99 " << mita::Percentile(admitted_server_ms, 99) << " ms\n";
}

// Full attention costs N x N compute units instead of N x (M + k): at the same queue capacity fewer
// full-attention requests are admitted than MiTA ones.
TEST_F(ServiceTest, FullAttentionCostsMoreComputeUnits) {
  EngineOptions options;
  options.batching.max_batch_size = 1000;
  options.batching.max_queue_delay = absl::Seconds(2);
  options.batching.queue_compute_units = 4 * 50 * 50;  // 4 full-attention requests, or 8 at M + k = 25
  options.max_encoded_image_bytes = kMaxImageBytes;
  TestServer server(registry_, options);
  ASSERT_TRUE(server.status().ok()) << server.status();
  client::ClassifyOptions full = Options();
  full.full_attention = true;
  BurstOutcome burst = SendBurst(server.client(), images_, 12, full);
  int ok = 0;
  for (const absl::Status& status : burst.statuses) ok += status.ok() ? 1 : 0;
  EXPECT_EQ(ok, 4);
  burst = SendBurst(server.client(), images_, 12, Options());
  ok = 0;
  for (const absl::Status& status : burst.statuses) ok += status.ok() ? 1 : 0;
  EXPECT_EQ(ok, 8);
  // One request that alone costs more than the whole queue can never be admitted.
  EngineOptions tiny = options;
  tiny.batching.queue_compute_units = 1000;
  TestServer small(registry_, tiny);
  ASSERT_TRUE(small.status().ok()) << small.status();
  absl::Status status = small.client().Classify(images_[0], Options()).status();
  ExpectStatus(status, absl::StatusCode::kResourceExhausted,
               "request needs 1250 compute units (tokens x attention width), more than the queue's capacity of 1000 "
               "(flag --queue_compute_units)");
  EXPECT_EQ(MetricValue(small.registry(), "mita_rejected_requests_total",
                        {{"model", kModel}, {"reason", "task_over_queue_compute_units"}}),
            1);
}

// ---------------------------------------------------------------------------------------------------------
// Document models (issue 3): a small random-weight document package (tools/reference_logits.py
// make-document-package: bytes tokenizer, vocabulary 256, 2 layers, max_tokens 4096) served over loopback.

constexpr char kDocumentModel[] = "random-document";
constexpr int64_t kDocumentMaxTokens = 4096;
constexpr int kDocumentClasses = 4;

// Real text for documents: this repository's README and design notes (UTF-8).
std::string RealText() {
  std::string text;
  for (const char* file : {"/README.md", "/server/planning/batcher.h", "/server/engine/inference_engine.cc"}) {
    text += test_util::ReadFile(SourceDirectory() + file);
  }
  return text;
}

// The first `count` bytes of `text` cut back to a UTF-8 character boundary.
std::string Utf8Prefix(const std::string& text, size_t count) {
  count = std::min(count, text.size());
  while (count > 0 && count < text.size() && (static_cast<unsigned char>(text[count]) & 0xC0) == 0x80) --count;
  return text.substr(0, count);
}

// A long document does not hold up short requests of the same model: with the long-document lane
// (EngineOptions::long_document_tokens) a short document sent while a long one computes is answered before it;
// with one lane (the control, as before 2026-12-02) it waits for the long forward to end.
TEST_F(ServiceTest, ALongDocumentDoesNotHoldUpShortOnes) {
  constexpr char kDocumentModel[] = "linux-doc-mita";
  std::vector<int64_t> long_ids(16384), short_ids(256);
  uint32_t state = 7;
  for (std::vector<int64_t>* ids : {&long_ids, &short_ids}) {
    for (int64_t& id : *ids) {
      state = state * 1664525u + 1013904223u;
      id = (state >> 8) % 4096;
    }
  }
  for (const int64_t long_document_tokens : {int64_t{0}, int64_t{8192}}) {
    SCOPED_TRACE(absl::StrCat("long_document_tokens=", long_document_tokens));
    EngineOptions options;
    options.batching.max_batch_size = 8;
    options.batching.max_queue_delay = absl::Milliseconds(1);
    options.long_document_tokens = long_document_tokens;
    test_util::InProcessServer server(registry_, options);
    ASSERT_TRUE(server.status().ok()) << server.status();
    client::ClassifyOptions classify;
    classify.model = kDocumentModel;
    classify.deadline = absl::Seconds(300);
    absl::StatusOr<v1::ClassifyRequest> long_request = client::BuildTokenIdsRequest(long_ids, classify);
    absl::StatusOr<v1::ClassifyRequest> short_request = client::BuildTokenIdsRequest(short_ids, classify);
    ASSERT_TRUE(long_request.ok() && short_request.ok());
    absl::Time long_done, short_done;
    absl::StatusOr<v1::ClassifyResponse> long_response, short_response;
    std::thread long_call([&] {
      long_response = server.client().ClassifyRaw(*long_request, absl::Seconds(300));
      long_done = absl::Now();
    });
    // Sent once the long document's forward has started: admitted (its tokens observed), then out of the queue.
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    auto started = [&] {
      return test_util::MetricValue(server.registry(), "mita_request_tokens", {{"model", kDocumentModel}}) >= 1 &&
             test_util::MetricValue(server.registry(), "mita_queue_depth", {{"model", kDocumentModel}}) == 0;
    };
    while (absl::Now() < give_up && !started()) absl::SleepFor(absl::Milliseconds(2));
    ASSERT_TRUE(started());
    short_response = server.client().ClassifyRaw(*short_request, absl::Seconds(300));
    short_done = absl::Now();
    long_call.join();
    ASSERT_TRUE(long_response.ok()) << long_response.status();
    ASSERT_TRUE(short_response.ok()) << short_response.status();
    if (long_document_tokens > 0) {
      EXPECT_LT(short_done, long_done) << "the short document waited for the long one";
    } else {
      EXPECT_GT(short_done, long_done) << "control: with one lane the short document waits";
    }
  }
}

class DocumentServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char pattern[] = "/tmp/mita-document-test-XXXXXX";
    const char* made = mkdtemp(pattern);
    ASSERT_NE(made, nullptr);
    directory_ = new std::string(made);
    const std::string package = absl::StrCat(*directory_, "/", kDocumentModel);
    const std::string command =
        absl::StrCat("/usr/bin/python3 ", SourceDirectory(),
                     "/tools/reference_logits.py make-document-package --seed 3 --max-tokens ", kDocumentMaxTokens,
                     " --num-classes ", kDocumentClasses, " --out ", package, " 2> ", *directory_, "/stderr.txt");
    ASSERT_EQ(std::system(command.c_str()), 0)
        << command << " failed (needs Debian's python3-torch); see " << *directory_ << "/stderr.txt";
    absl::StatusOr<std::unique_ptr<ModelRegistry>> registry = ModelRegistry::LoadFromDirectory(*directory_);
    ASSERT_TRUE(registry.ok()) << registry.status();
    registry_ = registry->release();
    // ASCII only, so that any byte range is valid UTF-8 (multi-byte text has its own test).
    text_ = new std::string(RealText());
    for (char& c : *text_) {
      if (static_cast<unsigned char>(c) >= 0x80) c = '?';
    }
    ASSERT_GT(text_->size(), static_cast<size_t>(kDocumentMaxTokens) + 100);
  }

  static void TearDownTestSuite() {
    delete registry_;
    delete text_;
    if (directory_ != nullptr) std::system(absl::StrCat("rm -rf ", *directory_).c_str());
    delete directory_;
  }

  void SetUp() override { ASSERT_NE(registry_, nullptr) << "suite set-up failed"; }

  static EngineOptions DefaultOptions() {
    EngineOptions options;
    options.batching.max_batch_size = 8;
    options.batching.max_queue_delay = absl::Milliseconds(1);
    return options;
  }

  static client::ClassifyOptions Options() {
    client::ClassifyOptions options;
    options.model = kDocumentModel;
    options.deadline = absl::Seconds(60);
    options.top_n = kDocumentClasses;
    return options;
  }

  static v1::ClassifyRequest TextRequest(const std::string& text, const client::ClassifyOptions& options) {
    absl::StatusOr<v1::ClassifyRequest> request = client::BuildTextRequest(text, options);
    EXPECT_TRUE(request.ok()) << request.status();
    return request.ok() ? *request : v1::ClassifyRequest();
  }

  // Class scores by class index.
  static std::vector<float> ScoresByClass(const v1::ClassifyResponse& response) {
    std::vector<float> scores(kDocumentClasses, -1.0f);
    for (const v1::ClassScore& score : response.classes()) {
      if (score.index() >= 0 && score.index() < kDocumentClasses) scores[static_cast<size_t>(score.index())] = score.score();
    }
    return scores;
  }

  static std::string* directory_;
  static ModelRegistry* registry_;
  static std::string* text_;
};

std::string* DocumentServiceTest::directory_ = nullptr;
ModelRegistry* DocumentServiceTest::registry_ = nullptr;
std::string* DocumentServiceTest::text_ = nullptr;

TEST_F(DocumentServiceTest, ClassifiesTextAndEchoesTheAppliedBudget) {
  TestServer server(registry_, DefaultOptions());
  ASSERT_TRUE(server.status().ok()) << server.status();
  const std::string text = Utf8Prefix(*text_, 3000);
  client::ClassifyOptions options = Options();
  options.return_statistics = true;
  absl::StatusOr<v1::ClassifyResponse> response = server.client().ClassifyText(text, options);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->model(), kDocumentModel);
  ASSERT_EQ(response->classes_size(), kDocumentClasses);
  float total = 0;
  for (const v1::ClassScore& score : response->classes()) {
    total += score.score();
    EXPECT_EQ(score.label(), absl::StrCat("topic ", score.index()));
  }
  EXPECT_NEAR(total, 1.0f, 1e-5f) << "all classes were asked for: the softmax sums to 1";
  // Bytes tokenizer: one token per byte.
  EXPECT_EQ(response->token_count(), static_cast<int64_t>(text.size()));
  EXPECT_EQ(response->input_token_count(), static_cast<int64_t>(text.size()));
  EXPECT_FALSE(response->budget().full_attention());
  EXPECT_EQ(response->budget().expert_count(), 16);  // the package's default budget
  EXPECT_EQ(response->budget().expert_width(), 64);
  EXPECT_EQ(response->budget().preset(), "default");
  ASSERT_EQ(response->statistics_size(), 2);
  for (const v1::LayerStatistics& layer : response->statistics()) {
    ASSERT_EQ(layer.queries_per_expert_size(), 16);
    double queries = 0;
    for (float q : layer.queries_per_expert()) queries += q;
    EXPECT_NEAR(queries, static_cast<double>(text.size()), 1e-2) << "every query is routed to one expert";
  }
  EXPECT_GT(response->timing().compute_us(), 0);
  EXPECT_GE(response->timing().total_us(), response->timing().compute_us());

  // Multi-byte UTF-8 is valid text: "na" + 2-byte "\u00ef" + "ve " + three 3-byte CJK characters = 16 bytes,
  // one token per byte.
  absl::StatusOr<v1::ClassifyResponse> multibyte =
      server.client().ClassifyText("na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E", Options());
  ASSERT_TRUE(multibyte.ok()) << multibyte.status();
  EXPECT_EQ(multibyte->token_count(), 16);

  // The same document as token ids (the byte values) gives the same answer.
  std::vector<int64_t> ids;
  for (char c : text) ids.push_back(static_cast<unsigned char>(c));
  absl::StatusOr<v1::ClassifyRequest> as_ids = client::BuildTokenIdsRequest(ids, options);
  ASSERT_TRUE(as_ids.ok());
  absl::StatusOr<v1::ClassifyResponse> by_ids = server.client().ClassifyRaw(*as_ids, absl::Seconds(60));
  ASSERT_TRUE(by_ids.ok()) << by_ids.status();
  EXPECT_THAT(ScoresByClass(*by_ids), ElementsAreArray(ScoresByClass(*response)));
  EXPECT_EQ(by_ids->token_count(), response->token_count());
}

TEST_F(DocumentServiceTest, BudgetsLargerThanTheDocumentAreClampedAndEchoed) {
  TestServer server(registry_, DefaultOptions());
  ASSERT_TRUE(server.status().ok()) << server.status();
  const std::string text = "A short document.";  // 17 tokens
  client::ClassifyOptions options = Options();
  options.expert_count = 256;   // the model's maximum, larger than N = 17
  options.expert_width = 1024;  // likewise
  absl::StatusOr<v1::ClassifyResponse> response = server.client().ClassifyText(text, options);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->token_count(), 17);
  EXPECT_EQ(response->budget().expert_count(), 17);
  EXPECT_EQ(response->budget().expert_width(), 17);
  // A preset and full attention.
  options = Options();
  options.preset = "fast";
  response = server.client().ClassifyText(text, options);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->budget().expert_count(), 8);
  EXPECT_EQ(response->budget().expert_width(), 17);  // min(32, 17)
  EXPECT_EQ(response->budget().preset(), "fast");
  options = Options();
  options.full_attention = true;
  options.return_statistics = true;
  response = server.client().ClassifyText(text, options);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(response->budget().full_attention());
  EXPECT_EQ(response->statistics_size(), 0);
  // Out of the model's range: INVALID_ARGUMENT naming the field, whatever the document's length.
  options = Options();
  options.expert_width = 1025;
  ExpectStatus(server.client().ClassifyText(text, options).status(), absl::StatusCode::kInvalidArgument,
               "field budget.experts.expert_width: 1025 is out of range: allowed [1, 1024]");
  options = Options();
  options.expert_count = -3;
  ExpectStatus(server.client().ClassifyText(text, options).status(), absl::StatusCode::kInvalidArgument,
               "budget.experts.expert_count");
  options = Options();
  options.preset = "turbo";
  ExpectStatus(server.client().ClassifyText(text, options).status(), absl::StatusCode::kInvalidArgument,
               "field budget.preset: unknown preset 'turbo'; available: accurate, balanced, exact, fast");
}

TEST_F(DocumentServiceTest, BadDocumentsGetInvalidArgumentNamingTheField) {
  TestServer server(registry_, DefaultOptions());
  ASSERT_TRUE(server.status().ok()) << server.status();
  const client::MitaClient& client = server.client();
  // Invalid UTF-8: a lone continuation byte at offset 5, a truncated 3-byte sequence at the end.
  ExpectStatus(client.ClassifyText(std::string("hello\x80world"), Options()).status(),
               absl::StatusCode::kInvalidArgument, "field document.text: invalid UTF-8 at byte offset 5");
  ExpectStatus(client.ClassifyText(std::string("abc\xE2\x82"), Options()).status(), absl::StatusCode::kInvalidArgument,
               "field document.text: invalid UTF-8 at byte offset 3");
  // Empty documents: defined answers.
  ExpectStatus(client.ClassifyText("", Options()).status(), absl::StatusCode::kInvalidArgument,
               "field document.text: the document is empty; a document needs at least 1 token");
  absl::StatusOr<v1::ClassifyRequest> no_ids = client::BuildTokenIdsRequest({}, Options());
  ASSERT_TRUE(no_ids.ok());
  ExpectStatus(client.ClassifyRaw(*no_ids).status(), absl::StatusCode::kInvalidArgument,
               "field document.token_ids.ids: the document is empty");
  v1::ClassifyRequest no_content;
  no_content.set_model(kDocumentModel);
  no_content.mutable_document();
  ExpectStatus(client.ClassifyRaw(no_content).status(), absl::StatusCode::kInvalidArgument,
               "field document: set document.text or document.token_ids");
  // Token ids out of the vocabulary [0, 256): index and allowed range named; an int64 beyond int32 too.
  for (int64_t bad : {int64_t{256}, int64_t{-1}, int64_t{1} << 40}) {
    absl::StatusOr<v1::ClassifyRequest> request = client::BuildTokenIdsRequest({65, 66, bad, 67}, Options());
    ASSERT_TRUE(request.ok());
    ExpectStatus(client.ClassifyRaw(*request).status(), absl::StatusCode::kInvalidArgument,
                 absl::StrCat("field document.token_ids.ids[2]: ", bad, " is out of range: allowed [0, 255]"));
  }
  // The wrong input kind, both ways.
  v1::ClassifyRequest image;
  image.set_model(kDocumentModel);
  image.set_image("\x89PNG");
  ExpectStatus(client.ClassifyRaw(image).status(), absl::StatusCode::kInvalidArgument,
               "field input: model 'random-document' takes a document (text or token ids), not an "
               "image");
  v1::ClassifyRequest nothing;
  nothing.set_model(kDocumentModel);
  ExpectStatus(client.ClassifyRaw(nothing).status(), absl::StatusCode::kInvalidArgument, "and none was set");
  // top_n beyond the classes.
  client::ClassifyOptions options = Options();
  options.top_n = kDocumentClasses + 1;
  ExpectStatus(client.ClassifyText("text", options).status(), absl::StatusCode::kInvalidArgument, "field top_n");
  // After all of that the server still serves.
  EXPECT_TRUE(client.ClassifyText("still serving", Options()).ok());
}

TEST_F(DocumentServiceTest, LengthLimitAndTruncation) {
  TestServer server(registry_, DefaultOptions());
  ASSERT_TRUE(server.status().ok()) << server.status();
  const std::string longer = text_->substr(0, kDocumentMaxTokens + 1);  // bytes: 4097 tokens
  client::ClassifyOptions options = Options();
  ExpectStatus(server.client().ClassifyText(longer, options).status(), absl::StatusCode::kInvalidArgument,
               "field document.text: the document has 4097 tokens, over the limit of 4096 tokens (the model's "
               "max_tokens); field document.truncate: set it to classify the first 4096 tokens");
  std::vector<int64_t> ids(static_cast<size_t>(kDocumentMaxTokens) + 1, 65);
  absl::StatusOr<v1::ClassifyRequest> as_ids = client::BuildTokenIdsRequest(ids, options);
  ASSERT_TRUE(as_ids.ok());
  ExpectStatus(server.client().ClassifyRaw(*as_ids).status(), absl::StatusCode::kInvalidArgument,
               "field document.token_ids.ids: the document has 4097 tokens, over the limit of 4096 tokens");
  // Truncated: the same answer as the first 4096 tokens sent alone.
  options.truncate = true;
  absl::StatusOr<v1::ClassifyResponse> truncated = server.client().ClassifyText(longer, options);
  ASSERT_TRUE(truncated.ok()) << truncated.status();
  EXPECT_EQ(truncated->token_count(), kDocumentMaxTokens);
  EXPECT_EQ(truncated->input_token_count(), kDocumentMaxTokens + 1);
  std::vector<int64_t> prefix_ids(longer.begin(), longer.begin() + kDocumentMaxTokens);
  absl::StatusOr<v1::ClassifyRequest> prefix_request = client::BuildTokenIdsRequest(prefix_ids, Options());
  ASSERT_TRUE(prefix_request.ok());
  absl::StatusOr<v1::ClassifyResponse> prefix = server.client().ClassifyRaw(*prefix_request, absl::Seconds(60));
  ASSERT_TRUE(prefix.ok()) << prefix.status();
  EXPECT_EQ(prefix->token_count(), kDocumentMaxTokens);
  EXPECT_EQ(prefix->input_token_count(), kDocumentMaxTokens);
  EXPECT_THAT(ScoresByClass(*truncated), ElementsAreArray(ScoresByClass(*prefix)));

  // A server whose batch token budget is below the model's max_tokens: the smaller limit applies and the
  // error names its flag; GetModel reports it.
  EngineOptions small = DefaultOptions();
  small.batching.max_batch_tokens = 1000;
  TestServer limited(registry_, small);
  ASSERT_TRUE(limited.status().ok()) << limited.status();
  ExpectStatus(limited.client().ClassifyText(text_->substr(0, 1001), Options()).status(),
               absl::StatusCode::kInvalidArgument,
               "the document has 1001 tokens, over the limit of 1000 tokens (flag --max_batch_tokens)");
  absl::StatusOr<v1::ModelMetadata> metadata = limited.client().GetModel(kDocumentModel);
  ASSERT_TRUE(metadata.ok()) << metadata.status();
  EXPECT_EQ(metadata->document_limits().max_tokens(), 1000);
}

// A 64K-token document, as text and as ids, fits the default gRPC receive limit of mita-server (4 MiB +
// 64 KiB): the request reaches the service (which answers with its own length error for this 4096-token
// model) instead of being refused by gRPC with RESOURCE_EXHAUSTED.
TEST_F(DocumentServiceTest, SixtyFourThousandTokenDocumentsFitTheDefaultMessageLimit) {
  TestServer server(registry_, DefaultOptions(), /*max_receive_message_bytes=*/(4 << 20) + (64 << 10));
  ASSERT_TRUE(server.status().ok()) << server.status();
  std::string text;
  while (text.size() < 65536) text += *text_;
  text = Utf8Prefix(text, 65536);
  ExpectStatus(server.client().ClassifyText(text, Options()).status(), absl::StatusCode::kInvalidArgument,
               "over the limit of 4096 tokens");
  // Ids near the top of a 64K vocabulary take 3 bytes each as varints; 65,536 of them.
  std::vector<int64_t> ids(65536, 65535);
  absl::StatusOr<v1::ClassifyRequest> request = client::BuildTokenIdsRequest(ids, Options());
  ASSERT_TRUE(request.ok());
  ExpectStatus(server.client().ClassifyRaw(*request).status(), absl::StatusCode::kInvalidArgument,
               "is out of range: allowed [0, 255]");
}

// Issue 3: documents of different lengths and budgets share one packed batch (no padding) and each gets the
// same answer as when it runs alone.
TEST_F(DocumentServiceTest, MixedBatchEqualsEachRequestAlone) {
  struct Item {
    size_t offset, length;
    std::optional<int64_t> expert_count, expert_width;
    std::string preset;
    bool full = false;
  };
  const std::vector<Item> items = {
      {0, 3000, std::nullopt, std::nullopt, "", false},  // default budget (16, 64)
      {100, 40, std::nullopt, std::nullopt, "fast", false},
      {500, 1200, 4, 16, "", false},
      {2000, 700, std::nullopt, std::nullopt, "", true},    // full attention
      {3000, 9, 200, 1000, "", false},                      // m and k clamped to N = 9
      {4000, 2048, 64, 256, "", false},
  };
  std::vector<v1::ClassifyRequest> requests;
  for (const Item& item : items) {
    client::ClassifyOptions options = Options();
    options.expert_count = item.expert_count;
    options.expert_width = item.expert_width;
    options.preset = item.preset;
    options.full_attention = item.full;
    options.return_statistics = true;
    requests.push_back(TextRequest(Utf8Prefix(text_->substr(item.offset), item.length), options));
  }
  // Together: one batch of all six (max_batch_size = 6 makes it full when the last arrives; the 10 s delay
  // never expires).
  EngineOptions together = DefaultOptions();
  together.batching.max_batch_size = static_cast<int64_t>(items.size());
  together.batching.max_queue_delay = absl::Seconds(10);
  std::vector<absl::StatusOr<v1::ClassifyResponse>> batched(items.size(), absl::UnknownError("not run"));
  {
    TestServer server(registry_, together);
    ASSERT_TRUE(server.status().ok()) << server.status();
    std::vector<std::thread> threads;
    for (size_t i = 0; i < items.size(); ++i) {
      threads.emplace_back([&, i] { batched[i] = server.client().ClassifyRaw(requests[i], absl::Seconds(60)); });
    }
    for (std::thread& thread : threads) thread.join();
  }
  // Alone: batches of one.
  EngineOptions alone_options = DefaultOptions();
  alone_options.batching.max_batch_size = 1;
  TestServer alone_server(registry_, alone_options);
  ASSERT_TRUE(alone_server.status().ok()) << alone_server.status();
  int64_t batch_tokens = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    ASSERT_TRUE(batched[i].ok()) << "item " << i << ": " << batched[i].status();
    EXPECT_EQ(batched[i]->timing().batch_size(), static_cast<int>(items.size())) << "item " << i;
    batch_tokens += batched[i]->token_count();
    absl::StatusOr<v1::ClassifyResponse> alone = alone_server.client().ClassifyRaw(requests[i], absl::Seconds(60));
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_EQ(alone->timing().batch_size(), 1);
    EXPECT_EQ(alone->token_count(), batched[i]->token_count());
    EXPECT_EQ(alone->budget().expert_count(), batched[i]->budget().expert_count());
    EXPECT_EQ(alone->budget().expert_width(), batched[i]->budget().expert_width());
    const std::vector<float> together_scores = ScoresByClass(*batched[i]);
    const std::vector<float> alone_scores = ScoresByClass(*alone);
    for (int c = 0; c < kDocumentClasses; ++c) {
      EXPECT_NEAR(together_scores[static_cast<size_t>(c)], alone_scores[static_cast<size_t>(c)], 1e-5f)
          << "item " << i << " class " << c;
    }
    ASSERT_EQ(alone->statistics_size(), batched[i]->statistics_size());
    for (int layer = 0; layer < alone->statistics_size(); ++layer) {
      const v1::LayerStatistics& a = alone->statistics(layer);
      const v1::LayerStatistics& b = batched[i]->statistics(layer);
      ASSERT_EQ(a.queries_per_expert_size(), b.queries_per_expert_size());
      // The routing may differ by a query at a float near-tie (averaged over 2 heads: 0.5).
      for (int e = 0; e < a.queries_per_expert_size(); ++e) {
        EXPECT_NEAR(a.queries_per_expert(e), b.queries_per_expert(e), 1.0) << "item " << i << " layer " << layer;
      }
    }
  }
  EXPECT_EQ(batched[4]->budget().expert_count(), 9);
  EXPECT_EQ(batched[4]->budget().expert_width(), 9);
  EXPECT_TRUE(batched[3]->budget().full_attention());
  EXPECT_GT(batch_tokens, 6000) << "the packed batch held every document's tokens";
}

TEST_F(DocumentServiceTest, GetModelDeclaresDocumentLimitsAndKnobs) {
  TestServer server(registry_, DefaultOptions());
  ASSERT_TRUE(server.status().ok()) << server.status();
  absl::StatusOr<v1::ModelMetadata> model = server.client().GetModel(kDocumentModel);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->architecture(), "mita_document");
  EXPECT_EQ(model->input_kind(), v1::INPUT_KIND_DOCUMENT);
  EXPECT_EQ(model->document_limits().max_tokens(), kDocumentMaxTokens);
  EXPECT_EQ(model->document_limits().vocabulary_size(), 256);
  EXPECT_EQ(model->document_limits().tokenizer(), "bytes");
  EXPECT_FALSE(model->has_image_limits());
  EXPECT_EQ(model->labels_size(), kDocumentClasses);
  const v1::Knobs& knobs = model->knobs();
  EXPECT_EQ(knobs.allowed_expert_counts_size(), 0);
  EXPECT_EQ(knobs.min_expert_count(), 1);
  EXPECT_EQ(knobs.max_expert_count(), 256);
  EXPECT_EQ(knobs.min_expert_width(), 1);
  EXPECT_EQ(knobs.max_expert_width(), 1024);
  EXPECT_EQ(knobs.default_budget().expert_count(), 16);
  EXPECT_EQ(knobs.default_budget().expert_width(), 64);
  ASSERT_EQ(knobs.presets_size(), 4);
  EXPECT_EQ(knobs.presets(2).name(), "exact");
  EXPECT_TRUE(knobs.presets(2).full_attention());
  EXPECT_EQ(knobs.presets(3).name(), "fast");
  EXPECT_EQ(knobs.presets(3).budget().expert_count(), 8);
  EXPECT_FALSE(knobs.presets(3).full_attention());
  EXPECT_TRUE(knobs.full_attention_supported());
  EXPECT_EQ(model->layers(), 2);
  EXPECT_EQ(model->heads(), 2);
  EXPECT_EQ(model->embed_dim(), 32);
}

TEST_F(DocumentServiceTest, AdmissionCountsDocumentTokensAndComputeUnits) {
  // Queue capacity 300,000 compute units: a 3000-token document at M + k = 16 + 64 costs 240,000 and is
  // admitted; the same document under full attention costs 9,000,000, more than the whole queue.
  EngineOptions options = DefaultOptions();
  options.batching.queue_compute_units = 300000;
  TestServer server(registry_, options);
  ASSERT_TRUE(server.status().ok()) << server.status();
  const std::string text = Utf8Prefix(*text_, 3000);
  ASSERT_EQ(text.size(), 3000u);
  ASSERT_TRUE(server.client().ClassifyText(text, Options()).ok());
  client::ClassifyOptions full = Options();
  full.full_attention = true;
  ExpectStatus(server.client().ClassifyText(text, full).status(), absl::StatusCode::kResourceExhausted,
               "request needs 9000000 compute units (tokens x attention width), more than the queue's capacity of "
               "300000 (flag --queue_compute_units)");
  const prometheus::Registry& registry = server.registry();
  EXPECT_EQ(MetricValue(registry, "mita_rejected_requests_total",
                        {{"model", kDocumentModel}, {"reason", "task_over_queue_compute_units"}}),
            1);
  double tokens_sum = -1, batch_tokens_count = -1, layer_count = -1;
  for (const prometheus::MetricFamily& family : registry.Collect()) {
    for (const prometheus::ClientMetric& metric : family.metric) {
      if (family.name == "mita_request_tokens") tokens_sum = metric.histogram.sample_sum;
      if (family.name == "mita_batch_tokens") batch_tokens_count = static_cast<double>(metric.histogram.sample_count);
      if (family.name == "mita_attention_pruned_key_fraction") {
        layer_count = std::max(layer_count, static_cast<double>(metric.histogram.sample_count));
      }
    }
  }
  EXPECT_EQ(tokens_sum, 3000);
  EXPECT_EQ(batch_tokens_count, 1);
  EXPECT_EQ(layer_count, 1) << "the attention series work for document models";
}

// The embedded document model (models/repository/linux-doc-mita, SentencePiece tokenizer) end to end over
// loopback: real text, its GetModel metadata, and a document longer than 16K tokens.
TEST(EmbeddedDocumentModelTest, ClassifiesRealTextOverLoopback) {
  constexpr char kEmbedded[] = "linux-doc-mita";
  const std::string directory = absl::StrCat(SourceDirectory(), "/models/repository/", kEmbedded);
  absl::StatusOr<models::ModelPackage> package = models::LoadModelPackage(directory);
  ASSERT_TRUE(package.ok()) << package.status();
  package->name = kEmbedded;
  std::vector<models::ModelPackage> packages;
  packages.push_back(*std::move(package));
  absl::StatusOr<std::unique_ptr<ModelRegistry>> registry = ModelRegistry::FromPackages(std::move(packages));
  ASSERT_TRUE(registry.ok()) << registry.status();
  TestServer server(registry->get(), EngineOptions());
  ASSERT_TRUE(server.status().ok()) << server.status();
  const client::MitaClient& client = server.client();

  absl::StatusOr<v1::ModelMetadata> model = client.GetModel(kEmbedded);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->input_kind(), v1::INPUT_KIND_DOCUMENT);
  EXPECT_EQ(model->document_limits().tokenizer(), "sentencepiece");
  EXPECT_GE(model->document_limits().max_tokens(), 65536);
  const int labels = model->labels_size();
  ASSERT_GT(labels, 1);

  const std::string text = RealText();
  client::ClassifyOptions options;
  options.model = kEmbedded;
  options.deadline = absl::Seconds(120);
  options.top_n = labels;
  options.return_statistics = true;
  absl::StatusOr<v1::ClassifyResponse> response = client.ClassifyText(text, options);
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(response->classes_size(), labels);
  float total = 0;
  for (const v1::ClassScore& score : response->classes()) {
    EXPECT_EQ(score.label(), model->labels(score.index()));
    total += score.score();
  }
  EXPECT_NEAR(total, 1.0f, 1e-4f);
  // SentencePiece: fewer tokens than bytes, more than one per 16 bytes.
  EXPECT_LT(response->token_count(), static_cast<int64_t>(text.size()));
  EXPECT_GT(response->token_count(), static_cast<int64_t>(text.size()) / 16);
  EXPECT_GE(response->token_count(), 16384) << "the test's real text is a long document";
  EXPECT_EQ(response->statistics_size(), model->layers());
  std::cout << "embedded document model: " << response->token_count() << " tokens classified in "
            << response->timing().compute_us() / 1000.0 << " ms of compute (default budget)\n";
}

TEST(ComputeUnitsTest, TokensTimesAttentionWidth) {
  models::AttentionBudget mita;
  mita.expert_count = 9;
  mita.expert_width = 16;
  EXPECT_EQ(ComputeUnits(50, mita), 50 * 25);
  models::AttentionBudget full;
  full.full_attention = true;
  EXPECT_EQ(ComputeUnits(65536, full), int64_t{65536} * 65536);
}

TEST(ClientTest, ParseTokenIds) {
  absl::StatusOr<std::vector<int64_t>> ids = client::ParseTokenIds("1 2,3\n\t40000000000 ,, 0\n");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre(1, 2, 3, 40000000000, 0));
  EXPECT_TRUE(client::ParseTokenIds("").ok());
  absl::Status bad = client::ParseTokenIds("1 2 x3").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("ids[2]: 'x3'"));
  EXPECT_FALSE(client::ParseTokenIds("99999999999999999999").ok()) << "over int64";
}

TEST(ClientTest, ReplicaTargetsAndServiceConfig) {
  // A list of IP literals becomes gRPC's ipv4:/ipv6: target; names and URIs pass as they are.
  EXPECT_EQ(*client::ResolveTarget("127.0.0.1:5000,127.0.0.2:5000"), "ipv4:127.0.0.1:5000,127.0.0.2:5000");
  EXPECT_EQ(*client::ResolveTarget("[::1]:5000,[::2]:5001"), "ipv6:[::1]:5000,[::2]:5001");
  EXPECT_EQ(*client::ResolveTarget("localhost:50051"), "localhost:50051");
  EXPECT_EQ(*client::ResolveTarget("dns:///mita-serve.ns.svc.cluster.local:50051"),
            "dns:///mita-serve.ns.svc.cluster.local:50051");
  EXPECT_EQ(*client::ResolveTarget("[::1]:65535"), "[::1]:65535");
  EXPECT_EQ(*client::ResolveTarget("dns:///[::1]:1"), "dns:///[::1]:1");
  EXPECT_EQ(*client::ResolveTarget("dns:///mita-serve"), "dns:///mita-serve") << "gRPC's default port";
  for (const char* bad : {"127.0.0.1:5000,host:5000", "127.0.0.1:5000,", "127.0.0.1,127.0.0.2:1",
                          "127.0.0.1:5000,[::1]:5000", "127.0.0.1:70000,127.0.0.2:1", "127.0.0.1:116307",
                          "127.0.0.1:50771abc", "127.0.0.1:-14765", "localhost:116307", "127.0.0.1:abc",
                          "127.0.0.1", "127.0.0.1:", ":50051", "", "127.0.0.1:+5077", "127.0.0.1:050771",
                          "127.0.0.1:0", "dns:///127.0.0.1:116307", "dns:///localhost:x"}) {
    const absl::Status status = client::ResolveTarget(bad).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_THAT(std::string(client::ResolveTarget("127.0.0.1:5000,host:5000").status().message()),
              HasSubstr("entry 'host:5000' is not an IP address with a port"));
  EXPECT_THAT(std::string(client::ResolveTarget("127.0.0.1:116307").status().message()),
              HasSubstr("with a port in [1, 65535]"));

  // The documented policy: round_robin, health checking, 5 attempts on UNAVAILABLE, for both services.
  absl::StatusOr<std::string> json = client::ServiceConfigJson(client::ReplicaPolicy{});
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(*json,
            R"({"loadBalancingConfig":[{"round_robin":{}}],"healthCheckConfig":{"serviceName":""},)"
            R"("methodConfig":[{"name":[{"service":"mita.v1.MitaService"},)"
            R"({"service":"inference.GRPCInferenceService"}],"retryPolicy":{"maxAttempts":5,)"
            R"("initialBackoff":"0.05s","maxBackoff":"1s","backoffMultiplier":2,)"
            R"("retryableStatusCodes":["UNAVAILABLE"]}}]})");
  // gRPC accepts it: a channel is made with it.
  client::ConnectionOptions options;
  options.target = "127.0.0.1:1,127.0.0.2:1";
  options.service_config_json = *json;
  EXPECT_TRUE(client::CreateChannel(options).ok());
  client::ReplicaPolicy plain;
  plain.load_balancing = "pick_first";
  plain.health_check = false;
  plain.max_attempts = 1;
  EXPECT_EQ(*client::ServiceConfigJson(plain), R"({"loadBalancingConfig":[{"pick_first":{}}]})");
  plain.max_attempts = 6;
  EXPECT_THAT(std::string(client::ServiceConfigJson(plain).status().message()), HasSubstr("allowed [1, 5]"));
  plain.max_attempts = 1;
  plain.health_check = true;
  EXPECT_THAT(std::string(client::ServiceConfigJson(plain).status().message()), HasSubstr("needs round_robin"));
  plain.load_balancing = "least_request";
  EXPECT_EQ(client::ServiceConfigJson(plain).status().code(), absl::StatusCode::kInvalidArgument);
  // A service config gRPC rejects is refused with its reason.
  options.service_config_json = R"({"loadBalancingConfig":[{"nope":{}}]})";
  const absl::Status rejected = client::CreateChannel(options).status();
  EXPECT_EQ(rejected.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(rejected.message()), HasSubstr("nope"));
}

TEST(StatusMappingTest, EveryCodeMapsToTheSameGrpcCode) {
  for (int code = 1; code <= 16; ++code) {
    const absl::Status status(static_cast<absl::StatusCode>(code), "message");
    const grpc::Status mapped = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(mapped.error_code()), code);
    EXPECT_EQ(mapped.error_message(), "message");
  }
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

// A failed forward answers every request of its batch: out of memory stays RESOURCE_EXHAUSTED (retryable, with
// the advice), everything else is INTERNAL; both name the model. Also through the exception mapping that the
// batch thread's catch block uses (kernels::CurrentExceptionStatus).
TEST(BatchFailureTest, OutOfMemoryStaysResourceExhaustedAndOtherFaultsAreInternal) {
  const absl::Status oom = BatchFailure("m", "cpu", 3, 150, absl::ResourceExhaustedError("attention: out of memory"));
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(oom.message()),
              ::testing::HasSubstr("model 'm' ran out of memory on cpu for this batch of 3 requests, 150 tokens"));
  EXPECT_THAT(std::string(oom.message()), ::testing::HasSubstr("smaller budget"));
  const absl::Status fault = BatchFailure("m", "cpu", 3, 150, absl::InvalidArgumentError("images: shape [1]"));
  EXPECT_EQ(fault.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(fault.message(), "model 'm' failed: images: shape [1]");
  absl::Status thrown;
  try {
    throw std::bad_alloc();
  } catch (...) {
    thrown = BatchFailure("m", "cpu", 1, 50, kernels::CurrentExceptionStatus("batch"));
  }
  EXPECT_EQ(thrown.code(), absl::StatusCode::kResourceExhausted) << thrown;
}

TEST(ModelRegistryTest, MissingRepositoryIsNotFound) {
  absl::StatusOr<std::unique_ptr<ModelRegistry>> registry =
      ModelRegistry::LoadFromDirectory("/nonexistent/model/repository");
  EXPECT_EQ(registry.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(registry.status().message()), HasSubstr("/nonexistent/model/repository"));
}

TEST(ResolveTopNTest, DefaultsAndRange) {
  EXPECT_EQ(*ResolveTopN(0, 10), 5);
  EXPECT_EQ(*ResolveTopN(0, 3), 3);
  EXPECT_EQ(*ResolveTopN(10, 10), 10);
  EXPECT_EQ(ResolveTopN(11, 10).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveTopN(-1, 10).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mita::server
