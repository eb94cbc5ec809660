// Transport security and authentication of the gRPC port.
//
//   * TLS: MakeServerCredentials builds gRPC SSL server credentials from PEM files (server certificate chain
//     and key; optionally a client CA, which makes the server require and verify client certificates, i.e.
//     mutual TLS). Without files the port is plaintext.
//   * Bearer token: BearerTokenAuthenticator checks the "authorization: Bearer <token>" metadata of a call
//     against a token read from a file (constant-time comparison). The mita.v1 handlers call it first; the
//     gRPC health service and reflection stay open so that load balancers and tools work without the token.
//     Send tokens only over TLS (in plaintext anyone on the path can read them). With a client policy
//     (server/policy/), a token the policy names by its SHA-256 is valid too (AuthenticateClient, unary_call.h).
// (Containment of the model repository is the registry's: server/engine/model_registry.h.)
#pragma once

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mita::server {

// PEM files of the gRPC port's TLS. All empty: plaintext.
struct TlsFiles {
  std::string cert_file;       // certificate chain of the server (PEM)
  std::string key_file;        // private key of the certificate (PEM)
  std::string client_ca_file;  // optional: CA certificates (PEM) that client certificates must chain to
};

// Plaintext credentials when `files` is all empty; else SSL server credentials with the certificate and key
// and, when client_ca_file is set, REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY against that CA.
// Errors: INVALID_ARGUMENT when only one of cert_file and key_file is set, or client_ca_file without them,
// or a file does not hold PEM data ("-----BEGIN"); NOT_FOUND when a file cannot be read. Messages name the
// flag (--tls_cert_file, --tls_key_file, --tls_client_ca_file).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsFiles& files);

// Checks the bearer token of calls. Thread-safe (immutable).
class BearerTokenAuthenticator {
 public:
  // Reads the token from `path`: the file's content without surrounding whitespace; it must be non-empty and
  // printable ASCII without spaces (it travels in an HTTP/2 header). Errors: NOT_FOUND when unreadable;
  // INVALID_ARGUMENT for an empty or malformed token (the message names the file, never the token).
  static absl::StatusOr<std::unique_ptr<BearerTokenAuthenticator>> FromFile(const std::string& path);
  // A token given directly (tests). Same rules as FromFile.
  static absl::StatusOr<std::unique_ptr<BearerTokenAuthenticator>> FromToken(const std::string& token);

  // OK when the call's metadata has "authorization: Bearer <token>" with this token (the scheme is
  // case-insensitive). Errors: UNAUTHENTICATED "missing ..." when there is no such metadata,
  // UNAUTHENTICATED "invalid bearer token" when the token differs (never echoed), UNAUTHENTICATED naming the
  // count when the call carries more than one "authorization" entry.
  absl::Status Check(const grpc::ServerContextBase& context) const;
  // The same check on the value of an "authorization" header; nullptr: absent.
  absl::Status CheckHeader(const std::string* authorization) const;
  // The token a call presents: the value of its one "authorization: Bearer <token>" metadata entry without the
  // scheme; nullopt when it has none, several, or another scheme.
  static std::optional<std::string> PresentedToken(const grpc::ServerContextBase& context);

 private:
  explicit BearerTokenAuthenticator(std::string token) : token_(std::move(token)) {}
  const std::string token_;
};

}  // namespace mita::server
