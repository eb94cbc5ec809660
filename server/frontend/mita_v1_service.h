// The mita.v1 front end (proto/mita/v1/mita.proto): MitaService's Classify, ListModels, GetModel and the
// repository API (ListRepository, LoadModel, UnloadModel) on gRPC's callback API. It translates a ClassifyRequest into the neutral InferenceRequest, submits it to the
// InferenceEngine, and words the answer and its errors in mita.v1's terms (its field names, e.g.
// "field budget.experts.expert_width: 51 is out of range: allowed [1, 50]"). A call waiting for its batch holds
// no thread; a cancelled call is given up through the reactor's OnCancel. Requests arrive as the bytes the
// client sent, so a message that does not parse is answered INVALID_ARGUMENT and counted.
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mita/v1/mita.grpc.pb.h"
#include "mita/v1/mita.pb.h"
#include "models/classifier.h"
#include "models/request_error.h"
#include "server/engine/inference_engine.h"
#include "server/engine/inference_request.h"
#include "server/frontend/inference_reactor.h"
#include "server/frontend/unary_call.h"
#include "server/metrics/metrics.h"

namespace mita::server {

// The neutral request of a ClassifyRequest. It views `request`, which must outlive it. Errors: INVALID_ARGUMENT
// for a budget choice this version does not know.
absl::StatusOr<InferenceRequest> ToInferenceRequest(const v1::ClassifyRequest& request);

// The ClassifyResponse of a result: the classes with their labels, the applied budget, timing, token counts and
// the statistics the result holds.
v1::ClassifyResponse ToClassifyResponse(const InferenceResult& result);

// The metadata GetModel returns: input kind with its limits (documents: max_tokens is the smaller of the model's
// and limits.max_tokens; images: max_encoded_bytes from limits), labels, knobs, and the model's shape.
// `cost` (optional): the model's cost figures (knobs.accuracy_order[].predicted_ms, cost_profile).
v1::ModelMetadata ToModelMetadata(const models::ClassifierDescription& model, const models::InputLimits& limits,
                                  const CostSummary* cost = nullptr);

// The mita.v1 name of a request part, e.g. "budget.experts.expert_width", "document.token_ids.ids[7]".
std::string MitaV1FieldName(const models::FieldProblem& problem);

// `status` in mita.v1's words: each field problem as "field <name>: <detail>", joined by "; "; other statuses
// unchanged.
absl::Status WordForMitaV1(const absl::Status& status);

// mita.v1's methods on the callback API, receiving the bytes the client sent (server/frontend/unary_call.h).
using MitaV1RawService = v1::MitaService::WithRawCallbackMethod_Classify<
    v1::MitaService::WithRawCallbackMethod_ListModels<v1::MitaService::WithRawCallbackMethod_GetModel<
        v1::MitaService::WithRawCallbackMethod_ListRepository<v1::MitaService::WithRawCallbackMethod_LoadModel<
            v1::MitaService::WithRawCallbackMethod_UnloadModel<v1::MitaService::Service>>>>>>;

class MitaV1Service final : public MitaV1RawService {
 public:
  // `engine` and `metrics` must outlive the service.
  MitaV1Service(InferenceEngine* engine, ServerMetrics* metrics, FrontEndOptions options);

  // Each receives its serialized request message and answers with its serialized response message: a
  // ClassifyRequest -> ClassifyResponse, ListModelsRequest -> ListModelsResponse, GetModelRequest ->
  // ModelMetadata. A request that does not parse is INVALID_ARGUMENT, counted like any other answer.
  grpc::ServerUnaryReactor* Classify(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  // The repository API on FrontEndOptions::lifecycle (server/engine/model_lifecycle.h; UNIMPLEMENTED without one):
  // the index, a load or reload (answered when done, with the model's entries), an unload (answered when the
  // model's requests are).
  grpc::ServerUnaryReactor* ListRepository(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* LoadModel(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UnloadModel(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;

 private:
  class ClassifyReactor;

  // A served model version's metadata: ToModelMetadata with its cost figures, its version and every served one.
  v1::ModelMetadata Describe(const ServedModel& model) const;

  InferenceEngine* const engine_;
  ServerMetrics* const metrics_;
  const FrontEndOptions options_;
};

}  // namespace mita::server
