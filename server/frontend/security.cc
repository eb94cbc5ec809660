#include "server/frontend/security.h"

#include <grpcpp/security/server_credentials.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace mita::server {
namespace {

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const std::string& flag) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot read '", path, "' (", flag, ")"));
  std::ostringstream bytes;
  bytes << file.rdbuf();
  if (file.bad()) return absl::NotFoundError(absl::StrCat("cannot read '", path, "' (", flag, ")"));
  return bytes.str();
}

absl::StatusOr<std::string> ReadPem(const std::string& path, const std::string& flag) {
  absl::StatusOr<std::string> text = ReadWholeFile(path, flag);
  if (!text.ok()) return text.status();
  if (!absl::StrContains(*text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' holds no PEM data (", flag, ")"));
  }
  return text;
}

absl::Status ValidateToken(const std::string& token, const std::string& origin) {
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("the bearer token ", origin, " is empty"));
  for (char c : token) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(absl::StrCat(
          "the bearer token ", origin, " must be printable ASCII without spaces (it is sent as an HTTP/2 header)"));
    }
  }
  return absl::OkStatus();
}

// Compares without an early exit, so that the time taken does not tell how many leading bytes matched.
bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char difference = a.size() == b.size() ? 0 : 1;
  const std::string& longer = a.size() >= b.size() ? a : b;
  for (size_t i = 0; i < longer.size(); ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    difference |= static_cast<unsigned char>(x ^ y);
  }
  return difference == 0;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsFiles& files) {
  if (files.cert_file.empty() && files.key_file.empty()) {
    if (!files.client_ca_file.empty()) {
      return absl::InvalidArgumentError("--tls_client_ca_file needs --tls_cert_file and --tls_key_file");
    }
    return grpc::InsecureServerCredentials();
  }
  if (files.cert_file.empty() || files.key_file.empty()) {
    return absl::InvalidArgumentError("set both --tls_cert_file and --tls_key_file, or neither");
  }
  absl::StatusOr<std::string> cert = ReadPem(files.cert_file, "--tls_cert_file");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(files.key_file, "--tls_key_file");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back({*std::move(key), *std::move(cert)});
  if (!files.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(files.client_ca_file, "--tls_client_ca_file");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::unique_ptr<BearerTokenAuthenticator>> BearerTokenAuthenticator::FromFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadWholeFile(path, "--auth_token_file");
  if (!text.ok()) return text.status();
  std::string token(absl::StripAsciiWhitespace(*text));
  if (absl::Status status = ValidateToken(token, absl::StrCat("in '", path, "' (--auth_token_file)")); !status.ok()) {
    return status;
  }
  return std::unique_ptr<BearerTokenAuthenticator>(new BearerTokenAuthenticator(std::move(token)));
}

absl::StatusOr<std::unique_ptr<BearerTokenAuthenticator>> BearerTokenAuthenticator::FromToken(
    const std::string& token) {
  if (absl::Status status = ValidateToken(token, "given"); !status.ok()) return status;
  return std::unique_ptr<BearerTokenAuthenticator>(new BearerTokenAuthenticator(token));
}

absl::Status BearerTokenAuthenticator::Check(const grpc::ServerContextBase& context) const {
  const auto& metadata = context.client_metadata();
  const auto [first, last] = metadata.equal_range("authorization");
  if (first == last) return CheckHeader(nullptr);
  // Two headers are ambiguous (a proxy may check one, the server the other): refused, whatever they hold.
  if (std::next(first) != last) {
    return absl::UnauthenticatedError(absl::StrCat("the call carries ", std::distance(first, last),
                                                   " 'authorization' metadata entries; send exactly one"));
  }
  const std::string value(first->second.data(), first->second.size());
  return CheckHeader(&value);
}

std::optional<std::string> BearerTokenAuthenticator::PresentedToken(const grpc::ServerContextBase& context) {
  constexpr absl::string_view kScheme = "bearer ";
  const auto& metadata = context.client_metadata();
  const auto [first, last] = metadata.equal_range("authorization");
  if (first == last || std::next(first) != last) return std::nullopt;
  const absl::string_view value(first->second.data(), first->second.size());
  if (value.size() < kScheme.size() || !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    return std::nullopt;
  }
  return std::string(absl::StripAsciiWhitespace(value.substr(kScheme.size())));
}

absl::Status BearerTokenAuthenticator::CheckHeader(const std::string* authorization) const {
  constexpr absl::string_view kScheme = "bearer ";
  if (authorization == nullptr) {
    return absl::UnauthenticatedError(
        "missing credentials: this server requires the metadata 'authorization: Bearer <token>'");
  }
  if (authorization->size() < kScheme.size() ||
      !absl::EqualsIgnoreCase(absl::string_view(*authorization).substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError("the authorization metadata must be 'Bearer <token>'");
  }
  const std::string presented(absl::StripAsciiWhitespace(absl::string_view(*authorization).substr(kScheme.size())));
  if (!ConstantTimeEquals(presented, token_)) return absl::UnauthenticatedError("invalid bearer token");
  return absl::OkStatus();
}

}  // namespace mita::server
