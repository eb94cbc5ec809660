#include "client/connection_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, server, "localhost:50051", "Server address, host:port.");
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
