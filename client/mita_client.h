// C++ client library for the MiTA Serve API (mita.v1.MitaService). Depends on the generated proto only.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mita/v1/mita.grpc.pb.h"
#include "mita/v1/mita.pb.h"

namespace mita::client {

// Options of one Classify call. At most one budget form may be set: an explicit budget (expert_count and/or
// expert_width set), a preset, full attention, or a latency target; none means the model's default budget.
struct ClassifyOptions {
  // Model name, as listed by ListModels.
  std::string model;
  // Explicit MiTA budget: expert count m and expert width k. Setting either one sends an explicit budget; an
  // unset one is sent as 0, which the server rejects.
  std::optional<int64_t> expert_count;
  std::optional<int64_t> expert_width;
  // A named preset declared by the model (ModelMetadata.knobs.presets), e.g. "fast".
  std::string preset;
  // Full (quadratic) attention with the same weights.
  bool full_attention = false;
  // Latency target (Budget.latency_target): the server chooses the most accurate budget of the model's accuracy
  // order predicted to answer within this many ms (0: within the call's deadline), never below `budget_floor`
  // (a name of that order; "": its last budget). A floor without a target is an error.
  std::optional<int64_t> latency_target_ms;
  std::string budget_floor;
  // Number of best classes to return; 0 means the server default (5, capped at the number of classes).
  int32_t top_n = 0;
  // Time allowed for the call (sent as the gRPC deadline); absl::InfiniteDuration() for none.
  absl::Duration deadline = absl::InfiniteDuration();
  // Ask for per-layer attention statistics.
  bool return_statistics = false;
  // Documents: cut a document longer than the model's maximum tokens instead of having it rejected
  // (Document.truncate).
  bool truncate = false;
};

// How to reach a server: address, optional TLS, optional bearer token, and how calls spread over replicas.
struct ConnectionOptions {
  // "host:port"; a comma list of IP literals "ip:port,ip:port" (ResolveTarget); or a gRPC target URI such as
  // "dns:///mita-serve.NAMESPACE.svc.cluster.local:50051" or "ipv4:10.0.0.1:50051,10.0.0.2:50051".
  std::string target;
  // The channel's service config (JSON, validated by CreateChannel): load balancing, retry policy, client-side
  // health checking; empty: gRPC's defaults (pick_first, no retries). ServiceConfigJson builds the documented one.
  std::string service_config_json;
  // Use TLS. Implied by any of the files below.
  bool tls = false;
  // PEM CA certificates that the server's certificate must chain to; empty: the system roots.
  std::string tls_ca_file;
  // PEM client certificate chain and key, for servers that require client certificates (both or neither).
  std::string tls_cert_file;
  std::string tls_key_file;
  // Name to check the server certificate against instead of the target's host (e.g. "localhost" when
  // connecting to 127.0.0.1); empty: the target's host.
  std::string tls_server_name;
  // Bearer token sent as "authorization: Bearer <token>" on every call; empty: none.
  std::string bearer_token;
};

// How a client spreads its calls over the replicas of a target (docs/deploy.md, "Clients of replicas").
struct ReplicaPolicy {
  // gRPC load-balancing policy: "pick_first" (one connection, gRPC's default) or "round_robin" (every address the
  // target resolves to, a call to each in turn).
  std::string load_balancing = "round_robin";
  // Watch each address's grpc.health.v1 status (service "") and pick only SERVING ones: a draining replica is left
  // as soon as it turns NOT_SERVING. Needs round_robin.
  bool health_check = true;
  // Retry the idempotent calls (every method of mita.v1.MitaService and inference.GRPCInferenceService) answered
  // UNAVAILABLE, up to `max_attempts` attempts in all, each on the next replica; 1: no retries.
  int max_attempts = 5;
};

// The service config JSON of `policy`. Errors: INVALID_ARGUMENT naming the field for an unknown policy, health
// checking without round_robin, or max_attempts outside [1, 5] (gRPC caps attempts at 5).
absl::StatusOr<std::string> ServiceConfigJson(const ReplicaPolicy& policy);

// The gRPC target of `target`: a comma list of IP literals with ports ("127.0.0.1:50051,127.0.0.2:50051" or
// "[::1]:50051,...") becomes "ipv4:..." or "ipv6:..."; HOST:PORT, a target URI (dns:///HOST:PORT) and gRPC's own
// ipv4:/ipv6:/unix: forms are returned as they are. Errors: INVALID_ARGUMENT for HOST:PORT or a URI whose port is
// not in [1, 65535] (digits only), a list with an empty entry or an entry that is not an IP literal with such a
// port, or IPv4 and IPv6 entries mixed.
absl::StatusOr<std::string> ResolveTarget(const std::string& target);

// A channel for `options`. Over TLS to a list of addresses, the certificate is checked against the first entry's
// host unless tls_server_name is set. Errors: INVALID_ARGUMENT for an empty or bad target (ResolveTarget), a
// service config gRPC rejects (with gRPC's reason), or only one of the client certificate files; a certificate
// file's ReadFileBytes error.
absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateChannel(const ConnectionOptions& options);

// Reads the whole file at `path` (images, documents, certificates, tokens). Errors: NOT_FOUND when it cannot
// be opened (missing, no permission); INVALID_ARGUMENT when it is a directory; DATA_LOSS when reading fails.
// Each message names the path.
absl::StatusOr<std::string> ReadFileBytes(const std::string& path);

// Reads a bearer token from a file (its content without surrounding whitespace). Errors: those of
// ReadFileBytes; INVALID_ARGUMENT when empty.
absl::StatusOr<std::string> ReadBearerToken(const std::string& path);

// Adds "authorization: Bearer <token>" to `context` unless `token` is empty.
void AddBearerToken(const std::string& token, grpc::ClientContext* context);

// Builds the request for `image` (encoded PNG or JPEG bytes) and `options`.
// Errors: INVALID_ARGUMENT when more than one budget form is set, or a budget floor without a latency target.
absl::StatusOr<v1::ClassifyRequest> BuildClassifyRequest(std::string image, const ClassifyOptions& options);

// Builds the request for a document given as UTF-8 text (sent as bytes; the server validates it).
// Errors: INVALID_ARGUMENT when more than one budget form is set.
absl::StatusOr<v1::ClassifyRequest> BuildTextRequest(std::string text, const ClassifyOptions& options);

// Builds the request for a document given as token ids (the server range-checks them against the model's
// vocabulary). Errors: INVALID_ARGUMENT when more than one budget form is set.
absl::StatusOr<v1::ClassifyRequest> BuildTokenIdsRequest(const std::vector<int64_t>& token_ids,
                                                         const ClassifyOptions& options);

// Parses a token-id file: decimal integers separated by whitespace and/or commas. Errors: INVALID_ARGUMENT
// naming the 0-based position (as the server does: "ids[2]: 'x3' is not an integer in the int64 range") and
// the text of the first entry that is not an int64.
absl::StatusOr<std::vector<int64_t>> ParseTokenIds(absl::string_view text);

// Converts a gRPC status to an absl::Status with the same code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

// A thin, thread-safe wrapper over the generated stub. Errors of every call are the RPC's status as an
// absl::Status with the same code and message (see mita.proto for the service's error mapping).
class MitaClient {
 public:
  // Uses `channel` (e.g. grpc::CreateChannel(target, grpc::InsecureChannelCredentials())).
  // `bearer_token`, when not empty, is sent on every call ("authorization: Bearer <token>").
  explicit MitaClient(std::shared_ptr<grpc::Channel> channel, std::string bearer_token = "");

  // Connects without TLS to `target` ("host:port"); the channel connects lazily on the first call.
  static std::unique_ptr<MitaClient> Connect(const std::string& target);
  // Connects with `options` (TLS, token). Errors: those of CreateChannel.
  static absl::StatusOr<std::unique_ptr<MitaClient>> Connect(const ConnectionOptions& options);

  // Classifies one encoded image. Errors: INVALID_ARGUMENT locally for conflicting budget options; else the
  // RPC's status (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...).
  absl::StatusOr<v1::ClassifyResponse> Classify(std::string image, const ClassifyOptions& options) const;

  // Classifies one document given as UTF-8 text, with a document model. Errors as Classify.
  absl::StatusOr<v1::ClassifyResponse> ClassifyText(std::string text, const ClassifyOptions& options) const;

  // Sends a request as is (e.g. a document input or a hand-built budget).
  // `deadline`: time allowed for the call, absl::InfiniteDuration() for none.
  absl::StatusOr<v1::ClassifyResponse> ClassifyRaw(const v1::ClassifyRequest& request,
                                                   absl::Duration deadline = absl::InfiniteDuration()) const;

  // The models the server hosts.
  absl::StatusOr<v1::ListModelsResponse> ListModels(absl::Duration deadline = absl::InfiniteDuration()) const;

  // Metadata of one model. Errors: NOT_FOUND for an unknown model.
  absl::StatusOr<v1::ModelMetadata> GetModel(const std::string& name,
                                             absl::Duration deadline = absl::InfiniteDuration()) const;

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::MitaService::Stub> stub_;
  std::string bearer_token_;
};

}  // namespace mita::client
