// The reactor of a front end's inference call on gRPC's callback API: it submits the neutral request to the
// InferenceEngine, gives the request up when gRPC cancels the call (OnCancel: the client cancelled or the
// deadline passed), and is counted and deleted when gRPC is done with it (UnaryCallReactor). A front end derives
// from it and turns the engine's answer into its own response in Answer, which ends by finishing the call
// (FinishCall).
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/message.h"
#include "server/engine/inference_engine.h"
#include "server/engine/inference_request.h"
#include "server/frontend/unary_call.h"

namespace mita::server {

class InferenceReactor : public UnaryCallReactor {
 public:
  InferenceReactor(const grpc::CallbackServerContext* context, ServerMetrics* metrics, RpcMethod method)
      : UnaryCallReactor(context, metrics, method) {}

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    if (call_ != nullptr) call_->Cancel();
  }

 protected:
  ~InferenceReactor() override = default;

  // Authenticates the call and finds its client of the budget policy (AuthenticateClient), then receives the bytes
  // the client sent into `*request` (ReceiveRequest: a whole message, inflated within the size limit, parsed).
  // Returns false when the call is already answered: an unauthenticated one finished at once and counted with model
  // "unknown" (its request is not trusted, nor inflated or parsed), one whose bytes are refused through Answer.
  bool Receive(const FrontEndOptions& options, const grpc::ByteBuffer& wire_request,
               google::protobuf::Message* request) {
    absl::StatusOr<std::shared_ptr<const policy::ClientAdmission>> client = AuthenticateClient(options, context());
    if (!client.ok()) {
      FinishCall("", client.status());
      return false;
    }
    client_ = *std::move(client);
    if (client_ != nullptr) set_client_metrics(metrics().ForClient(client_->name));
    if (absl::Status received = ReceiveRequest(options, context(), wire_request, request); !received.ok()) {
      Answer(received);
      return false;
    }
    return true;
  }

  // Submits `request` (as from the client Receive identified; to `model` when the front end resolved it:
  // InferenceEngine::Submit); the engine calls Answer exactly once, on this thread or another.
  void Submit(InferenceEngine& engine, InferenceRequest request, ModelHandle model = nullptr) {
    request.client = client_;
    std::unique_ptr<InferenceCall> call = engine.Submit(
        std::move(request), [this](absl::StatusOr<InferenceResult> result) { Answer(std::move(result)); },
        std::move(model));
    absl::MutexLock lock(&mu_);
    call_ = std::move(call);
  }

  // The engine's answer: build the response and finish the call.
  virtual void Answer(absl::StatusOr<InferenceResult> result) = 0;

 private:
  absl::Mutex mu_;
  std::unique_ptr<InferenceCall> call_ ABSL_GUARDED_BY(mu_);
  // The budget policy's client of the call (null without a policy).
  std::shared_ptr<const policy::ClientAdmission> client_;
};

}  // namespace mita::server
