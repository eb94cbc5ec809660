// The Open Inference Protocol front end (KServe V2 gRPC, `inference.GRPCInferenceService`,
// proto/kserve/grpc_predict_v2.proto), served beside mita.v1 on the same port, on gRPC's callback API. Every
// ModelInfer becomes one neutral InferenceRequest for the same InferenceEngine as mita.v1 (same model lookup,
// validation, batcher, error codes), and its errors are worded in this protocol's terms.
//
// Mapping (one input per request; concurrent requests share server-side batches as with mita.v1):
//   inputs, exactly one tensor, one of those the model declares (ModelMetadata), matching its name, datatype
//   and shape (rank included):
//     image      BYTES [1]   image model: an encoded PNG/JPEG
//     text       BYTES [1]   document model: UTF-8 text
//     token_ids  INT64 [-1]  document model: token ids
//   Typed `contents` or `raw_input_contents` (BYTES raw: 4-byte little-endian length + bytes per element; INT64
//   raw: 8 bytes little-endian per element).
//   request parameters (the budget and options; names with the prefix "mita_" are checked, others ignored):
//     mita_expert_count  int64   expert count m (> 0; leave it out for the model's default)
//     mita_expert_width  int64   expert width k (> 0; likewise)
//     mita_preset        string  a preset of the model
//     mita_attention     string  "full" | "mita" (default)
//     mita_top_n         int64   labels returned (0 or unset: min(5, classes))
//     mita_truncate      bool    cut a document longer than the model's maximum
//     mita_latency_target_ms  int64   let the server choose the budget: the most accurate of the model's
//                                     accuracy order predicted to answer within this many ms of receipt (>= 0;
//                                     0: the call's deadline); excludes the four budget parameters above
//     mita_budget_floor  string  with mita_latency_target_ms: the least accurate budget it may apply (a name of
//                                the accuracy order; unset: its last)
//   outputs (all unless the request names some; an unknown name is INVALID_ARGUMENT):
//     scores  FP32  [C]  softmax probability of every class, by class index
//     labels  BYTES [N]  the N = top-N best class labels, best first
//   Outputs come as raw_output_contents when the request sent raw_input_contents (Triton's clients always do,
//   and read FP32 outputs only from there), as typed contents otherwise.
//   response parameters: the budget applied (mita_attention, mita_expert_count, mita_expert_width,
//   mita_preset when one applied: "default" or the preset's name), why it applied (mita_budget_reason:
//   "requested", "most_accurate", "lowered_at_admission" or "lowered_at_batch_start") and the queue wait plus
//   compute predicted for it (mita_predicted_us, 0 when none was predicted), mita_top_n, and timing
//   (mita_queue_delay_us, mita_compute_us, mita_total_us in microseconds, mita_batch_size in requests,
//   mita_token_count in tokens).
//   Errors: the engine's codes, each field problem worded with this protocol's names (e.g. "parameter
//   mita_expert_count: 10 is not allowed: use one of 1, 4, 9, 16, 25, 36, 49", "input 'text': invalid UTF-8 at
//   byte offset 3"); a tensor that does not fit this mapping is INVALID_ARGUMENT naming the input and the
//   accepted forms.
//
// ModelMetadata: the official ModelMetadataResponse has no parameters field (open-inference-protocol
// specification, and KServe's grpc_predict_v2.proto), and the .proto here is kept exactly the protocol's. The
// knobs and their ranges are therefore declared in the response's gRPC initial metadata under the key
// "mita-parameters" (kParametersMetadataKey), a JSON object by parameter name (KnobsJson below); the same knobs
// are in mita.v1 GetModel on the same port.
// ModelConfig (Triton's extension "model_configuration", listed in ServerMetadata's extensions): the model in
// Triton's ModelConfig terms, for Triton's tools (perf_analyzer needs it): platform "mita_safetensors", backend
// "mita", max_batch_size 0 (tensors carry no batch dimension; the server batches requests itself), the declared
// inputs (a document model's two marked optional: a request sends one) and outputs, and the knobs' JSON as the
// parameter "mita-parameters".
// Readiness: ServerLive is true while the server answers; ServerReady and ModelReady follow SetReady (main
// sets it with the gRPC health status: true once the models are loaded, false while draining).
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kserve/grpc_predict_v2.grpc.pb.h"
#include "kserve/grpc_predict_v2.pb.h"
#include "models/classifier.h"
#include "models/request_error.h"
#include "server/engine/inference_engine.h"
#include "server/engine/inference_request.h"
#include "server/frontend/inference_reactor.h"
#include "server/frontend/unary_call.h"
#include "server/metrics/metrics.h"

namespace mita::server {

// gRPC initial-metadata key of the ModelMetadata response that carries KnobsJson.
inline constexpr char kParametersMetadataKey[] = "mita-parameters";
// The name of the server's one model repository in Triton's repository API (RepositoryIndex and the others also
// accept "").
inline constexpr char kRepositoryName[] = "models";
// ServerMetadata's extension name for ModelConfig (Triton's).
inline constexpr char kModelConfigurationExtension[] = "model_configuration";
// ServerMetadata's extension name for the repository API (Triton's).
inline constexpr char kModelRepositoryExtension[] = "model_repository";
// Output tensor names.
inline constexpr char kScoresOutput[] = "scores";
inline constexpr char kLabelsOutput[] = "labels";

// A ModelInfer request translated: the neutral request and the input values it views when they had to be
// decoded from raw_input_contents. Not copyable (the request views `bytes` / `token_ids`).
struct TranslatedInferRequest {
  InferenceRequest request;
  std::string bytes;
  std::vector<int64_t> token_ids;

  TranslatedInferRequest() = default;
  TranslatedInferRequest(const TranslatedInferRequest&) = delete;
  TranslatedInferRequest& operator=(const TranslatedInferRequest&) = delete;
};

// Translates a ModelInfer request for `model` into `*translated` (whose request views `request` and
// `*translated`), asking for every class (so that every class score comes back).
// Errors: INVALID_ARGUMENT naming the input, parameter or output and the accepted forms (see the file
// comment). The model version is the service's to resolve (ParseModelVersion, InferenceEngine::FindModel).
absl::Status ToInferenceRequest(const inference::ModelInferRequest& request, const models::ClassifierDescription& model,
                                TranslatedInferRequest* translated);

// The ModelInfer response of a result: outputs scores FP32 [C] and labels BYTES [N] (or those requested), the
// applied parameters and timing. Errors: INVALID_ARGUMENT for mita_top_n out of range.
absl::StatusOr<inference::ModelInferResponse> ToModelInferResponse(const inference::ModelInferRequest& request,
                                                                   const InferenceResult& result);

// The ModelMetadata response of a model: platform "mita_safetensors", its served `versions`, the input tensor(s) of
// its input kind and the two outputs.
inference::ModelMetadataResponse ToModelMetadataResponse(const models::ClassifierDescription& model,
                                                         const std::vector<int64_t>& versions);

// A request's model version: "" -> 0 (the highest served), "N" -> N >= 1. Errors: INVALID_ARGUMENT "model_version
// 'x' is not a version number (1, 2, ...; empty for the latest)".
absl::StatusOr<int64_t> ParseModelVersion(const std::string& text);

// The ModelConfig response of a model (Triton's extension; see the file comment).
inference::ModelConfigResponse ToModelConfigResponse(const models::ClassifierDescription& model);

// The knobs of a model as a JSON object by request parameter name, e.g.
// {"mita_expert_count":{"datatype":"INT64","allowed":[1,4,9],"min":1,"max":9,"default":9},
//  "mita_expert_width":{"datatype":"INT64","min":1,"max":50,"default":16},
//  "mita_preset":{"datatype":"BYTES","allowed":["fast"],"budgets":{"fast":{"mita_expert_count":4,...}}},
//  "mita_attention":{"datatype":"BYTES","allowed":["mita","full"],"default":"mita"},
//  "mita_top_n":{"datatype":"INT64","min":0,"max":10,"default":5}, "mita_truncate":{...},
//  "mita_latency_target_ms":{"datatype":"INT64","min":0},
//  "mita_budget_floor":{"datatype":"BYTES","allowed":["full","accurate",...],"accuracy_order":[{"name":"full",
//    "mita_attention":"full","accuracy":-1},{"name":"accurate","mita_expert_count":16,...},...]} (the budgets a
//  latency target chooses from, most accurate first; accuracy -1 when the package declares none),
//  "device":"cuda:0","weights_dtype":"bfloat16"}: the last two say where the model runs (not parameters).
std::string KnobsJson(const models::ClassifierDescription& model);

// This protocol's name of a request part, e.g. "parameter mita_expert_width", "input 'token_ids' element 7".
std::string OpenInferenceFieldName(const models::FieldProblem& problem);

// `status` in this protocol's words: each field problem as "<name>: <detail>", joined by "; "; other statuses
// unchanged.
absl::Status WordForOpenInference(const absl::Status& status);

// The protocol's methods on the callback API, receiving the bytes the client sent (server/frontend/unary_call.h).
using OpenInferenceRawService = inference::GRPCInferenceService::WithRawCallbackMethod_ServerLive<
    inference::GRPCInferenceService::WithRawCallbackMethod_ServerReady<
        inference::GRPCInferenceService::WithRawCallbackMethod_ModelReady<
            inference::GRPCInferenceService::WithRawCallbackMethod_ServerMetadata<
                inference::GRPCInferenceService::WithRawCallbackMethod_ModelMetadata<
                    inference::GRPCInferenceService::WithRawCallbackMethod_ModelInfer<
                        inference::GRPCInferenceService::WithRawCallbackMethod_ModelConfig<
                            inference::GRPCInferenceService::WithRawCallbackMethod_RepositoryIndex<
                                inference::GRPCInferenceService::WithRawCallbackMethod_RepositoryModelLoad<
                                    inference::GRPCInferenceService::WithRawCallbackMethod_RepositoryModelUnload<
                                        inference::GRPCInferenceService::Service>>>>>>>>>>;

class OpenInferenceService final : public OpenInferenceRawService {
 public:
  // Serves the models of `engine` (which, like `metrics`, must outlive the service). Not ready until
  // SetReady(true). `server_version` is the ServerMetadata version.
  OpenInferenceService(InferenceEngine* engine, ServerMetrics* metrics, FrontEndOptions options,
                       std::string server_version);

  // Readiness of the server and its models (ServerReady, ModelReady). Thread-safe.
  void SetReady(bool ready) { ready_.store(ready); }

  // Each receives its serialized request message (<Method>Request) and answers with its serialized response
  // message (<Method>Response); a request that does not parse is INVALID_ARGUMENT. Every method is authenticated
  // when the server has a bearer token (gRPC health stays open) and counted in mita_requests_total under its own
  // name. ModelReady, ModelMetadata and ModelConfig: INVALID_ARGUMENT for an empty name, NOT_FOUND for an unknown model or
  // version. ModelInfer: see the file comment.
  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  // Triton's repository extension on FrontEndOptions::lifecycle (server/engine/model_lifecycle.h): the index of
  // every model version with its state and reason; a load or reload (answered when done); an unload (answered when
  // the model's requests are). repository_name must be empty or "models"; Load refuses Triton's "config" and file
  // parameters (INVALID_ARGUMENT). Without a lifecycle, UNIMPLEMENTED.
  grpc::ServerUnaryReactor* RepositoryIndex(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RepositoryModelLoad(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RepositoryModelUnload(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;

 private:
  class InferReactor;

  // The model `name` at `version` ("" for the highest served). Errors: INVALID_ARGUMENT (empty name, a version
  // that is no number), NOT_FOUND.
  absl::StatusOr<ModelHandle> FindModel(const std::string& name, const std::string& version) const;

  InferenceEngine* const engine_;
  ServerMetrics* const metrics_;
  const FrontEndOptions options_;
  const std::string server_version_;
  std::atomic<bool> ready_{false};
};

}  // namespace mita::server
