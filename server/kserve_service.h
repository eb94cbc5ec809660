// Open Inference Protocol (KServe V2 gRPC, `inference.GRPCInferenceService`, proto/kserve/grpc_predict_v2.proto)
// served beside mita.v1 on the same port. It is a translation layer only: every ModelInfer becomes one
// v1::ClassifyRequest and runs through ClassifyService::Run, i.e. the same model lookup, validation, batcher,
// metrics (counted as method "Classify") and error codes (server/grpc_status.h) as mita.v1 Classify.
//
// Mapping (one input per request; concurrent requests share server-side batches as with mita.v1):
//   inputs, exactly one tensor (its name is free; "image", "text", "token_ids" are the declared ones):
//     BYTES, one element (shape [1] or [1, 1])  image model: an encoded PNG/JPEG -> ClassifyRequest.image
//                                              document model: UTF-8 text -> ClassifyRequest.document.text
//     INT64, shape [T] or [1, T]                document model: token ids -> ClassifyRequest.document.token_ids
//     Typed `contents` or `raw_input_contents` (BYTES raw: 4-byte little-endian length + bytes per element;
//     INT64 raw: 8 bytes little-endian per element).
//   request parameters (the budget and options; names with the prefix "mita_" are checked, others ignored):
//     mita_expert_count  int64   expert count m            -> budget.experts.expert_count
//     mita_expert_width  int64   expert width k            -> budget.experts.expert_width
//     mita_preset        string  a preset of the model     -> budget.preset
//     mita_attention     string  "full" | "mita" (default) -> budget.full_attention
//     mita_top_n         int64   labels returned (0 or unset: min(5, classes))
//     mita_truncate      bool    cut a document longer than the model's maximum -> document.truncate
//   outputs (all unless the request names some; an unknown name is INVALID_ARGUMENT):
//     scores  FP32  [C]  softmax probability of every class, by class index
//     labels  BYTES [N]  the N = top-N best class labels, best first
//   response parameters: the budget applied (mita_attention, mita_expert_count, mita_expert_width,
//   mita_preset when one applied: "default" or the preset's name), mita_top_n, and timing (mita_queue_delay_us,
//   mita_compute_us, mita_total_us in microseconds, mita_batch_size in requests, mita_token_count in tokens).
//   Errors: the mita.v1 code, with v1 field names replaced by the names above (e.g. "parameter
//   mita_expert_count 10 is not allowed: use one of 1, 4, 9, 16, 25, 36, 49"); a tensor that does not fit
//   this mapping is INVALID_ARGUMENT naming the input and the accepted forms.
//
// ModelMetadata: the official ModelMetadataResponse has no parameters field (open-inference-protocol
// specification, and KServe's grpc_predict_v2.proto), and the .proto here is kept exactly the protocol's. The
// knobs and their ranges are therefore declared in the response's gRPC initial metadata under the key
// "mita-parameters" (kParametersMetadataKey), a JSON object by parameter name (KnobsJson below); the same knobs
// are in mita.v1 GetModel on the same port.
// Readiness: ServerLive is true while the server answers; ServerReady and ModelReady follow SetReady (main
// sets it with the gRPC health status: true once the models are loaded, false while draining).
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "kserve/grpc_predict_v2.grpc.pb.h"
#include "kserve/grpc_predict_v2.pb.h"
#include "mita/v1/mita.pb.h"
#include "server/classify_service.h"
#include "server/metrics.h"
#include "server/model_registry.h"

namespace mita::server {

// gRPC initial-metadata key of the ModelMetadata response that carries KnobsJson.
inline constexpr char kParametersMetadataKey[] = "mita-parameters";
// The one model version served ("1"); ModelInfer and the metadata RPCs also accept an empty version.
inline constexpr char kModelVersion[] = "1";
// Output tensor names.
inline constexpr char kScoresOutput[] = "scores";
inline constexpr char kLabelsOutput[] = "labels";

// Translates a ModelInfer request for the model described by `model` (mita.v1 metadata: input kind, labels)
// into a v1::ClassifyRequest with top_n = all classes (so that every class score comes back).
// Errors: INVALID_ARGUMENT naming the input, parameter or output and the accepted forms (see the file
// comment); NOT_FOUND for a model version other than "" or "1".
absl::StatusOr<v1::ClassifyRequest> ToClassifyRequest(const inference::ModelInferRequest& request,
                                                      const v1::ModelMetadata& model);

// Builds the ModelInfer response from a Classify response of the request ToClassifyRequest made: outputs
// scores FP32 [C] and labels BYTES [N] (or those requested), the applied parameters and timing.
// Errors: INVALID_ARGUMENT for mita_top_n out of [0, C] (named "parameter mita_top_n").
absl::StatusOr<inference::ModelInferResponse> ToModelInferResponse(const inference::ModelInferRequest& request,
                                                                   const v1::ClassifyResponse& classified,
                                                                   const v1::ModelMetadata& model);

// The ModelMetadata response of a model: platform "mita_safetensors", version "1", the input tensor(s) of its
// input kind and the two outputs.
inference::ModelMetadataResponse ToModelMetadataResponse(const v1::ModelMetadata& model);

// The knobs of a model as a JSON object by request parameter name, e.g.
// {"mita_expert_count":{"datatype":"INT64","allowed":[1,4,9],"min":1,"max":9,"default":9},
//  "mita_expert_width":{"datatype":"INT64","min":1,"max":50,"default":16},
//  "mita_preset":{"datatype":"BYTES","allowed":["fast"],"budgets":{"fast":{"mita_expert_count":4,...}}},
//  "mita_attention":{"datatype":"BYTES","allowed":["mita","full"],"default":"mita"},
//  "mita_top_n":{"datatype":"INT64","min":0,"max":10,"default":5}, "mita_truncate":{...}}.
std::string KnobsJson(const v1::ModelMetadata& model);

// Replaces mita.v1 field names in an error message by the Open Inference Protocol names of the file comment
// ("field budget.preset" -> "parameter mita_preset", "field image" -> "input 'image'", ...).
std::string RenameFieldsInMessage(const std::string& message);

class KserveService final : public inference::GRPCInferenceService::Service {
 public:
  // Serves the models of `registry` through `classify`, which was built with `metrics` (all three must
  // outlive the service); a ModelInfer rejected by the translation, before it reaches `classify`, is counted
  // in `metrics` as a Classify call like the ones `classify` rejects. Not ready until SetReady(true).
  // The metadata declares the limits `classify` was built with (ClassifyService::options()); `server_version`
  // is the ServerMetadata version.
  KserveService(const ModelRegistry* registry, ClassifyService* classify, ServerMetrics* metrics,
                std::string server_version);

  // Readiness of the server and its models (ServerReady, ModelReady). Thread-safe.
  void SetReady(bool ready) { ready_.store(ready); }

  grpc::Status ServerLive(grpc::ServerContext* context, const inference::ServerLiveRequest* request,
                          inference::ServerLiveResponse* response) override;
  grpc::Status ServerReady(grpc::ServerContext* context, const inference::ServerReadyRequest* request,
                           inference::ServerReadyResponse* response) override;
  // Errors: INVALID_ARGUMENT for an empty name, NOT_FOUND for an unknown model or version.
  grpc::Status ModelReady(grpc::ServerContext* context, const inference::ModelReadyRequest* request,
                          inference::ModelReadyResponse* response) override;
  grpc::Status ServerMetadata(grpc::ServerContext* context, const inference::ServerMetadataRequest* request,
                              inference::ServerMetadataResponse* response) override;
  // Errors: as ModelReady.
  grpc::Status ModelMetadata(grpc::ServerContext* context, const inference::ModelMetadataRequest* request,
                             inference::ModelMetadataResponse* response) override;
  // Errors: see the file comment.
  grpc::Status ModelInfer(grpc::ServerContext* context, const inference::ModelInferRequest* request,
                          inference::ModelInferResponse* response) override;

 private:
  // The v1 metadata of model `name` at `version`. Errors: INVALID_ARGUMENT (empty name), NOT_FOUND.
  absl::StatusOr<const v1::ModelMetadata*> FindModel(const std::string& name, const std::string& version) const;

  const ModelRegistry* const registry_;
  ClassifyService* const classify_;
  ServerMetrics* const metrics_;
  const std::string server_version_;
  std::map<std::string, v1::ModelMetadata> models_;  // immutable after construction
  std::atomic<bool> ready_{false};
};

}  // namespace mita::server
