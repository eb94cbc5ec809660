// Command-line flags shared by mita-client and mita-bench for reaching a server: --server, --tls,
// --tls_ca_file, --tls_cert_file, --tls_key_file, --tls_server_name, --auth_token_file, and how calls spread over
// replicas: --load_balancing, --client_health_check, --max_attempts, --service_config.
#pragma once

#include "absl/status/statusor.h"
#include "client/mita_client.h"

namespace mita::client {

// The ConnectionOptions the flags describe (reads the token file). Errors: INVALID_ARGUMENT naming the flag for a
// bad server list, policy or service config; those of ReadBearerToken.
absl::StatusOr<ConnectionOptions> ConnectionOptionsFromFlags();

}  // namespace mita::client
