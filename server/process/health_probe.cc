// mita-health-probe: asks a server's gRPC health service (grpc.health.v1.Health/Check) whether a service is
// SERVING; exit 0 when it is, 1 otherwise (NOT_SERVING, unknown service, no answer; also, from Abseil's flag
// parser, an unknown or malformed flag), 2 for a stray argument or a timeout under 1 ms. For container
// HEALTHCHECKs (deploy/Dockerfile), where Kubernetes' own gRPC probe is not available. Links gRPC only.
//
// Usage: mita-health-probe [--address=127.0.0.1:50051] [--service=] [--timeout_ms=2000]
// (--service empty: the server as a whole; any length: mita-server's health service looks up any name.) The call is
// server/process/health_check_call.h (messages encoded by hand; SERVING = 1, grpc/health/v1/health.proto).
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "server/process/health_check_call.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "gRPC address of the server, host:port.");
ABSL_FLAG(std::string, service, "", "Service to check; empty: the server as a whole.");
ABSL_FLAG(int32_t, timeout_ms, 2000, "Deadline of the check, milliseconds.");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Asks a gRPC server's health service whether it (or --service) is SERVING; exit 0 if so, 1 if not (or an "
      "unknown flag), 2 for a bad argument.\n"
      "  mita-health-probe [--address=HOST:PORT] [--service=NAME] [--timeout_ms=N]");
  // --help lists the flags of this file (Abseil would look for a file named after the binary).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "/server/process/health_probe.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  // Abseil's parser itself exits 1 for an unknown or malformed flag.
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::fprintf(stderr, "mita-health-probe: unexpected argument '%s' (flags only: --address, --service, "
                 "--timeout_ms)\n", positional[1]);
    return 2;
  }
  if (absl::GetFlag(FLAGS_timeout_ms) <= 0) {
    std::fprintf(stderr, "mita-health-probe: --timeout_ms must be at least 1 (got %d)\n",
                 absl::GetFlag(FLAGS_timeout_ms));
    return 2;
  }
  const std::string service = absl::GetFlag(FLAGS_service);
  std::string bytes;
  const grpc::Status status = mita::server::HealthCheckCall(
      grpc::CreateChannel(absl::GetFlag(FLAGS_address), grpc::InsecureChannelCredentials()), service,
      std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)), &bytes);
  if (!status.ok()) {
    // gRPC and Abseil share the google.rpc.Code numbering.
    std::fprintf(stderr, "health check failed: %s: %s\n",
                 absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())).c_str(),
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
