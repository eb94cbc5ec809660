// config.json parsing and budget validation (see model_config.h).
#include "models/model_config.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace mita::models {
namespace {

using Json = nlohmann::json;

constexpr char kPrefix[] = "config.json: ";

absl::Status Invalid(absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(kPrefix, message));
}

// Looks up `key` in `object` (whose dotted path is `path`, empty for the root). Returns null when absent.
const Json* Find(const Json& object, absl::string_view key) {
  auto it = object.find(std::string(key));
  return it == object.end() ? nullptr : &*it;
}

std::string FieldPath(absl::string_view path, absl::string_view key) {
  return path.empty() ? std::string(key) : absl::StrCat(path, ".", key);
}

// Reads an integer field in [min_value, max_value]. JSON integers only (28.0 or "28" are rejected).
absl::StatusOr<int64_t> ReadInteger(const Json& object, absl::string_view path, absl::string_view key,
                                    int64_t min_value, int64_t max_value) {
  const std::string field = FieldPath(path, key);
  const Json* value = Find(object, key);
  if (value == nullptr) return Invalid(absl::StrCat("missing required field ", field));
  if (!value->is_number_integer()) {
    return Invalid(absl::StrCat(field, " must be an integer, found ", value->dump()));
  }
  int64_t result = 0;
  if (value->is_number_unsigned()) {
    const uint64_t unsigned_value = value->get<uint64_t>();
    if (unsigned_value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Invalid(absl::StrCat(field, " ", unsigned_value, " is out of range [", min_value, ", ", max_value, "]"));
    }
    result = static_cast<int64_t>(unsigned_value);
  } else {
    result = value->get<int64_t>();
  }
  if (result < min_value || result > max_value) {
    return Invalid(absl::StrCat(field, " ", result, " is out of range [", min_value, ", ", max_value, "]"));
  }
  return result;
}

// Reads a finite number (integer or floating point).
absl::StatusOr<double> ReadNumber(const Json& value, const std::string& field) {
  if (!value.is_number()) return Invalid(absl::StrCat(field, " must be a number, found ", value.dump()));
  const double result = value.get<double>();
  if (!std::isfinite(result)) return Invalid(absl::StrCat(field, " must be finite"));
  return result;
}

absl::StatusOr<std::string> ReadString(const Json& object, absl::string_view path, absl::string_view key) {
  const std::string field = FieldPath(path, key);
  const Json* value = Find(object, key);
  if (value == nullptr) return Invalid(absl::StrCat("missing required field ", field));
  if (!value->is_string()) return Invalid(absl::StrCat(field, " must be a string, found ", value->dump()));
  return value->get<std::string>();
}

absl::StatusOr<const Json*> ReadObject(const Json& object, absl::string_view path, absl::string_view key) {
  const std::string field = FieldPath(path, key);
  const Json* value = Find(object, key);
  if (value == nullptr) return Invalid(absl::StrCat("missing required field ", field));
  if (!value->is_object()) return Invalid(absl::StrCat(field, " must be an object, found ", value->dump()));
  return value;
}

// Reads `key` as an array of exactly `size` numbers, each > 0 when `positive`.
absl::StatusOr<std::vector<float>> ReadChannelVector(const Json& object, absl::string_view path, absl::string_view key,
                                                     int64_t size, bool positive) {
  const std::string field = FieldPath(path, key);
  const Json* value = Find(object, key);
  if (value == nullptr) return Invalid(absl::StrCat("missing required field ", field));
  if (!value->is_array()) return Invalid(absl::StrCat(field, " must be an array of numbers"));
  if (static_cast<int64_t>(value->size()) != size) {
    return Invalid(absl::StrCat(field, " has ", value->size(), " entries, expected in_channels = ", size));
  }
  std::vector<float> result;
  for (size_t i = 0; i < value->size(); ++i) {
    absl::StatusOr<double> number = ReadNumber((*value)[i], absl::StrCat(field, "[", i, "]"));
    if (!number.ok()) return number.status();
    if (positive && !(*number > 0)) return Invalid(absl::StrCat(field, "[", i, "] must be > 0, found ", *number));
    result.push_back(static_cast<float>(*number));
  }
  return result;
}

// A budget object: {"expert_count": m, "expert_width": k} or {"full_attention": true}.
absl::StatusOr<AttentionBudget> ReadBudget(const Json& value, const std::string& field) {
  if (!value.is_object()) return Invalid(absl::StrCat(field, " must be an object, found ", value.dump()));
  AttentionBudget budget;
  if (const Json* full = Find(value, "full_attention"); full != nullptr) {
    if (!full->is_boolean()) return Invalid(absl::StrCat(field, ".full_attention must be a boolean"));
    budget.full_attention = full->get<bool>();
  }
  if (budget.full_attention) return budget;
  // Ranges are checked against the model afterwards (CheckConfigBudget); here only the type and sign.
  absl::StatusOr<int64_t> count = ReadInteger(value, field, "expert_count", 1, std::numeric_limits<int32_t>::max());
  if (!count.ok()) return count.status();
  absl::StatusOr<int64_t> width = ReadInteger(value, field, "expert_width", 1, std::numeric_limits<int32_t>::max());
  if (!width.ok()) return width.status();
  budget.expert_count = *count;
  budget.expert_width = *width;
  return budget;
}

// Checks a budget declared in config.json against the model's ranges; the message names the config field.
// Reads attention.default_budget (required) and attention.presets (optional: an object of name -> budget),
// each checked by `check(budget, field)` against the model's ranges. Errors: INVALID_ARGUMENT naming the field.
absl::Status ReadDefaultBudgetAndPresets(
    const Json& attention, const std::function<absl::Status(const AttentionBudget&, const std::string&)>& check,
    AttentionBudget& default_budget, std::map<std::string, AttentionBudget>& presets) {
  const Json* default_value = Find(attention, "default_budget");
  if (default_value == nullptr) return Invalid("missing required field attention.default_budget");
  absl::StatusOr<AttentionBudget> budget = ReadBudget(*default_value, "attention.default_budget");
  if (!budget.ok()) return budget.status();
  if (absl::Status status = check(*budget, "attention.default_budget"); !status.ok()) return status;
  default_budget = *budget;
  if (const Json* values = Find(attention, "presets"); values != nullptr) {
    if (!values->is_object()) return Invalid("attention.presets must be an object of name -> budget");
    for (const auto& [name, value] : values->items()) {
      const std::string field = absl::StrCat("attention.presets.", name);
      if (name.empty()) return Invalid("attention.presets has an empty preset name");
      absl::StatusOr<AttentionBudget> preset = ReadBudget(value, field);
      if (!preset.ok()) return preset.status();
      if (absl::Status status = check(*preset, field); !status.ok()) return status;
      presets.emplace(name, *preset);
    }
  }
  return absl::OkStatus();
}

absl::Status CheckConfigBudget(const VitConfig& config, const AttentionBudget& budget, const std::string& field) {
  if (budget.full_attention) return absl::OkStatus();
  const std::vector<int64_t> counts = AllowedExpertCounts(config);
  bool count_allowed = false;
  for (int64_t count : counts) count_allowed |= count == budget.expert_count;
  if (!count_allowed) {
    return Invalid(absl::StrCat(field, ".expert_count ", budget.expert_count, " is not allowed: use one of ",
                                absl::StrJoin(counts, ", ")));
  }
  if (budget.expert_width < 1 || budget.expert_width > config.tokens()) {
    return Invalid(absl::StrCat(field, ".expert_width ", budget.expert_width, " is out of range [1, ",
                                config.tokens(), "]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<VitConfig> ParseValidated(const Json& root) {
  if (!root.is_object()) return Invalid("the top level must be a JSON object");
  VitConfig config;

  absl::StatusOr<std::string> architecture = ReadString(root, "", "architecture");
  if (!architecture.ok()) return architecture.status();
  if (*architecture != "mita_vit") {
    return Invalid(absl::StrCat("architecture \"", *architecture, "\" is not supported: use \"mita_vit\""));
  }
  config.architecture = *architecture;
  if (const Json* task = Find(root, "task"); task != nullptr) {
    if (!task->is_string() || task->get<std::string>() != "image_classification") {
      return Invalid(absl::StrCat("task ", task->dump(), " is not supported: use \"image_classification\""));
    }
  }

  // Upper bounds keep products such as tokens() and weight sizes far from int64 overflow.
  constexpr int64_t kMaxSide = 1 << 14;
  absl::StatusOr<int64_t> image_size = ReadInteger(root, "", "image_size", 1, kMaxSide);
  if (!image_size.ok()) return image_size.status();
  absl::StatusOr<int64_t> patch_size = ReadInteger(root, "", "patch_size", 1, *image_size);
  if (!patch_size.ok()) return patch_size.status();
  if (*image_size % *patch_size != 0) {
    return Invalid(absl::StrCat("patch_size ", *patch_size, " does not divide image_size ", *image_size));
  }
  config.image_size = *image_size;
  config.patch_size = *patch_size;
  if (config.tokens() > (int64_t{1} << 20)) {
    return Invalid(absl::StrCat("image_size / patch_size gives ", config.tokens(), " tokens, more than ",
                                int64_t{1} << 20));
  }

  absl::StatusOr<int64_t> in_channels = ReadInteger(root, "", "in_channels", 1, 3);
  if (!in_channels.ok()) return in_channels.status();
  if (*in_channels == 2) return Invalid("in_channels 2 is not supported: use 1 (grayscale) or 3 (RGB)");
  config.in_channels = *in_channels;

  absl::StatusOr<int64_t> embed_dim = ReadInteger(root, "", "embed_dim", 1, 1 << 16);
  if (!embed_dim.ok()) return embed_dim.status();
  config.embed_dim = *embed_dim;
  absl::StatusOr<int64_t> depth = ReadInteger(root, "", "depth", 1, 1024);
  if (!depth.ok()) return depth.status();
  config.depth = *depth;
  absl::StatusOr<int64_t> num_heads = ReadInteger(root, "", "num_heads", 1, config.embed_dim);
  if (!num_heads.ok()) return num_heads.status();
  if (config.embed_dim % *num_heads != 0) {
    return Invalid(absl::StrCat("num_heads ", *num_heads, " does not divide embed_dim ", config.embed_dim));
  }
  config.num_heads = *num_heads;
  absl::StatusOr<int64_t> mlp_hidden_dim = ReadInteger(root, "", "mlp_hidden_dim", 1, 1 << 20);
  if (!mlp_hidden_dim.ok()) return mlp_hidden_dim.status();
  config.mlp_hidden_dim = *mlp_hidden_dim;

  if (const Json* eps = Find(root, "layer_norm_eps"); eps != nullptr) {
    absl::StatusOr<double> value = ReadNumber(*eps, "layer_norm_eps");
    if (!value.ok()) return value.status();
    if (!(*value > 0)) return Invalid(absl::StrCat("layer_norm_eps must be > 0, found ", *value));
    config.layer_norm_eps = *value;
  }
  absl::StatusOr<int64_t> num_classes = ReadInteger(root, "", "num_classes", 1, 1 << 20);
  if (!num_classes.ok()) return num_classes.status();
  config.num_classes = *num_classes;

  absl::StatusOr<const Json*> normalization = ReadObject(root, "", "normalization");
  if (!normalization.ok()) return normalization.status();
  absl::StatusOr<std::vector<float>> mean =
      ReadChannelVector(**normalization, "normalization", "mean", config.in_channels, /*positive=*/false);
  if (!mean.ok()) return mean.status();
  absl::StatusOr<std::vector<float>> deviation =
      ReadChannelVector(**normalization, "normalization", "std", config.in_channels, /*positive=*/true);
  if (!deviation.ok()) return deviation.status();
  config.mean = *std::move(mean);
  config.std = *std::move(deviation);

  absl::StatusOr<const Json*> attention = ReadObject(root, "", "attention");
  if (!attention.ok()) return attention.status();
  absl::StatusOr<std::string> type = ReadString(**attention, "attention", "type");
  if (!type.ok()) return type.status();
  if (*type != "mita") return Invalid(absl::StrCat("attention.type \"", *type, "\" is not supported: use \"mita\""));
  if (const Json* dwc = Find(**attention, "depthwise_conv"); dwc != nullptr) {
    if (!dwc->is_boolean()) {
      return Invalid(absl::StrCat("attention.depthwise_conv must be a boolean, found ", dwc->dump()));
    }
    config.depthwise_conv = dwc->get<bool>();
  }
  if (absl::Status status = ReadDefaultBudgetAndPresets(
          **attention, [&config](const AttentionBudget& budget, const std::string& field) {
            return CheckConfigBudget(config, budget, field);
          },
          config.default_budget, config.presets);
      !status.ok()) {
    return status;
  }

  if (Find(root, "max_image_side") != nullptr) {
    absl::StatusOr<int64_t> max_side = ReadInteger(root, "", "max_image_side", 1, 1 << 16);
    if (!max_side.ok()) return max_side.status();
    config.max_image_side = *max_side;
  }
  return config;
}

// Checks a budget declared in a document config.json against max_expert_count / max_expert_width.
absl::Status CheckDocumentConfigBudget(const DocumentConfig& config, const AttentionBudget& budget,
                                       const std::string& field) {
  if (budget.full_attention) return absl::OkStatus();
  if (budget.expert_count < 1 || budget.expert_count > config.max_expert_count) {
    return Invalid(absl::StrCat(field, ".expert_count ", budget.expert_count, " is out of range [1, ",
                                config.max_expert_count, "]"));
  }
  if (budget.expert_width < 1 || budget.expert_width > config.max_expert_width) {
    return Invalid(absl::StrCat(field, ".expert_width ", budget.expert_width, " is out of range [1, ",
                                config.max_expert_width, "]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DocumentConfig> ParseValidatedDocument(const Json& root) {
  if (!root.is_object()) return Invalid("the top level must be a JSON object");
  DocumentConfig config;
  absl::StatusOr<std::string> architecture = ReadString(root, "", "architecture");
  if (!architecture.ok()) return architecture.status();
  if (*architecture != "mita_document") {
    return Invalid(absl::StrCat("architecture \"", *architecture, "\" is not supported: use \"mita_document\""));
  }
  config.architecture = *architecture;
  if (const Json* task = Find(root, "task"); task != nullptr) {
    if (!task->is_string() || task->get<std::string>() != "document_classification") {
      return Invalid(absl::StrCat("task ", task->dump(), " is not supported: use \"document_classification\""));
    }
  }
  // Upper bounds keep products (tokens x channels, weight sizes) far from int64 overflow.
  struct IntegerField {
    const char* key;
    int64_t max_value;
    int64_t* target;
  };
  for (const IntegerField& field : {IntegerField{"vocab_size", int64_t{1} << 24, &config.vocab_size},
                                    IntegerField{"embed_dim", 1 << 16, &config.embed_dim},
                                    IntegerField{"depth", 1024, &config.depth},
                                    IntegerField{"num_heads", 1 << 16, &config.num_heads},
                                    IntegerField{"mlp_hidden_dim", 1 << 20, &config.mlp_hidden_dim},
                                    IntegerField{"num_classes", 1 << 20, &config.num_classes},
                                    IntegerField{"max_tokens", int64_t{1} << 24, &config.max_tokens}}) {
    absl::StatusOr<int64_t> value = ReadInteger(root, "", field.key, 1, field.max_value);
    if (!value.ok()) return value.status();
    *field.target = *value;
  }
  if (config.num_heads > config.embed_dim || config.embed_dim % config.num_heads != 0) {
    return Invalid(absl::StrCat("num_heads ", config.num_heads, " does not divide embed_dim ", config.embed_dim));
  }
  if (const Json* eps = Find(root, "layer_norm_eps"); eps != nullptr) {
    absl::StatusOr<double> value = ReadNumber(*eps, "layer_norm_eps");
    if (!value.ok()) return value.status();
    if (!(*value > 0)) return Invalid(absl::StrCat("layer_norm_eps must be > 0, found ", *value));
    config.layer_norm_eps = *value;
  }
  absl::StatusOr<std::string> tokenizer = ReadString(root, "", "tokenizer");
  if (!tokenizer.ok()) return tokenizer.status();
  if (*tokenizer != "bytes" && *tokenizer != "sentencepiece") {
    return Invalid(absl::StrCat("tokenizer \"", *tokenizer, "\" is not supported: use \"bytes\" or \"sentencepiece\""));
  }
  if (*tokenizer == "bytes" && config.vocab_size < 256) {
    return Invalid(absl::StrCat("vocab_size ", config.vocab_size, " is too small for tokenizer \"bytes\" (needs 256)"));
  }
  config.tokenizer = *tokenizer;

  absl::StatusOr<const Json*> position = ReadObject(root, "", "position_encoding");
  if (!position.ok()) return position.status();
  absl::StatusOr<std::string> position_type = ReadString(**position, "position_encoding", "type");
  if (!position_type.ok()) return position_type.status();
  if (*position_type != "convolution") {
    return Invalid(absl::StrCat("position_encoding.type \"", *position_type, "\" is not supported: use \"convolution\""));
  }
  absl::StatusOr<int64_t> kernel_size = ReadInteger(**position, "position_encoding", "kernel_size", 1, 255);
  if (!kernel_size.ok()) return kernel_size.status();
  if (*kernel_size % 2 == 0) return Invalid(absl::StrCat("position_encoding.kernel_size ", *kernel_size, " must be odd"));
  config.position_kernel_size = *kernel_size;

  absl::StatusOr<const Json*> attention = ReadObject(root, "", "attention");
  if (!attention.ok()) return attention.status();
  absl::StatusOr<std::string> type = ReadString(**attention, "attention", "type");
  if (!type.ok()) return type.status();
  if (*type != "mita") return Invalid(absl::StrCat("attention.type \"", *type, "\" is not supported: use \"mita\""));
  absl::StatusOr<int64_t> max_count = ReadInteger(**attention, "attention", "max_expert_count", 1, config.max_tokens);
  if (!max_count.ok()) return max_count.status();
  config.max_expert_count = *max_count;
  absl::StatusOr<int64_t> max_width = ReadInteger(**attention, "attention", "max_expert_width", 1, config.max_tokens);
  if (!max_width.ok()) return max_width.status();
  config.max_expert_width = *max_width;
  if (absl::Status status = ReadDefaultBudgetAndPresets(
          **attention, [&config](const AttentionBudget& budget, const std::string& field) {
            return CheckDocumentConfigBudget(config, budget, field);
          },
          config.default_budget, config.presets);
      !status.ok()) {
    return status;
  }
  return config;
}

// Parses JSON text; INVALID_ARGUMENT "config.json: invalid JSON ..." on a syntax error, and on a number the
// parser cannot represent (nlohmann throws out_of_range, not parse_error, for e.g. 1e55555: found by
// tests/fuzz/model_config_fuzzer).
absl::StatusOr<Json> ParseJson(std::string_view json_text) {
  try {
    return Json::parse(json_text.begin(), json_text.end());
  } catch (const Json::parse_error& error) {
    return Invalid(absl::StrCat("invalid JSON at byte ", error.byte, ": ", error.what()));
  } catch (const Json::exception& error) {
    return Invalid(absl::StrCat("invalid JSON: ", error.what()));
  }
}

}  // namespace

absl::StatusOr<DocumentConfig> ParseDocumentConfig(std::string_view json_text) {
  absl::StatusOr<Json> root = ParseJson(json_text);
  if (!root.ok()) return root.status();
  try {
    return ParseValidatedDocument(*root);
  } catch (const Json::exception& error) {
    return Invalid(absl::StrCat("unexpected JSON structure: ", error.what()));
  }
}

absl::StatusOr<ModelKind> ParseModelKind(std::string_view json_text) {
  absl::StatusOr<Json> root = ParseJson(json_text);
  if (!root.ok()) return root.status();
  if (!root->is_object()) return Invalid("the top level must be a JSON object");
  absl::StatusOr<std::string> architecture = ReadString(*root, "", "architecture");
  if (!architecture.ok()) return architecture.status();
  if (*architecture == "mita_vit") return ModelKind::kImage;
  if (*architecture == "mita_document") return ModelKind::kDocument;
  return Invalid(absl::StrCat("architecture \"", *architecture,
                              "\" is not supported: use \"mita_vit\" or \"mita_document\""));
}

namespace {

// INVALID_ARGUMENT listing every problem of a budget ("; " between them), or OK when there is none.
absl::Status BudgetProblems(const std::vector<std::string>& problems) {
  if (problems.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrJoin(problems, "; "));
}

// "budget.experts.expert_width 51 is out of range: allowed [1, 50]" when `value` is outside [1, maximum].
void CheckKnobRange(const char* field, int64_t value, int64_t maximum, std::vector<std::string>* problems) {
  if (value < 1 || value > maximum) {
    problems->push_back(
        absl::StrCat("budget.experts.", field, " ", value, " is out of range: allowed [1, ", maximum, "]"));
  }
}

}  // namespace

absl::Status ValidateDocumentBudget(const DocumentConfig& config, const AttentionBudget& budget) {
  if (budget.full_attention) return absl::OkStatus();
  std::vector<std::string> problems;
  CheckKnobRange("expert_count", budget.expert_count, config.max_expert_count, &problems);
  CheckKnobRange("expert_width", budget.expert_width, config.max_expert_width, &problems);
  return BudgetProblems(problems);
}

AttentionBudget ApplyDocumentBudget(const AttentionBudget& budget, int64_t tokens) {
  if (budget.full_attention) return budget;
  AttentionBudget applied = budget;
  applied.expert_count = std::min(budget.expert_count, tokens);
  applied.expert_width = std::min(budget.expert_width, tokens);
  return applied;
}

absl::StatusOr<VitConfig> ParseVitConfig(std::string_view json_text) {
  absl::StatusOr<Json> parsed = ParseJson(json_text);
  if (!parsed.ok()) return parsed.status();
  const Json& root = *parsed;
  try {
    return ParseValidated(root);
  } catch (const Json::exception& error) {
    // Every access above checks the type first; this is a guard, not an expected path.
    return Invalid(absl::StrCat("unexpected JSON structure: ", error.what()));
  }
}

std::vector<int64_t> AllowedExpertCounts(const VitConfig& config) {
  std::vector<int64_t> counts;
  for (int64_t side = 1; side <= config.grid_side(); ++side) counts.push_back(side * side);
  return counts;
}

absl::StatusOr<AttentionBudget> ParseBudget(absl::string_view text) {
  AttentionBudget budget;
  if (text == "full") {
    budget.full_attention = true;
    return budget;
  }
  const std::vector<std::string> parts = absl::StrSplit(text, 'x');
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &budget.expert_count) ||
      !absl::SimpleAtoi(parts[1], &budget.expert_width)) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget '", text, "' is not expert_count x expert_width (e.g. 9x16) or 'full'"));
  }
  return budget;
}

std::string BudgetName(const AttentionBudget& budget) {
  if (budget.full_attention) return "full attention";
  return absl::StrCat("MiTA m=", budget.expert_count, " k=", budget.expert_width);
}

absl::Status ValidateBudget(const VitConfig& config, const AttentionBudget& budget) {
  if (budget.full_attention) return absl::OkStatus();
  const std::vector<int64_t> counts = AllowedExpertCounts(config);
  std::vector<std::string> problems;
  if (std::find(counts.begin(), counts.end(), budget.expert_count) == counts.end()) {
    problems.push_back(absl::StrCat("budget.experts.expert_count ", budget.expert_count,
                                    " is not allowed: use one of ", absl::StrJoin(counts, ", ")));
  }
  CheckKnobRange("expert_width", budget.expert_width, config.tokens(), &problems);
  return BudgetProblems(problems);
}

}  // namespace mita::models
