// mita-health-probe: asks a server's gRPC health service (grpc.health.v1.Health/Check) whether a service is
// SERVING; exit 0 when it is, 1 otherwise (NOT_SERVING, unknown service, no answer). For container
// HEALTHCHECKs (deploy/Dockerfile), where Kubernetes' own gRPC probe is not available. Links gRPC only.
//
// Usage: mita-health-probe [--address=127.0.0.1:50051] [--service=] [--timeout_ms=2000]
// (--service empty: the server as a whole; at most 200 bytes, exit 2 above.) The call is
// server/health_check_call.h (messages encoded by hand; SERVING = 1, grpc/health/v1/health.proto).
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "server/health_check_call.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "gRPC address of the server, host:port.");
ABSL_FLAG(std::string, service, "", "Service to check; empty: the server as a whole.");
ABSL_FLAG(int32_t, timeout_ms, 2000, "Deadline of the check, milliseconds.");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string service = absl::GetFlag(FLAGS_service);
  // gRPC's default health service (mita-server's) cannot parse a request whose service name is longer
  // (INVALID_ARGUMENT "could not parse request"); say why here instead.
  constexpr size_t kMaxServiceNameBytes = 200;
  if (service.size() > kMaxServiceNameBytes) {
    std::fprintf(stderr, "--service: %zu bytes; gRPC's health service accepts names of at most %zu bytes\n",
                 service.size(), kMaxServiceNameBytes);
    return 2;
  }
  std::string bytes;
  const grpc::Status status = mita::server::HealthCheckCall(
      grpc::CreateChannel(absl::GetFlag(FLAGS_address), grpc::InsecureChannelCredentials()), service,
      std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)), &bytes);
  if (!status.ok()) {
    std::fprintf(stderr, "health check failed: %d %s\n", static_cast<int>(status.error_code()),
                 status.error_message().c_str());
    return 1;
  }
  if (bytes == std::string("\x08\x01", 2)) {
    std::printf("SERVING\n");
    return 0;
  }
  std::printf("NOT SERVING\n");
  return 1;
}
