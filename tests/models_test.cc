// Tests of models/: config parsing and budgets, safetensors, model packages, and the MiTA-ViT classifier
// against its independent PyTorch twin (tools/mita_reference.py via tools/reference_logits.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Formatting.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/Context.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/stack.h>
#include <ATen/record_function.h>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/forward_scopes.h"
#include "models/classifier_errors.h"
#include "models/model_config.h"
#include "models/model_package.h"
#include "models/request_error.h"
#include "models/safetensors.h"
#include "models/vit_classifier.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"
#include "tools/accuracy_order.h"
#include "tools/fashion_mnist.h"
#include "tools/fashion_mnist_inputs.h"

namespace mita::models {
namespace {

using Json = nlohmann::json;

// ----- helpers -----

using test_util::ExpectStatus;
using test_util::kPython;
using test_util::MakeTempDirectory;
using test_util::ReadFile;
using test_util::RepositoryPath;
using test_util::SourceDirectory;
using test_util::WriteFile;

std::string LittleEndian64(uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xFF);
  return bytes;
}

// A safetensors file from header JSON text and the data buffer, written by hand.
std::string SafetensorsFile(const std::string& header, const std::string& data) {
  return LittleEndian64(header.size()) + header + data;
}

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// Writes float32 tensors as safetensors (name order, contiguous offsets).
std::string SafetensorsFromTensors(const std::map<std::string, at::Tensor>& tensors) {
  Json header = Json::object();
  std::string data;
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor contiguous = tensor.contiguous();
    const size_t begin = data.size();
    data.append(static_cast<const char*>(contiguous.data_ptr()), contiguous.numel() * sizeof(float));
    header[name] = {{"dtype", "F32"},
                    {"shape", std::vector<int64_t>(tensor.sizes().begin(), tensor.sizes().end())},
                    {"data_offsets", {begin, data.size()}}};
  }
  return SafetensorsFile(header.dump(), data);
}

// ----- config -----

// config.json as written by tools/train_image.py.
Json ValidConfigJson() {
  return Json::parse(R"({
    "architecture": "mita_vit", "task": "image_classification",
    "image_size": 28, "patch_size": 4, "in_channels": 1,
    "embed_dim": 96, "depth": 4, "num_heads": 4, "mlp_hidden_dim": 192,
    "layer_norm_eps": 1e-6, "num_classes": 10,
    "normalization": {"mean": [0.2860], "std": [0.3530]},
    "attention": {"type": "mita", "depthwise_conv": true,
                  "default_budget": {"expert_count": 9, "expert_width": 16},
                  "presets": {"fast": {"expert_count": 4, "expert_width": 8},
                              "balanced": {"expert_count": 9, "expert_width": 16},
                              "accurate": {"expert_count": 16, "expert_width": 32},
                              "exact": {"full_attention": true}}}
  })");
}

TEST(ModelConfigTest, ValidConfigParses) {
  absl::StatusOr<VitConfig> config = ParseVitConfig(ValidConfigJson().dump());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, "mita_vit");
  EXPECT_EQ(config->image_size, 28);
  EXPECT_EQ(config->patch_size, 4);
  EXPECT_EQ(config->grid_side(), 7);
  EXPECT_EQ(config->tokens(), 50);
  EXPECT_EQ(config->head_dim(), 24);
  EXPECT_EQ(config->mlp_hidden_dim, 192);
  EXPECT_DOUBLE_EQ(config->layer_norm_eps, 1e-6);
  EXPECT_EQ(config->num_classes, 10);
  EXPECT_EQ(config->mean, std::vector<float>{0.286f});
  EXPECT_EQ(config->std, std::vector<float>{0.353f});
  EXPECT_TRUE(config->depthwise_conv);
  EXPECT_EQ(config->default_budget.expert_count, 9);
  EXPECT_EQ(config->default_budget.expert_width, 16);
  ASSERT_EQ(config->presets.size(), 4u);
  EXPECT_EQ(config->presets.at("fast").expert_count, 4);
  EXPECT_EQ(config->presets.at("accurate").expert_width, 32);
  EXPECT_TRUE(config->presets.at("exact").full_attention);
  EXPECT_EQ(config->max_image_side, 4096);
}

TEST(ModelConfigTest, EachMissingFieldIsNamed) {
  for (const std::string pointer :
       {"/architecture", "/image_size", "/patch_size", "/in_channels", "/embed_dim", "/depth", "/num_heads",
        "/mlp_hidden_dim", "/num_classes", "/normalization", "/normalization/mean", "/normalization/std",
        "/attention", "/attention/type", "/attention/default_budget", "/attention/default_budget/expert_count",
        "/attention/default_budget/expert_width"}) {
    Json config = ValidConfigJson();
    const Json::json_pointer path(pointer);
    config[path.parent_pointer()].erase(path.back());
    std::string field = pointer.substr(1);
    std::replace(field.begin(), field.end(), '/', '.');
    ExpectStatus(ParseVitConfig(config.dump()).status(), absl::StatusCode::kInvalidArgument,
                 "missing required field " + field);
  }
}

TEST(ModelConfigTest, EachWrongTypeIsNamed) {
  for (const std::string pointer :
       {"/architecture", "/image_size", "/patch_size", "/in_channels", "/embed_dim", "/depth", "/num_heads",
        "/mlp_hidden_dim", "/layer_norm_eps", "/num_classes", "/normalization", "/normalization/mean",
        "/normalization/std", "/attention", "/attention/type", "/attention/depthwise_conv",
        "/attention/default_budget", "/attention/default_budget/expert_count", "/attention/presets",
        "/attention/presets/fast/expert_width", "/max_image_side"}) {
    Json config = ValidConfigJson();
    config[Json::json_pointer(pointer)] = pointer == "/architecture" || pointer == "/attention/type"
                                              ? Json(7)
                                              : Json("seven");
    std::string field = pointer.substr(1);
    std::replace(field.begin(), field.end(), '/', '.');
    const absl::Status status = ParseVitConfig(config.dump()).status();
    ExpectStatus(status, absl::StatusCode::kInvalidArgument, field);
  }
  Json fractional = ValidConfigJson();
  fractional["image_size"] = 28.5;
  ExpectStatus(ParseVitConfig(fractional.dump()).status(), absl::StatusCode::kInvalidArgument,
               "image_size must be an integer");
}

TEST(ModelConfigTest, OutOfRangeValuesAreNamedWithTheRange) {
  struct Case {
    std::string pointer;
    Json value;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"/architecture", "resnet", "architecture \"resnet\" is not supported"},
      {"/task", "translation", "task \"translation\" is not supported"},
      {"/image_size", 0, "image_size 0 is out of range [1, 16384]"},
      {"/patch_size", 5, "patch_size 5 does not divide image_size 28"},
      {"/patch_size", 56, "patch_size 56 is out of range [1, 28]"},
      {"/in_channels", 2, "in_channels 2 is not supported"},
      {"/in_channels", 4, "in_channels 4 is out of range [1, 3]"},
      {"/embed_dim", -1, "embed_dim -1 is out of range"},
      {"/num_heads", 5, "num_heads 5 does not divide embed_dim 96"},
      {"/depth", 0, "depth 0 is out of range [1, 1024]"},
      {"/mlp_hidden_dim", 0, "mlp_hidden_dim 0 is out of range"},
      {"/num_classes", 0, "num_classes 0 is out of range"},
      {"/layer_norm_eps", 0, "layer_norm_eps must be > 0"},
      {"/normalization/mean", Json::array({0.1, 0.2, 0.3}), "normalization.mean has 3 entries, expected in_channels = 1"},
      {"/normalization/std", Json::array({0.0}), "normalization.std[0] must be > 0"},
      {"/normalization/std", Json::array({1e-50}),
       "normalization.std[0] 1e-50 is out of float32's range [1.17549e-38, "},
      {"/normalization/mean", Json::array({-1e40}),
       "normalization.mean[0] -1e+40 is out of float32's range [-3.40282e+38, "},
      {"/attention/type", "linear", "attention.type \"linear\" is not supported"},
      {"/attention/default_budget/expert_count", 10,
       "attention.default_budget.expert_count 10 is not allowed: use one of 1, 4, 9, 16, 25, 36, 49"},
      {"/attention/default_budget/expert_width", 51,
       "attention.default_budget.expert_width 51 is out of range: allowed [1, 50]"},
      {"/attention/default_budget/expert_width", 0, "attention.default_budget.expert_width 0 is out of range"},
      {"/attention/presets/fast/expert_count", 64, "attention.presets.fast.expert_count 64 is not allowed"},
      {"/max_image_side", 0, "max_image_side 0 is out of range"},
  };
  for (const Case& test_case : cases) {
    Json config = ValidConfigJson();
    config[Json::json_pointer(test_case.pointer)] = test_case.value;
    ExpectStatus(ParseVitConfig(config.dump()).status(), absl::StatusCode::kInvalidArgument, test_case.message);
  }
}

TEST(ModelConfigTest, InvalidJsonIsInvalidArgument) {
  ExpectStatus(ParseVitConfig("{\"architecture\": ").status(), absl::StatusCode::kInvalidArgument,
               "config.json: invalid JSON");
  ExpectStatus(ParseVitConfig("[1, 2]").status(), absl::StatusCode::kInvalidArgument, "JSON object");
  ExpectStatus(ParseVitConfig("").status(), absl::StatusCode::kInvalidArgument, "invalid JSON");
  // A number the JSON parser cannot represent (it throws out_of_range, not parse_error; found by
  // tests/fuzz/model_config_fuzzer): every config kind.
  ExpectStatus(ParseVitConfig(R"({"depth": 555555555555555555555555e55555})").status(),
               absl::StatusCode::kInvalidArgument, "config.json: invalid JSON");
  ExpectStatus(ParseDocumentConfig(R"({"depth": 1e55555})").status(), absl::StatusCode::kInvalidArgument,
               "config.json: invalid JSON");
  ExpectStatus(ParseArchitecture(R"({"architecture": 1e55555})").status(), absl::StatusCode::kInvalidArgument,
               "config.json: invalid JSON");
}

// The tools' budget text: "MxK" or "full"; only the form is checked (values are CheckBudget's).
TEST(ModelConfigTest, ParseBudgetReadsMxKAndFullAndNamesThem) {
  absl::StatusOr<AttentionBudget> budget = ParseBudget("9x16");
  ASSERT_TRUE(budget.ok()) << budget.status();
  EXPECT_FALSE(budget->full_attention);
  EXPECT_EQ(budget->expert_count, 9);
  EXPECT_EQ(budget->expert_width, 16);
  EXPECT_EQ(BudgetName(*budget), "MiTA m=9 k=16");
  budget = ParseBudget("10x0");  // the form is right; CheckBudget rejects the values
  ASSERT_TRUE(budget.ok()) << budget.status();
  EXPECT_EQ(budget->expert_count, 10);
  EXPECT_EQ(budget->expert_width, 0);
  budget = ParseBudget("full");
  ASSERT_TRUE(budget.ok()) << budget.status();
  EXPECT_TRUE(budget->full_attention);
  EXPECT_EQ(BudgetName(*budget), "full attention");
  for (const char* bad : {"", "9", "9x", "x16", "9x16x2", "9*16", "ninexsixteen", "Full"}) {
    ExpectStatus(ParseBudget(bad).status(), absl::StatusCode::kInvalidArgument,
                 absl::StrCat("budget '", bad, "' is not expert_count x expert_width (e.g. 9x16) or 'full'"));
  }
}

TEST(ModelConfigTest, ImageKnobsAcceptTheAllowedRanges) {
  absl::StatusOr<VitConfig> config = ParseVitConfig(ValidConfigJson().dump());
  ASSERT_TRUE(config.ok());
  const BudgetKnobs knobs = ImageKnobs(*config);
  EXPECT_EQ(knobs.allowed_expert_counts, (std::vector<int64_t>{1, 4, 9, 16, 25, 36, 49}));
  EXPECT_EQ(knobs.max_expert_width, 50);
  for (int64_t count : {1, 4, 9, 16, 25, 36, 49}) {
    for (int64_t width : {1, 16, 50}) EXPECT_TRUE(CheckBudget(knobs, {false, count, width}).ok());
  }
  EXPECT_TRUE(CheckBudget(knobs, {true, 0, 0}).ok());  // full attention ignores m and k
}

TEST(ModelConfigTest, CheckBudgetRejectsNamingTheKnobAndRange) {
  absl::StatusOr<VitConfig> config = ParseVitConfig(ValidConfigJson().dump());
  ASSERT_TRUE(config.ok());
  const BudgetKnobs knobs = ImageKnobs(*config);
  using Problems = std::vector<FieldProblem>;
  for (int64_t count : {0, -4, 2, 10, 64}) {
    EXPECT_EQ(FieldProblems(CheckBudget(knobs, {false, count, 8})),
              (Problems{{RequestField::kExpertCount, -1,
                         std::to_string(count) + " is not allowed: use one of 1, 4, 9, 16, 25, 36, 49"}}));
  }
  for (int64_t width : {0, -1, 51, 1000}) {
    EXPECT_EQ(FieldProblems(CheckBudget(knobs, {false, 9, width})),
              (Problems{{RequestField::kExpertWidth, -1, std::to_string(width) + " is out of range: allowed [1, 50]"}}));
  }
  // Both knobs wrong: both are named, so that one answer tells the client everything to fix.
  const absl::Status both = CheckBudget(knobs, {false, 10, 51});
  EXPECT_EQ(both.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FieldProblems(both),
            (Problems{{RequestField::kExpertCount, -1, "10 is not allowed: use one of 1, 4, 9, 16, 25, 36, 49"},
                      {RequestField::kExpertWidth, -1, "51 is out of range: allowed [1, 50]"}}));
}

// One resolution for every model kind: default, presets ("" and "default" name the default), expert budgets with
// a knob left at 0 taking the default, full attention; every error a structured field problem.
TEST(ModelConfigTest, ResolveBudgetFollowsTheRequest) {
  absl::StatusOr<VitConfig> config = ParseVitConfig(ValidConfigJson().dump());
  ASSERT_TRUE(config.ok());
  const BudgetKnobs knobs = ImageKnobs(*config);
  BudgetRequest request;
  absl::StatusOr<ResolvedBudget> resolved = ResolveBudget(knobs, request);
  ASSERT_TRUE(resolved.ok());
  EXPECT_EQ(resolved->budget, config->default_budget);
  EXPECT_EQ(resolved->preset, "default");
  request.choice = BudgetRequest::Choice::kPreset;
  for (const char* name : {"", "default"}) {
    request.preset = name;
    resolved = ResolveBudget(knobs, request);
    ASSERT_TRUE(resolved.ok());
    EXPECT_EQ(resolved->budget, config->default_budget);
    EXPECT_EQ(resolved->preset, "default");
  }
  request.preset = "fast";
  resolved = ResolveBudget(knobs, request);
  ASSERT_TRUE(resolved.ok());
  EXPECT_EQ(resolved->budget, config->presets.at("fast"));
  EXPECT_EQ(resolved->preset, "fast");
  request.preset = "turbo";
  using Problems = std::vector<FieldProblem>;
  EXPECT_EQ(FieldProblems(ResolveBudget(knobs, request).status()),
            (Problems{{RequestField::kPreset, -1, "unknown preset 'turbo'; available: accurate, balanced, exact, fast"}}));
  request.choice = BudgetRequest::Choice::kExperts;
  request.expert_count = 4;
  request.expert_width = 0;
  resolved = ResolveBudget(knobs, request);
  ASSERT_TRUE(resolved.ok());
  EXPECT_EQ(resolved->budget, (AttentionBudget{false, 4, config->default_budget.expert_width}));
  EXPECT_EQ(resolved->preset, "");
  request.expert_count = 10;
  EXPECT_EQ(FieldProblems(ResolveBudget(knobs, request).status()),
            (Problems{{RequestField::kExpertCount, -1, "10 is not allowed: use one of 1, 4, 9, 16, 25, 36, 49"}}));
  request.choice = BudgetRequest::Choice::kFullAttention;
  resolved = ResolveBudget(knobs, request);
  ASSERT_TRUE(resolved.ok());
  EXPECT_TRUE(resolved->budget.full_attention);
  // A model whose default is full attention needs both knobs of an expert budget.
  BudgetKnobs full_default = knobs;
  full_default.default_budget = {true, 0, 0};
  request.choice = BudgetRequest::Choice::kExperts;
  request.expert_count = 4;
  request.expert_width = 0;
  EXPECT_EQ(FieldProblems(ResolveBudget(full_default, request).status()),
            (Problems{{RequestField::kExperts, -1,
                       "the model's default is full attention, so set both expert_count and expert_width"}}));
}

// attention.accuracy_order: entries kept in the file's order with their accuracies, each named "default" for
// the default budget (even where a preset equals it), else the preset equal to it, else its text.
TEST(ModelConfigTest, AccuracyOrderParsesAndNamesEachBudget) {
  Json json = ValidConfigJson();
  json["attention"]["accuracy_order"] = Json::parse(R"([
      {"budget": "16x32", "accuracy": 0.9}, {"budget": "9x16", "accuracy": 0.89},
      {"budget": "full", "accuracy": 0.88}, {"budget": "4x8", "accuracy": 0.87},
      {"budget": "25x50", "accuracy": 0.87, "note": "unknown keys are ignored"}])");
  absl::StatusOr<VitConfig> config = ParseVitConfig(json.dump());
  ASSERT_TRUE(config.ok()) << config.status();
  struct Expected {
    std::string name;
    AttentionBudget budget;
    double accuracy;
  };
  const std::vector<Expected> expected = {{"accurate", {false, 16, 32}, 0.9},
                                          {"default", {false, 9, 16}, 0.89},
                                          {"exact", {true, 0, 0}, 0.88},
                                          {"fast", {false, 4, 8}, 0.87},
                                          {"25x50", {false, 25, 50}, 0.87}};
  ASSERT_EQ(config->accuracy_order.size(), expected.size());
  const BudgetKnobs knobs = ImageKnobs(*config);
  ASSERT_EQ(knobs.accuracy_order.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    for (const DeclaredBudget& declared : {config->accuracy_order[i], knobs.accuracy_order[i]}) {
      EXPECT_EQ(declared.name, expected[i].name) << i;
      EXPECT_EQ(declared.budget, expected[i].budget) << i;
      EXPECT_DOUBLE_EQ(declared.accuracy, expected[i].accuracy) << i;
    }
  }
  // Without a preset for full attention it is named by its text.
  json["attention"]["presets"].erase("exact");
  config = ParseVitConfig(json.dump());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->accuracy_order[2].name, "full");
}

// Without attention.accuracy_order the knobs rank the default, the presets and full attention by compute units at
// the model's 50 tokens (50 x 50 full, 50 x (16 + 32), 50 x (9 + 16), 50 x (4 + 8)), with the same names.
TEST(ModelConfigTest, AbsentAccuracyOrderRanksByComputeWithTheSameNames) {
  absl::StatusOr<VitConfig> config = ParseVitConfig(ValidConfigJson().dump());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->accuracy_order.empty());
  const BudgetKnobs knobs = ImageKnobs(*config);
  std::vector<std::string> names;
  for (const DeclaredBudget& declared : knobs.accuracy_order) {
    names.push_back(declared.name);
    EXPECT_EQ(declared.accuracy, -1);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"exact", "accurate", "default", "fast"}));
}

TEST(ModelConfigTest, AccuracyOrderErrorsNameTheEntry) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"budget": "9x16", "accuracy": 0.9})", "attention.accuracy_order must be an array"},
      {R"([])", "attention.accuracy_order is empty: list at least one budget, or leave the field out"},
      {R"([7])", "attention.accuracy_order[0] must be an object, found 7"},
      {R"([{"accuracy": 0.9}])", "missing required field attention.accuracy_order[0].budget"},
      {R"([{"budget": 9, "accuracy": 0.9}])", "attention.accuracy_order[0].budget must be a string, found 9"},
      {R"([{"budget": "9x16", "accuracy": 0.9}, {"budget": "9x", "accuracy": 0.8}])",
       "attention.accuracy_order[1].budget \"9x\" is not expert_count x expert_width (e.g. \"9x16\") or \"full\""},
      {R"([{"budget": "9x16", "accuracy": 0.9}, {"budget": "4x8", "accuracy": 0.8},
           {"budget": "10x16", "accuracy": 0.7}])",
       "attention.accuracy_order[2].budget \"10x16\": expert_count 10 is not allowed: use one of 1, 4, 9, 16, 25, "
       "36, 49"},
      {R"([{"budget": "9x51", "accuracy": 0.9}])",
       "attention.accuracy_order[0].budget \"9x51\": expert_width 51 is out of range: allowed [1, 50]"},
      {R"([{"budget": "9x16", "accuracy": 0.9}, {"budget": "4x8", "accuracy": 0.8},
           {"budget": "9x16", "accuracy": 0.7}])",
       "attention.accuracy_order[2].budget \"9x16\" repeats attention.accuracy_order[0]"},
      {R"([{"budget": "full", "accuracy": 0.9}, {"budget": "full", "accuracy": 0.9}])",
       "attention.accuracy_order[1].budget \"full\" repeats attention.accuracy_order[0]"},
      {R"([{"budget": "9x16"}])", "missing required field attention.accuracy_order[0].accuracy"},
      {R"([{"budget": "9x16", "accuracy": "high"}])",
       "attention.accuracy_order[0].accuracy must be a number, found \"high\""},
      {R"([{"budget": "9x16", "accuracy": 1.5}])", "attention.accuracy_order[0].accuracy 1.5 is out of range [0, 1]"},
      {R"([{"budget": "9x16", "accuracy": -0.1}])",
       "attention.accuracy_order[0].accuracy -0.1 is out of range [0, 1]"},
      {R"([{"budget": "9x16", "accuracy": 0.8}, {"budget": "4x8", "accuracy": 0.85}])",
       "attention.accuracy_order[1].accuracy 0.85 is above attention.accuracy_order[0]'s 0.8: list the most "
       "accurate first"},
  };
  for (const auto& [order, message] : cases) {
    Json config = ValidConfigJson();
    config["attention"]["accuracy_order"] = Json::parse(order);
    ExpectStatus(ParseVitConfig(config.dump()).status(), absl::StatusCode::kInvalidArgument,
                 "config.json: " + message);
  }
}

// ----- --write_accuracy_order (tools/accuracy_order.h) -----

// Accuracies rounded to the 4 decimals written; ties go to fewer compute units at the given length (ApplyBudget
// first: at 20 tokens 16x32 runs as 16x20, 20 x 36 = 720 units against full attention's 20 x 20 = 400).
TEST(AccuracyOrderTest, SortsByRoundedAccuracyThenTheCheaperBudget) {
  using tools::MeasuredAccuracy;
  const std::vector<MeasuredAccuracy> measured = {{{false, 9, 16}, 0.88231},
                                                  {{true, 0, 0}, 0.9},
                                                  {{false, 16, 32}, 0.88229},
                                                  {{false, 4, 8}, 0.8823},
                                                  {{false, 9, 16}, 0.5}};  // listed twice: the first one counts
  std::vector<MeasuredAccuracy> sorted = tools::SortByAccuracy(measured, 50);
  ASSERT_EQ(sorted.size(), 4u);
  const std::vector<AttentionBudget> expected = {{true, 0, 0}, {false, 4, 8}, {false, 9, 16}, {false, 16, 32}};
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(sorted[i].budget, expected[i]) << i;
    EXPECT_EQ(sorted[i].accuracy, i == 0 ? 0.9 : 0.8823) << i;
  }
  const std::vector<MeasuredAccuracy> tied = {{{false, 16, 32}, 0.9}, {{true, 0, 0}, 0.9}};
  EXPECT_TRUE(tools::SortByAccuracy(tied, 20)[0].budget.full_attention);   // 400 < 720 units
  EXPECT_FALSE(tools::SortByAccuracy(tied, 50)[0].budget.full_attention);  // 50 x 48 = 2400 < 2500
}

// The rewrite keeps every line of the file (2-space indentation, key order) and adds only the order, which the
// config parser then reads back; a second write replaces it in place; an order the parser rejects leaves the
// file as it was.
TEST(AccuracyOrderTest, WriteKeepsTheFileAndAddsTheOrder) {
  const std::string directory = MakeTempDirectory("accuracy_order");
  const std::string path = directory + "/config.json";
  // As tools/train_image.py writes it (Python json.dump, indent=2).
  const std::string original =
      "{\n"
      "  \"architecture\": \"mita_vit\",\n"
      "  \"image_size\": 28,\n"
      "  \"patch_size\": 4,\n"
      "  \"in_channels\": 1,\n"
      "  \"embed_dim\": 96,\n"
      "  \"depth\": 4,\n"
      "  \"num_heads\": 4,\n"
      "  \"mlp_hidden_dim\": 192,\n"
      "  \"layer_norm_eps\": 1e-06,\n"
      "  \"num_classes\": 10,\n"
      "  \"normalization\": {\n"
      "    \"mean\": [\n"
      "      0.286\n"
      "    ],\n"
      "    \"std\": [\n"
      "      0.353\n"
      "    ]\n"
      "  },\n"
      "  \"attention\": {\n"
      "    \"type\": \"mita\",\n"
      "    \"depthwise_conv\": true,\n"
      "    \"default_budget\": {\n"
      "      \"expert_count\": 9,\n"
      "      \"expert_width\": 16\n"
      "    },\n"
      "    \"presets\": {\n"
      "      \"fast\": {\n"
      "        \"expert_count\": 4,\n"
      "        \"expert_width\": 8\n"
      "      },\n"
      "      \"accurate\": {\n"
      "        \"expert_count\": 16,\n"
      "        \"expert_width\": 32\n"
      "      }\n"
      "    }\n"
      "  },\n"
      "  \"max_image_side\": 4096\n"
      "}";
  WriteFile(path, original + "\n");
  absl::StatusOr<std::vector<DeclaredBudget>> written =
      tools::WriteAccuracyOrder(directory, {{{false, 16, 32}, 0.9}, {{false, 9, 16}, 0.89}, {{false, 1, 50}, 0.5}});
  ASSERT_TRUE(written.ok()) << written.status();
  ASSERT_EQ(written->size(), 3u);
  EXPECT_EQ((*written)[0].name, "accurate");
  EXPECT_EQ((*written)[1].name, "default");
  EXPECT_EQ((*written)[2].name, "1x50");
  const std::string expected_block =
      "    },\n"
      "    \"accuracy_order\": [\n"
      "      {\n        \"budget\": \"16x32\",\n        \"accuracy\": 0.9\n      },\n"
      "      {\n        \"budget\": \"9x16\",\n        \"accuracy\": 0.89\n      },\n"
      "      {\n        \"budget\": \"1x50\",\n        \"accuracy\": 0.5\n      }\n"
      "    ]\n";
  // The original with the block after the presets' closing brace (the last key of "attention").
  std::string expected = original + "\n";
  const std::string presets_end = "    }\n  },\n  \"max_image_side\"";
  const size_t at = expected.find(presets_end);
  ASSERT_NE(at, std::string::npos);
  expected.replace(at, 6, expected_block);
  const std::string text = ReadFile(path);
  EXPECT_EQ(text, expected);
  absl::StatusOr<VitConfig> config = ParseVitConfig(text);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->accuracy_order.size(), 3u);
  EXPECT_EQ(config->accuracy_order[2].budget, (AttentionBudget{false, 1, 50}));

  written = tools::WriteAccuracyOrder(directory, {{{false, 4, 8}, 0.7}});
  ASSERT_TRUE(written.ok()) << written.status();
  const std::string rewritten = ReadFile(path);
  std::string expected_again = expected;
  const size_t block = expected_again.find(expected_block);
  expected_again.replace(block, expected_block.size(),
                         "    },\n    \"accuracy_order\": [\n      {\n        \"budget\": \"4x8\",\n"
                         "        \"accuracy\": 0.7\n      }\n    ]\n");
  EXPECT_EQ(rewritten, expected_again);

  ExpectStatus(tools::WriteAccuracyOrder(directory, {{{false, 10, 16}, 0.7}}).status(),
               absl::StatusCode::kInvalidArgument,
               "config.json: attention.accuracy_order[0].budget \"10x16\": expert_count 10 is not allowed");
  EXPECT_EQ(ReadFile(path), rewritten);
  ExpectStatus(tools::WriteAccuracyOrder(directory + "/missing", {}).status(), absl::StatusCode::kNotFound,
               "cannot open");
}

// ----- safetensors -----

TEST(SafetensorsTest, HandWrittenFileRoundTrips) {
  // F32 [2, 3] = 0 .. 5; F16 [2] = 1.5, -2 (0x3E00, 0xC000); BF16 [1] = 3 (0x4040); F64 [2] = 0.25, -1000;
  // a scalar F32 (shape []) = 7; an empty F32 [0, 4].
  const std::string f32 = Bytes(std::vector<float>{0, 1, 2, 3, 4, 5});
  const std::string f16 = Bytes(std::vector<uint16_t>{0x3E00, 0xC000});
  const std::string bf16 = Bytes(std::vector<uint16_t>{0x4040});
  const std::string f64 = Bytes(std::vector<double>{0.25, -1000});
  const std::string scalar = Bytes(std::vector<float>{7});
  const std::string data = f32 + f16 + bf16 + f64 + scalar;
  const std::string header = R"({"__metadata__": {"format": "pt"},
    "matrix": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
    "half": {"dtype": "F16", "shape": [2], "data_offsets": [24, 28]},
    "brain": {"dtype": "BF16", "shape": [1], "data_offsets": [28, 30]},
    "double": {"dtype": "F64", "shape": [2], "data_offsets": [30, 46]},
    "scalar": {"dtype": "F32", "shape": [], "data_offsets": [46, 50]},
    "empty": {"dtype": "F32", "shape": [0, 4], "data_offsets": [50, 50]}})";
  absl::StatusOr<std::map<std::string, at::Tensor>> tensors = ParseSafetensors(SafetensorsFile(header, data));
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  ASSERT_EQ(tensors->size(), 6u);
  for (const auto& [name, tensor] : *tensors) {
    EXPECT_EQ(tensor.scalar_type(), at::kFloat) << name;
    EXPECT_TRUE(tensor.device().is_cpu()) << name;
  }
  const at::Tensor& matrix = tensors->at("matrix");
  EXPECT_EQ(matrix.sizes(), at::IntArrayRef({2, 3}));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(matrix.reshape({-1})[i].item<float>(), static_cast<float>(i));
  EXPECT_EQ(tensors->at("half")[0].item<float>(), 1.5f);
  EXPECT_EQ(tensors->at("half")[1].item<float>(), -2.0f);
  EXPECT_EQ(tensors->at("brain")[0].item<float>(), 3.0f);
  EXPECT_EQ(tensors->at("double")[0].item<float>(), 0.25f);
  EXPECT_EQ(tensors->at("double")[1].item<float>(), -1000.0f);
  EXPECT_EQ(tensors->at("scalar").dim(), 0);
  EXPECT_EQ(tensors->at("scalar").item<float>(), 7.0f);
  EXPECT_EQ(tensors->at("empty").sizes(), at::IntArrayRef({0, 4}));
}

TEST(SafetensorsTest, WrittenByTheTestWriterRoundTrips) {
  std::map<std::string, at::Tensor> tensors = {{"a", at::randn({3, 4})}, {"b", at::randn({5})}};
  absl::StatusOr<std::map<std::string, at::Tensor>> parsed = ParseSafetensors(SafetensorsFromTensors(tensors));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->at("a").equal(tensors["a"]));
  EXPECT_TRUE(parsed->at("b").equal(tensors["b"]));
}

TEST(SafetensorsTest, FileShorterThanEightBytes) {
  ExpectStatus(ParseSafetensors("").status(), absl::StatusCode::kInvalidArgument, "shorter than the 8-byte");
  ExpectStatus(ParseSafetensors(std::string("\x02\x00\x00", 3)).status(), absl::StatusCode::kInvalidArgument,
               "file is 3 bytes, shorter than the 8-byte header length");
}

TEST(SafetensorsTest, HeaderLengthBeyondFile) {
  ExpectStatus(ParseSafetensors(LittleEndian64(100) + "{}").status(), absl::StatusCode::kInvalidArgument,
               "header length 100 is beyond the file: only 2 bytes follow");
  ExpectStatus(ParseSafetensors(LittleEndian64(~uint64_t{0}) + "{}").status(), absl::StatusCode::kInvalidArgument,
               "is beyond the file");
}

TEST(SafetensorsTest, InvalidJson) {
  ExpectStatus(ParseSafetensors(SafetensorsFile("{\"a\": [", "")).status(), absl::StatusCode::kInvalidArgument,
               "header is not valid JSON");
  ExpectStatus(ParseSafetensors(SafetensorsFile(R"({"a": {"data_offsets": [0, 1e55555]}})", "")).status(),
               absl::StatusCode::kInvalidArgument, "header is not valid JSON");
  ExpectStatus(ParseSafetensors(SafetensorsFile("[1]", "")).status(), absl::StatusCode::kInvalidArgument,
               "header must be a JSON object");
  ExpectStatus(ParseSafetensors(SafetensorsFile(R"({"a": 5})", "")).status(), absl::StatusCode::kInvalidArgument,
               "tensor \"a\": entry must be a JSON object");
  ExpectStatus(ParseSafetensors(SafetensorsFile(R"({"a": {"dtype": "F32", "shape": [1]}})", "xxxx")).status(),
               absl::StatusCode::kInvalidArgument, "tensor \"a\": missing \"data_offsets\"");
}

TEST(SafetensorsTest, UnknownDtype) {
  ExpectStatus(
      ParseSafetensors(SafetensorsFile(R"({"a": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})",
                                       std::string(8, '\0')))
          .status(),
      absl::StatusCode::kInvalidArgument, "tensor \"a\": dtype \"I64\" is not supported: use F32, F16, BF16 or F64");
  ExpectStatus(
      ParseSafetensors(SafetensorsFile(R"({"a": {"dtype": "F31", "shape": [1], "data_offsets": [0, 4]}})",
                                       std::string(4, '\0')))
          .status(),
      absl::StatusCode::kInvalidArgument, "dtype \"F31\" is not supported");
}

TEST(SafetensorsTest, NegativeOrNonIntegerShape) {
  for (const std::string shape : {"[-1]", "[2.5]", "[\"2\"]", "5", "[1, null]"}) {
    const std::string header = R"({"a": {"dtype": "F32", "shape": )" + shape + R"(, "data_offsets": [0, 4]}})";
    ExpectStatus(ParseSafetensors(SafetensorsFile(header, std::string(4, '\0'))).status(),
                 absl::StatusCode::kInvalidArgument, "tensor \"a\": shape");
  }
}

TEST(SafetensorsTest, OffsetsOutOfBounds) {
  ExpectStatus(
      ParseSafetensors(SafetensorsFile(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                                       std::string(8, '\0')))
          .status(),
      absl::StatusCode::kInvalidArgument, "tensor \"a\": data_offsets [0, 16] are out of bounds: the data buffer holds 8 bytes");
  ExpectStatus(
      ParseSafetensors(SafetensorsFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})",
                                       std::string(8, '\0')))
          .status(),
      absl::StatusCode::kInvalidArgument, "end before they begin");
  ExpectStatus(
      ParseSafetensors(SafetensorsFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})",
                                       std::string(8, '\0')))
          .status(),
      absl::StatusCode::kInvalidArgument, "must be two non-negative integers");
}

TEST(SafetensorsTest, OffsetsNotMatchingShape) {
  ExpectStatus(
      ParseSafetensors(SafetensorsFile(R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})",
                                       std::string(12, '\0')))
          .status(),
      absl::StatusCode::kInvalidArgument, "data_offsets [0, 12] span 12 bytes but shape [2,2] x F32 needs 16");
  ExpectStatus(
      ParseSafetensors(SafetensorsFile(R"({"a": {"dtype": "F16", "shape": [3], "data_offsets": [0, 12]}})",
                                       std::string(12, '\0')))
          .status(),
      absl::StatusCode::kInvalidArgument, "x F16 needs 6");
}

TEST(SafetensorsTest, OverlappingOffsets) {
  ExpectStatus(ParseSafetensors(SafetensorsFile(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                                std::string(12, '\0')))
                   .status(),
               absl::StatusCode::kInvalidArgument, "tensor \"b\": data_offsets [4, 12] overlap tensor \"a\" [0, 8]");
}

TEST(SafetensorsTest, HolesAndUnindexedBytes) {
  // The format requires the data buffer to be fully indexed (no polyglot files).
  ExpectStatus(ParseSafetensors(SafetensorsFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                                                std::string(8, '\0')))
                   .status(),
               absl::StatusCode::kInvalidArgument, "leaving a gap after byte 0");
  ExpectStatus(ParseSafetensors(SafetensorsFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                                                std::string(8, '\0')))
                   .status(),
               absl::StatusCode::kInvalidArgument, "the tensors cover 4 bytes of the 8-byte data buffer");
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  ExpectStatus(LoadSafetensors("/nonexistent/model.safetensors").status(), absl::StatusCode::kNotFound,
               "/nonexistent/model.safetensors");
}

// ----- model packages (a tiny model with weights written here, no Python) -----

// image 4, patch 2 (grid 2, N = 5), C = 4, 2 heads, 1 block, MLP 8, 3 classes.
Json TinyConfigJson(bool depthwise_conv) {
  Json config = {{"architecture", "mita_vit"},
                 {"image_size", 4},
                 {"patch_size", 2},
                 {"in_channels", 1},
                 {"embed_dim", 4},
                 {"depth", 1},
                 {"num_heads", 2},
                 {"mlp_hidden_dim", 8},
                 {"num_classes", 3},
                 {"normalization", {{"mean", {0.5}}, {"std", {0.25}}}},
                 {"attention",
                  {{"type", "mita"},
                   {"depthwise_conv", depthwise_conv},
                   {"default_budget", {{"expert_count", 1}, {"expert_width", 2}}}}}};
  return config;
}

std::map<std::string, at::Tensor> TinyWeights(bool depthwise_conv) {
  std::map<std::string, at::Tensor> weights = {
      {"patch_embed.proj.weight", at::randn({4, 1, 2, 2})},
      {"patch_embed.proj.bias", at::randn({4})},
      {"cls_token", at::randn({1, 1, 4})},
      {"pos_embed", at::randn({1, 5, 4})},
      {"blocks.0.norm1.weight", at::randn({4})},
      {"blocks.0.norm1.bias", at::randn({4})},
      {"blocks.0.attn.qkv.weight", at::randn({12, 4})},
      {"blocks.0.attn.qkv.bias", at::randn({12})},
      {"blocks.0.attn.proj.weight", at::randn({4, 4})},
      {"blocks.0.attn.proj.bias", at::randn({4})},
      {"blocks.0.norm2.weight", at::randn({4})},
      {"blocks.0.norm2.bias", at::randn({4})},
      {"blocks.0.mlp.fc1.weight", at::randn({8, 4})},
      {"blocks.0.mlp.fc1.bias", at::randn({8})},
      {"blocks.0.mlp.fc2.weight", at::randn({4, 8})},
      {"blocks.0.mlp.fc2.bias", at::randn({4})},
      {"norm.weight", at::randn({4})},
      {"norm.bias", at::randn({4})},
      {"head.weight", at::randn({3, 4})},
      {"head.bias", at::randn({3})},
  };
  if (depthwise_conv) {
    weights["blocks.0.attn.dwc.weight"] = at::randn({4, 1, 3, 3});
    weights["blocks.0.attn.dwc.bias"] = at::randn({4});
  }
  return weights;
}

std::string WriteTinyPackage(const std::string& name, const Json& config,
                             const std::map<std::string, at::Tensor>& weights, const std::string& labels) {
  const std::string directory = MakeTempDirectory(name);
  WriteFile(directory + "/config.json", config.dump(2));
  WriteFile(directory + "/model.safetensors", SafetensorsFromTensors(weights));
  WriteFile(directory + "/labels.txt", labels);
  return directory;
}

TEST(ModelPackageTest, ValidPackageLoads) {
  const std::string directory =
      WriteTinyPackage("valid", TinyConfigJson(true), TinyWeights(true), "cat\ndog\r\nbird\n");
  absl::StatusOr<ModelPackage> package = LoadModelPackage(directory);
  ASSERT_TRUE(package.ok()) << package.status();
  EXPECT_EQ(package->name, std::filesystem::path(directory).filename().string());
  ASSERT_NE(package->classifier, nullptr);
  EXPECT_EQ(package->classifier->description().labels, (std::vector<std::string>{"cat", "dog", "bird"}));
  EXPECT_EQ(package->classifier->description().input_kind, InputKind::kImage);
  absl::StatusOr<std::unique_ptr<VitClassifier>> typed = LoadVitClassifier(directory);
  ASSERT_TRUE(typed.ok()) << typed.status();
  EXPECT_EQ((*typed)->config().num_classes, 3);
  // Loads without a final newline too.
  WriteFile(directory + "/labels.txt", "cat\ndog\nbird");
  EXPECT_TRUE(LoadModelPackage(directory).ok());
}

TEST(ModelPackageTest, MissingFolderAndFilesAreNotFound) {
  ExpectStatus(LoadModelPackage("/nonexistent/package").status(), absl::StatusCode::kNotFound, "no folder");
  for (const std::string file : {"config.json", "model.safetensors", "labels.txt"}) {
    const std::string directory =
        WriteTinyPackage("missing_" + file, TinyConfigJson(false), TinyWeights(false), "a\nb\nc\n");
    std::filesystem::remove(directory + "/" + file);
    ExpectStatus(LoadModelPackage(directory).status(), absl::StatusCode::kNotFound, "missing file");
    ExpectStatus(LoadModelPackage(directory).status(), absl::StatusCode::kNotFound, file);
  }
}

TEST(ModelPackageTest, MissingTensorIsNamed) {
  std::map<std::string, at::Tensor> weights = TinyWeights(true);
  weights.erase("blocks.0.attn.dwc.weight");
  const std::string directory = WriteTinyPackage("missing_tensor", TinyConfigJson(true), weights, "a\nb\nc\n");
  ExpectStatus(LoadModelPackage(directory).status(), absl::StatusCode::kInvalidArgument,
               "model.safetensors: weights: missing tensor \"blocks.0.attn.dwc.weight\" (expected shape [4, 1, 3, 3])");
}

TEST(ModelPackageTest, WrongShapeIsNamedWithBothShapes) {
  std::map<std::string, at::Tensor> weights = TinyWeights(false);
  weights["blocks.0.attn.qkv.weight"] = at::randn({4, 12});
  const std::string directory = WriteTinyPackage("wrong_shape", TinyConfigJson(false), weights, "a\nb\nc\n");
  ExpectStatus(LoadModelPackage(directory).status(), absl::StatusCode::kInvalidArgument,
               "tensor \"blocks.0.attn.qkv.weight\" has shape [4, 12], expected [12, 4]");
}

TEST(ModelPackageTest, ExtraTensorIsAnError) {
  std::map<std::string, at::Tensor> weights = TinyWeights(false);
  weights["blocks.0.attn.extra"] = at::randn({2});
  const std::string directory = WriteTinyPackage("extra_tensor", TinyConfigJson(false), weights, "a\nb\nc\n");
  ExpectStatus(LoadModelPackage(directory).status(), absl::StatusCode::kInvalidArgument,
               "unexpected tensor \"blocks.0.attn.extra\"");
  // DWC weights in a package whose config says no DWC.
  const std::string dwc_directory =
      WriteTinyPackage("extra_dwc", TinyConfigJson(false), TinyWeights(true), "a\nb\nc\n");
  ExpectStatus(LoadModelPackage(dwc_directory).status(), absl::StatusCode::kInvalidArgument,
               "attention.depthwise_conv is false");
}

TEST(ModelPackageTest, LabelsCountMismatch) {
  const std::string directory = WriteTinyPackage("labels", TinyConfigJson(false), TinyWeights(false), "a\nb\n");
  ExpectStatus(LoadModelPackage(directory).status(), absl::StatusCode::kInvalidArgument,
               "labels.txt: holds 2 labels, config.json num_classes is 3");
  WriteFile(directory + "/labels.txt", "a\n\nc\n");
  ExpectStatus(LoadModelPackage(directory).status(), absl::StatusCode::kInvalidArgument,
               "labels.txt: line 2 is empty");
}

TEST(ModelPackageTest, MalformedFilesArePrefixed) {
  const std::string directory = WriteTinyPackage("malformed", TinyConfigJson(false), TinyWeights(false), "a\nb\nc\n");
  WriteFile(directory + "/model.safetensors", "\x01\x02");
  ExpectStatus(LoadModelPackage(directory).status(), absl::StatusCode::kInvalidArgument,
               "model.safetensors: safetensors: file is 2 bytes");
  WriteFile(directory + "/config.json", "{");
  ExpectStatus(LoadModelPackage(directory).status(), absl::StatusCode::kInvalidArgument, "config.json: invalid JSON");
}

// ----- classifier -----

TEST(VitClassifierTest, ForwardRejectsBadInputs) {
  absl::StatusOr<VitConfig> config = ParseVitConfig(TinyConfigJson(true).dump());
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<VitClassifier>> model = VitClassifier::Create("tiny", *config, {"cat", "dog", "bird"}, TinyWeights(true));
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<AttentionBudget> two = {{false, 1, 2}, {false, 4, 5}};
  ExpectStatus((*model)->Forward(at::randn({2, 1, 8, 8}), two, false).status(), absl::StatusCode::kInvalidArgument,
               "images: shape [2, 1, 8, 8], expected [B >= 1, 1, 4, 4]");
  ExpectStatus((*model)->Forward(at::randn({3, 1, 4, 4}), two, false).status(), absl::StatusCode::kInvalidArgument,
               "budgets: 2 entries for a batch of 3 images");
  const std::vector<AttentionBudget> bad = {{false, 1, 2}, {false, 9, 2}};
  ExpectStatus((*model)->Forward(at::randn({2, 1, 4, 4}), bad, false).status(), absl::StatusCode::kInvalidArgument,
               "expert_count: 9 is not allowed: use one of 1, 4");
  ExpectStatus((*model)->Forward(at::randn({2, 1, 4, 4}).to(at::kDouble), two, false).status(),
               absl::StatusCode::kInvalidArgument, "float32");
}

TEST(VitClassifierTest, TinyModelRunsAllBudgetsAndReportsStatistics) {
  absl::StatusOr<VitConfig> config = ParseVitConfig(TinyConfigJson(true).dump());
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<VitClassifier>> model = VitClassifier::Create("tiny", *config, {"cat", "dog", "bird"}, TinyWeights(true));
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<AttentionBudget> budgets = {{false, 1, 2}, {true, 0, 0}, {false, 4, 5}};
  absl::StatusOr<ClassifierOutput> output = (*model)->Forward(at::randn({3, 1, 4, 4}), budgets, true);
  ASSERT_TRUE(output.ok()) << output.status();
  EXPECT_EQ(output->logits.sizes(), at::IntArrayRef({3, 3}));
  EXPECT_TRUE(output->logits.isfinite().all().item<bool>());
  ASSERT_EQ(output->statistics.size(), 3u);
  EXPECT_EQ(output->statistics[0].size(), 1u);  // one layer
  EXPECT_TRUE(output->statistics[1].empty());   // full attention: no routing
  ASSERT_EQ(output->statistics[2].size(), 1u);
  EXPECT_EQ(output->statistics[2][0].queries_per_expert.size(), 4u);
  output->logits.add_(1);  // callers may modify the logits (not an inference-mode tensor)
}

// Through the Classifier interface: Prepare decodes and preprocesses a real PNG, resolving and applying the
// budget; Run on prepared items gives Forward's logits on the same tensors; bad inputs are field problems.
TEST(VitClassifierTest, PrepareAndRunThroughTheClassifierInterface) {
  absl::StatusOr<std::unique_ptr<VitClassifier>> model = LoadVitClassifier(RepositoryPath() + "/fashion-mnist-vit");
  ASSERT_TRUE(model.ok()) << model.status();
  const Classifier& classifier = **model;
  absl::StatusOr<test_util::TestImages> images = test_util::FashionMnistTestPngs(2);
  ASSERT_TRUE(images.ok()) << images.status();
  ClassifierInput input;
  input.kind = ClassifierInput::Kind::kImage;
  input.bytes = images->pngs[0];
  BudgetRequest preset;
  preset.choice = BudgetRequest::Choice::kPreset;
  preset.preset = "fast";
  absl::StatusOr<BatchItem> first = classifier.Prepare(input, preset, InputLimits{});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->tokens, 50);
  EXPECT_EQ(first->input_tokens, 50);
  EXPECT_EQ(first->budget.preset, "fast");
  EXPECT_EQ(first->budget.budget, (*model)->config().presets.at("fast"));
  EXPECT_EQ(first->compute_units, ComputeUnits(50, first->budget.budget));
  EXPECT_EQ(first->input.sizes(), at::IntArrayRef({1, 28, 28}));
  input.bytes = images->pngs[1];
  BudgetRequest full;
  full.choice = BudgetRequest::Choice::kFullAttention;
  absl::StatusOr<BatchItem> second = classifier.Prepare(input, full, InputLimits{});
  ASSERT_TRUE(second.ok()) << second.status();
  const std::vector<const BatchItem*> items = {&*first, &*second};
  absl::StatusOr<ClassifierOutput> run = classifier.Run(items, /*want_statistics=*/true);
  ASSERT_TRUE(run.ok()) << run.status();
  absl::StatusOr<ClassifierOutput> forward = (*model)->Forward(
      at::stack({first->input, second->input}), {first->budget.budget, second->budget.budget}, false);
  ASSERT_TRUE(forward.ok()) << forward.status();
  EXPECT_LE(run->logits.sub(forward->logits).abs().max().item<double>(), 1e-5);
  EXPECT_EQ(run->statistics[0].size(), 4u);  // MiTA in 4 layers
  EXPECT_TRUE(run->statistics[1].empty());   // full attention has no routing
  using Problems = std::vector<FieldProblem>;
  input.bytes = "";
  EXPECT_EQ(FieldProblems(classifier.Prepare(input, {}, InputLimits{}).status()),
            (Problems{{RequestField::kImage, -1, "empty"}}));
  input.bytes = images->pngs[0];
  InputLimits small;
  small.max_encoded_image_bytes = 10;
  EXPECT_EQ(FieldProblems(classifier.Prepare(input, {}, small).status()),
            (Problems{{RequestField::kImage, -1,
                       absl::StrCat(images->pngs[0].size(), " bytes is over the limit of 10 bytes")}}));
  input.bytes = "not an image";
  EXPECT_EQ(FieldProblems(classifier.Prepare(input, {}, InputLimits{}).status()),
            (Problems{{RequestField::kImage, -1, "unknown format: expected PNG or JPEG (by signature)"}}));
  ClassifierInput text;
  text.kind = ClassifierInput::Kind::kText;
  text.bytes = "a document";
  EXPECT_EQ(FieldProblems(classifier.Prepare(text, {}, InputLimits{}).status()),
            (Problems{{RequestField::kInput, -1, "model 'fashion-mnist-vit' takes an image, not a document"}}));
  EXPECT_EQ(FieldProblems(classifier.Prepare(ClassifierInput{}, {}, InputLimits{}).status()),
            (Problems{{RequestField::kInput, -1, "model 'fashion-mnist-vit' takes an image and none was set"}}));
}

// An image whose caller left is dropped between layers; the others get the logits they get alone.
TEST(VitClassifierTest, ImagesWhoseCallerLeftAreDroppedAndTheOthersGoOn) {
  absl::StatusOr<std::unique_ptr<VitClassifier>> model = LoadVitClassifier(RepositoryPath() + "/fashion-mnist-vit");
  ASSERT_TRUE(model.ok()) << model.status();
  at::manual_seed(7);
  const at::Tensor images = at::randn({4, 1, 28, 28});
  const std::vector<AttentionBudget> budgets = {{false, 9, 16}, {true, 0, 0}, {false, 4, 8}, {false, 9, 16}};
  std::map<size_t, int> asked;
  const ItemCheck check = [&asked](size_t item) -> absl::Status {
    return item == 2 && ++asked[item] > 2 ? absl::CancelledError("image 2 left") : absl::OkStatus();
  };
  absl::StatusOr<ClassifierOutput> output =
      (*model)->Forward(images, budgets, true, kernels::MitaBackend::kAuto, check);
  ASSERT_TRUE(output.ok()) << output.status();
  ExpectStatus(output->stopped[2], absl::StatusCode::kCancelled, "image 2 left");
  EXPECT_TRUE(output->statistics[2].empty());
  EXPECT_EQ(output->logits[2].abs().max().item<double>(), 0.0);
  for (int64_t b : {0, 1, 3}) {
    EXPECT_TRUE(output->stopped[static_cast<size_t>(b)].ok());
    absl::StatusOr<ClassifierOutput> alone = (*model)->Forward(images.narrow(0, b, 1), {budgets[b]}, true);
    ASSERT_TRUE(alone.ok());
    EXPECT_LE(output->logits[b].sub(alone->logits[0]).abs().max().item<double>(), 1e-5) << b;
    EXPECT_EQ(output->statistics[static_cast<size_t>(b)].size(), alone->statistics[0].size());
  }
}

// The images the Python comparison uses: the first `count` Fashion-MNIST test images, preprocessed.
absl::StatusOr<at::Tensor> FashionMnistBatch(const VitConfig& config, int64_t count) {
  absl::StatusOr<datasets::FashionMnist> data = datasets::ReadFashionMnist("t10k");
  if (!data.ok()) return data.status();
  absl::StatusOr<std::vector<at::Tensor>> images = datasets::PreprocessedImages(*data, config, count);
  if (!images.ok()) return images.status();
  return at::stack(*images);
}

Json BudgetJson(const AttentionBudget& budget) {
  if (budget.full_attention) return {{"full_attention", true}};
  return {{"expert_count", budget.expert_count}, {"expert_width", budget.expert_width}};
}

// Runs tools/reference_logits.py on `images` [B, C, S, S] with per-item budgets; returns logits [B, classes].
absl::StatusOr<at::Tensor> PythonLogits(const std::string& package, const at::Tensor& images,
                                        const std::vector<AttentionBudget>& budgets, const std::string& work) {
  const at::Tensor contiguous = images.contiguous();
  WriteFile(work + "/images.f32",
            std::string(static_cast<const char*>(contiguous.data_ptr()), contiguous.numel() * sizeof(float)));
  Json budget_list = Json::array();
  for (const AttentionBudget& budget : budgets) budget_list.push_back(BudgetJson(budget));
  WriteFile(work + "/budgets.json", budget_list.dump());
  const std::string command = std::string(kPython) + " " + SourceDirectory() +
                              "/tools/reference_logits.py logits --package " + package + " --images " + work +
                              "/images.f32 --budgets " + work + "/budgets.json --out " + work +
                              "/logits.f32 2> " + work + "/python_stderr.txt";
  if (std::system(command.c_str()) != 0) {
    return absl::InternalError("reference_logits.py failed: " + ReadFile(work + "/python_stderr.txt"));
  }
  const std::string bytes = ReadFile(work + "/logits.f32");
  const int64_t batch = images.size(0);
  if (bytes.size() % (batch * sizeof(float)) != 0 || bytes.empty()) {
    return absl::InternalError("reference_logits.py wrote " + std::to_string(bytes.size()) + " bytes");
  }
  at::Tensor logits = at::empty({batch, static_cast<int64_t>(bytes.size() / sizeof(float)) / batch});
  std::memcpy(logits.data_ptr(), bytes.data(), bytes.size());
  return logits;
}

// A random-weight package made by the Python twin (DWC on unless `no_dwc`).
class PythonTwinTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    MITA_REQUIRE_PYTHON_TORCH();
    // Random inputs below are seeded: near-ties in the top-k key selection can resolve differently under
    // different summation orders (C++ vs PyTorch, batched vs alone), and an unseeded input makes that a
    // coin toss per run instead of a reproducible result.
    at::manual_seed(20261129);
    const bool no_dwc = GetParam();
    work_ = MakeTempDirectory(no_dwc ? "twin_no_dwc" : "twin_dwc");
    package_ = work_ + "/package";
    const std::string command = std::string(kPython) + " " + SourceDirectory() +
                                "/tools/reference_logits.py make-package --seed 3 --out " + package_ +
                                (no_dwc ? " --no-dwc" : "") + " 2> " + work_ + "/make_stderr.txt";
    ASSERT_EQ(std::system(command.c_str()), 0) << ReadFile(work_ + "/make_stderr.txt");
    absl::StatusOr<std::unique_ptr<VitClassifier>> model = LoadVitClassifier(package_);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_EQ((*model)->config().depthwise_conv, !no_dwc);
    model_ = *std::move(model);
  }

  std::string work_;
  std::string package_;
  std::unique_ptr<VitClassifier> model_;
};

// The largest |C++ - Python| logit difference seen by the comparisons (printed by the last one).
double max_difference_seen = 0;

void CompareWithPython(const VitClassifier& model, const std::string& package_directory, const at::Tensor& images,
                       const std::vector<AttentionBudget>& budgets, const std::string& work, double tolerance,
                       kernels::MitaBackend backend = kernels::MitaBackend::kAuto) {
  absl::StatusOr<ClassifierOutput> output = model.Forward(images, budgets, false, backend);
  ASSERT_TRUE(output.ok()) << output.status();
  absl::StatusOr<at::Tensor> expected = PythonLogits(package_directory, images, budgets, work);
  ASSERT_TRUE(expected.ok()) << expected.status();
  ASSERT_EQ(output->logits.sizes(), expected->sizes());
  const at::Tensor difference = output->logits.sub(*expected).abs();
  for (int64_t b = 0; b < images.size(0); ++b) {
    const double item_difference = difference[b].max().item<double>();
    max_difference_seen = std::max(max_difference_seen, item_difference);
    EXPECT_LE(item_difference, tolerance)
        << "item " << b << " budget " << BudgetJson(budgets[b]).dump() << "\nC++:    " << output->logits[b]
        << "\nPython: " << (*expected)[b];
  }
  std::cout << "[ info ] max |C++ - Python| logit difference so far: " << max_difference_seen << "\n";
}

TEST_P(PythonTwinTest, LogitsMatchOnFashionMnistAtThreeBudgets) {
  absl::StatusOr<at::Tensor> images = FashionMnistBatch(model_->config(), 6);
  if (!images.ok()) MITA_MISSING_DEPENDENCY("Fashion-MNIST not installed: " << images.status());
  for (const AttentionBudget budget : {AttentionBudget{false, 9, 16}, AttentionBudget{false, 4, 8},
                                       AttentionBudget{false, 16, 32}, AttentionBudget{true, 0, 0}}) {
    CompareWithPython(*model_, package_, *images, std::vector<AttentionBudget>(6, budget), work_, 1e-4);
  }
}

TEST_P(PythonTwinTest, LogitsMatchWithDifferentBudgetsInOneBatch) {
  absl::StatusOr<at::Tensor> images = FashionMnistBatch(model_->config(), 9);
  if (!images.ok()) MITA_MISSING_DEPENDENCY("Fashion-MNIST not installed: " << images.status());
  const std::vector<AttentionBudget> budgets = {{false, 4, 8},  {false, 16, 32}, {true, 0, 0},
                                                {false, 9, 16}, {false, 49, 50}, {false, 1, 1},
                                                {false, 25, 5}, {true, 0, 0},    {false, 9, 16}};
  CompareWithPython(*model_, package_, *images, budgets, work_, 1e-4);
  // Random inputs too (not only the black-background images); seeded in SetUp, because random weights and
  // inputs make near-ties in the top-k selection likely and an unseeded draw once flipped one (CI, 2.6e-3).
  CompareWithPython(*model_, package_, at::randn({9, 1, 28, 28}), budgets, work_, 1e-4);
  // And the reference kernel.
  CompareWithPython(*model_, package_, *images, budgets, work_, 1e-4, kernels::MitaBackend::kReference);
}

TEST_P(PythonTwinTest, MixedBatchEqualsEachItemAlone) {
  const at::Tensor images = at::randn({7, 1, 28, 28});
  const std::vector<AttentionBudget> budgets = {{false, 4, 8}, {true, 0, 0},   {false, 16, 32}, {false, 9, 16},
                                                {false, 4, 50}, {false, 36, 3}, {true, 0, 0}};
  absl::StatusOr<ClassifierOutput> batched = model_->Forward(images, budgets, true);
  ASSERT_TRUE(batched.ok()) << batched.status();
  ASSERT_EQ(batched->statistics.size(), budgets.size());
  for (size_t b = 0; b < budgets.size(); ++b) {
    absl::StatusOr<ClassifierOutput> alone =
        model_->Forward(images.narrow(0, b, 1), {budgets[b]}, true);
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_LE(batched->logits[b].sub(alone->logits[0]).abs().max().item<double>(), 1e-5) << "item " << b;
    EXPECT_EQ(batched->statistics[b].size(), budgets[b].full_attention ? 0u : 4u) << "item " << b;
    ASSERT_EQ(batched->statistics[b].size(), alone->statistics[0].size());
    for (size_t layer = 0; layer < batched->statistics[b].size(); ++layer) {
      EXPECT_EQ(batched->statistics[b][layer].queries_per_expert, alone->statistics[0][layer].queries_per_expert);
    }
  }
}

// tools/convert_timm_checkpoint.py: a timm-style .pth ({"model": state_dict}) of the same weights converts to a
// package whose config (inferred from the tensor shapes) and logits equal the original package's.
TEST_P(PythonTwinTest, ConvertedTimmCheckpointGivesTheSameLogits) {
  const std::string checkpoint = work_ + "/checkpoint.pth";
  const std::string converted = work_ + "/converted";
  const std::string save = std::string(kPython) + " -c 'import sys, torch; sys.path.insert(0, \"" +
                           SourceDirectory() + "/tools\"); from mita_reference import load_safetensors; " +
                           "torch.save({\"model\": load_safetensors(\"" + package_ +
                           "/model.safetensors\"), \"epoch\": 300}, \"" + checkpoint + "\")' 2> " + work_ +
                           "/save_stderr.txt";
  ASSERT_EQ(std::system(save.c_str()), 0) << ReadFile(work_ + "/save_stderr.txt");
  // pool_size 3 and kv_topk 4: the official constructor squares them (M = 9, k = 16).
  const std::string convert = std::string(kPython) + " " + SourceDirectory() +
                              "/tools/convert_timm_checkpoint.py --checkpoint " + checkpoint + " --out " + converted +
                              " --num_heads 4 --pool_size 3 --kv_topk 4 --mean 0.2860 --std 0.3530 > " + work_ +
                              "/convert_log.txt 2>&1";
  ASSERT_EQ(std::system(convert.c_str()), 0) << ReadFile(work_ + "/convert_log.txt");
  absl::StatusOr<std::unique_ptr<VitClassifier>> package = LoadVitClassifier(converted);
  ASSERT_TRUE(package.ok()) << package.status();
  const VitConfig& original = model_->config();
  EXPECT_EQ((*package)->config().image_size, original.image_size);
  EXPECT_EQ((*package)->config().patch_size, original.patch_size);
  EXPECT_EQ((*package)->config().embed_dim, original.embed_dim);
  EXPECT_EQ((*package)->config().depth, original.depth);
  EXPECT_EQ((*package)->config().mlp_hidden_dim, original.mlp_hidden_dim);
  EXPECT_EQ((*package)->config().depthwise_conv, original.depthwise_conv);
  EXPECT_EQ((*package)->config().default_budget.expert_count, 9);
  EXPECT_EQ((*package)->config().default_budget.expert_width, 16);
  const at::Tensor images = at::randn({4, 1, 28, 28});
  const std::vector<AttentionBudget> budgets = {{false, 9, 16}, {false, 4, 8}, {true, 0, 0}, {false, 16, 32}};
  absl::StatusOr<ClassifierOutput> expected = model_->Forward(images, budgets, false);
  absl::StatusOr<ClassifierOutput> actual = (*package)->Forward(images, budgets, false);
  ASSERT_TRUE(expected.ok() && actual.ok());
  EXPECT_TRUE(at::equal(actual->logits, expected->logits));
}

INSTANTIATE_TEST_SUITE_P(Dwc, PythonTwinTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("NoDwc") : std::string("Dwc");
                         });

// The trained package in the repository, when it has been trained (tools/train_image.py).
TEST(TrainedPackageTest, MatchesPythonAndClassifiesFashionMnist) {
  const std::string directory = SourceDirectory() + "/models/repository/fashion-mnist-vit";
  if (!std::filesystem::exists(directory + "/model.safetensors")) {
    MITA_MISSING_DEPENDENCY("no trained package at " << directory << " (train it with tools/train_image.py)");
  }
  absl::StatusOr<std::unique_ptr<VitClassifier>> package = LoadVitClassifier(directory);
  ASSERT_TRUE(package.ok()) << package.status();
  EXPECT_EQ((*package)->description().labels, datasets::FashionMnistLabels());
  absl::StatusOr<datasets::FashionMnist> data = datasets::ReadFashionMnist("t10k");
  if (!data.ok()) MITA_MISSING_DEPENDENCY("Fashion-MNIST not installed: " << data.status());
  constexpr int64_t kCount = 200;
  absl::StatusOr<at::Tensor> images = FashionMnistBatch((*package)->config(), kCount);
  ASSERT_TRUE(images.ok()) << images.status();
  absl::StatusOr<ClassifierOutput> output = (*package)->Forward(
      *images, std::vector<AttentionBudget>(kCount, (*package)->config().default_budget), false);
  ASSERT_TRUE(output.ok()) << output.status();
  const at::Tensor predicted = output->logits.argmax(1);
  int64_t correct = 0;
  for (int64_t i = 0; i < kCount; ++i) correct += predicted[i].item<int64_t>() == data->labels[i];
  EXPECT_GE(correct, kCount * 8 / 10) << "accuracy on the first " << kCount << " test images";
  MITA_REQUIRE_PYTHON_TORCH();
  const std::string work = MakeTempDirectory("trained");
  const std::vector<AttentionBudget> budgets = {{false, 9, 16}, {false, 4, 8}, {true, 0, 0}, {false, 16, 32},
                                                {false, 49, 50}, {false, 1, 4}};
  CompareWithPython(**package, directory, images->narrow(0, 0, 6), budgets, work, 1e-4);
}

// ----- forward errors -----

// Both classifiers (vit_classifier.cc, document_classifier.cc) pass a failed attention-kernel call through
// internal::KernelFault: running out of memory stays RESOURCE_EXHAUSTED (the image classifier once turned it
// into INTERNAL while the document classifier kept it); any other kernel error on validated input is INTERNAL.
TEST(ClassifierErrorsTest, KernelOutOfMemoryStaysResourceExhaustedOtherKernelErrorsAreInternal) {
  const absl::Status out_of_memory =
      absl::ResourceExhaustedError("MiTA attention: DefaultCPUAllocator: can't allocate memory");
  EXPECT_EQ(internal::KernelFault(out_of_memory), out_of_memory);
  ExpectStatus(internal::KernelFault(absl::InvalidArgumentError("items[0].expert_width 10 is outside [1, 9]")),
               absl::StatusCode::kInternal, "attention kernel: items[0].expert_width 10 is outside [1, 9]");
  ExpectStatus(internal::KernelFault(absl::InternalError("full attention failed: x")), absl::StatusCode::kInternal,
               "attention kernel: full attention failed: x");
  ExpectStatus(internal::KernelFault(absl::UnknownError("y")), absl::StatusCode::kInternal, "attention kernel: y");
  EXPECT_TRUE(internal::KernelFault(absl::OkStatus()).ok());
}


// The scopes a profiler tells a forward's phases apart by (kernels/forward_scopes.h, mita-forward-phases): both
// embedded models open each of them, as often as their layers say, on the thread that runs the forward.
std::map<std::string, int>* scopes_seen = nullptr;

std::unique_ptr<at::ObserverContext> CountScope(const at::RecordFunction& function) {
  if (scopes_seen != nullptr && std::strncmp(function.name(), "mita::", 6) == 0) ++(*scopes_seen)[function.name()];
  return nullptr;
}

TEST(ForwardScopesTest, BothEmbeddedModelsOpenEveryPhaseScopeOncePerLayer) {
  for (const std::string name : {"fashion-mnist-vit", "linux-doc-mita"}) {
    SCOPED_TRACE(name);
    absl::StatusOr<ModelPackage> package = LoadModelPackage(RepositoryPath() + "/" + name);
    ASSERT_TRUE(package.ok()) << package.status();
    const Classifier& model = *package->classifier;
    const int64_t tokens = model.description().tokens_per_input > 0 ? model.description().tokens_per_input : 300;
    absl::StatusOr<BatchItem> mita = model.SyntheticItem(tokens, AttentionBudget{false, 4, 8});
    absl::StatusOr<BatchItem> full = model.SyntheticItem(tokens, AttentionBudget{true, 0, 0});
    ASSERT_TRUE(mita.ok() && full.ok()) << mita.status() << full.status();
    std::map<std::string, int> seen;
    scopes_seen = &seen;
    const at::CallbackHandle handle = at::addThreadLocalCallback(at::RecordFunctionCallback(&CountScope));
    absl::StatusOr<ClassifierOutput> output = model.Run({&*mita, &*full}, /*want_statistics=*/false);
    at::removeCallback(handle);
    scopes_seen = nullptr;
    ASSERT_TRUE(output.ok()) << output.status();
    const int layers = static_cast<int>(model.description().layers);
    EXPECT_EQ(seen[kernels::kEmbeddingScope], 1);
    EXPECT_EQ(seen[kernels::kLayerScope], layers);
    EXPECT_EQ(seen[kernels::kPoolAndHeadScope], 1);
    EXPECT_GE(seen[kernels::kLinearScope], 4 * layers + 1) << "qkv, projection, two MLP layers per block, the head";
    EXPECT_GE(seen[kernels::kMitaAttentionScope], layers);
    EXPECT_GE(seen[kernels::kLandmarksScope], layers);
    EXPECT_GE(seen[kernels::kFullAttentionScope], layers);
    // The image model's DWC term in every layer; the document model's position convolution once per document.
    EXPECT_EQ(seen[kernels::kDepthwiseConvolutionScope], name == "fashion-mnist-vit" ? layers : 2);
  }
}

}  // namespace
}  // namespace mita::models
