// How every front end serves a unary call on gRPC's callback API: the request arrives as the bytes the client
// sent (raw methods), so that a message that does not parse is the server's INVALID_ARGUMENT, answered and
// counted like any other call, and the size limit applies to those bytes; the call ends in FinishCall, the one
// place where a call's outcome is counted (mita_requests_total{method, model, code}, and the latency of a
// successful inference) and where its absl::Status becomes a grpc::Status.
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "google/protobuf/message.h"
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
// "unknown"; server-wide methods ignore it) with `status`'s code; a successful inference also observes
// `latency`. Then finishes `reactor` with `status` (already worded by the front end).
void FinishCall(grpc::ServerUnaryReactor* reactor, ServerMetrics& metrics, RpcMethod method,
                const std::string& model, const absl::Status& status, absl::Duration latency = absl::ZeroDuration());

// The call's bearer-token check: OK without an authenticator, else its verdict (UNAUTHENTICATED).
absl::Status Authenticate(const FrontEndOptions& options, const grpc::ServerContextBase& context);

// The call's deadline as absl::Time (absl::InfiniteFuture() for none).
absl::Time DeadlineOf(const grpc::ServerContextBase& context);

// Checks the size of the bytes the client sent against the receive limit, then parses them into `*request`.
// Errors: RESOURCE_EXHAUSTED over the limit (naming it and its flag); INVALID_ARGUMENT "the request could not be
// parsed as a <type> message (<n> bytes): ..." for bytes that are not that message's wire format (a truncated
// varint, a bad length, an unterminated group, invalid UTF-8 in a string field).
absl::Status ReceiveRequest(const FrontEndOptions& options, const grpc::ByteBuffer& wire,
                            google::protobuf::Message* request);

// Checks `response` against the send limit and serializes it into `*wire`. Errors: RESOURCE_EXHAUSTED over the
// limit; INTERNAL when serialization fails.
absl::Status SendResponse(const FrontEndOptions& options, const google::protobuf::Message& response,
                          grpc::ByteBuffer* wire);

// Serves a call answered at once: authenticates, receives `Request`, runs `handle(request, &response, &model)`
// (an absl::Status; `model` names the model the call is about, for the count), sends `Response`, and finishes
// through FinishCall with the status worded by `word`.
template <typename Request, typename Response, typename Handle, typename Word>
grpc::ServerUnaryReactor* AnswerAtOnce(grpc::CallbackServerContext* context, const grpc::ByteBuffer* wire_request,
                                       grpc::ByteBuffer* wire_response, ServerMetrics& metrics,
                                       const FrontEndOptions& options, RpcMethod method, Word word, Handle handle) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // An unauthenticated call is counted with model "unknown": its request is not trusted.
  if (absl::Status status = Authenticate(options, *context); !status.ok()) {
    FinishCall(reactor, metrics, method, "", status);
    return reactor;
  }
  Request request;
  Response response;
  std::string model;
  absl::Status status = ReceiveRequest(options, *wire_request, &request);
  if (status.ok()) status = handle(request, &response, &model);
  if (status.ok()) status = SendResponse(options, response, wire_response);
  FinishCall(reactor, metrics, method, model, word(status));
  return reactor;
}

}  // namespace mita::server
