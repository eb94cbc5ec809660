// config.json parsing (see model_config.h).
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
#include "kernels/status_macros.h"
#include "models/request_error.h"
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

// Reads `key` as an array of exactly `size` numbers, each a float32 value (|x| <= FLT_MAX) and, when `positive`, at
// least FLT_MIN: a larger magnitude would be undefined to narrow, a smaller positive one would round to 0 or a
// subnormal whose reciprocal overflows.
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
    constexpr double kLargest = std::numeric_limits<float>::max();
    constexpr double kSmallest = std::numeric_limits<float>::min();
    if (std::abs(*number) > kLargest || (positive && *number < kSmallest)) {
      return Invalid(absl::StrCat(field, "[", i, "] ", *number, " is out of float32's range [",
                                  positive ? kSmallest : -kLargest, ", ", kLargest, "]"));
    }
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

// Reads attention.default_budget (required) and attention.presets (optional: an object of name -> budget) into
// `config`, each checked against `knobs` (CheckBudget). Errors: INVALID_ARGUMENT naming the config field, e.g.
// "config.json: attention.presets.fast.expert_count 10 is not allowed: use one of 1, 4, 9".
absl::Status ReadDefaultBudgetAndPresets(const Json& attention, const BudgetKnobs& knobs, EncoderConfig& config) {
  auto check = [&knobs](const AttentionBudget& budget, const std::string& field) -> absl::Status {
    const std::vector<FieldProblem> problems = FieldProblems(CheckBudget(knobs, budget));
    if (problems.empty()) return absl::OkStatus();
    const FieldProblem& first = problems.front();
    return Invalid(absl::StrCat(field, ".", RequestFieldName(first.field), " ", first.detail));
  };
  const Json* default_value = Find(attention, "default_budget");
  if (default_value == nullptr) return Invalid("missing required field attention.default_budget");
  absl::StatusOr<AttentionBudget> budget = ReadBudget(*default_value, "attention.default_budget");
  if (!budget.ok()) return budget.status();
  RETURN_IF_ERROR(check(*budget, "attention.default_budget"));
  config.default_budget = *budget;
  if (const Json* values = Find(attention, "presets"); values != nullptr) {
    if (!values->is_object()) return Invalid("attention.presets must be an object of name -> budget");
    for (const auto& [name, value] : values->items()) {
      const std::string field = absl::StrCat("attention.presets.", name);
      if (name.empty()) return Invalid("attention.presets has an empty preset name");
      absl::StatusOr<AttentionBudget> preset = ReadBudget(value, field);
      if (!preset.ok()) return preset.status();
      RETURN_IF_ERROR(check(*preset, field));
      config.presets.emplace(name, *preset);
    }
  }
  return absl::OkStatus();
}

// Reads attention.accuracy_order (optional) into config.accuracy_order: a non-empty array, most accurate first,
// of {"budget": "9x16" | "full", "accuracy": a in [0, 1]}, accuracies non-increasing. `knobs` holds the parsed
// default budget and presets: each budget is checked against it (CheckBudget, full attention only where
// supported) and named by DeclaredBudgetName. Errors: INVALID_ARGUMENT naming the entry, e.g.
// "config.json: attention.accuracy_order[2].budget \"10x16\": expert_count 10 is not allowed: use one of 1, 4, 9".
absl::Status ReadAccuracyOrder(const Json& attention, const BudgetKnobs& knobs, EncoderConfig& config) {
  const Json* values = Find(attention, "accuracy_order");
  if (values == nullptr) return absl::OkStatus();
  if (!values->is_array()) {
    return Invalid(absl::StrCat("attention.accuracy_order must be an array of {\"budget\", \"accuracy\"} objects, "
                                "found ", values->dump()));
  }
  if (values->empty()) {
    return Invalid("attention.accuracy_order is empty: list at least one budget, or leave the field out");
  }
  for (size_t i = 0; i < values->size(); ++i) {
    const std::string entry = absl::StrCat("attention.accuracy_order[", i, "]");
    const Json& value = (*values)[i];
    if (!value.is_object()) return Invalid(absl::StrCat(entry, " must be an object, found ", value.dump()));
    ASSIGN_OR_RETURN(const std::string text, ReadString(value, entry, "budget"));
    const std::string field = absl::StrCat(entry, ".budget \"", text, "\"");
    absl::StatusOr<AttentionBudget> budget = ParseBudget(text);
    if (!budget.ok()) {
      return Invalid(absl::StrCat(field, " is not expert_count x expert_width (e.g. \"9x16\") or \"full\""));
    }
    if (budget->full_attention && !knobs.full_attention_supported) {
      return Invalid(absl::StrCat(field, ": this model does not run full attention"));
    }
    if (const std::vector<FieldProblem> problems = FieldProblems(CheckBudget(knobs, *budget)); !problems.empty()) {
      return Invalid(absl::StrCat(field, ": ", RequestFieldName(problems.front().field), " ", problems.front().detail));
    }
    for (size_t j = 0; j < config.accuracy_order.size(); ++j) {
      if (config.accuracy_order[j].budget == *budget) {
        return Invalid(absl::StrCat(field, " repeats attention.accuracy_order[", j, "]"));
      }
    }
    const std::string accuracy_field = absl::StrCat(entry, ".accuracy");
    const Json* accuracy_value = Find(value, "accuracy");
    if (accuracy_value == nullptr) return Invalid(absl::StrCat("missing required field ", accuracy_field));
    ASSIGN_OR_RETURN(const double accuracy, ReadNumber(*accuracy_value, accuracy_field));
    if (accuracy < 0 || accuracy > 1) {
      return Invalid(absl::StrCat(accuracy_field, " ", accuracy, " is out of range [0, 1]"));
    }
    if (i > 0 && accuracy > config.accuracy_order.back().accuracy) {
      return Invalid(absl::StrCat(accuracy_field, " ", accuracy, " is above attention.accuracy_order[", i - 1,
                                  "]'s ", config.accuracy_order.back().accuracy, ": list the most accurate first"));
    }
    config.accuracy_order.push_back(DeclaredBudget{DeclaredBudgetName(knobs, *budget), *budget, accuracy});
  }
  return absl::OkStatus();
}

// Reads the fields both architectures share, except the budgets (they need the kind's knobs): architecture
// (must be `architecture`), task (optional, must be `task`), embed_dim, depth, num_heads (divides embed_dim),
// mlp_hidden_dim, layer_norm_eps (optional), num_classes, and attention.type ("mita"). Returns the attention
// object. Errors: INVALID_ARGUMENT naming the field.
absl::StatusOr<const Json*> ReadEncoder(const Json& root, absl::string_view architecture, absl::string_view task,
                                        EncoderConfig& config) {
  if (!root.is_object()) return Invalid("the top level must be a JSON object");
  ASSIGN_OR_RETURN(config.architecture, ReadString(root, "", "architecture"));
  if (config.architecture != architecture) {
    return Invalid(absl::StrCat("architecture \"", config.architecture, "\" is not supported: use \"", architecture,
                                "\""));
  }
  if (const Json* value = Find(root, "task"); value != nullptr) {
    if (!value->is_string() || value->get<std::string>() != task) {
      return Invalid(absl::StrCat("task ", value->dump(), " is not supported: use \"", task, "\""));
    }
  }
  // Upper bounds keep products such as tokens x channels and weight sizes far from int64 overflow.
  ASSIGN_OR_RETURN(config.embed_dim, ReadInteger(root, "", "embed_dim", 1, 1 << 16));
  ASSIGN_OR_RETURN(config.depth, ReadInteger(root, "", "depth", 1, 1024));
  ASSIGN_OR_RETURN(config.num_heads, ReadInteger(root, "", "num_heads", 1, config.embed_dim));
  if (config.embed_dim % config.num_heads != 0) {
    return Invalid(absl::StrCat("num_heads ", config.num_heads, " does not divide embed_dim ", config.embed_dim));
  }
  ASSIGN_OR_RETURN(config.mlp_hidden_dim, ReadInteger(root, "", "mlp_hidden_dim", 1, 1 << 20));
  if (const Json* eps = Find(root, "layer_norm_eps"); eps != nullptr) {
    ASSIGN_OR_RETURN(const double value, ReadNumber(*eps, "layer_norm_eps"));
    if (!(value > 0)) return Invalid(absl::StrCat("layer_norm_eps must be > 0, found ", value));
    config.layer_norm_eps = value;
  }
  ASSIGN_OR_RETURN(config.num_classes, ReadInteger(root, "", "num_classes", 1, 1 << 20));
  ASSIGN_OR_RETURN(const Json* attention, ReadObject(root, "", "attention"));
  ASSIGN_OR_RETURN(const std::string type, ReadString(*attention, "attention", "type"));
  if (type != "mita") return Invalid(absl::StrCat("attention.type \"", type, "\" is not supported: use \"mita\""));
  return attention;
}

absl::StatusOr<VitConfig> ParseValidated(const Json& root) {
  VitConfig config;
  ASSIGN_OR_RETURN(const Json* attention, ReadEncoder(root, "mita_vit", "image_classification", config));
  constexpr int64_t kMaxSide = 1 << 14;
  ASSIGN_OR_RETURN(config.image_size, ReadInteger(root, "", "image_size", 1, kMaxSide));
  ASSIGN_OR_RETURN(config.patch_size, ReadInteger(root, "", "patch_size", 1, config.image_size));
  if (config.image_size % config.patch_size != 0) {
    return Invalid(absl::StrCat("patch_size ", config.patch_size, " does not divide image_size ", config.image_size));
  }
  if (config.tokens() > (int64_t{1} << 20)) {
    return Invalid(absl::StrCat("image_size / patch_size gives ", config.tokens(), " tokens, more than ",
                                int64_t{1} << 20));
  }
  ASSIGN_OR_RETURN(config.in_channels, ReadInteger(root, "", "in_channels", 1, 3));
  if (config.in_channels == 2) return Invalid("in_channels 2 is not supported: use 1 (grayscale) or 3 (RGB)");

  ASSIGN_OR_RETURN(const Json* normalization, ReadObject(root, "", "normalization"));
  ASSIGN_OR_RETURN(config.mean,
                   ReadChannelVector(*normalization, "normalization", "mean", config.in_channels, /*positive=*/false));
  ASSIGN_OR_RETURN(config.std,
                   ReadChannelVector(*normalization, "normalization", "std", config.in_channels, /*positive=*/true));

  if (const Json* dwc = Find(*attention, "depthwise_conv"); dwc != nullptr) {
    if (!dwc->is_boolean()) {
      return Invalid(absl::StrCat("attention.depthwise_conv must be a boolean, found ", dwc->dump()));
    }
    config.depthwise_conv = dwc->get<bool>();
  }
  RETURN_IF_ERROR(ReadDefaultBudgetAndPresets(*attention, ImageKnobs(config), config));
  RETURN_IF_ERROR(ReadAccuracyOrder(*attention, ImageKnobs(config), config));  // the knobs now have the presets

  if (Find(root, "max_image_side") != nullptr) {
    ASSIGN_OR_RETURN(config.max_image_side, ReadInteger(root, "", "max_image_side", 1, 1 << 16));
  }
  return config;
}

absl::StatusOr<DocumentConfig> ParseValidatedDocument(const Json& root) {
  DocumentConfig config;
  ASSIGN_OR_RETURN(const Json* attention, ReadEncoder(root, "mita_document", "document_classification", config));
  ASSIGN_OR_RETURN(config.vocab_size, ReadInteger(root, "", "vocab_size", 1, int64_t{1} << 24));
  ASSIGN_OR_RETURN(config.max_tokens, ReadInteger(root, "", "max_tokens", 1, int64_t{1} << 24));
  ASSIGN_OR_RETURN(config.tokenizer, ReadString(root, "", "tokenizer"));
  if (config.tokenizer != "bytes" && config.tokenizer != "sentencepiece") {
    return Invalid(
        absl::StrCat("tokenizer \"", config.tokenizer, "\" is not supported: use \"bytes\" or \"sentencepiece\""));
  }
  if (config.tokenizer == "bytes" && config.vocab_size < 256) {
    return Invalid(absl::StrCat("vocab_size ", config.vocab_size, " is too small for tokenizer \"bytes\" (needs 256)"));
  }

  ASSIGN_OR_RETURN(const Json* position, ReadObject(root, "", "position_encoding"));
  ASSIGN_OR_RETURN(const std::string position_type, ReadString(*position, "position_encoding", "type"));
  if (position_type != "convolution") {
    return Invalid(
        absl::StrCat("position_encoding.type \"", position_type, "\" is not supported: use \"convolution\""));
  }
  ASSIGN_OR_RETURN(config.position_kernel_size, ReadInteger(*position, "position_encoding", "kernel_size", 1, 255));
  if (config.position_kernel_size % 2 == 0) {
    return Invalid(absl::StrCat("position_encoding.kernel_size ", config.position_kernel_size, " must be odd"));
  }

  if (Find(root, "pooling") != nullptr) {
    ASSIGN_OR_RETURN(const Json* pooling, ReadObject(root, "", "pooling"));
    ASSIGN_OR_RETURN(const std::string pooling_type, ReadString(*pooling, "pooling", "type"));
    if (pooling_type == "attention") {
      config.pooling = DocumentConfig::Pooling::kAttention;
      ASSIGN_OR_RETURN(config.pooling_heads, ReadInteger(*pooling, "pooling", "heads", 1, config.embed_dim));
      if (config.embed_dim % config.pooling_heads != 0) {
        return Invalid(absl::StrCat("pooling.heads ", config.pooling_heads, " does not divide embed_dim ",
                                    config.embed_dim));
      }
      if (Find(*pooling, "position_buckets") != nullptr) {
        ASSIGN_OR_RETURN(config.pooling_position_buckets,
                         ReadInteger(*pooling, "pooling", "position_buckets", 0, 64));
      }
    } else if (pooling_type != "mean") {
      return Invalid(absl::StrCat("pooling.type \"", pooling_type, "\" is not supported: use \"mean\" or \"attention\""));
    }
  }

  ASSIGN_OR_RETURN(config.max_expert_count,
                   ReadInteger(*attention, "attention", "max_expert_count", 1, config.max_tokens));
  ASSIGN_OR_RETURN(config.max_expert_width,
                   ReadInteger(*attention, "attention", "max_expert_width", 1, config.max_tokens));
  RETURN_IF_ERROR(ReadDefaultBudgetAndPresets(*attention, DocumentKnobs(config), config));
  RETURN_IF_ERROR(ReadAccuracyOrder(*attention, DocumentKnobs(config), config));  // the knobs now have the presets
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

absl::StatusOr<std::string> ParseArchitecture(std::string_view json_text) {
  ASSIGN_OR_RETURN(const Json root, ParseJson(json_text));
  if (!root.is_object()) return Invalid("the top level must be a JSON object");
  return ReadString(root, "", "architecture");
}

namespace {

// The knobs every model has, from its config: the default budget and the presets.
BudgetKnobs KnobsWithBudgets(const EncoderConfig& config) {
  BudgetKnobs knobs;
  knobs.default_budget = config.default_budget;
  knobs.presets = config.presets;
  return knobs;
}

}  // namespace

BudgetKnobs DocumentKnobs(const DocumentConfig& config) {
  BudgetKnobs knobs = KnobsWithBudgets(config);
  knobs.min_expert_count = 1;
  knobs.max_expert_count = config.max_expert_count;
  knobs.min_expert_width = 1;
  knobs.max_expert_width = config.max_expert_width;
  knobs.accuracy_order =
      config.accuracy_order.empty() ? DefaultAccuracyOrder(knobs, config.max_tokens) : config.accuracy_order;
  return knobs;
}

BudgetKnobs ImageKnobs(const VitConfig& config) {
  BudgetKnobs knobs = KnobsWithBudgets(config);
  for (int64_t side = 1; side <= config.grid_side(); ++side) knobs.allowed_expert_counts.push_back(side * side);
  knobs.min_expert_count = 1;
  knobs.max_expert_count = config.grid_side() * config.grid_side();
  knobs.min_expert_width = 1;
  knobs.max_expert_width = config.tokens();
  knobs.accuracy_order =
      config.accuracy_order.empty() ? DefaultAccuracyOrder(knobs, config.tokens()) : config.accuracy_order;
  return knobs;
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

}  // namespace mita::models
