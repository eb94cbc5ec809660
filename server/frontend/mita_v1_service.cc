// The mita.v1 front end (see mita_v1_service.h).
#include "server/frontend/mita_v1_service.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/status_macros.h"

namespace mita::server {

absl::StatusOr<InferenceRequest> ToInferenceRequest(const v1::ClassifyRequest& request) {
  InferenceRequest neutral;
  neutral.model = request.model();
  if (request.model_version() < 0) {
    return models::InvalidRequest(models::RequestField::kModelVersion,
                                  absl::StrCat(request.model_version(), " is out of range: allowed >= 0 (0: the latest)"));
  }
  neutral.model_version = request.model_version();
  models::ClassifierInput& input = neutral.input;
  switch (request.input_case()) {
    case v1::ClassifyRequest::kImage:
      input.kind = models::ClassifierInput::Kind::kImage;
      input.bytes = request.image();
      break;
    case v1::ClassifyRequest::kDocument:
      input.truncate = request.document().truncate();
      switch (request.document().content_case()) {
        case v1::Document::kText:
          input.kind = models::ClassifierInput::Kind::kText;
          input.bytes = request.document().text();
          break;
        case v1::Document::kTokenIds:
          input.kind = models::ClassifierInput::Kind::kTokenIds;
          input.token_ids = absl::MakeConstSpan(request.document().token_ids().ids().data(),
                                                static_cast<size_t>(request.document().token_ids().ids_size()));
          break;
        case v1::Document::CONTENT_NOT_SET:
          return models::InvalidRequest(models::RequestField::kDocument,
                                        "set document.text or document.token_ids");
      }
      break;
    case v1::ClassifyRequest::INPUT_NOT_SET:
      input.kind = models::ClassifierInput::Kind::kNone;
      break;
  }
  models::BudgetRequest& budget = neutral.budget;
  switch (request.budget().choice_case()) {
    case v1::Budget::CHOICE_NOT_SET:
      budget.choice = models::BudgetRequest::Choice::kDefault;
      break;
    case v1::Budget::kPreset:
      budget.choice = models::BudgetRequest::Choice::kPreset;
      budget.preset = request.budget().preset();
      break;
    case v1::Budget::kExperts:
      budget.choice = models::BudgetRequest::Choice::kExperts;
      budget.expert_count = request.budget().experts().expert_count();
      budget.expert_width = request.budget().experts().expert_width();
      break;
    case v1::Budget::kFullAttention:
      budget.choice = models::BudgetRequest::Choice::kFullAttention;
      break;
    case v1::Budget::kLatencyTarget:
      budget.choice = models::BudgetRequest::Choice::kLatencyTarget;
      if (request.budget().latency_target().target_ms() < 0) {
        return models::InvalidRequest(models::RequestField::kLatencyTarget,
                                      absl::StrCat(request.budget().latency_target().target_ms(),
                                                   " is out of range: allowed >= 0 (0 means the call's deadline)"));
      }
      budget.latency_target = absl::Milliseconds(request.budget().latency_target().target_ms());
      budget.floor = request.budget().latency_target().floor();
      break;
    default:
      return models::InvalidRequest(models::RequestField::kBudget, "unknown budget choice");
  }
  neutral.top_n = request.top_n();
  neutral.return_statistics = request.return_statistics();
  return neutral;
}

namespace {

v1::BudgetReason ToBudgetReason(BudgetReason reason) {
  switch (reason) {
    case BudgetReason::kRequested:
      return v1::BUDGET_REASON_REQUESTED;
    case BudgetReason::kMostAccurate:
      return v1::BUDGET_REASON_MOST_ACCURATE;
    case BudgetReason::kLoweredAtAdmission:
      return v1::BUDGET_REASON_LOWERED_AT_ADMISSION;
    case BudgetReason::kLoweredAtBatchStart:
      return v1::BUDGET_REASON_LOWERED_AT_BATCH_START;
  }
  return v1::BUDGET_REASON_UNSPECIFIED;
}

}  // namespace

v1::ClassifyResponse ToClassifyResponse(const InferenceResult& result) {
  v1::ClassifyResponse response;
  const std::vector<std::string>& labels = result.model->labels;
  response.set_model(result.model->name);
  response.set_model_version(result.model_version);
  for (const models::ClassScore& score : result.classes) {
    v1::ClassScore* entry = response.add_classes();
    entry->set_index(static_cast<int32_t>(score.index));
    if (score.index >= 0 && score.index < static_cast<int64_t>(labels.size())) {
      entry->set_label(labels[static_cast<size_t>(score.index)]);
    }
    entry->set_score(score.probability);
  }
  const models::AttentionBudget& applied = result.budget.budget;
  v1::AppliedBudget* budget = response.mutable_budget();
  budget->set_full_attention(applied.full_attention);
  if (!applied.full_attention) {
    budget->set_expert_count(applied.expert_count);
    budget->set_expert_width(applied.expert_width);
  }
  budget->set_preset(result.budget.preset);
  budget->set_reason(ToBudgetReason(result.budget_reason));
  budget->set_predicted_us(absl::ToInt64Microseconds(result.predicted));
  v1::Timing* timing = response.mutable_timing();
  timing->set_queue_delay_us(absl::ToInt64Microseconds(result.queue_delay));
  timing->set_compute_us(absl::ToInt64Microseconds(result.compute));
  timing->set_total_us(absl::ToInt64Microseconds(result.total));
  timing->set_batch_size(static_cast<int32_t>(result.batch_size));
  response.set_token_count(result.tokens);
  response.set_input_token_count(result.input_tokens);
  for (size_t layer = 0; layer < result.statistics.size(); ++layer) {
    const kernels::MitaItemStatistics& stats = result.statistics[layer];
    v1::LayerStatistics* out = response.add_statistics();
    out->set_layer(static_cast<int32_t>(layer));
    for (double queries : stats.queries_per_expert) out->add_queries_per_expert(static_cast<float>(queries));
    out->set_load_imbalance(static_cast<float>(stats.load_imbalance));
    out->set_routing_entropy(static_cast<float>(stats.routing_entropy));
    out->set_pruned_key_fraction(static_cast<float>(stats.pruned_key_fraction));
    out->set_expert_overlap_fraction(static_cast<float>(stats.expert_overlap_fraction));
  }
  return response;
}

v1::ModelMetadata ToModelMetadata(const models::ClassifierDescription& model, const models::InputLimits& limits,
                                  const CostSummary* cost) {
  v1::ModelMetadata metadata;
  metadata.set_name(model.name);
  metadata.set_architecture(model.architecture);
  if (model.image.has_value()) {
    metadata.set_input_kind(v1::INPUT_KIND_IMAGE);
    v1::ImageLimits* image = metadata.mutable_image_limits();
    image->set_width(static_cast<int32_t>(model.image->width));
    image->set_height(static_cast<int32_t>(model.image->height));
    image->set_channels(static_cast<int32_t>(model.image->channels));
    image->set_max_width(static_cast<int32_t>(model.image->max_width));
    image->set_max_height(static_cast<int32_t>(model.image->max_height));
    image->set_max_encoded_bytes(limits.max_encoded_image_bytes);
  }
  if (model.document.has_value()) {
    metadata.set_input_kind(v1::INPUT_KIND_DOCUMENT);
    v1::DocumentLimits* document = metadata.mutable_document_limits();
    document->set_max_tokens(std::min(model.document->max_tokens, limits.max_tokens));
    document->set_vocabulary_size(model.document->vocabulary_size);
    document->set_tokenizer(model.document->tokenizer);
  }
  for (const std::string& label : model.labels) metadata.add_labels(label);
  const models::BudgetKnobs& knobs = model.knobs;
  v1::Knobs* out = metadata.mutable_knobs();
  for (int64_t count : knobs.allowed_expert_counts) out->add_allowed_expert_counts(count);
  out->set_min_expert_count(knobs.min_expert_count);
  out->set_max_expert_count(knobs.max_expert_count);
  out->set_min_expert_width(knobs.min_expert_width);
  out->set_max_expert_width(knobs.max_expert_width);
  if (knobs.default_budget.full_attention) {
    out->set_default_full_attention(true);
  } else {
    out->mutable_default_budget()->set_expert_count(knobs.default_budget.expert_count);
    out->mutable_default_budget()->set_expert_width(knobs.default_budget.expert_width);
  }
  for (const auto& [name, preset] : knobs.presets) {
    v1::NamedBudget* named = out->add_presets();
    named->set_name(name);
    if (preset.full_attention) {
      named->set_full_attention(true);
    } else {
      named->mutable_budget()->set_expert_count(preset.expert_count);
      named->mutable_budget()->set_expert_width(preset.expert_width);
    }
  }
  out->set_full_attention_supported(knobs.full_attention_supported);
  for (size_t i = 0; i < knobs.accuracy_order.size(); ++i) {
    const models::DeclaredBudget& declared = knobs.accuracy_order[i];
    v1::DeclaredBudget* entry = out->add_accuracy_order();
    entry->set_name(declared.name);
    if (declared.budget.full_attention) {
      entry->set_full_attention(true);
    } else {
      entry->mutable_budget()->set_expert_count(declared.budget.expert_count);
      entry->mutable_budget()->set_expert_width(declared.budget.expert_width);
    }
    entry->set_accuracy(declared.accuracy);
    if (cost != nullptr && i < cost->predicted.size()) {
      entry->set_predicted_ms(absl::ToDoubleMilliseconds(cost->predicted[i]));
    }
  }
  if (cost != nullptr) {
    v1::CostProfile* profile = metadata.mutable_cost_profile();
    profile->set_source(cost->profile.source);
    profile->set_calibration_batches(cost->profile.calibration_batches);
    profile->set_calibration_ms(absl::ToDoubleMilliseconds(cost->profile.calibration_time));
    profile->set_reference_tokens(cost->reference_tokens);
    profile->set_correction(cost->correction);
    profile->set_batch_overhead_ms(absl::ToDoubleMilliseconds(cost->batch_overhead));
  }
  metadata.set_layers(static_cast<int32_t>(model.layers));
  metadata.set_heads(static_cast<int32_t>(model.heads));
  metadata.set_embed_dim(static_cast<int32_t>(model.embed_dim));
  metadata.set_tokens_per_input(model.tokens_per_input);
  metadata.set_device(model.device);
  metadata.set_weights_dtype(model.weights_dtype);
  return metadata;
}

std::string MitaV1FieldName(const models::FieldProblem& problem) {
  using models::RequestField;
  switch (problem.field) {
    case RequestField::kModel:
      return "model";
    case RequestField::kModelVersion:
      return "model_version";
    case RequestField::kInput:
      return "input";
    case RequestField::kImage:
      return "image";
    case RequestField::kDocument:
      return "document";
    case RequestField::kDocumentText:
      return "document.text";
    case RequestField::kDocumentTokenIds:
      return problem.index >= 0 ? absl::StrCat("document.token_ids.ids[", problem.index, "]")
                                : "document.token_ids.ids";
    case RequestField::kBudget:
      return "budget";
    case RequestField::kExperts:
      return "budget.experts";
    case RequestField::kExpertCount:
      return "budget.experts.expert_count";
    case RequestField::kExpertWidth:
      return "budget.experts.expert_width";
    case RequestField::kPreset:
      return "budget.preset";
    case RequestField::kTopN:
      return "top_n";
    case RequestField::kTruncate:
      return "document.truncate";
    case RequestField::kLatencyTarget:
      return "budget.latency_target.target_ms";
    case RequestField::kBudgetFloor:
      return "budget.latency_target.floor";
  }
  return "request";
}

absl::Status WordForMitaV1(const absl::Status& status) {
  return models::WordProblems(
      status, [](const models::FieldProblem& problem) { return absl::StrCat("field ", MitaV1FieldName(problem)); });
}

// One Classify call: received, translated and submitted at construction, finished from whichever thread
// answers it. It owns the parsed request, which the submitted neutral request views.
class MitaV1Service::ClassifyReactor final : public InferenceReactor {
 public:
  ClassifyReactor(MitaV1Service* service, grpc::CallbackServerContext* context, const grpc::ByteBuffer* wire_request,
                  grpc::ByteBuffer* wire_response)
      : InferenceReactor(context, service->metrics_, RpcMethod::kClassify),
        service_(service),
        wire_response_(wire_response) {
    if (!Receive(service_->options_, *wire_request, &request_)) {
      return;
    }
    model_ = request_.model();
    absl::StatusOr<InferenceRequest> neutral = ToInferenceRequest(request_);
    if (!neutral.ok()) {
      Answer(neutral.status());
      return;
    }
    neutral->deadline = DeadlineOf(*context);
    Submit(*service_->engine_, *std::move(neutral));
  }

 private:
  void Answer(absl::StatusOr<InferenceResult> result) override {
    absl::Status status = result.status();
    absl::Duration total;
    if (result.ok()) {
      total = result->total;
      status = SendResponse(service_->options_, ToClassifyResponse(*result), wire_response_);
    }
    FinishCall(model_, WordForMitaV1(status), total);
  }

  MitaV1Service* const service_;
  grpc::ByteBuffer* const wire_response_;
  v1::ClassifyRequest request_;
  std::string model_;  // the request's model, once it parsed
};

MitaV1Service::MitaV1Service(InferenceEngine* engine, ServerMetrics* metrics, FrontEndOptions options)
    : engine_(engine), metrics_(metrics), options_(std::move(options)) {}

grpc::ServerUnaryReactor* MitaV1Service::Classify(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return new ClassifyReactor(this, context, request, response);
}

grpc::ServerUnaryReactor* MitaV1Service::ListModels(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerAtOnce<v1::ListModelsRequest, v1::ListModelsResponse>(
      context, request, response, *metrics_, options_, RpcMethod::kListModels, WordForMitaV1,
      [this](const v1::ListModelsRequest&, v1::ListModelsResponse* answer, std::string*) {
        for (const ModelHandle& model : engine_->models()) *answer->add_models() = Describe(*model);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* MitaV1Service::GetModel(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerAtOnce<v1::GetModelRequest, v1::ModelMetadata>(
      context, request, response, *metrics_, options_, RpcMethod::kGetModel, WordForMitaV1,
      [this](const v1::GetModelRequest& asked, v1::ModelMetadata* answer, std::string* model_name) {
        *model_name = asked.name();
        if (asked.version() < 0) {
          return models::InvalidRequest(models::RequestField::kModelVersion,
                                        absl::StrCat(asked.version(), " is out of range: allowed >= 0 (0: the latest)"));
        }
        ASSIGN_OR_RETURN(const ModelHandle model, engine_->FindModel(asked.name(), asked.version()));
        *answer = Describe(*model);
        return absl::OkStatus();
      });
}

v1::ModelMetadata MitaV1Service::Describe(const ServedModel& model) const {
  const CostSummary cost = model.runner().cost_summary();
  v1::ModelMetadata metadata = ToModelMetadata(model.description(), engine_->input_limits(), &cost);
  metadata.set_version(model.version());
  for (const int64_t version : engine_->versions(model.name())) metadata.add_versions(version);
  return metadata;
}

namespace {

// The repository API's precondition: a lifecycle.
absl::Status CheckLifecycle(const ModelLifecycle* lifecycle) {
  if (lifecycle == nullptr) return absl::UnimplementedError("this server has no model repository API");
  return absl::OkStatus();
}

void AddEntries(const std::vector<ModelLifecycle::Entry>& entries, const std::string& only,
                google::protobuf::RepeatedPtrField<v1::RepositoryEntry>* out) {
  for (const ModelLifecycle::Entry& entry : entries) {
    if (!only.empty() && entry.name != only) continue;
    v1::RepositoryEntry* added = out->Add();
    added->set_name(entry.name);
    added->set_version(entry.version);
    added->set_state(entry.state);
    added->set_reason(entry.reason);
  }
}

}  // namespace

grpc::ServerUnaryReactor* MitaV1Service::ListRepository(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerAtOnce<v1::ListRepositoryRequest, v1::ListRepositoryResponse>(
      context, request, response, *metrics_, options_, RpcMethod::kListRepository, WordForMitaV1,
      [this](const v1::ListRepositoryRequest& asked, v1::ListRepositoryResponse* answer, std::string*) {
        RETURN_IF_ERROR(CheckLifecycle(options_.lifecycle));
        AddEntries(options_.lifecycle->Index(asked.ready_only()), "", answer->mutable_entries());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* MitaV1Service::LoadModel(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerLater<v1::LoadModelRequest, v1::LoadModelResponse>(
      context, request, response, *metrics_, options_, RpcMethod::kLoadModel, WordForMitaV1,
      [this](const v1::LoadModelRequest& asked, std::string* model,
             std::function<void(absl::StatusOr<v1::LoadModelResponse>)> finish) {
        *model = asked.name();
        if (absl::Status checked = CheckLifecycle(options_.lifecycle); !checked.ok()) return finish(checked);
        const std::string name = asked.name();
        options_.lifecycle->LoadInBackground(name, [this, name, finish](absl::Status status) {
          if (!status.ok()) return finish(status);
          v1::LoadModelResponse answer;
          AddEntries(options_.lifecycle->Index(false), name, answer.mutable_entries());
          finish(answer);
        });
      });
}

grpc::ServerUnaryReactor* MitaV1Service::UnloadModel(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerLater<v1::UnloadModelRequest, v1::UnloadModelResponse>(
      context, request, response, *metrics_, options_, RpcMethod::kUnloadModel, WordForMitaV1,
      [this](const v1::UnloadModelRequest& asked, std::string* model,
             std::function<void(absl::StatusOr<v1::UnloadModelResponse>)> finish) {
        *model = asked.name();
        if (absl::Status checked = CheckLifecycle(options_.lifecycle); !checked.ok()) return finish(checked);
        options_.lifecycle->UnloadInBackground(asked.name(), [finish](absl::Status status) {
          finish(status.ok() ? absl::StatusOr<v1::UnloadModelResponse>(v1::UnloadModelResponse())
                             : absl::StatusOr<v1::UnloadModelResponse>(status));
        });
      });
}

}  // namespace mita::server
