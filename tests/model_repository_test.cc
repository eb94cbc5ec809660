// The model repository on disk (server/engine/model_repository.h: folders, versions, version policies) and the
// models' lifecycle while serving (server/engine/model_lifecycle.h), through the mita.v1 repository API of an
// in-process server on the embedded image model. The same lifecycle under load and through Triton's client:
// tests/model_lifecycle_test.py.
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "mita/v1/mita.grpc.pb.h"
#include "server/engine/model_lifecycle.h"
#include "server/engine/model_repository.h"
#include "tests/server_test_util.h"
#include "tests/test_util.h"

namespace mita::server {
namespace {

namespace fs = std::filesystem;
using test_util::ExpectStatus;
using ::testing::ElementsAre;

constexpr char kModel[] = "fashion-mnist-vit";

// A copy of the embedded image package at `directory`.
void CopyPackage(const fs::path& directory) {
  fs::create_directories(directory.parent_path());
  fs::copy(fs::path(test_util::RepositoryPath()) / kModel, directory, fs::copy_options::recursive);
}

std::vector<int64_t> Versions(const std::vector<VersionFolder>& folders) {
  std::vector<int64_t> versions;
  for (const VersionFolder& folder : folders) versions.push_back(folder.version);
  return versions;
}

TEST(ModelRepositoryTest, ReadsPackagesVersionsAndPolicies) {
  const fs::path root = test_util::MakeTempDirectory("repository_layout");
  CopyPackage(root / "plain");
  for (const char* version : {"1", "2", "10"}) CopyPackage(root / "versioned" / version);
  fs::create_directories(root / "versioned" / "abc");      // not a version: ignored
  fs::create_directories(root / "versioned" / ".hidden");  // likewise
  fs::create_directories(root / ".hidden-model");
  fs::create_directories(root / "empty");

  absl::StatusOr<std::vector<std::string>> names = ModelFolderNames(root.string());
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_THAT(*names, ElementsAre("empty", "plain", "versioned"));

  absl::StatusOr<ModelFolder> plain = ReadModelFolder(root.string(), "plain");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->versioned);
  ASSERT_EQ(plain->versions.size(), 1u);
  EXPECT_EQ(plain->versions[0].version, 1);
  EXPECT_EQ(plain->versions[0].directory, (root / "plain").string());

  absl::StatusOr<ModelFolder> versioned = ReadModelFolder(root.string(), "versioned");
  ASSERT_TRUE(versioned.ok()) << versioned.status();
  EXPECT_TRUE(versioned->versioned);
  EXPECT_THAT(Versions(versioned->versions), ElementsAre(1, 2, 10));
  // Default policy: the latest version.
  EXPECT_THAT(Versions(*ServedVersions(*versioned)), ElementsAre(10));

  const fs::path policy = root / "versioned" / "version_policy.json";
  test_util::WriteFile(policy.string(), R"({"latest": 2})");
  EXPECT_THAT(Versions(*ServedVersions(*ReadModelFolder(root.string(), "versioned"))), ElementsAre(2, 10));
  test_util::WriteFile(policy.string(), R"({"specific": [2, 1, 2]})");
  EXPECT_THAT(Versions(*ServedVersions(*ReadModelFolder(root.string(), "versioned"))), ElementsAre(1, 2));
  test_util::WriteFile(policy.string(), R"({"all": true})");
  EXPECT_THAT(Versions(*ServedVersions(*ReadModelFolder(root.string(), "versioned"))), ElementsAre(1, 2, 10));
  test_util::WriteFile(policy.string(), R"({"specific": [3]})");
  ExpectStatus(ServedVersions(*ReadModelFolder(root.string(), "versioned")).status(), absl::StatusCode::kNotFound,
               "version_policy.json names version 3; the folder holds 1, 2, 10");

  for (const auto& [text, why] : std::vector<std::pair<std::string, std::string>>{
           {"not json", "not a JSON object"},
           {R"({"latest": 0})", "\"latest\" must be an integer >= 1"},
           {R"({"latest": 1, "all": true})", "has 2 keys"},
           {R"({"specific": []})", "\"specific\" must be a non-empty list of versions"},
           {R"({"specific": [1, "2"]})", "a version must be an integer >= 1"},
           {R"({"all": false})", "\"all\" must be true"},
           {R"({"newest": 1})", "unknown key \"newest\""}}) {
    test_util::WriteFile(policy.string(), text);
    ExpectStatus(ReadModelFolder(root.string(), "versioned").status(), absl::StatusCode::kInvalidArgument,
                 absl::StrCat(policy.string(), ": ", why));
  }
  fs::remove(policy);

  ExpectStatus(ReadModelFolder(root.string(), "empty").status(), absl::StatusCode::kNotFound,
               "holds neither config.json nor a version folder (1, 2, ...)");
  ExpectStatus(ReadModelFolder(root.string(), "missing").status(), absl::StatusCode::kNotFound,
               "has no folder 'missing'");
  for (const std::string& name : std::vector<std::string>{"../plain", ".hidden-model", "versioned/1", "",
                                                         std::string(300, 'x')}) {
    ExpectStatus(ReadModelFolder(root.string(), name).status(), absl::StatusCode::kInvalidArgument,
                 "is not a model folder name: 1 to 255 bytes, no '/', not starting with '.'");
  }
  // Names come from requests: echoed escaped.
  ExpectStatus(ReadModelFolder(root.string(), "a\nb").status(), absl::StatusCode::kNotFound, "has no folder 'a\\nb'");

  // The fingerprint follows the files: a changed file changes it, an unchanged folder keeps it.
  const std::string before = ReadModelFolder(root.string(), "versioned")->fingerprint;
  EXPECT_EQ(ReadModelFolder(root.string(), "versioned")->fingerprint, before);
  const fs::path labels = root / "versioned" / "2" / "labels.txt";
  fs::last_write_time(labels, fs::last_write_time(labels) + std::chrono::seconds(1));
  EXPECT_NE(ReadModelFolder(root.string(), "versioned")->fingerprint, before);

  // A version loads under its model's name.
  absl::StatusOr<models::ModelPackage> package = LoadModelVersion(
      root.string(), *versioned, versioned->versions[1], models::Placement{});
  ASSERT_TRUE(package.ok()) << package.status();
  EXPECT_EQ(package->name, "versioned");
  EXPECT_EQ(package->classifier->description().name, "versioned");
}

TEST(ModelRepositoryTest, ModelControlModes) {
  EXPECT_EQ(*ParseModelControlMode("none"), ModelControlMode::kNone);
  EXPECT_EQ(*ParseModelControlMode("explicit"), ModelControlMode::kExplicit);
  EXPECT_EQ(*ParseModelControlMode("poll"), ModelControlMode::kPoll);
  ExpectStatus(ParseModelControlMode("manual").status(), absl::StatusCode::kInvalidArgument,
               "flag --model_control_mode: 'manual' is not a mode: use none, explicit or poll");
}

// The repository API of mita.v1 on an in-process server: versions served and named by requests and answers.
class ModelLifecycleServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = test_util::MakeTempDirectory("repository_service");
    CopyPackage(root_ / kModel / "1");
  }

  std::unique_ptr<test_util::InProcessServer> Start(ModelControlMode mode) {
    test_util::InProcessServerOptions options;
    options.lifecycle_repository = root_.string();
    options.model_control_mode = mode;
    auto server = std::make_unique<test_util::InProcessServer>(nullptr, std::move(options));
    EXPECT_TRUE(server->status().ok()) << server->status();
    return server;
  }

  static std::unique_ptr<v1::MitaService::Stub> Stub(const test_util::InProcessServer& server) {
    return v1::MitaService::NewStub(grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials()));
  }

  // Classifies one image at `version`; the answer's model version, or -1 with `*status` set.
  int64_t Classify(v1::MitaService::Stub& stub, int64_t version, grpc::Status* status = nullptr) {
    static const std::string* const png =
        new std::string(test_util::FashionMnistTestPngs(1)->pngs.at(0));
    v1::ClassifyRequest request;
    request.set_model(kModel);
    request.set_image(*png);
    request.set_model_version(version);
    v1::ClassifyResponse response;
    grpc::ClientContext context;
    const grpc::Status answer = stub.Classify(&context, request, &response);
    if (status != nullptr) *status = answer;
    if (!answer.ok()) return -1;
    EXPECT_EQ(response.model(), kModel);
    EXPECT_EQ(response.classes_size(), 5);
    return response.model_version();
  }

  fs::path root_;
};

TEST_F(ModelLifecycleServiceTest, LoadsReplacesAndUnloadsVersions) {
  std::unique_ptr<test_util::InProcessServer> server = Start(ModelControlMode::kExplicit);
  std::unique_ptr<v1::MitaService::Stub> stub = Stub(*server);
  EXPECT_EQ(Classify(*stub, 0), 1);

  CopyPackage(root_ / kModel / "2");
  test_util::WriteFile((root_ / kModel / "version_policy.json").string(), R"({"all": true})");
  {
    v1::LoadModelRequest request;
    request.set_name(kModel);
    v1::LoadModelResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(stub->LoadModel(&context, request, &response).ok());
    ASSERT_EQ(response.entries_size(), 2);
    EXPECT_EQ(response.entries(1).version(), 2);
    EXPECT_EQ(response.entries(1).state(), "READY");
  }
  EXPECT_EQ(Classify(*stub, 0), 2);  // the highest version by default
  EXPECT_EQ(Classify(*stub, 1), 1);
  {
    v1::GetModelRequest request;
    request.set_name(kModel);
    v1::ModelMetadata response;
    grpc::ClientContext context;
    ASSERT_TRUE(stub->GetModel(&context, request, &response).ok());
    EXPECT_EQ(response.version(), 2);
    EXPECT_THAT(response.versions(), ElementsAre(1, 2));
  }

  // Back to the latest only: version 1 is unloaded, and a request naming it is NOT_FOUND.
  std::filesystem::remove(root_ / kModel / "version_policy.json");
  ASSERT_TRUE(server->lifecycle()->Load(kModel).ok());
  grpc::Status status;
  EXPECT_EQ(Classify(*stub, 1, &status), -1);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "model 'fashion-mnist-vit' has no version 1; served: 2");
  EXPECT_EQ(Classify(*stub, -1, &status), -1);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "field model_version: -1 is out of range: allowed >= 0 (0: the latest)");

  // A version that fails to load leaves the serving one in place; the index says why.
  CopyPackage(root_ / kModel / "3");
  test_util::WriteFile((root_ / kModel / "3" / "config.json").string(), "{");
  ExpectStatus(server->lifecycle()->Load(kModel), absl::StatusCode::kFailedPrecondition,
               "model 'fashion-mnist-vit' version 3 failed to load: model package '");
  EXPECT_EQ(Classify(*stub, 0), 2);
  {
    v1::ListRepositoryRequest request;
    v1::ListRepositoryResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(stub->ListRepository(&context, request, &response).ok());
    ASSERT_EQ(response.entries_size(), 3);
    EXPECT_EQ(response.entries(0).state(), "UNAVAILABLE");  // version 1: no longer chosen
    EXPECT_EQ(response.entries(0).reason(), "unloaded: the version policy no longer chooses it");
    EXPECT_EQ(response.entries(1).state(), "READY");
    EXPECT_EQ(response.entries(2).version(), 3);
    EXPECT_EQ(response.entries(2).state(), "UNAVAILABLE");
    EXPECT_THAT(response.entries(2).reason(), ::testing::HasSubstr("config.json"));
    request.set_ready_only(true);
    grpc::ClientContext ready_context;
    ASSERT_TRUE(stub->ListRepository(&ready_context, request, &response).ok());
    ASSERT_EQ(response.entries_size(), 1);
    EXPECT_EQ(response.entries(0).version(), 2);
  }
  std::filesystem::remove_all(root_ / kModel / "3");

  {
    v1::UnloadModelRequest request;
    request.set_name(kModel);
    v1::UnloadModelResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(stub->UnloadModel(&context, request, &response).ok());
  }
  EXPECT_EQ(Classify(*stub, 0, &status), -1);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(server->engine().models().empty());
  ExpectStatus(server->lifecycle()->Unload("no-such-model"), absl::StatusCode::kNotFound,
               "model 'no-such-model' is neither loaded nor in the repository");
  ExpectStatus(server->lifecycle()->Load("no-such-model"), absl::StatusCode::kNotFound, "has no folder 'no-such-model'");
  // Loaded again from its folder.
  ASSERT_TRUE(server->lifecycle()->Load(kModel).ok());
  EXPECT_EQ(Classify(*stub, 0), 2);
}

TEST_F(ModelLifecycleServiceTest, ModeNoneRefusesTheApi) {
  std::unique_ptr<test_util::InProcessServer> server = Start(ModelControlMode::kNone);
  std::unique_ptr<v1::MitaService::Stub> stub = Stub(*server);
  v1::LoadModelRequest request;
  request.set_name(kModel);
  v1::LoadModelResponse response;
  grpc::ClientContext context;
  const grpc::Status status = stub->LoadModel(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(status.error_message(),
            "loading a model is not allowed: the server runs with --model_control_mode=none (models are fixed); start "
            "it with --model_control_mode=explicit to load and unload models by request");
  EXPECT_EQ(Classify(*stub, 0), 1);
}

TEST(ModelLifecycleWithoutRepositoryTest, ApiIsUnimplemented) {
  absl::StatusOr<std::unique_ptr<ModelRegistry>> registry = ModelRegistry::LoadFromDirectory(test_util::RepositoryPath());
  ASSERT_TRUE(registry.ok()) << registry.status();
  test_util::InProcessServer server(registry->get(), test_util::InProcessServerOptions{});
  ASSERT_TRUE(server.status().ok()) << server.status();
  std::unique_ptr<v1::MitaService::Stub> stub =
      v1::MitaService::NewStub(grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials()));
  v1::ListRepositoryRequest request;
  v1::ListRepositoryResponse response;
  grpc::ClientContext context;
  const grpc::Status status = stub->ListRepository(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(status.error_message(), "this server has no model repository API");
}

}  // namespace
}  // namespace mita::server
