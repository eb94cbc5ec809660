#include "server/kserve_service.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/time.h"
#include "server/grpc_status.h"

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

bool IsDocumentModel(const v1::ModelMetadata& model) { return model.input_kind() == v1::INPUT_KIND_DOCUMENT; }

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

// The BYTES elements of `input`: its typed contents, or `raw` (4-byte little-endian length + bytes each).
absl::StatusOr<std::vector<std::string>> BytesElements(const InputTensor& input, const std::string* raw) {
  if (raw == nullptr) return std::vector<std::string>(input.contents().bytes_contents().begin(),
                                                      input.contents().bytes_contents().end());
  std::vector<std::string> elements;
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
    elements.emplace_back(raw->substr(offset, length));
    offset += length;
  }
  return elements;
}

// The INT64 elements of `input`: its typed contents, or `raw` (8 bytes little-endian each).
absl::StatusOr<std::vector<int64_t>> Int64Elements(const InputTensor& input, const std::string* raw) {
  if (raw == nullptr) {
    return std::vector<int64_t>(input.contents().int64_contents().begin(), input.contents().int64_contents().end());
  }
  if (raw->size() % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("input '", input.name(), "': raw INT64 contents of ", raw->size(), " bytes: not a multiple of 8"));
  }
  std::vector<int64_t> elements(raw->size() / 8);
  for (size_t i = 0; i < elements.size(); ++i) {
    const auto* p = reinterpret_cast<const unsigned char*>(raw->data() + 8 * i);
    uint64_t value = 0;
    for (int b = 7; b >= 0; --b) value = value << 8 | p[b];
    elements[i] = static_cast<int64_t>(value);
  }
  return elements;
}

std::string AcceptedInputs(const v1::ModelMetadata& model) {
  return IsDocumentModel(model) ? "a BYTES tensor with one UTF-8 text element (shape [1]) or an INT64 tensor of "
                                  "token ids (shape [T] or [1, T])"
                                : "a BYTES tensor with one encoded PNG or JPEG element (shape [1])";
}

void SetInt(google::protobuf::Map<std::string, inference::InferParameter>& parameters, const std::string& name,
            int64_t value) {
  parameters[name].set_int64_param(value);
}

}  // namespace

std::string RenameFieldsInMessage(const std::string& message) {
  // Most specific first; each replacement runs over the result of the previous ones.
  static const std::pair<const char*, const char*> kRenames[] = {
      {"field budget.experts.expert_count", "parameter mita_expert_count"},
      {"field budget.experts.expert_width", "parameter mita_expert_width"},
      {"budget.experts.expert_count", "parameter mita_expert_count"},
      {"budget.experts.expert_width", "parameter mita_expert_width"},
      {"field budget.experts", "parameters mita_expert_count/mita_expert_width"},
      {"field budget.preset", "parameter mita_preset"},
      {"field budget", "parameters mita_*"},
      {"set both expert_count and expert_width", "set both mita_expert_count and mita_expert_width"},
      {"(use budget.experts or budget.full_attention)", "(use mita_expert_count/mita_expert_width or "
                                                        "mita_attention=full)"},
      {"field top_n", "parameter mita_top_n"},
      {"field image", "input 'image'"},
      {"field document.token_ids", "input 'token_ids'"},
      {"field document.text", "input 'text'"},
      {"field document", "input"},
      {"field input", "input"},
  };
  std::string result = message;
  for (const auto& [from, to] : kRenames) result = absl::StrReplaceAll(result, {{from, to}});
  return result;
}

absl::StatusOr<v1::ClassifyRequest> ToClassifyRequest(const inference::ModelInferRequest& request,
                                                      const v1::ModelMetadata& model) {
  v1::ClassifyRequest classify;
  classify.set_model(request.model_name());
  if (!request.model_version().empty() && request.model_version() != kModelVersion) {
    return absl::NotFoundError(absl::StrCat("model '", model.name(), "' version '", request.model_version(),
                                            "' not found; available: ", kModelVersion));
  }

  // The input tensor.
  if (request.inputs_size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("inputs: ", request.inputs_size(), " tensors; model '",
                                                   model.name(), "' takes exactly one: ", AcceptedInputs(model)));
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
  absl::StatusOr<int64_t> count = ElementCount(input);
  if (!count.ok()) return count.status();
  const std::string shape = absl::StrCat("[", absl::StrJoin(input.shape(), ", "), "]");
  if (input.datatype() == "BYTES") {
    absl::StatusOr<std::vector<std::string>> elements = BytesElements(input, raw);
    if (!elements.ok()) return elements.status();
    if (*count != 1 || elements->size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", input.name(), "': BYTES shape ", shape, " with ", elements->size(), " elements; model '",
          model.name(), "' takes one element per request (send concurrent requests; the server batches them)"));
    }
    // An input named as a declared BYTES input (image, text) goes to that request field, so that a model of the
    // other kind answers as over mita.v1 ("takes a document ..., not an image"); any other name goes by the
    // model's kind.
    const bool document =
        input.name() == kTextInput || (input.name() != kImageInput && IsDocumentModel(model));
    if (document) {
      classify.mutable_document()->set_text(std::move((*elements)[0]));
    } else {
      classify.set_image(std::move((*elements)[0]));
    }
  } else if (input.datatype() == "INT64" && IsDocumentModel(model)) {
    absl::StatusOr<std::vector<int64_t>> elements = Int64Elements(input, raw);
    if (!elements.ok()) return elements.status();
    const bool batch_of_one = input.shape_size() == 1 || (input.shape_size() == 2 && input.shape(0) == 1);
    if (!batch_of_one || static_cast<int64_t>(elements->size()) != *count) {
      return absl::InvalidArgumentError(absl::StrCat("input '", input.name(), "': INT64 shape ", shape, " with ",
                                                     elements->size(), " elements; expected shape [T] or [1, T] ",
                                                     "holding T token ids"));
    }
    for (int64_t id : *elements) classify.mutable_document()->mutable_token_ids()->add_ids(id);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("input '", input.name(), "': datatype '", input.datatype(),
                                                   "' is not accepted; model '", model.name(), "' takes ",
                                                   AcceptedInputs(model)));
  }

  // Requested outputs.
  for (const auto& output : request.outputs()) {
    if (output.name() != kScoresOutput && output.name() != kLabelsOutput) {
      return absl::InvalidArgumentError(absl::StrCat("outputs: unknown output '", output.name(),
                                                     "'; available: ", kScoresOutput, ", ", kLabelsOutput));
    }
  }

  // Parameters: the budget and options.
  std::optional<int64_t> expert_count;
  std::optional<int64_t> expert_width;
  std::optional<std::string> preset;
  bool full_attention = false;
  // Errors of non-positive expert knobs, reported together after the loop (count first, as over mita.v1).
  std::string expert_count_error, expert_width_error;
  for (const auto& [name, parameter] : request.parameters()) {
    if (!absl::StartsWith(name, kParameterPrefix)) continue;  // other clients' parameters
    if (name == kExpertCount || name == kExpertWidth || name == kTopN) {
      absl::StatusOr<int64_t> value = IntegerParameter(name, parameter);
      if (!value.ok()) return value.status();
      if (name == kTopN) {
        // All classes are computed (top_n below); mita_top_n only cuts the labels output.
        absl::StatusOr<int64_t> top_n = ResolveTopN(*value, model.labels_size());
        if (!top_n.ok()) return top_n.status();
        continue;
      }
      if (*value <= 0) {
        // 0 would mean "the model's default" in mita.v1; here a parameter left out means that.
        (name == kExpertCount ? expert_count_error : expert_width_error) = absl::StrCat(
            "parameter ", name, ": ", *value, " must be positive (leave it out for the model's default)");
        continue;
      }
      (name == kExpertCount ? expert_count : expert_width) = *value;
    } else if (name == kPreset || name == kAttention) {
      absl::StatusOr<std::string> value = StringParameter(name, parameter);
      if (!value.ok()) return value.status();
      if (name == kPreset) {
        preset = *value;
      } else if (*value == "full") {
        full_attention = true;
      } else if (*value != "mita") {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter mita_attention: '", value->substr(0, 64), "' is not one of: mita, full"));
      }
    } else if (name == kTruncate) {
      if (parameter.parameter_choice_case() != inference::InferParameter::kBoolParam) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter mita_truncate: must be a bool_param, got ", ParameterKind(parameter)));
      }
      if (classify.has_document()) classify.mutable_document()->set_truncate(parameter.bool_param());
    } else {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", name.substr(0, 64), " is not known; available: ",
                                                     absl::StrJoin({kAttention, kExpertCount, kExpertWidth, kPreset,
                                                                    kTopN, kTruncate},
                                                                   ", ")));
    }
  }
  if (!expert_count_error.empty() || !expert_width_error.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        expert_count_error, !expert_count_error.empty() && !expert_width_error.empty() ? "; " : "",
        expert_width_error));
  }
  const bool experts = expert_count.has_value() || expert_width.has_value();
  if (static_cast<int>(experts) + static_cast<int>(preset.has_value()) + static_cast<int>(full_attention) > 1) {
    return absl::InvalidArgumentError(
        "parameters: set one budget: mita_expert_count and/or mita_expert_width, or mita_preset, or "
        "mita_attention=full");
  }
  if (full_attention) {
    classify.mutable_budget()->mutable_full_attention();
  } else if (preset.has_value()) {
    classify.mutable_budget()->set_preset(*preset);
  } else if (experts) {
    v1::ExpertBudget* budget = classify.mutable_budget()->mutable_experts();
    budget->set_expert_count(expert_count.value_or(0));
    budget->set_expert_width(expert_width.value_or(0));
  }
  classify.set_top_n(model.labels_size());
  return classify;
}

absl::StatusOr<inference::ModelInferResponse> ToModelInferResponse(const inference::ModelInferRequest& request,
                                                                   const v1::ClassifyResponse& classified,
                                                                   const v1::ModelMetadata& model) {
  const int64_t classes = model.labels_size();
  int64_t top_n = 0;
  if (auto it = request.parameters().find(kTopN); it != request.parameters().end()) {
    absl::StatusOr<int64_t> value = IntegerParameter(kTopN, it->second);
    if (!value.ok()) return value.status();
    top_n = *value;
  }
  absl::StatusOr<int64_t> resolved_top_n = ResolveTopN(top_n, classes);
  if (!resolved_top_n.ok()) {
    return absl::Status(resolved_top_n.status().code(),
                        RenameFieldsInMessage(std::string(resolved_top_n.status().message())));
  }

  bool want_scores = request.outputs_size() == 0;
  bool want_labels = request.outputs_size() == 0;
  for (const auto& output : request.outputs()) {
    want_scores |= output.name() == kScoresOutput;
    want_labels |= output.name() == kLabelsOutput;
  }

  inference::ModelInferResponse response;
  response.set_model_name(classified.model());
  response.set_model_version(kModelVersion);
  response.set_id(request.id());
  if (want_scores) {
    OutputTensor* scores = response.add_outputs();
    scores->set_name(kScoresOutput);
    scores->set_datatype("FP32");
    scores->add_shape(classes);
    std::vector<float> values(static_cast<size_t>(classes), 0.0f);
    for (const v1::ClassScore& score : classified.classes()) {
      if (score.index() >= 0 && score.index() < classes) values[static_cast<size_t>(score.index())] = score.score();
    }
    *scores->mutable_contents()->mutable_fp32_contents() = {values.begin(), values.end()};
  }
  if (want_labels) {
    OutputTensor* labels = response.add_outputs();
    labels->set_name(kLabelsOutput);
    labels->set_datatype("BYTES");
    const int64_t n = std::min<int64_t>(*resolved_top_n, classified.classes_size());
    labels->add_shape(n);
    for (int64_t i = 0; i < n; ++i) labels->mutable_contents()->add_bytes_contents(classified.classes(i).label());
  }

  auto& parameters = *response.mutable_parameters();
  const v1::AppliedBudget& budget = classified.budget();
  parameters[kAttention].set_string_param(budget.full_attention() ? "full" : "mita");
  if (!budget.full_attention()) {
    SetInt(parameters, kExpertCount, budget.expert_count());
    SetInt(parameters, kExpertWidth, budget.expert_width());
  }
  if (!budget.preset().empty()) parameters[kPreset].set_string_param(budget.preset());
  SetInt(parameters, kTopN, *resolved_top_n);
  SetInt(parameters, "mita_queue_delay_us", classified.timing().queue_delay_us());
  SetInt(parameters, "mita_compute_us", classified.timing().compute_us());
  SetInt(parameters, "mita_total_us", classified.timing().total_us());
  SetInt(parameters, "mita_batch_size", classified.timing().batch_size());
  SetInt(parameters, "mita_token_count", classified.token_count());
  return response;
}

inference::ModelMetadataResponse ToModelMetadataResponse(const v1::ModelMetadata& model) {
  inference::ModelMetadataResponse response;
  response.set_name(model.name());
  response.add_versions(kModelVersion);
  response.set_platform(kPlatform);
  auto add = [](google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>* tensors,
                const std::string& name, const std::string& datatype, std::vector<int64_t> shape) {
    inference::ModelMetadataResponse::TensorMetadata* tensor = tensors->Add();
    tensor->set_name(name);
    tensor->set_datatype(datatype);
    for (int64_t dimension : shape) tensor->add_shape(dimension);
  };
  if (IsDocumentModel(model)) {
    add(response.mutable_inputs(), kTextInput, "BYTES", {1});
    add(response.mutable_inputs(), kTokenIdsInput, "INT64", {-1});
  } else {
    add(response.mutable_inputs(), kImageInput, "BYTES", {1});
  }
  add(response.mutable_outputs(), kScoresOutput, "FP32", {model.labels_size()});
  add(response.mutable_outputs(), kLabelsOutput, "BYTES", {-1});
  return response;
}

std::string KnobsJson(const v1::ModelMetadata& model) {
  const v1::Knobs& knobs = model.knobs();
  nlohmann::json json = nlohmann::json::object();
  json[kExpertCount] = {{"datatype", "INT64"},
                        {"allowed", std::vector<int64_t>(knobs.allowed_expert_counts().begin(),
                                                         knobs.allowed_expert_counts().end())},
                        {"min", knobs.min_expert_count()},
                        {"max", knobs.max_expert_count()},
                        {"default", knobs.default_budget().expert_count()}};
  json[kExpertWidth] = {{"datatype", "INT64"},
                        {"min", knobs.min_expert_width()},
                        {"max", knobs.max_expert_width()},
                        {"default", knobs.default_budget().expert_width()}};
  nlohmann::json presets = nlohmann::json::object();
  std::vector<std::string> preset_names;
  for (const v1::NamedBudget& preset : knobs.presets()) {
    preset_names.push_back(preset.name());
    presets[preset.name()] = {{kExpertCount, preset.budget().expert_count()},
                              {kExpertWidth, preset.budget().expert_width()}};
  }
  json[kPreset] = {{"datatype", "BYTES"}, {"allowed", preset_names}, {"budgets", presets}};
  std::vector<std::string> attention = {"mita"};
  if (knobs.full_attention_supported()) attention.push_back("full");
  json[kAttention] = {{"datatype", "BYTES"}, {"allowed", attention}, {"default", "mita"}};
  const int64_t classes = model.labels_size();
  json[kTopN] = {{"datatype", "INT64"}, {"min", 0}, {"max", classes}, {"default", std::min<int64_t>(5, classes)}};
  if (IsDocumentModel(model)) json[kTruncate] = {{"datatype", "BOOL"}, {"default", false}};
  return json.dump();
}

KserveService::KserveService(const ModelRegistry* registry, ClassifyService* classify, ServerMetrics* metrics,
                             std::string server_version)
    : registry_(registry), classify_(classify), metrics_(metrics), server_version_(std::move(server_version)) {
  for (const models::ModelPackage* package : registry_->packages()) {
    models_.emplace(package->name, BuildModelMetadata(*package, classify_->options()));
  }
}

absl::StatusOr<const v1::ModelMetadata*> KserveService::FindModel(const std::string& name,
                                                                  const std::string& version) const {
  auto it = models_.find(name);
  if (it == models_.end()) {
    absl::Status status = registry_->Lookup(name).status();
    if (status.ok()) status = absl::InternalError(absl::StrCat("model '", name, "' is registered but not served"));
    return status;
  }
  if (!version.empty() && version != kModelVersion) {
    return absl::NotFoundError(
        absl::StrCat("model '", name, "' version '", version, "' not found; available: ", kModelVersion));
  }
  return &it->second;
}

grpc::Status KserveService::ServerLive(grpc::ServerContext* /*context*/,
                                       const inference::ServerLiveRequest* /*request*/,
                                       inference::ServerLiveResponse* response) {
  response->set_live(true);
  return grpc::Status::OK;
}

grpc::Status KserveService::ServerReady(grpc::ServerContext* /*context*/,
                                        const inference::ServerReadyRequest* /*request*/,
                                        inference::ServerReadyResponse* response) {
  response->set_ready(ready_.load() && !models_.empty());
  return grpc::Status::OK;
}

grpc::Status KserveService::ModelReady(grpc::ServerContext* /*context*/, const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) {
  absl::StatusOr<const v1::ModelMetadata*> model = FindModel(request->name(), request->version());
  if (!model.ok()) return ToGrpcStatus(model.status());
  response->set_ready(ready_.load());
  return grpc::Status::OK;
}

grpc::Status KserveService::ServerMetadata(grpc::ServerContext* /*context*/,
                                           const inference::ServerMetadataRequest* /*request*/,
                                           inference::ServerMetadataResponse* response) {
  response->set_name("mita-serve");
  response->set_version(server_version_);
  return grpc::Status::OK;
}

grpc::Status KserveService::ModelMetadata(grpc::ServerContext* context, const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) {
  if (absl::Status auth = classify_->Authenticate(*context, RpcMethod::kGetModel); !auth.ok()) {
    return ToGrpcStatus(auth);
  }
  absl::StatusOr<const v1::ModelMetadata*> model = FindModel(request->name(), request->version());
  if (!model.ok()) return ToGrpcStatus(model.status());
  *response = ToModelMetadataResponse(**model);
  context->AddInitialMetadata(kParametersMetadataKey, KnobsJson(**model));
  return grpc::Status::OK;
}

grpc::Status KserveService::ModelInfer(grpc::ServerContext* context, const inference::ModelInferRequest* request,
                                       inference::ModelInferResponse* response) {
  if (absl::Status auth = classify_->Authenticate(*context, RpcMethod::kClassify); !auth.ok()) {
    return ToGrpcStatus(auth);
  }
  absl::Time deadline = absl::InfiniteFuture();
  if (context->deadline() != std::chrono::system_clock::time_point::max()) {
    deadline = absl::FromChrono(context->deadline());
  }
  auto cancelled = [context] { return context->IsCancelled(); };
  auto fail = [](const absl::Status& status) {
    return ToGrpcStatus(absl::Status(status.code(), RenameFieldsInMessage(std::string(status.message()))));
  };
  auto it = models_.find(request->model_name());
  if (it == models_.end()) {
    // An empty or unknown model: ClassifyService gives (and counts) the same error as for mita.v1.
    v1::ClassifyRequest unknown;
    unknown.set_model(request->model_name());
    absl::StatusOr<v1::ClassifyResponse> result = classify_->HandleClassify(unknown, deadline, cancelled);
    return fail(result.ok() ? absl::InternalError("model lookup disagrees with the classify service")
                            : result.status());
  }
  const v1::ModelMetadata& model = it->second;
  absl::StatusOr<v1::ClassifyRequest> classify = ToClassifyRequest(*request, model);
  if (!classify.ok()) {
    metrics_->CountRequest(RpcMethod::kClassify, metrics_->ForModel(model.name()), classify.status().code());
    return fail(classify.status());
  }
  absl::StatusOr<v1::ClassifyResponse> classified = classify_->HandleClassify(*classify, deadline, cancelled);
  if (!classified.ok()) return fail(classified.status());
  absl::StatusOr<inference::ModelInferResponse> translated = ToModelInferResponse(*request, *classified, model);
  if (!translated.ok()) return fail(translated.status());
  *response = *std::move(translated);
  return grpc::Status::OK;
}

}  // namespace mita::server
