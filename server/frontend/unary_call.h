// How every front end serves a unary call on gRPC's callback API: the request arrives as the bytes the client
// sent (raw methods, and gRPC's own per-message decompression is off: ConfigureTransport), so that a message that
// does not parse, does not arrive whole, or is compressed beyond the size limit is the server's own answer,
// counted like any other call; the call ends in UnaryCallReactor::FinishCall, the one place where a call's
// absl::Status becomes a grpc::Status, and is counted (mita_requests_total{method, model, code}, and the latency of
// a successful inference) once gRPC is done with it: an answer that never reached the client counts as CANCELLED.
#pragma once

#include <grpc/support/time.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "google/protobuf/message.h"
#include "server/engine/model_lifecycle.h"
#include "server/frontend/grpc_status.h"
#include "server/frontend/message_limits.h"
#include "server/frontend/security.h"
#include "server/metrics/metrics.h"
#include "server/policy/policy_holder.h"

namespace mita::server {

// What a front end needs besides the engine: authentication and message size limits.
struct FrontEndOptions {
  // When set (not owned, must outlive the service), every call of the front end's API must carry its bearer token
  // (UNAUTHENTICATED otherwise, counted with model "unknown").
  const BearerTokenAuthenticator* authenticator = nullptr;
  // When set, requests and responses over their limits get RESOURCE_EXHAUSTED naming the limit and its flag.
  std::shared_ptr<const MessageSizeGuard> message_size;
  // When set (not owned, must outlive the service), the repository API (loading and unloading models) acts on it;
  // else that API answers UNIMPLEMENTED.
  ModelLifecycle* lifecycle = nullptr;
  // When set (not owned, must outlive the service), the budget policy per client (mita-server
  // --client_policy_file): each inference call is attributed to a client (AuthenticateClient) whose rules and quota
  // the engine applies; a bearer token the policy names is a credential of the server as well.
  const policy::ClientPolicyHolder* client_policy = nullptr;
};

// The reactor of one unary call. FinishCall finishes the call; OnDone (gRPC is done with the call) counts it and
// deletes the reactor. Front ends derive from it (InferenceReactor) or use it as it is (AnswerAtOnce).
class UnaryCallReactor : public grpc::ServerUnaryReactor {
 public:
  // `context` and `metrics` must outlive the call (gRPC's context does; the metrics outlive the server).
  UnaryCallReactor(const grpc::CallbackServerContext* context, ServerMetrics* metrics, RpcMethod method)
      : context_(context), metrics_(metrics), method_(method) {}

  // Finishes the call with `status` (already worded by the front end) about the model named `model` (a name the
  // server does not host counts as "unknown"; server-wide methods ignore it). Call once. The call is counted in
  // OnDone: with status's code, except that an answer whose call was cancelled before it reached the client (the
  // client reset the stream or closed the connection, or the deadline passed while its flow-control window held
  // the answer back) counts as CANCELLED, since the client never got it (a DEADLINE_EXCEEDED stays one); a
  // successful inference that did reach its client observes `latency`.
  void FinishCall(const std::string& model, const absl::Status& status, absl::Duration latency = absl::ZeroDuration());

  // Counts the call (see FinishCall) and deletes this reactor.
  void OnDone() override;
  // The budget policy's client the call is from: OnDone counts it in mita_client_requests_total too.
  void set_client_metrics(ClientMetrics* client) { client_ = client; }

 protected:
  ~UnaryCallReactor() override = default;

  const grpc::CallbackServerContext& context() const { return *context_; }
  ServerMetrics& metrics() const { return *metrics_; }
  RpcMethod method() const { return method_; }

 private:
  const grpc::CallbackServerContext* const context_;
  ServerMetrics* const metrics_;
  const RpcMethod method_;
  // What FinishCall answered, counted in OnDone.
  std::string model_;
  absl::StatusCode code_ = absl::StatusCode::kUnknown;
  absl::Duration latency_;
  bool finished_ = false;
  ClientMetrics* client_ = nullptr;
};

// The call's bearer-token check: OK without an authenticator, else its verdict (UNAUTHENTICATED), except that with
// a client policy a token the policy names is valid too (AuthenticateClient's check).
absl::Status Authenticate(const FrontEndOptions& options, const grpc::ServerContextBase& context);
// Authenticates the call (Authenticate) and attributes it to a client of the budget policy: the client whose
// token_sha256 is the SHA-256 of the call's bearer token, else the client whose certificate_subject is the call's
// mTLS peer certificate subject (AuthContext "x509_subject"), else "default". With --auth_token_file, a call
// must present that token or a token the policy names (UNAUTHENTICATED otherwise); without it, tokens are not
// required and an unknown one is the default client. Returns null without a client policy. Never echoes a token.
absl::StatusOr<std::shared_ptr<const policy::ClientAdmission>> AuthenticateClient(
    const FrontEndOptions& options, const grpc::ServerContextBase& context);

// Creates the per-client series of every client name `policy` has held (ClientPolicyHolder::client_names) at 0,
// so that they are exported before their first call; call at start and after each reload.
void DeclareClientMetrics(const policy::ClientPolicyHolder& policy, ServerMetrics& metrics);
// The call's deadline as absl::Time: absl::InfiniteFuture() for none, and for a deadline beyond what
// std::chrono::system_clock represents (about the year 2262; DeadlineFromTimespec).
absl::Time DeadlineOf(const grpc::ServerContextBase& context);

// The absl::Time of a gRPC deadline in any of gRPC's clocks, without overflow: gRPC's infinite future, and any
// time past std::chrono::system_clock::time_point::max(), are absl::InfiniteFuture(). (A grpc-timeout of
// 2562047H or more, grpc-go's longest, is such a time; gRPC's own conversion to system_clock wraps it into the
// past.)
absl::Time DeadlineFromTimespec(gpr_timespec deadline);

// Sets the server's transport up for ReceiveRequest: gRPC's per-message decompression off
// (GRPC_ARG_ENABLE_PER_MESSAGE_DECOMPRESSION = 0), so that a compressed request reaches the handler as the client
// sent it and is inflated there, after authentication, at most to the receive limit. (gRPC 1.51 inflates a
// compressed message in full before any limit applies: a 1 MiB gzip body became a 1 GiB message; docs/hostile_input.md.)
// Every service on the server receives compressed messages as they were sent: the front ends through
// ReceiveRequest, grpc.health.v1 (server/frontend/health_service.h) likewise; gRPC's reflection service does not inflate.
void ConfigureTransport(grpc::ServerBuilder& builder);

// Receives a request: checks that a whole message arrived, inflates it when the client compressed it (gzip or
// deflate, the grpc-encoding of a message flagged compressed) at most to the receive limit, checks the size of the
// message against that limit, then parses it into `*request`. Errors: INVALID_ARGUMENT when no whole message arrived
// (the stream ended first: none was sent, or fewer bytes than its gRPC length prefix declared), CANCELLED when the
// client reset the stream before its message was whole; RESOURCE_EXHAUSTED over the limit (naming it and its flag;
// for a compressed message as soon as inflating passes the limit); INVALID_ARGUMENT for a message flagged compressed
// whose bytes are not data of its encoding ("... flagged gzip-compressed (grpc-encoding: gzip), but its 11 bytes are
// not gzip data: incorrect header check"), and "the request could not be parsed as a <type> message (<n> bytes):
// ..." for bytes that are not that message's wire format (a truncated varint, a bad length, an unterminated group,
// invalid UTF-8 in a string field).
absl::Status ReceiveRequest(const FrontEndOptions& options, const grpc::ServerContextBase& context,
                            const grpc::ByteBuffer& wire, google::protobuf::Message* request);

// Checks `response` against the send limit and serializes it into `*wire`. Errors: RESOURCE_EXHAUSTED over the
// limit; INTERNAL when serialization fails.
absl::Status SendResponse(const FrontEndOptions& options, const google::protobuf::Message& response,
                          grpc::ByteBuffer* wire);

// Serves a call answered later, from another thread: authenticates, receives `Request`, then runs
// `start(request, &model, finish)`, which must call `finish(absl::StatusOr<Response>)` exactly once, on any
// thread; `finish` sends the response and finishes the call through UnaryCallReactor::FinishCall with the status
// worded by `word`. For work that waits (loading a model): no gRPC thread is held meanwhile. `options` must outlive
// the call (a service's member does).
template <typename Request, typename Response, typename Start, typename Word>
grpc::ServerUnaryReactor* AnswerLater(grpc::CallbackServerContext* context, const grpc::ByteBuffer* wire_request,
                                      grpc::ByteBuffer* wire_response, ServerMetrics& metrics,
                                      const FrontEndOptions& options, RpcMethod method, Word word, Start start) {
  auto* reactor = new UnaryCallReactor(context, &metrics, method);
  // An unauthenticated call is counted with model "unknown": its request is not trusted (nor read: it is not
  // inflated or parsed).
  if (absl::Status status = Authenticate(options, *context); !status.ok()) {
    reactor->FinishCall("", status);
    return reactor;
  }
  Request request;
  if (absl::Status status = ReceiveRequest(options, *context, *wire_request, &request); !status.ok()) {
    reactor->FinishCall("", word(status));
    return reactor;
  }
  auto model = std::make_shared<std::string>();
  start(request, model.get(),
        [reactor, model, wire_response, &options, word](absl::StatusOr<Response> response) {
          absl::Status status = response.status();
          if (status.ok()) status = SendResponse(options, *response, wire_response);
          reactor->FinishCall(*model, word(status));
        });
  return reactor;
}

// Serves a call answered at once: authenticates, receives `Request`, runs `handle(request, &response, &model)`
// (an absl::Status; `model` names the model the call is about, for the count), sends `Response`, and finishes
// through UnaryCallReactor::FinishCall with the status worded by `word` (AnswerLater, finishing at once).
template <typename Request, typename Response, typename Handle, typename Word>
grpc::ServerUnaryReactor* AnswerAtOnce(grpc::CallbackServerContext* context, const grpc::ByteBuffer* wire_request,
                                       grpc::ByteBuffer* wire_response, ServerMetrics& metrics,
                                       const FrontEndOptions& options, RpcMethod method, Word word, Handle handle) {
  return AnswerLater<Request, Response>(
      context, wire_request, wire_response, metrics, options, method, word,
      [&handle](const Request& request, std::string* model, auto finish) {
        Response response;
        const absl::Status status = handle(request, &response, model);
        if (status.ok()) {
          finish(std::move(response));
        } else {
          finish(status);
        }
      });
}

}  // namespace mita::server
