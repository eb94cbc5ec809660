// How every front end finishes a unary call (gRPC's callback API): the one place where a call's outcome is
// counted (mita_requests_total{method, model, code}, and the latency of a successful Classify) and where its
// absl::Status becomes a grpc::Status.
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/grpc_status.h"
#include "server/message_limits.h"
#include "server/metrics.h"
#include "server/security.h"

namespace mita::server {

// What a front end needs besides the engine: authentication and message size limits.
struct FrontEndOptions {
  // When set (not owned, must outlive the service), every call of the front end's API must carry its bearer token
  // (UNAUTHENTICATED otherwise, counted with model "unknown").
  const BearerTokenAuthenticator* authenticator = nullptr;
  // When set, requests and responses over their limits get RESOURCE_EXHAUSTED naming the limit and its flag.
  std::shared_ptr<const MessageSizeGuard> message_size;
};

// Counts one finished call of `method` for the model named `model` (a name the server does not host counts as
// "unknown") with `status`'s code; a successful Classify also observes `latency`. Then finishes `reactor` with
// `status` (already worded by the front end).
inline void FinishCall(grpc::ServerUnaryReactor* reactor, ServerMetrics& metrics, RpcMethod method,
                       const std::string& model, const absl::Status& status,
                       absl::Duration latency = absl::ZeroDuration()) {
  ModelMetrics* model_metrics = metrics.ForModel(model);
  metrics.CountRequest(method, model_metrics, status.code());
  if (status.ok() && method == RpcMethod::kClassify && model_metrics != nullptr) model_metrics->ObserveLatency(latency);
  reactor->Finish(ToGrpcStatus(status));
}

// The call's bearer-token check: OK without an authenticator, else its verdict (UNAUTHENTICATED).
inline absl::Status Authenticate(const FrontEndOptions& options, const grpc::ServerContextBase& context) {
  return options.authenticator == nullptr ? absl::OkStatus() : options.authenticator->Check(context);
}

// The call's deadline as absl::Time (absl::InfiniteFuture() for none).
inline absl::Time DeadlineOf(const grpc::ServerContextBase& context) {
  const std::chrono::system_clock::time_point deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

}  // namespace mita::server
