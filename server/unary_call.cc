// Unary calls of the front ends (see unary_call.h).
#include "server/unary_call.h"

#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/proto_buffer_writer.h>

#include "absl/strings/str_cat.h"

namespace mita::server {

void FinishCall(grpc::ServerUnaryReactor* reactor, ServerMetrics& metrics, RpcMethod method,
                const std::string& model, const absl::Status& status, absl::Duration latency) {
  ModelMetrics* model_metrics = metrics.ForModel(model);
  metrics.CountRequest(method, model_metrics, status.code());
  if (status.ok() && IsInferenceMethod(method) && model_metrics != nullptr) model_metrics->ObserveLatency(latency);
  reactor->Finish(ToGrpcStatus(status));
}

absl::Status Authenticate(const FrontEndOptions& options, const grpc::ServerContextBase& context) {
  return options.authenticator == nullptr ? absl::OkStatus() : options.authenticator->Check(context);
}

absl::Time DeadlineOf(const grpc::ServerContextBase& context) {
  const std::chrono::system_clock::time_point deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

absl::Status ReceiveRequest(const FrontEndOptions& options, const grpc::ByteBuffer& wire,
                            google::protobuf::Message* request) {
  const int64_t bytes = static_cast<int64_t>(wire.Length());
  if (options.message_size != nullptr) {
    if (absl::Status size = options.message_size->CheckRequestBytes(bytes); !size.ok()) return size;
  }
  grpc::ByteBuffer copy(wire);  // shares the slices; the reader consumes its own handle
  grpc::ProtoBufferReader reader(&copy);
  if (!request->ParseFromZeroCopyStream(&reader)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request could not be parsed as a ", request->GetDescriptor()->full_name(), " message (", bytes,
        " bytes): it is not that message's protobuf wire format (e.g. a truncated varint, a bad length, an "
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
