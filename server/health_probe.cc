// mita-health-probe: asks a server's gRPC health service (grpc.health.v1.Health/Check) whether a service is
// SERVING; exit 0 when it is, 1 otherwise (NOT_SERVING, unknown service, no answer). For container
// HEALTHCHECKs (deploy/Dockerfile), where Kubernetes' own gRPC probe is not available. Links gRPC only.
//
// Usage: mita-health-probe [--address=127.0.0.1:50051] [--service=] [--timeout_ms=2000]
// (--service empty: the server as a whole.) The request and response are encoded by hand: the Health
// messages are HealthCheckRequest {string service = 1} and HealthCheckResponse {ServingStatus status = 1},
// SERVING = 1 (grpc/health/v1/health.proto).
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/synchronization/notification.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "gRPC address of the server, host:port.");
ABSL_FLAG(std::string, service, "", "Service to check; empty: the server as a whole.");
ABSL_FLAG(int32_t, timeout_ms, 2000, "Deadline of the check, milliseconds.");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string service = absl::GetFlag(FLAGS_service);
  if (service.size() > 127) {
    std::fprintf(stderr, "--service: longer than 127 bytes\n");
    return 2;
  }
  std::string request_bytes;
  if (!service.empty()) {
    request_bytes.push_back(0x0a);  // field 1, length-delimited
    request_bytes.push_back(static_cast<char>(service.size()));
    request_bytes += service;
  }
  grpc::GenericStub stub(grpc::CreateChannel(absl::GetFlag(FLAGS_address), grpc::InsecureChannelCredentials()));
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) {
    std::fprintf(stderr, "health check failed: %d %s\n", static_cast<int>(status.error_code()),
                 status.error_message().c_str());
    return 1;
  }
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  if (bytes == std::string("\x08\x01", 2)) {
    std::printf("SERVING\n");
    return 0;
  }
  std::printf("NOT SERVING\n");
  return 1;
}
