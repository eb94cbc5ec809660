// The Open Inference Protocol front end (see open_inference_service.h).
#include "server/frontend/open_inference_service.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/base/casts.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/status_macros.h"

namespace mita::server {
namespace {

using InputTensor = inference::ModelInferRequest::InferInputTensor;
using OutputTensor = inference::ModelInferResponse::InferOutputTensor;

constexpr char kPlatform[] = "mita_safetensors";
// The declared input tensors (ModelMetadata): an image model's, a document model's two.
constexpr char kImageInput[] = "image";
constexpr char kTextInput[] = "text";
constexpr char kTokenIdsInput[] = "token_ids";
constexpr char kParameterPrefix[] = "mita_";
constexpr char kExpertCount[] = "mita_expert_count";
constexpr char kExpertWidth[] = "mita_expert_width";
constexpr char kPreset[] = "mita_preset";
constexpr char kAttention[] = "mita_attention";
constexpr char kTopN[] = "mita_top_n";
constexpr char kTruncate[] = "mita_truncate";
constexpr char kLatencyTargetMs[] = "mita_latency_target_ms";
constexpr char kBudgetFloor[] = "mita_budget_floor";
// Response-only parameters: why the applied budget ran, and the queue wait plus compute predicted for it.
constexpr char kBudgetReason[] = "mita_budget_reason";
constexpr char kPredictedUs[] = "mita_predicted_us";

const char* ParameterKind(const inference::InferParameter& parameter) {
  switch (parameter.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam:
      return "bool_param";
    case inference::InferParameter::kInt64Param:
      return "int64_param";
    case inference::InferParameter::kStringParam:
      return "string_param";
    case inference::InferParameter::kDoubleParam:
      return "double_param";
    case inference::InferParameter::kUint64Param:
      return "uint64_param";
    case inference::InferParameter::PARAMETER_CHOICE_NOT_SET:
      break;
  }
  return "no value";
}

// The integer value of parameter `name` (int64_param, or uint64_param up to INT64_MAX).
absl::StatusOr<int64_t> IntegerParameter(const std::string& name, const inference::InferParameter& parameter) {
  if (parameter.parameter_choice_case() == inference::InferParameter::kInt64Param) return parameter.int64_param();
  if (parameter.parameter_choice_case() == inference::InferParameter::kUint64Param &&
      parameter.uint64_param() <= static_cast<uint64_t>(INT64_MAX)) {
    return static_cast<int64_t>(parameter.uint64_param());
  }
  return absl::InvalidArgumentError(
      absl::StrCat("parameter ", name, ": must be an int64_param, got ", ParameterKind(parameter)));
}

absl::StatusOr<std::string> StringParameter(const std::string& name, const inference::InferParameter& parameter) {
  if (parameter.parameter_choice_case() == inference::InferParameter::kStringParam) return parameter.string_param();
  return absl::InvalidArgumentError(
      absl::StrCat("parameter ", name, ": must be a string_param, got ", ParameterKind(parameter)));
}

// The element count of `shape`. Errors: INVALID_ARGUMENT for a negative dimension or an overflow.
absl::StatusOr<int64_t> ElementCount(const InputTensor& input) {
  int64_t count = 1;
  for (int64_t dimension : input.shape()) {
    if (dimension < 0 || (dimension > 0 && count > INT64_MAX / dimension)) {
      return absl::InvalidArgumentError(absl::StrCat("input '", input.name(), "': shape [",
                                                     absl::StrJoin(input.shape(), ", "), "] is not valid"));
    }
    count *= dimension;
  }
  return count;
}

bool IsDocumentModel(const models::ClassifierDescription& model) {
  return model.input_kind == models::InputKind::kDocument;
}

// The BYTES elements of `input`, viewing the request: its typed contents, or `raw` (4-byte little-endian length
// + bytes each).
absl::StatusOr<std::vector<std::string_view>> BytesElements(const InputTensor& input, const std::string* raw) {
  std::vector<std::string_view> elements;
  if (raw == nullptr) {
    for (const std::string& element : input.contents().bytes_contents()) elements.emplace_back(element);
    return elements;
  }
  size_t offset = 0;
  while (offset < raw->size()) {
    if (raw->size() - offset < 4) {
      return absl::InvalidArgumentError(absl::StrCat("input '", input.name(), "': raw BYTES contents end inside ",
                                                     "an element's 4-byte length"));
    }
    const auto* p = reinterpret_cast<const unsigned char*>(raw->data() + offset);
    const uint64_t length = uint64_t{p[0]} | uint64_t{p[1]} << 8 | uint64_t{p[2]} << 16 | uint64_t{p[3]} << 24;
    offset += 4;
    if (length > raw->size() - offset) {
      return absl::InvalidArgumentError(absl::StrCat("input '", input.name(), "': raw BYTES element of ", length,
                                                     " bytes is longer than the ", raw->size() - offset,
                                                     " bytes left"));
    }
    elements.emplace_back(raw->data() + offset, length);
    offset += length;
  }
  return elements;
}

// The INT64 elements of `input`: a view of its typed contents, or `raw` (8 bytes little-endian each) decoded
// into `*storage`.
absl::StatusOr<absl::Span<const int64_t>> Int64Elements(const InputTensor& input, const std::string* raw,
                                                        std::vector<int64_t>* storage) {
  if (raw == nullptr) {
    return absl::MakeConstSpan(input.contents().int64_contents().data(),
                               static_cast<size_t>(input.contents().int64_contents_size()));
  }
  if (raw->size() % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("input '", input.name(), "': raw INT64 contents of ", raw->size(), " bytes: not a multiple of 8"));
  }
  storage->resize(raw->size() / 8);
  for (size_t i = 0; i < storage->size(); ++i) {
    const auto* p = reinterpret_cast<const unsigned char*>(raw->data() + 8 * i);
    uint64_t value = 0;
    for (int b = 7; b >= 0; --b) value = value << 8 | p[b];
    (*storage)[i] = static_cast<int64_t>(value);
  }
  return absl::MakeConstSpan(*storage);
}

// One input tensor a model declares (ModelMetadata, ModelConfig) and the input kind it carries.
struct DeclaredInput {
  const char* name;
  const char* datatype;
  std::vector<int64_t> shape;  // -1: any length
  models::ClassifierInput::Kind kind;
  // Whether a request may leave it out: a document model takes one of its two inputs (ModelConfig "optional").
  bool optional;
};

// The inputs of `model`: what ModelMetadata and ModelConfig declare and ModelInfer accepts, one list for all.
std::vector<DeclaredInput> DeclaredInputs(const models::ClassifierDescription& model) {
  if (IsDocumentModel(model)) {
    return {{kTextInput, "BYTES", {1}, models::ClassifierInput::Kind::kText, true},
            {kTokenIdsInput, "INT64", {-1}, models::ClassifierInput::Kind::kTokenIds, true}};
  }
  return {{kImageInput, "BYTES", {1}, models::ClassifierInput::Kind::kImage, false}};
}

// Triton's name of a protocol datatype (ModelConfig): BYTES is TYPE_STRING.
inference::DataType TritonDataType(std::string_view datatype) {
  if (datatype == "BYTES") return inference::TYPE_STRING;
  if (datatype == "INT64") return inference::TYPE_INT64;
  if (datatype == "FP32") return inference::TYPE_FP32;
  return inference::TYPE_INVALID;
}

// Appends `value` as 4 little-endian bytes.
void AppendLittleEndian32(uint32_t value, std::string* out) {
  for (int b = 0; b < 4; ++b) out->push_back(static_cast<char>((value >> (8 * b)) & 0xff));
}

std::string ShapeText(absl::Span<const int64_t> shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

// "text (BYTES [1]), token_ids (INT64 [-1])".
std::string AcceptedInputs(const models::ClassifierDescription& model) {
  std::vector<std::string> inputs;
  for (const DeclaredInput& input : DeclaredInputs(model)) {
    inputs.push_back(absl::StrCat(input.name, " (", input.datatype, " ", ShapeText(input.shape), ")"));
  }
  return absl::StrJoin(inputs, ", ");
}

void SetInt(google::protobuf::Map<std::string, inference::InferParameter>& parameters, const std::string& name,
            int64_t value) {
  parameters[name].set_int64_param(value);
}

// The input tensor of `request` into `translated->request.input`, checked against the model's declared inputs:
// its name, datatype and shape (rank included; -1 matches any length). The values themselves (an empty image,
// an empty document) are the classifier's to check, worded as over mita.v1.
absl::Status TranslateInput(const inference::ModelInferRequest& request, const models::ClassifierDescription& model,
                            TranslatedInferRequest* translated) {
  if (request.inputs_size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("inputs: ", request.inputs_size(), " tensors; model '", model.name,
                                                   "' takes exactly one of its inputs: ", AcceptedInputs(model)));
  }
  const std::string* raw = nullptr;
  if (request.raw_input_contents_size() > 0) {
    if (request.raw_input_contents_size() != request.inputs_size()) {
      return absl::InvalidArgumentError(absl::StrCat("raw_input_contents: ", request.raw_input_contents_size(),
                                                     " entries for ", request.inputs_size(), " input"));
    }
    if (request.inputs(0).has_contents()) {
      return absl::InvalidArgumentError(absl::StrCat("input '", request.inputs(0).name(),
                                                     "': set either contents or raw_input_contents, not both"));
    }
    raw = &request.raw_input_contents(0);
  }
  const InputTensor& input = request.inputs(0);
  const std::vector<DeclaredInput> declared_inputs = DeclaredInputs(model);
  const DeclaredInput* declared = nullptr;
  for (const DeclaredInput& candidate : declared_inputs) {
    if (input.name() == candidate.name) declared = &candidate;
  }
  const std::string name = input.name().substr(0, 64);
  if (declared == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("input '", name, "' is not an input of model '", model.name,
                                                   "'; its inputs: ", AcceptedInputs(model)));
  }
  if (input.datatype() != declared->datatype) {
    return absl::InvalidArgumentError(absl::StrCat("input '", name, "': datatype '", input.datatype().substr(0, 16),
                                                   "' is not the declared ", declared->datatype));
  }
  bool shape_matches = input.shape_size() == static_cast<int>(declared->shape.size());
  for (int i = 0; shape_matches && i < input.shape_size(); ++i) {
    shape_matches = declared->shape[static_cast<size_t>(i)] == -1 ? input.shape(i) >= 0
                                                                  : input.shape(i) == declared->shape[static_cast<size_t>(i)];
  }
  if (!shape_matches) {
    return absl::InvalidArgumentError(absl::StrCat("input '", name, "': shape ", ShapeText(input.shape()),
                                                   " does not match the declared ", ShapeText(declared->shape),
                                                   " (one input per request; send requests concurrently, the server "
                                                   "batches them)"));
  }
  ASSIGN_OR_RETURN(const int64_t count, ElementCount(input));
  models::ClassifierInput& neutral = translated->request.input;
  neutral.kind = declared->kind;
  if (input.datatype() == "BYTES") {
    ASSIGN_OR_RETURN(const std::vector<std::string_view> elements, BytesElements(input, raw));
    if (static_cast<int64_t>(elements.size()) != count) {
      return absl::InvalidArgumentError(absl::StrCat("input '", name, "': shape ", ShapeText(input.shape()),
                                                     " with ", elements.size(), " elements"));
    }
    neutral.bytes = elements[0];
  } else {
    ASSIGN_OR_RETURN(const absl::Span<const int64_t> ids, Int64Elements(input, raw, &translated->token_ids));
    if (static_cast<int64_t>(ids.size()) != count) {
      return absl::InvalidArgumentError(absl::StrCat("input '", name, "': shape ", ShapeText(input.shape()),
                                                     " with ", ids.size(), " elements"));
    }
    neutral.token_ids = ids;
  }
  return absl::OkStatus();
}

// The budget and options of `request`'s parameters into `translated->request`.
absl::Status TranslateParameters(const inference::ModelInferRequest& request,
                                 const models::ClassifierDescription& model, TranslatedInferRequest* translated) {
  std::optional<int64_t> expert_count;
  std::optional<int64_t> expert_width;
  std::optional<std::string> preset;
  bool full_attention = false;
  bool attention_set = false;  // mita_attention given at all ("mita" too): it names the budget's kind
  std::optional<int64_t> latency_target_ms;
  std::optional<std::string> floor;
  // Non-positive expert knobs, reported together after the loop (count first, as over mita.v1).
  std::vector<models::FieldProblem> knob_problems;
  for (const auto& [name, parameter] : request.parameters()) {
    if (!absl::StartsWith(name, kParameterPrefix)) continue;  // other clients' parameters
    if (name == kExpertCount || name == kExpertWidth || name == kTopN || name == kLatencyTargetMs) {
      ASSIGN_OR_RETURN(const int64_t value, IntegerParameter(name, parameter));
      if (name == kLatencyTargetMs) {
        if (value < 0) {
          // mita.v1's wording for budget.latency_target.target_ms.
          return models::InvalidRequest(models::RequestField::kLatencyTarget,
                                        absl::StrCat(value, " is out of range: allowed >= 0 (0 means the call's "
                                                            "deadline)"));
        }
        latency_target_ms = value;
        continue;
      }
      if (name == kTopN) {
        // All classes are computed (top_n below); mita_top_n only cuts the labels output.
        RETURN_IF_ERROR(ResolveTopN(value, static_cast<int64_t>(model.labels.size())).status());
        continue;
      }
      const models::RequestField field =
          name == kExpertCount ? models::RequestField::kExpertCount : models::RequestField::kExpertWidth;
      if (value <= 0) {
        // 0 would mean "the model's default" in mita.v1; here a parameter left out means that. Worded with the
        // model's range, as mita.v1 words it.
        models::FieldProblem problem = models::KnobProblem(model.knobs, field, value)
                                           .value_or(models::FieldProblem{field, -1, absl::StrCat(value, " is not allowed")});
        absl::StrAppend(&problem.detail, " (leave it out for the model's default)");
        knob_problems.push_back(std::move(problem));
        continue;
      }
      (name == kExpertCount ? expert_count : expert_width) = value;
    } else if (name == kPreset || name == kAttention || name == kBudgetFloor) {
      ASSIGN_OR_RETURN(const std::string value, StringParameter(name, parameter));
      if (name == kBudgetFloor) {
        floor = value;
        continue;
      }
      if (name == kPreset) {
        preset = value;
        continue;
      }
      attention_set = true;
      if (value == "full") {
        full_attention = true;
      } else if (value != "mita") {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter mita_attention: '", value.substr(0, 64), "' is not one of: mita, full"));
      }
    } else if (name == kTruncate) {
      if (parameter.parameter_choice_case() != inference::InferParameter::kBoolParam) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter mita_truncate: must be a bool_param, got ", ParameterKind(parameter)));
      }
      translated->request.input.truncate = parameter.bool_param();
    } else {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", name.substr(0, 64), " is not known; available: ",
                                                     absl::StrJoin({kAttention, kBudgetFloor, kExpertCount,
                                                                    kExpertWidth, kLatencyTargetMs, kPreset, kTopN,
                                                                    kTruncate},
                                                                   ", ")));
    }
  }
  if (!knob_problems.empty()) {
    std::sort(knob_problems.begin(), knob_problems.end(),
              [](const models::FieldProblem& a, const models::FieldProblem& b) { return a.field < b.field; });
    return models::InvalidRequest(std::move(knob_problems));
  }
  const bool experts = expert_count.has_value() || expert_width.has_value();
  if (floor.has_value() && !latency_target_ms.has_value()) {
    return models::InvalidRequest(models::RequestField::kBudgetFloor,
                                  absl::StrCat("needs ", kLatencyTargetMs, " (a floor bounds the budget the server ",
                                               "chooses for a latency target)"));
  }
  if (latency_target_ms.has_value()) {
    // The server chooses the budget: any parameter naming one conflicts, whatever its value.
    std::vector<const char*> conflicting;
    if (expert_count.has_value()) conflicting.push_back(kExpertCount);
    if (expert_width.has_value()) conflicting.push_back(kExpertWidth);
    if (preset.has_value()) conflicting.push_back(kPreset);
    if (attention_set) conflicting.push_back(kAttention);
    if (!conflicting.empty()) {
      return models::InvalidRequest(
          models::RequestField::kLatencyTarget,
          absl::StrCat("the server chooses the budget for a latency target: leave out ",
                       absl::StrJoin(conflicting, ", "), " (or ", kBudgetFloor, " to bound its choice)"));
    }
    models::BudgetRequest& budget = translated->request.budget;
    budget.choice = models::BudgetRequest::Choice::kLatencyTarget;
    budget.latency_target = absl::Milliseconds(*latency_target_ms);
    budget.floor = floor.value_or("");
    return absl::OkStatus();
  }
  if (static_cast<int>(experts) + static_cast<int>(preset.has_value()) + static_cast<int>(full_attention) > 1) {
    return absl::InvalidArgumentError(
        "parameters: set one budget: mita_expert_count and/or mita_expert_width, or mita_preset, or "
        "mita_attention=full");
  }
  models::BudgetRequest& budget = translated->request.budget;
  if (full_attention) {
    budget.choice = models::BudgetRequest::Choice::kFullAttention;
  } else if (preset.has_value()) {
    budget.choice = models::BudgetRequest::Choice::kPreset;
    budget.preset = *preset;
  } else if (experts) {
    budget.choice = models::BudgetRequest::Choice::kExperts;
    budget.expert_count = expert_count.value_or(0);
    budget.expert_width = expert_width.value_or(0);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ToInferenceRequest(const inference::ModelInferRequest& request, const models::ClassifierDescription& model,
                                TranslatedInferRequest* translated) {
  translated->request.model = request.model_name();
  ASSIGN_OR_RETURN(translated->request.model_version, ParseModelVersion(request.model_version()));
  RETURN_IF_ERROR(TranslateInput(request, model, translated));
  for (const auto& output : request.outputs()) {
    if (output.name() != kScoresOutput && output.name() != kLabelsOutput) {
      return absl::InvalidArgumentError(absl::StrCat("outputs: unknown output '", output.name(),
                                                     "'; available: ", kScoresOutput, ", ", kLabelsOutput));
    }
  }
  RETURN_IF_ERROR(TranslateParameters(request, model, translated));
  translated->request.top_n = static_cast<int64_t>(model.labels.size());
  return absl::OkStatus();
}

absl::StatusOr<inference::ModelInferResponse> ToModelInferResponse(const inference::ModelInferRequest& request,
                                                                   const InferenceResult& result) {
  const models::ClassifierDescription& model = *result.model;
  const int64_t classes = static_cast<int64_t>(model.labels.size());
  int64_t top_n = 0;
  if (auto it = request.parameters().find(kTopN); it != request.parameters().end()) {
    ASSIGN_OR_RETURN(top_n, IntegerParameter(kTopN, it->second));
  }
  ASSIGN_OR_RETURN(const int64_t resolved_top_n, ResolveTopN(top_n, classes));

  bool want_scores = request.outputs_size() == 0;
  bool want_labels = request.outputs_size() == 0;
  for (const auto& output : request.outputs()) {
    want_scores |= output.name() == kScoresOutput;
    want_labels |= output.name() == kLabelsOutput;
  }

  // Outputs come in the form the input came: raw_output_contents for a raw request (what Triton's clients send,
  // and the only form their InferResult.as_numpy reads for FP32), typed contents otherwise.
  const bool raw = request.raw_input_contents_size() > 0;
  inference::ModelInferResponse response;
  response.set_model_name(model.name);
  response.set_model_version(std::to_string(result.model_version));
  response.set_id(request.id());
  if (want_scores) {
    OutputTensor* scores = response.add_outputs();
    scores->set_name(kScoresOutput);
    scores->set_datatype("FP32");
    scores->add_shape(classes);
    std::vector<float> values(static_cast<size_t>(classes), 0.0f);
    for (const models::ClassScore& score : result.classes) {
      if (score.index >= 0 && score.index < classes) values[static_cast<size_t>(score.index)] = score.probability;
    }
    if (raw) {
      std::string* bytes = response.add_raw_output_contents();
      bytes->reserve(4 * values.size());
      for (float value : values) AppendLittleEndian32(absl::bit_cast<uint32_t>(value), bytes);
    } else {
      *scores->mutable_contents()->mutable_fp32_contents() = {values.begin(), values.end()};
    }
  }
  if (want_labels) {
    OutputTensor* labels = response.add_outputs();
    labels->set_name(kLabelsOutput);
    labels->set_datatype("BYTES");
    const int64_t n = std::min<int64_t>(resolved_top_n, static_cast<int64_t>(result.classes.size()));
    labels->add_shape(n);
    std::string* bytes = raw ? response.add_raw_output_contents() : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t index = result.classes[static_cast<size_t>(i)].index;
      const std::string& label = index >= 0 && index < classes ? model.labels[static_cast<size_t>(index)] : "";
      if (raw) {
        AppendLittleEndian32(static_cast<uint32_t>(label.size()), bytes);
        bytes->append(label);
      } else {
        labels->mutable_contents()->add_bytes_contents(label);
      }
    }
  }

  auto& parameters = *response.mutable_parameters();
  const models::AttentionBudget& budget = result.budget.budget;
  parameters[kAttention].set_string_param(budget.full_attention ? "full" : "mita");
  if (!budget.full_attention) {
    SetInt(parameters, kExpertCount, budget.expert_count);
    SetInt(parameters, kExpertWidth, budget.expert_width);
  }
  if (!result.budget.preset.empty()) parameters[kPreset].set_string_param(result.budget.preset);
  parameters[kBudgetReason].set_string_param(BudgetReasonName(result.budget_reason));
  SetInt(parameters, kPredictedUs, absl::ToInt64Microseconds(result.predicted));
  SetInt(parameters, kTopN, resolved_top_n);
  SetInt(parameters, "mita_queue_delay_us", absl::ToInt64Microseconds(result.queue_delay));
  SetInt(parameters, "mita_compute_us", absl::ToInt64Microseconds(result.compute));
  SetInt(parameters, "mita_total_us", absl::ToInt64Microseconds(result.total));
  SetInt(parameters, "mita_batch_size", result.batch_size);
  SetInt(parameters, "mita_token_count", result.tokens);
  return response;
}

absl::StatusOr<int64_t> ParseModelVersion(const std::string& text) {
  if (text.empty()) return 0;
  int64_t version = 0;
  if (text.size() > 18 || !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      !absl::SimpleAtoi(text, &version) || version < 1) {
    return models::InvalidRequest(models::RequestField::kModelVersion,
                                  absl::StrCat("'", text.substr(0, 100),
                                               "' is not a version number (1, 2, ...; empty for the latest)"));
  }
  return version;
}

inference::ModelMetadataResponse ToModelMetadataResponse(const models::ClassifierDescription& model,
                                                         const std::vector<int64_t>& versions) {
  inference::ModelMetadataResponse response;
  response.set_name(model.name);
  for (const int64_t version : versions) response.add_versions(std::to_string(version));
  response.set_platform(kPlatform);
  auto add = [](google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>* tensors,
                const std::string& name, const std::string& datatype, std::vector<int64_t> shape) {
    inference::ModelMetadataResponse::TensorMetadata* tensor = tensors->Add();
    tensor->set_name(name);
    tensor->set_datatype(datatype);
    for (int64_t dimension : shape) tensor->add_shape(dimension);
  };
  for (const DeclaredInput& input : DeclaredInputs(model)) add(response.mutable_inputs(), input.name, input.datatype, input.shape);
  add(response.mutable_outputs(), kScoresOutput, "FP32", {static_cast<int64_t>(model.labels.size())});
  add(response.mutable_outputs(), kLabelsOutput, "BYTES", {-1});
  return response;
}

inference::ModelConfigResponse ToModelConfigResponse(const models::ClassifierDescription& model) {
  inference::ModelConfigResponse response;
  inference::ModelConfig& config = *response.mutable_config();
  config.set_name(model.name);
  config.set_platform(kPlatform);
  config.set_backend("mita");
  config.set_max_batch_size(0);
  for (const DeclaredInput& declared : DeclaredInputs(model)) {
    inference::ModelInput* input = config.add_input();
    input->set_name(declared.name);
    input->set_data_type(TritonDataType(declared.datatype));
    for (int64_t dimension : declared.shape) input->add_dims(dimension);
    input->set_optional(declared.optional);
  }
  auto add_output = [&config](const char* name, const char* datatype, int64_t dimension) {
    inference::ModelOutput* output = config.add_output();
    output->set_name(name);
    output->set_data_type(TritonDataType(datatype));
    output->add_dims(dimension);
  };
  add_output(kScoresOutput, "FP32", static_cast<int64_t>(model.labels.size()));
  add_output(kLabelsOutput, "BYTES", -1);
  (*config.mutable_parameters())[kParametersMetadataKey].set_string_value(KnobsJson(model));
  return response;
}

std::string KnobsJson(const models::ClassifierDescription& model) {
  const models::BudgetKnobs& knobs = model.knobs;
  nlohmann::json json = nlohmann::json::object();
  json[kExpertCount] = {{"datatype", "INT64"},
                        {"allowed", knobs.allowed_expert_counts},
                        {"min", knobs.min_expert_count},
                        {"max", knobs.max_expert_count},
                        {"default", knobs.default_budget.expert_count}};
  json[kExpertWidth] = {{"datatype", "INT64"},
                        {"min", knobs.min_expert_width},
                        {"max", knobs.max_expert_width},
                        {"default", knobs.default_budget.expert_width}};
  nlohmann::json presets = nlohmann::json::object();
  std::vector<std::string> preset_names;
  for (const auto& [name, preset] : knobs.presets) {
    preset_names.push_back(name);
    if (preset.full_attention) {
      presets[name] = {{kAttention, "full"}};
    } else {
      presets[name] = {{kExpertCount, preset.expert_count}, {kExpertWidth, preset.expert_width}};
    }
  }
  json[kPreset] = {{"datatype", "BYTES"}, {"allowed", preset_names}, {"budgets", presets}};
  // The budgets a latency target chooses from, most accurate first, each with its held-out accuracy (-1 when
  // the package declares none and they are ranked by compute): the names mita_budget_floor takes.
  nlohmann::json order = nlohmann::json::array();
  std::vector<std::string> order_names;
  for (const models::DeclaredBudget& declared : knobs.accuracy_order) {
    order_names.push_back(declared.name);
    nlohmann::json entry = {{"name", declared.name}, {"accuracy", declared.accuracy}};
    if (declared.budget.full_attention) {
      entry[kAttention] = "full";
    } else {
      entry[kExpertCount] = declared.budget.expert_count;
      entry[kExpertWidth] = declared.budget.expert_width;
    }
    order.push_back(std::move(entry));
  }
  json[kLatencyTargetMs] = {{"datatype", "INT64"}, {"min", 0}};
  json[kBudgetFloor] = {{"datatype", "BYTES"}, {"allowed", order_names}, {"accuracy_order", order}};
  std::vector<std::string> attention = {"mita"};
  if (knobs.full_attention_supported) attention.push_back("full");
  json[kAttention] = {{"datatype", "BYTES"}, {"allowed", attention}, {"default", "mita"}};
  const int64_t classes = static_cast<int64_t>(model.labels.size());
  json[kTopN] = {{"datatype", "INT64"}, {"min", 0}, {"max", classes}, {"default", std::min<int64_t>(5, classes)}};
  if (IsDocumentModel(model)) json[kTruncate] = {{"datatype", "BOOL"}, {"default", false}};
  // Where the model runs, as mita.v1 GetModel says (not request parameters).
  json["device"] = model.device;
  json["weights_dtype"] = model.weights_dtype;
  return json.dump();
}

std::string OpenInferenceFieldName(const models::FieldProblem& problem) {
  using models::RequestField;
  switch (problem.field) {
    case RequestField::kModel:
      return "model_name";
    case RequestField::kModelVersion:
      return "model_version";
    case RequestField::kInput:
    case RequestField::kDocument:
      return "input";
    case RequestField::kImage:
      return absl::StrCat("input '", kImageInput, "'");
    case RequestField::kDocumentText:
      return absl::StrCat("input '", kTextInput, "'");
    case RequestField::kDocumentTokenIds:
      return problem.index >= 0 ? absl::StrCat("input '", kTokenIdsInput, "' element ", problem.index)
                                : absl::StrCat("input '", kTokenIdsInput, "'");
    case RequestField::kBudget:
      return "parameters mita_*";
    case RequestField::kExperts:
      return absl::StrCat("parameters ", kExpertCount, "/", kExpertWidth);
    case RequestField::kExpertCount:
      return absl::StrCat("parameter ", kExpertCount);
    case RequestField::kExpertWidth:
      return absl::StrCat("parameter ", kExpertWidth);
    case RequestField::kPreset:
      return absl::StrCat("parameter ", kPreset);
    case RequestField::kTopN:
      return absl::StrCat("parameter ", kTopN);
    case RequestField::kTruncate:
      return absl::StrCat("parameter ", kTruncate);
    case RequestField::kLatencyTarget:
      return absl::StrCat("parameter ", kLatencyTargetMs);
    case RequestField::kBudgetFloor:
      return absl::StrCat("parameter ", kBudgetFloor);
  }
  return "request";
}

absl::Status WordForOpenInference(const absl::Status& status) {
  return models::WordProblems(status, OpenInferenceFieldName);
}

// One ModelInfer call: received, translated and submitted at construction, finished from whichever thread
// answers it. It owns the parsed request (and input values decoded from raw contents), which the submitted
// neutral request views.
class OpenInferenceService::InferReactor final : public InferenceReactor {
 public:
  InferReactor(OpenInferenceService* service, grpc::CallbackServerContext* context,
               const grpc::ByteBuffer* wire_request, grpc::ByteBuffer* wire_response)
      : InferenceReactor(context, service->metrics_, RpcMethod::kModelInfer),
        service_(service),
        wire_response_(wire_response) {
    if (!Receive(service_->options_, *wire_request, &request_)) {
      return;
    }
    model_ = request_.model_name();
    // The version resolved here is the one the input is translated for and runs on.
    absl::StatusOr<ModelHandle> model = service_->FindModel(model_, request_.model_version());
    absl::Status status = model.status();
    if (status.ok()) status = ToInferenceRequest(request_, (*model)->description(), &translated_);
    if (!status.ok()) {
      Answer(status);
      return;
    }
    translated_.request.deadline = DeadlineOf(*context);
    Submit(*service_->engine_, std::move(translated_.request), *std::move(model));
  }

 private:
  void Answer(absl::StatusOr<InferenceResult> result) override {
    absl::Status status = result.status();
    absl::Duration total;
    if (result.ok()) {
      total = result->total;
      absl::StatusOr<inference::ModelInferResponse> response = ToModelInferResponse(request_, *result);
      status = response.ok() ? SendResponse(service_->options_, *response, wire_response_) : response.status();
    }
    FinishCall(model_, WordForOpenInference(status), total);
  }

  OpenInferenceService* const service_;
  grpc::ByteBuffer* const wire_response_;
  inference::ModelInferRequest request_;
  std::string model_;  // the request's model, once it parsed
  // Input values decoded from raw_input_contents, viewed by the submitted request until it is answered.
  TranslatedInferRequest translated_;
};

OpenInferenceService::OpenInferenceService(InferenceEngine* engine, ServerMetrics* metrics, FrontEndOptions options,
                                           std::string server_version)
    : engine_(engine), metrics_(metrics), options_(std::move(options)), server_version_(std::move(server_version)) {}

absl::StatusOr<ModelHandle> OpenInferenceService::FindModel(const std::string& name,
                                                             const std::string& version) const {
  if (name.empty()) return engine_->FindModel(name).status();
  ASSIGN_OR_RETURN(const int64_t number, ParseModelVersion(version));
  return engine_->FindModel(name, number);
}

grpc::ServerUnaryReactor* OpenInferenceService::ServerLive(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request,
                                                           grpc::ByteBuffer* response) {
  return AnswerAtOnce<inference::ServerLiveRequest, inference::ServerLiveResponse>(
      context, request, response, *metrics_, options_, RpcMethod::kServerLive, WordForOpenInference,
      [](const inference::ServerLiveRequest&, inference::ServerLiveResponse* answer, std::string*) {
        answer->set_live(true);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::ServerReady(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* request,
                                                            grpc::ByteBuffer* response) {
  return AnswerAtOnce<inference::ServerReadyRequest, inference::ServerReadyResponse>(
      context, request, response, *metrics_, options_, RpcMethod::kServerReady, WordForOpenInference,
      [this](const inference::ServerReadyRequest&, inference::ServerReadyResponse* answer, std::string*) {
        answer->set_ready(ready_.load() && !engine_->models().empty());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelReady(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request,
                                                           grpc::ByteBuffer* response) {
  return AnswerAtOnce<inference::ModelReadyRequest, inference::ModelReadyResponse>(
      context, request, response, *metrics_, options_, RpcMethod::kModelReady, WordForOpenInference,
      [this](const inference::ModelReadyRequest& asked, inference::ModelReadyResponse* answer, std::string* model) {
        *model = asked.name();
        RETURN_IF_ERROR(FindModel(asked.name(), asked.version()).status());
        answer->set_ready(ready_.load());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::ServerMetadata(grpc::CallbackServerContext* context,
                                                               const grpc::ByteBuffer* request,
                                                               grpc::ByteBuffer* response) {
  return AnswerAtOnce<inference::ServerMetadataRequest, inference::ServerMetadataResponse>(
      context, request, response, *metrics_, options_, RpcMethod::kServerMetadata, WordForOpenInference,
      [this](const inference::ServerMetadataRequest&, inference::ServerMetadataResponse* answer, std::string*) {
        answer->set_name("mita-serve");
        answer->set_version(server_version_);
        answer->add_extensions(kModelConfigurationExtension);
        if (options_.lifecycle != nullptr) answer->add_extensions(kModelRepositoryExtension);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelMetadata(grpc::CallbackServerContext* context,
                                                              const grpc::ByteBuffer* request,
                                                              grpc::ByteBuffer* response) {
  return AnswerAtOnce<inference::ModelMetadataRequest, inference::ModelMetadataResponse>(
      context, request, response, *metrics_, options_, RpcMethod::kModelMetadata, WordForOpenInference,
      [this, context](const inference::ModelMetadataRequest& asked, inference::ModelMetadataResponse* answer,
                      std::string* model_name) {
        *model_name = asked.name();
        ASSIGN_OR_RETURN(const ModelHandle model, FindModel(asked.name(), asked.version()));
        *answer = ToModelMetadataResponse(model->description(), engine_->versions(model->name()));
        context->AddInitialMetadata(kParametersMetadataKey, KnobsJson(model->description()));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelConfig(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* request,
                                                            grpc::ByteBuffer* response) {
  return AnswerAtOnce<inference::ModelConfigRequest, inference::ModelConfigResponse>(
      context, request, response, *metrics_, options_, RpcMethod::kModelConfig, WordForOpenInference,
      [this](const inference::ModelConfigRequest& asked, inference::ModelConfigResponse* answer,
             std::string* model_name) {
        *model_name = asked.name();
        ASSIGN_OR_RETURN(const ModelHandle model, FindModel(asked.name(), asked.version()));
        *answer = ToModelConfigResponse(model->description());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelInfer(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request,
                                                           grpc::ByteBuffer* response) {
  return new InferReactor(this, context, request, response);
}

namespace {

// The repository API's preconditions: a lifecycle, and the server's one repository.
absl::Status CheckRepository(const ModelLifecycle* lifecycle, const std::string& repository_name) {
  if (lifecycle == nullptr) return absl::UnimplementedError("this server has no model repository API");
  if (!repository_name.empty() && repository_name != kRepositoryName) {
    return absl::NotFoundError(absl::StrCat("repository_name '", repository_name.substr(0, 100),
                                            "' is not a repository of this server; use \"\" or \"", kRepositoryName,
                                            "\""));
  }
  return absl::OkStatus();
}

}  // namespace

grpc::ServerUnaryReactor* OpenInferenceService::RepositoryIndex(grpc::CallbackServerContext* context,
                                                                const grpc::ByteBuffer* request,
                                                                grpc::ByteBuffer* response) {
  return AnswerAtOnce<inference::RepositoryIndexRequest, inference::RepositoryIndexResponse>(
      context, request, response, *metrics_, options_, RpcMethod::kRepositoryIndex, WordForOpenInference,
      [this](const inference::RepositoryIndexRequest& asked, inference::RepositoryIndexResponse* answer,
             std::string*) {
        RETURN_IF_ERROR(CheckRepository(options_.lifecycle, asked.repository_name()));
        for (const ModelLifecycle::Entry& entry : options_.lifecycle->Index(asked.ready())) {
          inference::RepositoryIndexResponse::ModelIndex* index = answer->add_models();
          index->set_name(entry.name);
          if (entry.version > 0) index->set_version(std::to_string(entry.version));
          index->set_state(entry.state);
          index->set_reason(entry.reason);
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::RepositoryModelLoad(grpc::CallbackServerContext* context,
                                                                    const grpc::ByteBuffer* request,
                                                                    grpc::ByteBuffer* response) {
  using Response = inference::RepositoryModelLoadResponse;
  return AnswerLater<inference::RepositoryModelLoadRequest, Response>(
      context, request, response, *metrics_, options_, RpcMethod::kRepositoryModelLoad, WordForOpenInference,
      [this](const inference::RepositoryModelLoadRequest& asked, std::string* model,
             std::function<void(absl::StatusOr<Response>)> finish) {
        *model = asked.model_name();
        absl::Status checked = CheckRepository(options_.lifecycle, asked.repository_name());
        for (const auto& [name, value] : asked.parameters()) {
          if (!checked.ok()) break;
          checked = absl::InvalidArgumentError(absl::StrCat(
              "parameter '", name.substr(0, 100),
              "' is not supported: a model loads from its repository folder as it is (no config or file overrides)"));
        }
        if (!checked.ok()) return finish(checked);
        options_.lifecycle->LoadInBackground(asked.model_name(), [finish](absl::Status status) {
          finish(status.ok() ? absl::StatusOr<Response>(Response()) : absl::StatusOr<Response>(status));
        });
      });
}

grpc::ServerUnaryReactor* OpenInferenceService::RepositoryModelUnload(grpc::CallbackServerContext* context,
                                                                      const grpc::ByteBuffer* request,
                                                                      grpc::ByteBuffer* response) {
  using Response = inference::RepositoryModelUnloadResponse;
  return AnswerLater<inference::RepositoryModelUnloadRequest, Response>(
      context, request, response, *metrics_, options_, RpcMethod::kRepositoryModelUnload, WordForOpenInference,
      [this](const inference::RepositoryModelUnloadRequest& asked, std::string* model,
             std::function<void(absl::StatusOr<Response>)> finish) {
        *model = asked.model_name();
        absl::Status checked = CheckRepository(options_.lifecycle, asked.repository_name());
        for (const auto& [name, value] : asked.parameters()) {
          if (!checked.ok()) break;
          if (name == "unload_dependents" && value.has_bool_param()) continue;  // no model here has dependents
          checked = absl::InvalidArgumentError(
              absl::StrCat("parameter '", name.substr(0, 100), "' is not supported (only unload_dependents, bool)"));
        }
        if (!checked.ok()) return finish(checked);
        options_.lifecycle->UnloadInBackground(asked.model_name(), [finish](absl::Status status) {
          finish(status.ok() ? absl::StatusOr<Response>(Response()) : absl::StatusOr<Response>(status));
        });
      });
}

}  // namespace mita::server
