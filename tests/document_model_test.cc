// Tests of the long-document side of models/: DocumentConfig parsing and budgets, UTF-8 validation, the bytes
// and SentencePiece tokenizers, document packages, and the DocumentClassifier against its independent PyTorch
// twin (MitaDocument in tools/mita_reference.py, run through tools/reference_logits.py).
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/tensor.h>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/document_classifier.h"
#include "models/model_config.h"
#include "models/model_package.h"
#include "models/request_error.h"
#include "models/safetensors.h"
#include "models/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace mita::models {
namespace {

using ::testing::ElementsAre;
using Json = nlohmann::json;

// ----- helpers -----

using test_util::ExpectStatus;
using test_util::kPython;
using test_util::MakeTempDirectory;
using test_util::ReadFile;
using test_util::SourceDirectory;
using test_util::WriteFile;

bool HasProgram(const std::string& name) {
  return std::system(("command -v " + name + " > /dev/null 2>&1").c_str()) == 0;
}

// ----- config -----

// config.json as written by tools/reference_logits.py make-document-package (document_config()).
Json ValidDocumentConfigJson() {
  return Json::parse(R"({
    "architecture": "mita_document", "task": "document_classification",
    "vocab_size": 256, "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_hidden_dim": 64,
    "layer_norm_eps": 1e-6, "num_classes": 4, "max_tokens": 65536, "tokenizer": "bytes",
    "position_encoding": {"type": "convolution", "kernel_size": 5},
    "attention": {"type": "mita",
                  "default_budget": {"expert_count": 16, "expert_width": 64},
                  "presets": {"fast": {"expert_count": 8, "expert_width": 32},
                              "exact": {"full_attention": true}},
                  "max_expert_count": 256, "max_expert_width": 1024}
  })");
}

TEST(DocumentConfigTest, ValidConfigParses) {
  absl::StatusOr<DocumentConfig> config = ParseDocumentConfig(ValidDocumentConfigJson().dump());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, "mita_document");
  EXPECT_EQ(config->vocab_size, 256);
  EXPECT_EQ(config->embed_dim, 32);
  EXPECT_EQ(config->depth, 2);
  EXPECT_EQ(config->num_heads, 2);
  EXPECT_EQ(config->head_dim(), 16);
  EXPECT_EQ(config->mlp_hidden_dim, 64);
  EXPECT_EQ(config->num_classes, 4);
  EXPECT_DOUBLE_EQ(config->layer_norm_eps, 1e-6);
  EXPECT_EQ(config->max_tokens, 65536);
  EXPECT_EQ(config->tokenizer, "bytes");
  EXPECT_EQ(config->position_kernel_size, 5);
  EXPECT_EQ(config->default_budget.expert_count, 16);
  EXPECT_EQ(config->default_budget.expert_width, 64);
  ASSERT_EQ(config->presets.size(), 2u);
  EXPECT_EQ(config->presets.at("fast").expert_count, 8);
  EXPECT_EQ(config->presets.at("fast").expert_width, 32);
  EXPECT_TRUE(config->presets.at("exact").full_attention);
  EXPECT_EQ(config->max_expert_count, 256);
  EXPECT_EQ(config->max_expert_width, 1024);
  absl::StatusOr<std::string> architecture = ParseArchitecture(ValidDocumentConfigJson().dump());
  ASSERT_TRUE(architecture.ok());
  EXPECT_EQ(*architecture, "mita_document");
}

TEST(DocumentConfigTest, EachMissingFieldIsNamed) {
  for (const std::string pointer :
       {"/architecture", "/vocab_size", "/embed_dim", "/depth", "/num_heads", "/mlp_hidden_dim", "/num_classes",
        "/max_tokens", "/tokenizer", "/position_encoding", "/position_encoding/type",
        "/position_encoding/kernel_size", "/attention", "/attention/type", "/attention/default_budget",
        "/attention/max_expert_count", "/attention/max_expert_width"}) {
    Json config = ValidDocumentConfigJson();
    const Json::json_pointer path(pointer);
    config[path.parent_pointer()].erase(path.back());
    std::string field = pointer.substr(1);
    std::replace(field.begin(), field.end(), '/', '.');
    ExpectStatus(ParseDocumentConfig(config.dump()).status(), absl::StatusCode::kInvalidArgument,
                 "config.json: missing required field " + field);
  }
}

TEST(DocumentConfigTest, BadValuesAreNamedWithTheirRange) {
  const std::vector<std::pair<std::string, Json>> cases = {
      {"/num_heads", 3}, {"/max_tokens", 0}, {"/tokenizer", "words"}, {"/position_encoding/kernel_size", 4},
      {"/position_encoding/type", "learned"}, {"/attention/default_budget/expert_width", 5000},
      {"/attention/presets/fast/expert_count", 300}, {"/attention/max_expert_width", 70000},
      {"/architecture", "mita_vit"}, {"/vocab_size", 100}, {"/embed_dim", 32.0}};
  const std::vector<std::string> messages = {
      "num_heads 3 does not divide embed_dim 32", "max_tokens 0 is out of range [1, 16777216]",
      "tokenizer \"words\" is not supported", "position_encoding.kernel_size 4 must be odd",
      "position_encoding.type \"learned\" is not supported",
      "attention.default_budget.expert_width 5000 is out of range: allowed [1, 1024]",
      "attention.presets.fast.expert_count 300 is out of range: allowed [1, 256]",
      "attention.max_expert_width 70000 is out of range [1, 65536]", "architecture \"mita_vit\" is not supported",
      "vocab_size 100 is too small for tokenizer \"bytes\"", "embed_dim must be an integer"};
  for (size_t i = 0; i < cases.size(); ++i) {
    Json config = ValidDocumentConfigJson();
    config[Json::json_pointer(cases[i].first)] = cases[i].second;
    ExpectStatus(ParseDocumentConfig(config.dump()).status(), absl::StatusCode::kInvalidArgument, messages[i]);
  }
  ExpectStatus(ParseDocumentConfig("{").status(), absl::StatusCode::kInvalidArgument, "config.json: invalid JSON");
}

// "pooling": absent means the mean (packages from before attention pooling keep loading); attention pooling's
// heads and position buckets are read and checked.
TEST(DocumentConfigTest, PoolingIsTheMeanByDefaultOrAttentionWithItsChecks) {
  EXPECT_EQ(ParseDocumentConfig(ValidDocumentConfigJson().dump())->pooling, DocumentConfig::Pooling::kMean);
  Json json = ValidDocumentConfigJson();
  json["pooling"] = Json::parse(R"({"type": "mean"})");
  EXPECT_EQ(ParseDocumentConfig(json.dump())->pooling, DocumentConfig::Pooling::kMean);
  json["pooling"] = Json::parse(R"({"type": "attention", "heads": 4, "position_buckets": 17})");
  absl::StatusOr<DocumentConfig> config = ParseDocumentConfig(json.dump());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->pooling, DocumentConfig::Pooling::kAttention);
  EXPECT_EQ(config->pooling_heads, 4);
  EXPECT_EQ(config->pooling_position_buckets, 17);
  json["pooling"] = Json::parse(R"({"type": "attention", "heads": 2})");
  EXPECT_EQ(ParseDocumentConfig(json.dump())->pooling_position_buckets, 0);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"type": "max"})", "pooling.type \"max\" is not supported: use \"mean\" or \"attention\""},
      {R"({"type": "attention"})", "missing required field pooling.heads"},
      {R"({"type": "attention", "heads": 3})", "pooling.heads 3 does not divide embed_dim 32"},
      {R"({"type": "attention", "heads": 64})", "pooling.heads 64 is out of range [1, 32]"},
      {R"({"type": "attention", "heads": 2, "position_buckets": 65})",
       "pooling.position_buckets 65 is out of range [0, 64]"},
      {R"("attention")", "pooling must be an object"}};
  for (const auto& [pooling, message] : cases) {
    json["pooling"] = Json::parse(pooling);
    ExpectStatus(ParseDocumentConfig(json.dump()).status(), absl::StatusCode::kInvalidArgument,
                 "config.json: " + message);
  }
}

// A document package's accuracy order: named as for images, checked against the max_expert_* ranges.
TEST(DocumentConfigTest, AccuracyOrderIsNamedAndCheckedAgainstTheRanges) {
  Json json = ValidDocumentConfigJson();
  json["attention"]["accuracy_order"] = Json::parse(R"([
      {"budget": "32x128", "accuracy": 0.8}, {"budget": "16x64", "accuracy": 0.8},
      {"budget": "full", "accuracy": 0.75}, {"budget": "8x32", "accuracy": 0.7}])");
  absl::StatusOr<DocumentConfig> config = ParseDocumentConfig(json.dump());
  ASSERT_TRUE(config.ok()) << config.status();
  std::vector<std::string> names;
  for (const DeclaredBudget& declared : DocumentKnobs(*config).accuracy_order) names.push_back(declared.name);
  EXPECT_EQ(names, (std::vector<std::string>{"32x128", "default", "exact", "fast"}));
  EXPECT_EQ(config->accuracy_order[0].budget, (AttentionBudget{false, 32, 128}));
  EXPECT_DOUBLE_EQ(config->accuracy_order[3].accuracy, 0.7);
  json["attention"]["accuracy_order"][1]["budget"] = "16x2000";
  ExpectStatus(ParseDocumentConfig(json.dump()).status(), absl::StatusCode::kInvalidArgument,
               "config.json: attention.accuracy_order[1].budget \"16x2000\": expert_width 2000 is out of range: "
               "allowed [1, 1024]");
  json["attention"]["accuracy_order"][1]["budget"] = "300x64";
  ExpectStatus(ParseDocumentConfig(json.dump()).status(), absl::StatusCode::kInvalidArgument,
               "config.json: attention.accuracy_order[1].budget \"300x64\": expert_count 300 is out of range: "
               "allowed [1, 256]");
}

TEST(DocumentBudgetTest, CheckNamesTheKnobAndRange) {
  const BudgetKnobs knobs = DocumentKnobs(*ParseDocumentConfig(ValidDocumentConfigJson().dump()));
  EXPECT_TRUE(CheckBudget(knobs, {true, 0, 0}).ok());
  EXPECT_TRUE(CheckBudget(knobs, {false, 1, 1}).ok());
  EXPECT_TRUE(CheckBudget(knobs, {false, 256, 1024}).ok());
  using Problems = std::vector<FieldProblem>;
  EXPECT_EQ(FieldProblems(CheckBudget(knobs, {false, 16, 5000})),
            (Problems{{RequestField::kExpertWidth, -1, "5000 is out of range: allowed [1, 1024]"}}));
  EXPECT_EQ(FieldProblems(CheckBudget(knobs, {false, 0, 8})),
            (Problems{{RequestField::kExpertCount, -1, "0 is out of range: allowed [1, 256]"}}));
  EXPECT_EQ(FieldProblems(CheckBudget(knobs, {false, 257, 8})),
            (Problems{{RequestField::kExpertCount, -1, "257 is out of range: allowed [1, 256]"}}));
  const absl::Status both = CheckBudget(knobs, {false, -1, 5000});
  EXPECT_EQ(both.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FieldProblems(both), (Problems{{RequestField::kExpertCount, -1, "-1 is out of range: allowed [1, 256]"},
                                           {RequestField::kExpertWidth, -1, "5000 is out of range: allowed [1, 1024]"}}));
  // The neutral message names each knob too (logs and tools see it).
  EXPECT_EQ(both.message(), "expert_count: -1 is out of range: allowed [1, 256]; "
                            "expert_width: 5000 is out of range: allowed [1, 1024]");
}

TEST(DocumentBudgetTest, ApplyClampsToTheDocumentLength) {
  const AttentionBudget applied = ApplyBudget({false, 16, 64}, 40);
  EXPECT_FALSE(applied.full_attention);
  EXPECT_EQ(applied.expert_count, 16);
  EXPECT_EQ(applied.expert_width, 40);
  const AttentionBudget tiny = ApplyBudget({false, 16, 64}, 3);
  EXPECT_EQ(tiny.expert_count, 3);
  EXPECT_EQ(tiny.expert_width, 3);
  const AttentionBudget unchanged = ApplyBudget({false, 16, 64}, 70000);
  EXPECT_EQ(unchanged.expert_count, 16);
  EXPECT_EQ(unchanged.expert_width, 64);
  EXPECT_TRUE(ApplyBudget({true, 0, 0}, 5).full_attention);
}

// ----- UTF-8 and tokenizers -----

TEST(Utf8Test, WellFormedTextPasses) {
  EXPECT_TRUE(ValidateUtf8("").ok());
  EXPECT_TRUE(ValidateUtf8("plain ASCII\n").ok());
  // 2-, 3- and 4-byte forms at their boundaries: U+0080, U+07FF, U+0800, U+D7FF, U+E000, U+FFFF, U+10000, U+10FFFF.
  EXPECT_TRUE(ValidateUtf8("\xC2\x80\xDF\xBF\xE0\xA0\x80\xED\x9F\xBF\xEE\x80\x80\xEF\xBF\xBF\xF0\x90\x80\x80"
                           "\xF4\x8F\xBF\xBF")
                  .ok());
}

TEST(Utf8Test, EachMalformedSequenceIsReportedAtItsOffset) {
  const std::vector<std::pair<std::string, size_t>> cases = {
      {"ab\x80", 2},                 // lone continuation byte
      {"a\xC0\xAF", 1},              // overlong 2-byte form of '/'
      {"\xC1\xBF", 0},               // overlong
      {"xy\xE0\x80\xAF", 2},         // overlong 3-byte form
      {"\xED\xA0\x80", 0},           // surrogate U+D800
      {"abc\xF4\x90\x80\x80", 3},    // above U+10FFFF
      {"\xF5\x80\x80\x80", 0},       // F5 never appears
      {"ok \xE2\x82", 3},            // truncated at the end
      {"\xE2\x82(", 0},              // continuation missing
      {"\xC3\xA9\xFF", 2},           // 0xFF after a valid character
  };
  for (const auto& [text, offset] : cases) {
    ExpectStatus(ValidateUtf8(text), absl::StatusCode::kInvalidArgument,
                 "invalid UTF-8 at byte offset " + std::to_string(offset));
  }
}

TEST(TokenizerTest, BytesTokenizerGivesByteValues) {
  std::unique_ptr<Tokenizer> tokenizer = MakeBytesTokenizer();
  EXPECT_EQ(tokenizer->name(), "bytes");
  EXPECT_EQ(tokenizer->vocab_size(), 256);
  absl::StatusOr<std::vector<int64_t>> ids = tokenizer->Encode("a\xC3\xA9\n");
  ASSERT_TRUE(ids.ok());
  EXPECT_THAT(*ids, ElementsAre(97, 0xC3, 0xA9, 10));
  EXPECT_TRUE(tokenizer->Encode("")->empty());
}

// A small SentencePiece model trained in the test by spm_train (Debian package sentencepiece) on generated text;
// the C++ tokenizer's ids are compared with spm_encode's (the library's own command-line encoder).
class SentencePieceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HasProgram("spm_train") || !HasProgram("spm_encode")) {
      MITA_MISSING_DEPENDENCY("spm_train/spm_encode not installed (Debian package sentencepiece)");
    }
    work_ = MakeTempDirectory("sentencepiece");
    std::ostringstream text;
    const std::vector<std::string> words = {"kernel", "driver", "memory", "interrupt", "device", "tree",
                                            "scheduler", "network", "packet", "filesystem", "inode", "page"};
    uint32_t state = 12345;  // a fixed LCG: the same corpus every run
    for (int line = 0; line < 400; ++line) {
      for (int word = 0; word < 12; ++word) {
        state = state * 1664525u + 1013904223u;
        text << words[(state >> 16) % words.size()] << ((state >> 8) % 7 == 0 ? "s " : " ");
      }
      text << "\n";
    }
    WriteFile(work_ + "/corpus.txt", text.str());
    const std::string command = "spm_train --input=" + work_ + "/corpus.txt --model_prefix=" + work_ +
                                "/tokenizer --vocab_size=40 --model_type=unigram --minloglevel=2 > " + work_ +
                                "/spm_train.log 2>&1";
    ASSERT_EQ(std::system(command.c_str()), 0) << ReadFile(work_ + "/spm_train.log");
  }
  std::string work_;
};

TEST_F(SentencePieceTest, EncodesAsSpmEncode) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadSentencePieceTokenizer(work_ + "/tokenizer.model");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ((*tokenizer)->name(), "sentencepiece");
  EXPECT_EQ((*tokenizer)->vocab_size(), 40);
  const std::string text = "the kernel drivers schedule interrupts\nfor network packets and inode pages";
  absl::StatusOr<std::vector<int64_t>> ids = (*tokenizer)->Encode(text);
  ASSERT_TRUE(ids.ok()) << ids.status();
  ASSERT_FALSE(ids->empty());
  for (int64_t id : *ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 40);
  }
  // spm_encode reads one line per sentence: the text goes as one line (the normaliser maps the newline to a space).
  std::string one_line = text;
  std::replace(one_line.begin(), one_line.end(), '\n', ' ');
  WriteFile(work_ + "/input.txt", one_line + "\n");
  ASSERT_EQ(std::system(("spm_encode --model=" + work_ + "/tokenizer.model --output_format=id < " + work_ +
                         "/input.txt > " + work_ + "/ids.txt")
                            .c_str()),
            0);
  std::istringstream expected_stream(ReadFile(work_ + "/ids.txt"));
  std::vector<int64_t> expected((std::istream_iterator<int64_t>(expected_stream)), std::istream_iterator<int64_t>());
  EXPECT_EQ(*ids, expected);
  absl::StatusOr<std::vector<int64_t>> empty = (*tokenizer)->Encode("");
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

// EncodeBounded hands the tokenizer pieces cut before whitespace: the ids equal those of the whole text (here
// with pieces far smaller than the default, so that every piece boundary is exercised), on the embedded
// document model's tokenizer and on the one trained in the test; it stops after max_tokens + 1 ids; `stop` is
// asked before every piece and ends the encoding with its status.
TEST_F(SentencePieceTest, BoundedEncodingEqualsTheWholeTextAndStops) {
  const std::string text = ReadFile(SourceDirectory() + "/docs/design.md") + "\n\t  trailing  spaces   and\n\nlines ";
  ASSERT_GT(text.size(), 5000u);
  std::vector<std::unique_ptr<Tokenizer>> tokenizers;
  absl::StatusOr<std::unique_ptr<Tokenizer>> trained = LoadSentencePieceTokenizer(work_ + "/tokenizer.model");
  ASSERT_TRUE(trained.ok()) << trained.status();
  tokenizers.push_back(*std::move(trained));
  absl::StatusOr<std::unique_ptr<Tokenizer>> embedded =
      LoadSentencePieceTokenizer(SourceDirectory() + "/models/repository/linux-doc-mita/tokenizer.model");
  ASSERT_TRUE(embedded.ok()) << embedded.status();
  tokenizers.push_back(*std::move(embedded));
  tokenizers.push_back(MakeBytesTokenizer());
  for (const std::unique_ptr<Tokenizer>& tokenizer : tokenizers) {
    absl::StatusOr<std::vector<int64_t>> whole = tokenizer->Encode(text);
    ASSERT_TRUE(whole.ok());
    for (size_t piece_bytes : {size_t{64}, size_t{500}, kEncodePieceBytes}) {
      SCOPED_TRACE(absl::StrCat(tokenizer->name(), ", pieces of ", piece_bytes, " bytes"));
      int pieces = 0;
      absl::StatusOr<BoundedEncoding> bounded = EncodeBounded(
          *tokenizer, text, int64_t{1} << 40,
          [&pieces] {
            ++pieces;
            return absl::OkStatus();
          },
          piece_bytes);
      ASSERT_TRUE(bounded.ok()) << bounded.status();
      EXPECT_TRUE(bounded->complete);
      EXPECT_EQ(bounded->ids, *whole);
      EXPECT_GE(pieces, static_cast<int>(text.size() / piece_bytes));
      // Stops once more than max_tokens ids exist: the first max_tokens + 1 of the whole text's.
      absl::StatusOr<BoundedEncoding> cut = EncodeBounded(*tokenizer, text, 100, nullptr, piece_bytes);
      ASSERT_TRUE(cut.ok());
      EXPECT_FALSE(cut->complete);
      EXPECT_EQ(cut->ids, std::vector<int64_t>(whole->begin(), whole->begin() + 101));
    }
  }
  // A run of characters the model does not know, without whitespace, is cut at character boundaries.
  std::string emoji;
  for (int i = 0; i < 5000; ++i) emoji += "\xF0\x9F\x98\x80";
  int pieces = 0;
  absl::StatusOr<BoundedEncoding> unknown = EncodeBounded(*tokenizers[0], emoji, 1 << 20, [&pieces] {
    ++pieces;
    return absl::OkStatus();
  });
  ASSERT_TRUE(unknown.ok()) << unknown.status();
  EXPECT_EQ(pieces, static_cast<int>((emoji.size() + kEncodePieceBytes - 1) / kEncodePieceBytes));
  // `stop` ends it.
  int asked = 0;
  absl::StatusOr<BoundedEncoding> stopped = EncodeBounded(*tokenizers[0], emoji, 1 << 20, [&asked] {
    return ++asked < 2 ? absl::OkStatus() : absl::CancelledError("the caller left");
  });
  ExpectStatus(stopped.status(), absl::StatusCode::kCancelled, "the caller left");
  EXPECT_EQ(asked, 2);
}

TEST(Utf8Test, OnlyWhitespaceIsUnicodesWhiteSpace) {
  EXPECT_TRUE(IsOnlyWhitespace(""));
  EXPECT_TRUE(IsOnlyWhitespace(" \t\r\n\v\f"));
  // U+0085, U+00A0, U+1680, U+2000, U+200A, U+2028, U+2029, U+202F, U+205F, U+3000.
  EXPECT_TRUE(IsOnlyWhitespace("\xC2\x85\xC2\xA0\xE1\x9A\x80\xE2\x80\x80\xE2\x80\x8A\xE2\x80\xA8\xE2\x80\xA9"
                               "\xE2\x80\xAF\xE2\x81\x9F\xE3\x80\x80"));
  EXPECT_FALSE(IsOnlyWhitespace(" a "));
  EXPECT_FALSE(IsOnlyWhitespace("\xE2\x80\x8B"));  // U+200B ZERO WIDTH SPACE is not White_Space
  EXPECT_FALSE(IsOnlyWhitespace("\xF0\x9F\x98\x80"));
}

TEST_F(SentencePieceTest, MissingOrCorruptModelIsAnError) {
  ExpectStatus(LoadSentencePieceTokenizer(work_ + "/absent.model").status(), absl::StatusCode::kNotFound,
               "absent.model");
  WriteFile(work_ + "/corrupt.model", "this is not a protobuf \xFF\xFF\xFF");
  ExpectStatus(LoadSentencePieceTokenizer(work_ + "/corrupt.model").status(), absl::StatusCode::kInvalidArgument,
               "tokenizer.model: not a SentencePiece model");
  // LoadTokenizer: the tokenizer's vocabulary must fit the model's embedding table.
  DocumentConfig config = *ParseDocumentConfig(ValidDocumentConfigJson().dump());
  config.tokenizer = "sentencepiece";
  config.vocab_size = 30;
  std::filesystem::create_directories(work_ + "/package");
  std::filesystem::copy_file(work_ + "/tokenizer.model", work_ + "/package/tokenizer.model");
  ExpectStatus(LoadTokenizer(config, work_ + "/package").status(), absl::StatusCode::kInvalidArgument,
               "has 40 tokens, config.json vocab_size is 30");
  config.vocab_size = 40;
  absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = LoadTokenizer(config, work_ + "/package");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->name(), "sentencepiece");
  std::filesystem::create_directories(work_ + "/no_model");
  ExpectStatus(LoadTokenizer(config, work_ + "/no_model").status(), absl::StatusCode::kNotFound, "tokenizer.model");
}

// ----- packages and the classifier against the PyTorch twin -----

Json BudgetJson(const AttentionBudget& budget) {
  if (budget.full_attention) return {{"full_attention", true}};
  return {{"expert_count", budget.expert_count}, {"expert_width", budget.expert_width}};
}

// Runs tools/reference_logits.py document-logits: every document alone through MitaDocument; [B, classes].
absl::StatusOr<at::Tensor> PythonDocumentLogits(const std::string& package, const at::Tensor& token_ids,
                                                const std::vector<int64_t>& lengths,
                                                const std::vector<AttentionBudget>& budgets, const std::string& work) {
  const at::Tensor contiguous = token_ids.contiguous();
  WriteFile(work + "/tokens.i64",
            std::string(static_cast<const char*>(contiguous.data_ptr()), contiguous.numel() * sizeof(int64_t)));
  Json budget_list = Json::array();
  for (const AttentionBudget& budget : budgets) budget_list.push_back(BudgetJson(budget));
  WriteFile(work + "/budgets.json", budget_list.dump());
  WriteFile(work + "/lengths.json", Json(lengths).dump());
  const std::string command = std::string(kPython) + " " + SourceDirectory() +
                              "/tools/reference_logits.py document-logits --package " + package + " --tokens " +
                              work + "/tokens.i64 --lengths " + work + "/lengths.json --budgets " + work +
                              "/budgets.json --out " + work + "/logits.f32 2> " + work + "/python_stderr.txt";
  if (std::system(command.c_str()) != 0) {
    return absl::InternalError("reference_logits.py failed: " + ReadFile(work + "/python_stderr.txt"));
  }
  const std::string bytes = ReadFile(work + "/logits.f32");
  const auto batch = static_cast<int64_t>(lengths.size());
  if (bytes.empty() || bytes.size() % (batch * sizeof(float)) != 0) {
    return absl::InternalError("reference_logits.py wrote " + std::to_string(bytes.size()) + " bytes");
  }
  at::Tensor logits = at::empty({batch, static_cast<int64_t>(bytes.size() / sizeof(float)) / batch});
  std::memcpy(logits.data_ptr(), bytes.data(), bytes.size());
  return logits;
}

std::vector<AttentionBudget> Applied(const std::vector<AttentionBudget>& budgets, const std::vector<int64_t>& lengths) {
  std::vector<AttentionBudget> applied;
  for (size_t b = 0; b < budgets.size(); ++b) applied.push_back(ApplyBudget(budgets[b], lengths[b]));
  return applied;
}

int64_t Sum(const std::vector<int64_t>& values) {
  int64_t total = 0;
  for (int64_t value : values) total += value;
  return total;
}

// A random-weight bytes-tokenizer package made by the Python twin (make-document-package --seed 3).
class DocumentTwinTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MITA_REQUIRE_PYTHON_TORCH();
    at::manual_seed(20261129);
    work_ = MakeTempDirectory("document_twin");
    package_directory_ = work_ + "/package";
    const std::string command = std::string(kPython) + " " + SourceDirectory() +
                                "/tools/reference_logits.py make-document-package --seed 3 --out " +
                                package_directory_ + " 2> " + work_ + "/make_stderr.txt";
    ASSERT_EQ(std::system(command.c_str()), 0) << ReadFile(work_ + "/make_stderr.txt");
    absl::StatusOr<std::unique_ptr<DocumentClassifier>> model = LoadDocumentClassifier(package_directory_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *std::move(model);
  }

  // C++ packed forward of all documents vs the twin running each alone; returns the largest difference.
  double CompareWithPython(const std::vector<int64_t>& lengths, const std::vector<AttentionBudget>& budgets,
                           double tolerance, kernels::MitaBackend backend = kernels::MitaBackend::kAuto) {
    const at::Tensor tokens = at::randint(0, 256, {Sum(lengths)}, at::TensorOptions().dtype(at::kLong));
    absl::StatusOr<ClassifierOutput> output = model_->Forward(tokens, lengths, budgets, false, backend);
    EXPECT_TRUE(output.ok()) << output.status();
    absl::StatusOr<at::Tensor> expected = PythonDocumentLogits(package_directory_, tokens, lengths, budgets, work_);
    EXPECT_TRUE(expected.ok()) << expected.status();
    if (!output.ok() || !expected.ok()) return 1e9;
    EXPECT_EQ(output->logits.sizes(), expected->sizes());
    double largest = 0;
    for (size_t b = 0; b < lengths.size(); ++b) {
      const double difference = output->logits[b].sub((*expected)[b]).abs().max().item<double>();
      largest = std::max(largest, difference);
      EXPECT_LE(difference, tolerance) << "document " << b << " of " << lengths[b] << " tokens, budget "
                                       << BudgetJson(budgets[b]).dump();
    }
    return largest;
  }

  std::string work_;
  std::string package_directory_;
  std::unique_ptr<DocumentClassifier> model_;
};

TEST_F(DocumentTwinTest, PackageLoadsAsADocumentModel) {
  absl::StatusOr<ModelPackage> package = LoadModelPackage(package_directory_);
  ASSERT_TRUE(package.ok()) << package.status();
  EXPECT_EQ(package->name, "package");
  ASSERT_NE(package->classifier, nullptr);
  const ClassifierDescription& description = package->classifier->description();
  EXPECT_EQ(description.name, "package");
  EXPECT_EQ(description.architecture, "mita_document");
  EXPECT_EQ(description.input_kind, InputKind::kDocument);
  EXPECT_FALSE(description.image.has_value());
  ASSERT_TRUE(description.document.has_value());
  EXPECT_EQ(description.document->tokenizer, "bytes");
  EXPECT_EQ(description.document->max_tokens, 65536);
  EXPECT_EQ(description.document->vocabulary_size, 256);
  EXPECT_EQ(description.tokens_per_input, 0);
  EXPECT_EQ(description.knobs.max_expert_count, model_->config().max_expert_count);
  EXPECT_TRUE(description.knobs.allowed_expert_counts.empty());
  EXPECT_THAT(description.labels, ElementsAre("topic 0", "topic 1", "topic 2", "topic 3"));
  ASSERT_NE(model_->tokenizer(), nullptr);
  EXPECT_EQ(model_->tokenizer()->name(), "bytes");
  // The typed loader refuses a package of another architecture.
  ExpectStatus(LoadVitClassifier(package_directory_).status(), absl::StatusCode::kInvalidArgument,
               "architecture \"mita_document\" is not \"mita_vit\"");
}

// Through the Classifier interface: Prepare tokenizes, checks and truncates, resolving and applying the budget;
// Run on the prepared items gives the logits of Forward on the same ids.
TEST_F(DocumentTwinTest, PrepareAndRunThroughTheClassifierInterface) {
  const Classifier& classifier = *model_;
  ClassifierInput text;
  text.kind = ClassifierInput::Kind::kText;
  text.bytes = "Hello, packed batches.";  // the bytes tokenizer: one token per byte
  BudgetRequest experts;
  experts.choice = BudgetRequest::Choice::kExperts;
  experts.expert_count = 64;  // more than the 22 tokens: applied as 22
  absl::StatusOr<BatchItem> item = classifier.Prepare(text, experts, InputLimits{});
  ASSERT_TRUE(item.ok()) << item.status();
  EXPECT_EQ(item->tokens, 22);
  EXPECT_EQ(item->input_tokens, 22);
  EXPECT_EQ(item->budget.budget, (AttentionBudget{false, 22, 22}));  // default width 64, both cut to the 22 tokens
  EXPECT_EQ(item->budget.preset, "");
  EXPECT_EQ(item->compute_units, 22 * 44);
  // The server's token limit cuts a document when truncation is asked, and says who set it otherwise.
  InputLimits limits;
  limits.max_tokens = 10;
  limits.max_tokens_source = "flag --max_batch_tokens";
  using Problems = std::vector<FieldProblem>;
  EXPECT_EQ(FieldProblems(classifier.Prepare(text, {}, limits).status()),
            (Problems{{RequestField::kDocumentText, -1,
                       "the document has more than 10 tokens, over the limit of 10 tokens (flag --max_batch_tokens)"},
                      {RequestField::kTruncate, -1, "set it to classify the first 10 tokens"}}));
  text.truncate = true;
  absl::StatusOr<BatchItem> cut = classifier.Prepare(text, {}, limits);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->tokens, 10);
  // Tokenized only as far as the limit needs: the count before truncation is a lower bound.
  EXPECT_EQ(cut->input_tokens, 11);
  EXPECT_EQ(cut->budget.preset, "default");
  // Token ids: each is range-checked, naming its position.
  const std::vector<int64_t> ids = {1, 2, 300};
  ClassifierInput token_ids;
  token_ids.kind = ClassifierInput::Kind::kTokenIds;
  token_ids.token_ids = ids;
  EXPECT_EQ(FieldProblems(classifier.Prepare(token_ids, {}, InputLimits{}).status()),
            (Problems{{RequestField::kDocumentTokenIds, 2, "300 is out of range: allowed [0, 255]"}}));
  ClassifierInput image;
  image.kind = ClassifierInput::Kind::kImage;
  image.bytes = "\x89PNG";
  EXPECT_EQ(FieldProblems(classifier.Prepare(image, {}, InputLimits{}).status()),
            (Problems{{RequestField::kInput, -1,
                       "model 'package' takes a document (text or token ids), not an image"}}));
  // Run on two prepared items equals Forward on the same ids.
  const std::vector<const BatchItem*> items = {&*item, &*cut};
  absl::StatusOr<ClassifierOutput> run = classifier.Run(items, /*want_statistics=*/true);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->statistics.size(), 2u);
  EXPECT_EQ(run->statistics[0].size(), 2u);  // two layers of MiTA
  for (size_t b = 0; b < items.size(); ++b) {
    absl::StatusOr<ClassifierOutput> alone =
        model_->Forward(items[b]->input, {items[b]->tokens}, {items[b]->budget.budget}, false);
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_LE(run->logits[static_cast<int64_t>(b)].sub(alone->logits[0]).abs().max().item<double>(), 1e-5);
  }
}

TEST_F(DocumentTwinTest, LogitsMatchPythonAtSeveralBudgetsAndFullAttention) {
  // Five documents (1 to 1,500 tokens) at four MiTA budgets and full attention, then at mixed budgets: all in one
  // packed batch (one C++ forward, one Python run that takes each document alone).
  const std::vector<int64_t> document_lengths = {300, 57, 1, 1500, 129};
  std::vector<int64_t> lengths;
  std::vector<AttentionBudget> budgets;
  for (const AttentionBudget budget : {AttentionBudget{false, 16, 64}, AttentionBudget{false, 8, 32},
                                       AttentionBudget{false, 4, 16}, AttentionBudget{false, 32, 128},
                                       AttentionBudget{true, 0, 0}}) {
    for (int64_t length : document_lengths) {
      lengths.push_back(length);
      budgets.push_back(ApplyBudget(budget, length));
    }
  }
  const std::vector<AttentionBudget> mixed =
      Applied({{false, 16, 64}, {true, 0, 0}, {false, 2, 3}, {false, 64, 256}, {false, 129, 129}}, document_lengths);
  lengths.insert(lengths.end(), document_lengths.begin(), document_lengths.end());
  budgets.insert(budgets.end(), mixed.begin(), mixed.end());
  double largest = CompareWithPython(lengths, budgets, 1e-4);
  // The reference kernel too.
  largest = std::max(largest, CompareWithPython(document_lengths, mixed, 1e-4, kernels::MitaBackend::kReference));
  std::cout << "[ info ] max |C++ - Python| document logit difference: " << largest << "\n";
}

TEST_F(DocumentTwinTest, MixedPackedBatchEqualsEachDocumentAlone) {
  const std::vector<int64_t> lengths = {5, 700, 64, 1, 333, 128, 900};
  const std::vector<AttentionBudget> budgets = Applied(
      {{false, 16, 64}, {false, 8, 32}, {true, 0, 0}, {false, 4, 16}, {false, 32, 128}, {false, 1, 1}, {true, 0, 0}},
      lengths);
  const at::Tensor tokens = at::randint(0, 256, {Sum(lengths)}, at::TensorOptions().dtype(at::kLong));
  absl::StatusOr<ClassifierOutput> batched = model_->Forward(tokens, lengths, budgets, true);
  ASSERT_TRUE(batched.ok()) << batched.status();
  ASSERT_EQ(batched->logits.size(0), static_cast<int64_t>(lengths.size()));
  ASSERT_EQ(batched->statistics.size(), lengths.size());
  int64_t offset = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    absl::StatusOr<ClassifierOutput> alone = model_->Forward(
        tokens.narrow(0, offset, lengths[b]), {lengths[b]}, {budgets[b]}, true);
    offset += lengths[b];
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_LE(batched->logits[b].sub(alone->logits[0]).abs().max().item<double>(), 1e-5) << "document " << b;
    EXPECT_EQ(batched->statistics[b].size(), budgets[b].full_attention ? 0u : 2u) << "document " << b;
    ASSERT_EQ(batched->statistics[b].size(), alone->statistics[0].size());
    for (size_t layer = 0; layer < batched->statistics[b].size(); ++layer) {
      EXPECT_EQ(batched->statistics[b][layer].queries_per_expert.size(),
                static_cast<size_t>(budgets[b].expert_count));
      EXPECT_EQ(batched->statistics[b][layer].queries_per_expert, alone->statistics[0][layer].queries_per_expert);
    }
  }
}

// A document whose caller left is dropped from the packed batch between layers (or inside full attention's
// query chunks); the others go on and get the logits they get alone.
TEST_F(DocumentTwinTest, DocumentsWhoseCallerLeftAreDroppedAndTheOthersGoOn) {
  const std::vector<int64_t> lengths = {300, 1200, 57, 800};
  const std::vector<AttentionBudget> budgets =
      Applied({{false, 16, 64}, {true, 0, 0}, {false, 4, 16}, {true, 0, 0}}, lengths);
  const at::Tensor tokens = at::randint(0, 256, {Sum(lengths)}, at::TensorOptions().dtype(at::kLong));
  // Document 1 (full attention) leaves during its first layer's attention, document 2 before the second layer.
  std::map<size_t, int> asked;
  const ItemCheck check = [&asked](size_t item) -> absl::Status {
    const int calls = ++asked[item];
    if (item == 1 && calls > 3) return absl::CancelledError("document 1 left");
    if (item == 2 && calls > 1) return absl::DeadlineExceededError("document 2's deadline passed");
    return absl::OkStatus();
  };
  absl::StatusOr<ClassifierOutput> output =
      model_->Forward(tokens, lengths, budgets, true, kernels::MitaBackend::kAuto, check);
  ASSERT_TRUE(output.ok()) << output.status();
  ASSERT_EQ(output->stopped.size(), 4u);
  EXPECT_TRUE(output->stopped[0].ok());
  ExpectStatus(output->stopped[1], absl::StatusCode::kCancelled, "document 1 left");
  ExpectStatus(output->stopped[2], absl::StatusCode::kDeadlineExceeded, "document 2's deadline passed");
  EXPECT_TRUE(output->stopped[3].ok());
  EXPECT_EQ(output->logits[1].abs().max().item<double>(), 0.0);
  EXPECT_TRUE(output->statistics[2].empty());
  // Full attention asked once per query chunk: far more often than once per layer.
  EXPECT_GT(asked[3], 4);
  int64_t offset = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (b == 0 || b == 3) {
      absl::StatusOr<ClassifierOutput> alone =
          model_->Forward(tokens.narrow(0, offset, lengths[b]), {lengths[b]}, {budgets[b]}, true);
      ASSERT_TRUE(alone.ok());
      EXPECT_LE(output->logits[static_cast<int64_t>(b)].sub(alone->logits[0]).abs().max().item<double>(), 1e-5) << b;
    }
    offset += lengths[b];
  }
  // Everybody gone: nothing left to run, every document stopped.
  absl::StatusOr<ClassifierOutput> none = model_->Forward(
      tokens, lengths, budgets, false, kernels::MitaBackend::kAuto,
      [](size_t) { return absl::CancelledError("gone"); });
  ASSERT_TRUE(none.ok());
  for (const absl::Status& stopped : none->stopped) EXPECT_EQ(stopped.code(), absl::StatusCode::kCancelled);
}

// Attention pooling (config.json "pooling": {"type": "attention", "heads": 4, "position_buckets": 17}): the C++
// forward against the twin on lengths that end in different position buckets (1 token: bucket 0 only; 5,000
// tokens: buckets 0-12), in a packed batch with mixed budgets.
TEST_F(DocumentTwinTest, AttentionPoolingMatchesPython) {
  const std::string directory = work_ + "/attention_pooling";
  const std::string command = std::string(kPython) + " " + SourceDirectory() +
                              "/tools/reference_logits.py make-document-package --seed 5 --pooling attention --out " +
                              directory + " 2> " + work_ + "/make_stderr.txt";
  ASSERT_EQ(std::system(command.c_str()), 0) << ReadFile(work_ + "/make_stderr.txt");
  absl::StatusOr<std::unique_ptr<DocumentClassifier>> pooled = LoadDocumentClassifier(directory);
  ASSERT_TRUE(pooled.ok()) << pooled.status();
  EXPECT_EQ((*pooled)->config().pooling, DocumentConfig::Pooling::kAttention);
  EXPECT_EQ((*pooled)->config().pooling_heads, 4);
  EXPECT_EQ((*pooled)->config().pooling_position_buckets, 17);
  model_ = *std::move(pooled);
  package_directory_ = directory;
  const std::vector<int64_t> lengths = {1, 2, 7, 300, 5000};
  const std::vector<AttentionBudget> budgets =
      Applied({{false, 16, 64}, {true, 0, 0}, {false, 4, 16}, {false, 32, 128}, {false, 16, 64}}, lengths);
  EXPECT_LE(CompareWithPython(lengths, budgets, 1e-4), 1e-4);
}

TEST_F(DocumentTwinTest, ForwardRejectsBadInputsNamingTheRange) {
  const DocumentClassifier& model = *model_;
  const auto ids = [](std::vector<int64_t> values) { return at::tensor(values, at::TensorOptions().dtype(at::kLong)); };
  const AttentionBudget mita{false, 2, 3};
  ExpectStatus(model.Forward(ids({1, 2, 256, 4}), {4}, {mita}, false).status(), absl::StatusCode::kInvalidArgument,
               "token_ids: id 256 at position 2 is out of range: allowed [0, 255]");
  ExpectStatus(model.Forward(ids({1, -1, 3}), {3}, {mita}, false).status(), absl::StatusCode::kInvalidArgument,
               "token_ids: id -1 at position 1 is out of range: allowed [0, 255]");
  ExpectStatus(model.Forward(ids({1, 2, 3}), {2}, {{true, 0, 0}}, false).status(),
               absl::StatusCode::kInvalidArgument, "lengths: sum to 2 tokens, token_ids holds 3");
  ExpectStatus(model.Forward(ids({1, 2, 3}), {3, 0}, {mita, mita}, false).status(),
               absl::StatusCode::kInvalidArgument, "lengths[1]: 0 tokens is out of range: allowed [1, 65536]");
  ExpectStatus(model.Forward(ids({1, 2, 3}), {3}, {mita, mita}, false).status(), absl::StatusCode::kInvalidArgument,
               "budgets: 2 entries for a batch of 1 documents");
  ExpectStatus(model.Forward(ids({}), {}, {}, false).status(), absl::StatusCode::kInvalidArgument,
               "lengths: the batch has no documents");
  ExpectStatus(model.Forward(ids({1, 2, 3}), {3}, {{false, 2, 5000}}, false).status(),
               absl::StatusCode::kInvalidArgument,
               "budgets[0]: expert_width: 5000 is out of range: allowed [1, 1024]");
  ExpectStatus(model.Forward(ids({1, 2, 3}), {3}, {{false, 16, 64}}, false).status(),
               absl::StatusCode::kInvalidArgument, "must not exceed the document's 3 tokens");
  ExpectStatus(model.Forward(at::tensor(std::vector<int>{1, 2, 3}), {3}, {mita}, false).status(),
               absl::StatusCode::kInvalidArgument, "token_ids: must be a 1-D int64 tensor");
  // max_tokens: the same weights with a 64-token limit.
  absl::StatusOr<std::map<std::string, at::Tensor>> weights = LoadSafetensors(package_directory_ + "/model.safetensors");
  ASSERT_TRUE(weights.ok()) << weights.status();
  DocumentConfig short_config = model_->config();
  short_config.max_tokens = 64;
  absl::StatusOr<std::unique_ptr<DocumentClassifier>> short_model = DocumentClassifier::Create(
      "short", short_config, model_->description().labels, *std::move(weights), MakeBytesTokenizer());
  ASSERT_TRUE(short_model.ok()) << short_model.status();
  const at::Tensor tokens = at::randint(0, 256, {65}, at::TensorOptions().dtype(at::kLong));
  ExpectStatus((*short_model)->Forward(tokens, {65}, {{true, 0, 0}}, false).status(),
               absl::StatusCode::kInvalidArgument, "lengths[0]: 65 tokens is out of range: allowed [1, 64]");
  EXPECT_TRUE((*short_model)->Forward(tokens.narrow(0, 0, 64), {64}, {{true, 0, 0}}, false).ok());
}

TEST_F(DocumentTwinTest, PackageFaultsAreNamed) {
  // A weight missing from the file.
  absl::StatusOr<std::map<std::string, at::Tensor>> weights = LoadSafetensors(package_directory_ + "/model.safetensors");
  ASSERT_TRUE(weights.ok());
  std::map<std::string, at::Tensor> missing = *weights;
  missing.erase("position_conv.weight");
  ExpectStatus(DocumentClassifier::Create("package", model_->config(), model_->description().labels, missing, nullptr)
                   .status(),
               absl::StatusCode::kInvalidArgument, "weights: missing tensor \"position_conv.weight\" (expected shape [32, 1, 5])");
  std::map<std::string, at::Tensor> extra = *weights;
  extra["pos_embed"] = at::empty({1, 4, 32});
  ExpectStatus(DocumentClassifier::Create("package", model_->config(), model_->description().labels, extra, nullptr)
                   .status(),
               absl::StatusCode::kInvalidArgument,
               "weights: unexpected tensor \"pos_embed\"");
  // A sentencepiece config without tokenizer.model.
  Json config = Json::parse(ReadFile(package_directory_ + "/config.json"));
  config["tokenizer"] = "sentencepiece";
  WriteFile(package_directory_ + "/config.json", config.dump());
  ExpectStatus(LoadModelPackage(package_directory_).status(), absl::StatusCode::kNotFound, "tokenizer.model");
}

// The trained packages (tools/train_document.py): each loads with its SentencePiece tokenizer, and its C++ logits
// equal the twin's on real text of its domain at three budgets and full attention.
struct TrainedPackage {
  std::string name;
  std::string text;
};
void PrintTo(const TrainedPackage& package, std::ostream* out) { *out << package.name; }

class TrainedDocumentPackageTest : public ::testing::TestWithParam<TrainedPackage> {};

TEST_P(TrainedDocumentPackageTest, LoadsAndMatchesPython) {
  const std::string directory = SourceDirectory() + "/models/repository/" + GetParam().name;
  if (!std::filesystem::exists(directory + "/model.safetensors")) {
    MITA_MISSING_DEPENDENCY("no trained package at " << directory << " (train it with tools/train_document.py)");
  }
  absl::StatusOr<std::unique_ptr<DocumentClassifier>> model = LoadDocumentClassifier(directory);
  ASSERT_TRUE(model.ok()) << model.status();
  const DocumentClassifier& package = **model;
  ASSERT_NE(package.tokenizer(), nullptr);
  EXPECT_EQ(package.tokenizer()->name(), "sentencepiece");
  EXPECT_EQ(package.tokenizer()->vocab_size(), package.config().vocab_size);
  EXPECT_GE(package.config().max_tokens, 65536);
  EXPECT_EQ(static_cast<int64_t>(package.description().labels.size()), package.config().num_classes);
  const std::string& text = GetParam().text;
  absl::StatusOr<std::vector<int64_t>> ids = package.tokenizer()->Encode(text);
  ASSERT_TRUE(ids.ok()) << ids.status();
  ASSERT_GT(ids->size(), 20u);
  MITA_REQUIRE_PYTHON_TORCH();
  const auto n = static_cast<int64_t>(ids->size());
  std::vector<int64_t> all_ids, lengths;
  std::vector<AttentionBudget> budgets;
  for (const AttentionBudget budget : {AttentionBudget{false, 8, 32}, AttentionBudget{false, 16, 64},
                                       AttentionBudget{false, 32, 128}, AttentionBudget{true, 0, 0}}) {
    all_ids.insert(all_ids.end(), ids->begin(), ids->end());
    lengths.push_back(n);
    budgets.push_back(ApplyBudget(budget, n));
  }
  const at::Tensor tokens = at::tensor(all_ids, at::TensorOptions().dtype(at::kLong));
  absl::StatusOr<ClassifierOutput> output = package.Forward(tokens, lengths, budgets, false);
  ASSERT_TRUE(output.ok()) << output.status();
  const std::string work = MakeTempDirectory("trained_document");
  absl::StatusOr<at::Tensor> expected = PythonDocumentLogits(directory, tokens, lengths, budgets, work);
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_LE(output->logits.sub(*expected).abs().max().item<double>(), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(
    EmbeddedModels, TrainedDocumentPackageTest,
    ::testing::Values(
        TrainedPackage{"linux-doc-mita",
                       "The I2C bus driver registers an adapter; client drivers bind to devices found in the device "
                       "tree.\nEach transfer is a list of messages. The SMBus protocol is a subset of I2C."},
        TrainedPackage{"texlive-doc-mita",
                       "The package provides commands to typeset musical scores: \\begin{music} starts a piece, "
                       "\\notes ... \\enotes a group of notes.\nSee the bibliography style options of biblatex."}),
    [](const ::testing::TestParamInfo<TrainedPackage>& info) {
      std::string name = info.param.name;
      std::replace(name.begin(), name.end(), '-', '_');
      return name;
    });

// Every embedded document model's tokenizer was trained with byte fallback: characters outside its vocabulary
// become their UTF-8 bytes (pieces <0xNN>), never <unk> (id 0), and the C++ ids still equal spm_encode's.
TEST(TrainedDocumentPackageTest, EveryDocumentTokenizerFallsBackToBytes) {
  int tokenizers = 0;
  for (const auto& entry : std::filesystem::directory_iterator(SourceDirectory() + "/models/repository")) {
    const std::string model_path = entry.path().string() + "/tokenizer.model";
    if (!std::filesystem::exists(model_path)) continue;
    ++tokenizers;
    SCOPED_TRACE(model_path);
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadSentencePieceTokenizer(model_path);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    const std::string text = "Parrot \xF0\x9F\xA6\x9C and \xE9\xBE\x98 in a manual";  // U+1F99C, U+9F98
    absl::StatusOr<std::vector<int64_t>> ids = (*tokenizer)->Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(std::count(ids->begin(), ids->end(), 0), 0) << "an <unk> id in the encoding";
    const std::string work = MakeTempDirectory("document_tokenizer");
    WriteFile(work + "/input.txt", text + "\n");
    ASSERT_EQ(std::system(("spm_encode --model=" + model_path + " --output_format=id < " + work + "/input.txt > " +
                           work + "/ids.txt")
                              .c_str()),
              0);
    std::istringstream expected_stream(ReadFile(work + "/ids.txt"));
    std::vector<int64_t> expected((std::istream_iterator<int64_t>(expected_stream)),
                                  std::istream_iterator<int64_t>());
    EXPECT_EQ(*ids, expected);
    // Byte pieces: the 4 bytes of the emoji and the 3 of the rare ideograph, unless they are pieces themselves.
    EXPECT_GE(ids->size(), 7u);
  }
  EXPECT_GE(tokenizers, 2) << "the embedded document models (linux-doc-mita, texlive-doc-mita)";
}

}  // namespace
}  // namespace mita::models
