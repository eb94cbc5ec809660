#include "server/process/health_check_call.h"

#include <grpcpp/client_context.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"

namespace mita::server {

grpc::Status HealthCheckCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                             std::chrono::milliseconds timeout, std::string* response_bytes) {
  std::string request_bytes;
  if (!service.empty()) {
    request_bytes.push_back(0x0a);  // field 1, length-delimited
    // The length as a base-128 varint: 7 bits a byte, low bits first, the high bit set on all but the last
    // (protobuf encoding guide, "Base 128 Varints").
    for (uint64_t length = service.size(); ; length >>= 7) {
      if (length < 0x80) {
        request_bytes.push_back(static_cast<char>(length));
        break;
      }
      request_bytes.push_back(static_cast<char>((length & 0x7f) | 0x80));
    }
    request_bytes += service;
  }
  grpc::GenericStub stub(channel);
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status call_status) {
                   status = std::move(call_status);
                   done.Notify();
                 });
  done.WaitForNotification();
  response_bytes->clear();
  if (status.ok()) {
    std::vector<grpc::Slice> slices;
    if (response.Dump(&slices).ok()) {
      for (const grpc::Slice& part : slices) response_bytes->append(reinterpret_cast<const char*>(part.begin()), part.size());
    }
  }
  return status;
}

}  // namespace mita::server
