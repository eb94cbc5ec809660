#include "client/mita_client.h"

#include <arpa/inet.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/validate_service_config.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace mita::client {
namespace {

void SetDeadline(grpc::ClientContext& context, absl::Duration deadline) {
  if (deadline == absl::InfiniteDuration()) return;
  context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(deadline));
}

}  // namespace

absl::StatusOr<std::string> ReadFileBytes(const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' is a directory, not a file"));
  }
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  std::ostringstream bytes;
  bytes << file.rdbuf();
  if (file.bad()) return absl::DataLossError(absl::StrCat("cannot read '", path, "'"));
  return bytes.str();
}

absl::StatusOr<std::string> ServiceConfigJson(const ReplicaPolicy& policy) {
  if (policy.load_balancing != "round_robin" && policy.load_balancing != "pick_first") {
    return absl::InvalidArgumentError(absl::StrCat("load balancing '", policy.load_balancing,
                                                   "' is not one of round_robin, pick_first"));
  }
  if (policy.health_check && policy.load_balancing != "round_robin") {
    return absl::InvalidArgumentError("client-side health checking needs round_robin (pick_first ignores it)");
  }
  if (policy.max_attempts < 1 || policy.max_attempts > 5) {
    return absl::InvalidArgumentError(
        absl::StrCat("max attempts ", policy.max_attempts, " is out of range: allowed [1, 5] (1: no retries)"));
  }
  std::string json = absl::StrCat(R"({"loadBalancingConfig":[{")", policy.load_balancing, R"(":{}}])");
  if (policy.health_check) absl::StrAppend(&json, R"(,"healthCheckConfig":{"serviceName":""})");
  if (policy.max_attempts > 1) {
    absl::StrAppend(&json, R"(,"methodConfig":[{"name":[{"service":"mita.v1.MitaService"},)",
                    R"({"service":"inference.GRPCInferenceService"}],"retryPolicy":{"maxAttempts":)",
                    policy.max_attempts,
                    R"(,"initialBackoff":"0.05s","maxBackoff":"1s","backoffMultiplier":2,)",
                    R"("retryableStatusCodes":["UNAVAILABLE"]}}])");
  }
  absl::StrAppend(&json, "}");
  return json;
}

namespace {

// Whether `port` is a port number in [1, 65535] written in at most 5 decimal digits (no sign, no suffix).
bool IsPort(absl::string_view port) {
  int value = 0;
  return !port.empty() && port.size() <= 5 && std::all_of(port.begin(), port.end(), absl::ascii_isdigit) &&
         absl::SimpleAtoi(port, &value) && value >= 1 && value <= 65535;
}

// Splits HOST:PORT ([v6]:PORT for IPv6) at its last colon; false when there is no host or no valid port.
bool SplitHostPort(absl::string_view address, absl::string_view* host) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 || !IsPort(address.substr(colon + 1))) return false;
  *host = address.substr(0, colon);
  return true;
}

}  // namespace

absl::StatusOr<std::string> ResolveTarget(const std::string& target) {
  if (absl::StartsWith(target, "ipv4:") || absl::StartsWith(target, "ipv6:") || absl::StartsWith(target, "unix:")) {
    return target;
  }
  absl::string_view host;
  if (const size_t scheme = target.find("://"); scheme != std::string::npos) {
    // A URI (dns:///HOST:PORT): its port, when it names one, is checked.
    const absl::string_view authority = absl::string_view(target).substr(target.rfind('/') + 1);
    const size_t bracket = authority.rfind(']');
    const size_t colon = authority.rfind(':');
    if (colon != absl::string_view::npos && (bracket == absl::string_view::npos || colon > bracket) &&
        !SplitHostPort(authority, &host)) {
      return absl::InvalidArgumentError(absl::StrCat("'", target, "': '", authority.substr(colon + 1),
                                                     "' is not a port: allowed [1, 65535]"));
    }
    return target;
  }
  if (target.find(',') == std::string::npos) {
    if (!SplitHostPort(target, &host)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", target, "' is not HOST:PORT ([v6]:PORT for IPv6) with a port in [1, 65535]"));
    }
    return target;
  }
  bool v4 = false, v6 = false;
  for (absl::string_view entry : absl::StrSplit(target, ',')) {
    const bool has_port = SplitHostPort(entry, &host);
    unsigned char address[16];
    if (has_port && inet_pton(AF_INET, std::string(host).c_str(), address) == 1) {
      v4 = true;
    } else if (has_port && host.size() > 2 && host.front() == '[' && host.back() == ']' &&
               inet_pton(AF_INET6, std::string(host.substr(1, host.size() - 2)).c_str(), address) == 1) {
      v6 = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("server list '", target, "': entry '", entry,
                                                     "' is not an IP address with a port in [1, 65535] "
                                                     "(a.b.c.d:PORT or [v6]:PORT); for host names use "
                                                     "dns:///HOST:PORT"));
    }
  }
  if (v4 && v6) {
    return absl::InvalidArgumentError(absl::StrCat("server list '", target,
                                                   "' mixes IPv4 and IPv6 addresses; use one family, or "
                                                   "dns:///HOST:PORT for a name with both"));
  }
  return absl::StrCat(v4 ? "ipv4:" : "ipv6:", target);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateChannel(const ConnectionOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("the server address is empty");
  absl::StatusOr<std::string> target = ResolveTarget(options.target);
  if (!target.ok()) return target.status();
  grpc::ChannelArguments arguments;
  if (!options.service_config_json.empty()) {
    const std::string error = grpc::experimental::ValidateServiceConfigJSON(options.service_config_json);
    if (!error.empty()) return absl::InvalidArgumentError(absl::StrCat("the service config is not valid: ", error));
    arguments.SetServiceConfigJSON(options.service_config_json);
  }
  const bool tls = options.tls || !options.tls_ca_file.empty() || !options.tls_cert_file.empty() ||
                   !options.tls_key_file.empty() || !options.tls_server_name.empty();
  if (!tls) return grpc::CreateCustomChannel(*target, grpc::InsecureChannelCredentials(), arguments);
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("set both the client certificate and its key, or neither");
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadFileBytes(options.tls_ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
  }
  if (!options.tls_cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadFileBytes(options.tls_cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFileBytes(options.tls_key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  if (!options.tls_server_name.empty()) {
    arguments.SetSslTargetNameOverride(options.tls_server_name);
  } else if (*target != options.target) {
    // A list of addresses: gRPC would check the certificate against the whole list; the first entry's host is
    // the name (every replica serves the same certificate).
    absl::string_view host;
    const absl::string_view first = absl::string_view(options.target).substr(0, options.target.find(','));
    if (SplitHostPort(first, &host)) {
      host = absl::StripPrefix(absl::StripSuffix(host, "]"), "[");
      arguments.SetSslTargetNameOverride(std::string(host));
    }
  }
  return grpc::CreateCustomChannel(*target, grpc::SslCredentials(ssl), arguments);
}

absl::StatusOr<std::string> ReadBearerToken(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileBytes(path);
  if (!text.ok()) return text.status();
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("the token file '", path, "' is empty"));
  return token;
}

void AddBearerToken(const std::string& token, grpc::ClientContext* context) {
  if (!token.empty()) context->AddMetadata("authorization", absl::StrCat("Bearer ", token));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // gRPC and Abseil share the google.rpc.Code numbering.
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

namespace {

// The request without its input: model, budget, top_n, statistics. Errors: INVALID_ARGUMENT when more than
// one budget form is set.
absl::StatusOr<v1::ClassifyRequest> BuildRequestWithoutInput(const ClassifyOptions& options) {
  const bool explicit_budget = options.expert_count.has_value() || options.expert_width.has_value();
  const bool latency_target = options.latency_target_ms.has_value();
  const int forms =
      int{explicit_budget} + int{!options.preset.empty()} + int{options.full_attention} + int{latency_target};
  if (forms > 1) {
    return absl::InvalidArgumentError(
        "set at most one budget form: expert_count/expert_width, preset, full_attention or latency_target_ms");
  }
  if (!options.budget_floor.empty() && !latency_target) {
    return absl::InvalidArgumentError("budget_floor needs latency_target_ms (it bounds the budget the server chooses)");
  }
  v1::ClassifyRequest request;
  request.set_model(options.model);
  if (explicit_budget) {
    v1::ExpertBudget* experts = request.mutable_budget()->mutable_experts();
    experts->set_expert_count(options.expert_count.value_or(0));
    experts->set_expert_width(options.expert_width.value_or(0));
  } else if (!options.preset.empty()) {
    request.mutable_budget()->set_preset(options.preset);
  } else if (options.full_attention) {
    request.mutable_budget()->mutable_full_attention();
  } else if (latency_target) {
    v1::LatencyTarget* target = request.mutable_budget()->mutable_latency_target();
    target->set_target_ms(*options.latency_target_ms);
    target->set_floor(options.budget_floor);
  }
  request.set_top_n(options.top_n);
  request.set_return_statistics(options.return_statistics);
  return request;
}

}  // namespace

absl::StatusOr<v1::ClassifyRequest> BuildClassifyRequest(std::string image, const ClassifyOptions& options) {
  absl::StatusOr<v1::ClassifyRequest> request = BuildRequestWithoutInput(options);
  if (!request.ok()) return request.status();
  request->set_image(std::move(image));
  return request;
}

absl::StatusOr<v1::ClassifyRequest> BuildTextRequest(std::string text, const ClassifyOptions& options) {
  absl::StatusOr<v1::ClassifyRequest> request = BuildRequestWithoutInput(options);
  if (!request.ok()) return request.status();
  v1::Document* document = request->mutable_document();
  document->set_text(std::move(text));
  document->set_truncate(options.truncate);
  return request;
}

absl::StatusOr<v1::ClassifyRequest> BuildTokenIdsRequest(const std::vector<int64_t>& token_ids,
                                                         const ClassifyOptions& options) {
  absl::StatusOr<v1::ClassifyRequest> request = BuildRequestWithoutInput(options);
  if (!request.ok()) return request.status();
  v1::Document* document = request->mutable_document();
  document->mutable_token_ids()->mutable_ids()->Add(token_ids.begin(), token_ids.end());
  document->set_truncate(options.truncate);
  return request;
}

absl::StatusOr<std::vector<int64_t>> ParseTokenIds(absl::string_view text) {
  std::vector<int64_t> ids;
  size_t position = 0;
  while (position < text.size()) {
    const char c = text[position];
    if (absl::ascii_isspace(static_cast<unsigned char>(c)) || c == ',') {
      ++position;
      continue;
    }
    size_t end = position;
    while (end < text.size() && !absl::ascii_isspace(static_cast<unsigned char>(text[end])) && text[end] != ',') {
      ++end;
    }
    const absl::string_view entry = text.substr(position, end - position);
    int64_t id = 0;
    if (!absl::SimpleAtoi(entry, &id)) {
      return absl::InvalidArgumentError(absl::StrCat("ids[", ids.size(), "]: '", entry.substr(0, 32),
                                                     "' is not an integer in the int64 range"));
    }
    ids.push_back(id);
    position = end;
  }
  return ids;
}

MitaClient::MitaClient(std::shared_ptr<grpc::Channel> channel, std::string bearer_token)
    : channel_(std::move(channel)), stub_(v1::MitaService::NewStub(channel_)), bearer_token_(std::move(bearer_token)) {}

absl::StatusOr<std::unique_ptr<MitaClient>> MitaClient::Connect(const ConnectionOptions& options) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = CreateChannel(options);
  if (!channel.ok()) return channel.status();
  return std::make_unique<MitaClient>(*std::move(channel), options.bearer_token);
}

std::unique_ptr<MitaClient> MitaClient::Connect(const std::string& target) {
  return std::make_unique<MitaClient>(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
}

absl::StatusOr<v1::ClassifyResponse> MitaClient::Classify(std::string image, const ClassifyOptions& options) const {
  absl::StatusOr<v1::ClassifyRequest> request = BuildClassifyRequest(std::move(image), options);
  if (!request.ok()) return request.status();
  return ClassifyRaw(*request, options.deadline);
}

absl::StatusOr<v1::ClassifyResponse> MitaClient::ClassifyText(std::string text,
                                                              const ClassifyOptions& options) const {
  absl::StatusOr<v1::ClassifyRequest> request = BuildTextRequest(std::move(text), options);
  if (!request.ok()) return request.status();
  return ClassifyRaw(*request, options.deadline);
}

absl::StatusOr<v1::ClassifyResponse> MitaClient::ClassifyRaw(const v1::ClassifyRequest& request,
                                                             absl::Duration deadline) const {
  grpc::ClientContext context;
  SetDeadline(context, deadline);
  AddBearerToken(bearer_token_, &context);
  v1::ClassifyResponse response;
  grpc::Status status = stub_->Classify(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::ListModelsResponse> MitaClient::ListModels(absl::Duration deadline) const {
  grpc::ClientContext context;
  SetDeadline(context, deadline);
  AddBearerToken(bearer_token_, &context);
  v1::ListModelsResponse response;
  grpc::Status status = stub_->ListModels(&context, v1::ListModelsRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::ModelMetadata> MitaClient::GetModel(const std::string& name, absl::Duration deadline) const {
  grpc::ClientContext context;
  SetDeadline(context, deadline);
  AddBearerToken(bearer_token_, &context);
  v1::GetModelRequest request;
  request.set_name(name);
  v1::ModelMetadata response;
  grpc::Status status = stub_->GetModel(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

}  // namespace mita::client
