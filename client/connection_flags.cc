#include "client/connection_flags.h"

#include <grpcpp/support/validate_service_config.h>

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, server, "localhost:50051",
          "Server address: host:port; replicas as a comma list of IP addresses with ports (a.b.c.d:P,a.b.c.e:P); or a "
          "gRPC target such as dns:///mita-serve.NAMESPACE.svc.cluster.local:50051.");
ABSL_FLAG(std::string, load_balancing, "",
          "gRPC load-balancing policy over the addresses --server resolves to: round_robin (each call to the next "
          "replica) or pick_first; empty: gRPC's default, pick_first.");
ABSL_FLAG(bool, client_health_check, false,
          "Watch each replica's grpc.health.v1 status and pick only SERVING ones (a draining replica is left at "
          "once); needs --load_balancing=round_robin.");
ABSL_FLAG(int32_t, max_attempts, 1,
          "Attempts per call, [1, 5]: a call answered UNAVAILABLE is retried on the next replica up to this many "
          "attempts in all (gRPC retry policy; every mita.v1 and Open Inference Protocol method is idempotent); 1: "
          "no retries.");
ABSL_FLAG(std::string, service_config, "",
          "gRPC service config JSON of the channel, instead of --load_balancing, --client_health_check and "
          "--max_attempts.");
ABSL_FLAG(bool, tls, false,
          "Connect over TLS (implied by the other --tls_* flags); server checked against the "
          "system roots unless --tls_ca_file is set.");
ABSL_FLAG(std::string, tls_ca_file, "", "PEM CA certificates the server certificate must chain to.");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate chain, for servers that require one.");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name to check the server certificate against instead of the --server host (e.g. localhost).");
ABSL_FLAG(std::string, auth_token_file, "", "File holding the bearer token to send ('authorization: Bearer ...').");

namespace mita::client {

absl::StatusOr<ConnectionOptions> ConnectionOptionsFromFlags() {
  ConnectionOptions options;
  options.target = absl::GetFlag(FLAGS_server);
  if (absl::Status status = ResolveTarget(options.target).status(); !status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--server: ", status.message()));
  }
  const std::string load_balancing = absl::GetFlag(FLAGS_load_balancing);
  const bool health_check = absl::GetFlag(FLAGS_client_health_check);
  const int32_t max_attempts = absl::GetFlag(FLAGS_max_attempts);
  options.service_config_json = absl::GetFlag(FLAGS_service_config);
  const bool policy_flags = !load_balancing.empty() || health_check || max_attempts != 1;
  if (!options.service_config_json.empty()) {
    if (policy_flags) {
      return absl::InvalidArgumentError(
          "--service_config: set it alone, or --load_balancing, --client_health_check and --max_attempts instead");
    }
    const std::string error = grpc::experimental::ValidateServiceConfigJSON(options.service_config_json);
    if (!error.empty()) return absl::InvalidArgumentError(absl::StrCat("--service_config: not valid: ", error));
  } else if (policy_flags) {
    ReplicaPolicy policy;
    policy.load_balancing = load_balancing.empty() ? "pick_first" : load_balancing;
    policy.health_check = health_check;
    policy.max_attempts = max_attempts;
    if (load_balancing != "" && load_balancing != "round_robin" && load_balancing != "pick_first") {
      return absl::InvalidArgumentError(
          absl::StrCat("--load_balancing: '", load_balancing, "' is not round_robin or pick_first"));
    }
    if (health_check && policy.load_balancing != "round_robin") {
      return absl::InvalidArgumentError("--client_health_check needs --load_balancing=round_robin");
    }
    if (max_attempts < 1 || max_attempts > 5) {
      return absl::InvalidArgumentError(
          absl::StrCat("--max_attempts: ", max_attempts, " is out of range: allowed [1, 5]"));
    }
    absl::StatusOr<std::string> json = ServiceConfigJson(policy);
    if (!json.ok()) return json.status();
    options.service_config_json = *std::move(json);
  }
  options.tls = absl::GetFlag(FLAGS_tls);
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file); !path.empty()) {
    absl::StatusOr<std::string> token = ReadBearerToken(path);
    if (!token.ok()) return token.status();
    options.bearer_token = *std::move(token);
  }
  return options;
}

}  // namespace mita::client
