// Unary calls of the front ends (see unary_call.h).
#include "server/frontend/unary_call.h"

#include <grpc/grpc.h>
#include <grpc/grpc_security_constants.h>
#include <grpc/support/time.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/security/auth_context.h>
#include <grpcpp/support/proto_buffer_writer.h>

#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "google/protobuf/io/zero_copy_stream_impl.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/policy/budget_rules.h"

namespace grpc::internal {

// The compression of a received message is in gRPC's C buffer (grpc_byte_buffer.data.raw.compression), which
// grpc::ByteBuffer keeps private; this class, declared in grpcpp/support/byte_buffer.h as a friend of ByteBuffer
// and defined nowhere in gRPC's libraries, reads it. Only here.
class GrpcByteBufferPeer {
 public:
  explicit GrpcByteBufferPeer(const ByteBuffer* buffer) : buffer_(buffer) {}
  grpc_compression_algorithm compression() const {
    grpc_byte_buffer* c = const_cast<ByteBuffer*>(buffer_)->c_buffer();
    return c != nullptr && c->type == GRPC_BB_RAW ? c->data.raw.compression : GRPC_COMPRESS_NONE;
  }

 private:
  const ByteBuffer* const buffer_;
};

}  // namespace grpc::internal

namespace mita::server {

void UnaryCallReactor::FinishCall(const std::string& model, const absl::Status& status, absl::Duration latency) {
  model_ = model;
  code_ = status.code();
  latency_ = latency;
  finished_ = true;
  metrics_->CallFinished();
  Finish(ToGrpcStatus(status));
}

void UnaryCallReactor::OnDone() {
  // IsCancelled() is final here: true when the call ended without its status reaching the client (the client
  // reset the stream or closed the connection first, or the deadline passed while the answer waited for the
  // client's flow-control window). Such an answer counts as CANCELLED, whatever it would have said, except a
  // DEADLINE_EXCEEDED: the deadline is why it did not arrive.
  absl::StatusCode code = finished_ ? code_ : absl::StatusCode::kCancelled;
  if (code != absl::StatusCode::kDeadlineExceeded && context_->IsCancelled()) code = absl::StatusCode::kCancelled;
  ModelMetrics* model_metrics = metrics_->ForModel(model_);
  metrics_->CountRequest(method_, model_metrics, code);
  if (code == absl::StatusCode::kOk && IsInferenceMethod(method_) && model_metrics != nullptr) {
    model_metrics->ObserveLatency(latency_);
  }
  // gRPC's retry policy marks each attempt after the first (gRPC A6: grpc-previous-rpc-attempts).
  const auto& client_metadata = context_->client_metadata();
  if (const auto attempts = client_metadata.find("grpc-previous-rpc-attempts");
      attempts != client_metadata.end() && attempts->second != "0") {
    metrics_->CountRetriedCall();
  }
  if (client_ != nullptr) client_->CountRequest(code);
  if (finished_) metrics_->CallCounted();
  delete this;
}

absl::Status Authenticate(const FrontEndOptions& options, const grpc::ServerContextBase& context) {
  return AuthenticateClient(options, context).status();
}

absl::StatusOr<std::shared_ptr<const policy::ClientAdmission>> AuthenticateClient(
    const FrontEndOptions& options, const grpc::ServerContextBase& context) {
  std::optional<std::string> token;
  if (options.client_policy != nullptr) token = BearerTokenAuthenticator::PresentedToken(context);
  if (options.authenticator != nullptr) {
    absl::Status checked = options.authenticator->Check(context);
    // A token the policy names is a credential of its own.
    if (!checked.ok() && !(token.has_value() && options.client_policy->IsPolicyToken(*token))) return checked;
  }
  if (options.client_policy == nullptr) return nullptr;
  std::optional<std::string> subject;
  if (const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context(); auth != nullptr) {
    const std::vector<grpc::string_ref> subjects = auth->FindPropertyValues(GRPC_X509_SUBJECT_PROPERTY_NAME);
    if (subjects.size() == 1) subject = std::string(subjects.front().data(), subjects.front().size());
  }
  return options.client_policy->Identify(token.has_value() ? &*token : nullptr,
                                         subject.has_value() ? &*subject : nullptr);
}

void DeclareClientMetrics(const policy::ClientPolicyHolder& policy, ServerMetrics& metrics) {
  for (const std::string& name : policy.client_names()) {
    ClientMetrics* client = metrics.ForClient(name);
    for (int rule = 0; rule < policy::kNumPolicyRules; ++rule) {
      client->DeclarePolicyRule(policy::PolicyRuleName(static_cast<policy::PolicyRule>(rule)));
    }
  }
}

absl::Time DeadlineFromTimespec(gpr_timespec deadline) {
  if (gpr_time_cmp(deadline, gpr_inf_future(deadline.clock_type)) == 0) return absl::InfiniteFuture();
  const gpr_timespec real = gpr_convert_clock_type(deadline, GPR_CLOCK_REALTIME);
  const absl::Time time = absl::FromUnixSeconds(real.tv_sec) + absl::Nanoseconds(real.tv_nsec);
  // The latest time std::chrono::system_clock (int64 nanoseconds since 1970) represents; a later deadline is none.
  static const absl::Time kLatest = absl::FromChrono(std::chrono::system_clock::time_point::max());
  return time >= kLatest ? absl::InfiniteFuture() : time;
}

absl::Time DeadlineOf(const grpc::ServerContextBase& context) { return DeadlineFromTimespec(context.raw_deadline()); }

void ConfigureTransport(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_ENABLE_PER_MESSAGE_DECOMPRESSION, 0);
}

namespace {

// The static guard of a front end without size limits: gRPC's default limit, uncounted.
const MessageSizeGuard& DefaultGuard() {
  static const MessageSizeGuard* const guard = new MessageSizeGuard(MessageSizeLimits{}, nullptr);
  return *guard;
}

const char* EncodingName(grpc_compression_algorithm algorithm) {
  switch (algorithm) {
    case GRPC_COMPRESS_GZIP:
      return "gzip";
    case GRPC_COMPRESS_DEFLATE:
      return "deflate";
    default:
      return "an unknown encoding";
  }
}

}  // namespace

absl::Status ReceiveRequest(const FrontEndOptions& options, const grpc::ServerContextBase& context,
                            const grpc::ByteBuffer& wire, google::protobuf::Message* request) {
  if (!wire.Valid()) {
    // gRPC hands a unary handler no message when the stream ended, or was reset, before a whole one arrived (a
    // connection closed mid-message looks like an end here; the call is counted CANCELLED once gRPC is done).
    if (context.IsCancelled()) {
      return absl::CancelledError("the client reset the stream before its request message was complete");
    }
    return absl::InvalidArgumentError(
        "no complete request message arrived: the stream ended before one did (none was sent, or fewer bytes than "
        "its 5-byte gRPC prefix declares)");
  }
  const MessageSizeGuard& guard = options.message_size != nullptr ? *options.message_size : DefaultGuard();
  const int64_t wire_bytes = static_cast<int64_t>(wire.Length());
  const grpc_compression_algorithm compression = grpc::internal::GrpcByteBufferPeer(&wire).compression();
  if (absl::Status size = guard.CheckRequestBytes(wire_bytes); !size.ok()) return size;
  // gRPC itself treats an empty message flagged compressed as uncompressed; so does the server.
  const bool compressed = compression != GRPC_COMPRESS_NONE && wire_bytes > 0;
  int64_t bytes = wire_bytes;
  bool parsed = false;
  if (compressed) {
    std::vector<grpc::Slice> slices;
    if (!wire.Dump(&slices).ok()) return absl::InvalidArgumentError("the request message could not be read");
    std::vector<absl::string_view> pieces;
    for (const grpc::Slice& slice : slices) {
      pieces.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    std::vector<std::string> inflated;
    RETURN_IF_ERROR(guard.InflateRequest(EncodingName(compression), pieces, &inflated));
    bytes = 0;
    std::deque<google::protobuf::io::ArrayInputStream> arrays;  // stays in place as it grows
    std::vector<google::protobuf::io::ZeroCopyInputStream*> streams;
    for (const std::string& piece : inflated) {
      bytes += static_cast<int64_t>(piece.size());
      arrays.emplace_back(piece.data(), static_cast<int>(piece.size()));
      streams.push_back(&arrays.back());
    }
    google::protobuf::io::ConcatenatingInputStream stream(streams.data(), static_cast<int>(streams.size()));
    parsed = request->ParseFromZeroCopyStream(&stream);
  } else {
    grpc::ByteBuffer copy(wire);  // shares the slices; the reader consumes its own handle
    grpc::ProtoBufferReader reader(&copy);
    parsed = request->ParseFromZeroCopyStream(&reader);
  }
  if (!parsed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request could not be parsed as a ", request->GetDescriptor()->full_name(), " message (", bytes,
        " bytes", compressed ? absl::StrCat(", inflated from ", EncodingName(compression)) : "",
        "): it is not that message's protobuf wire format (e.g. a truncated varint, a bad length, an "
        "unterminated group, or invalid UTF-8 in a string field)"));
  }
  return absl::OkStatus();
}

absl::Status SendResponse(const FrontEndOptions& options, const google::protobuf::Message& response,
                          grpc::ByteBuffer* wire) {
  if (options.message_size != nullptr) {
    if (absl::Status size = options.message_size->CheckResponse(response); !size.ok()) return size;
  }
  bool own_buffer = false;
  const grpc::Status serialized =
      grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::Message>(response, wire, &own_buffer);
  if (!serialized.ok()) {
    return absl::InternalError(absl::StrCat("cannot serialize the response: ", serialized.error_message()));
  }
  return absl::OkStatus();
}

}  // namespace mita::server
