// Helpers shared by the tests of the service (library mita_server_test_util: the server libraries and the
// client library): an in-process server on loopback for a model registry, metric values read from a
// registry, and raw grpc.health.v1 / reflection calls. The helpers that need no server are in test_util.h.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/mita_client.h"
#include "prometheus/registry.h"
#include "server/engine/inference_engine.h"
#include "server/engine/model_registry.h"
#include "server/frontend/health_service.h"
#include "server/frontend/message_limits.h"
#include "server/frontend/mita_v1_service.h"
#include "server/frontend/open_inference_service.h"
#include "server/frontend/unary_call.h"
#include "server/metrics/metrics.h"
#include "server/process/metrics_http_server.h"

namespace mita::test_util {

// The sum over the samples of family `name` whose labels include all of `labels`: counter and gauge values,
// histogram sample counts. 0 when there is no such sample.
double MetricValue(const prometheus::Registry& registry, const std::string& name,
                   const std::map<std::string, std::string>& labels = {});

// grpc.health.v1.Health/Check of `service` ("" for the whole server) over a raw call on `channel`:
// HealthCheckRequest {string service = 1} encoded by hand. Returns the status code and, when OK, the response
// bytes (HealthCheckResponse {ServingStatus status = 1}: "\x08\x01" for SERVING). 10 s deadline.
std::pair<grpc::StatusCode, std::string> HealthCheck(const std::shared_ptr<grpc::Channel>& channel,
                                                     const std::string& service);

// grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo over a raw bidirectional call on `channel`:
// one ServerReflectionRequest {list_services = 7: ""} encoded by hand. Returns the bytes of the answer (the
// service names appear in it). Errors: UNAVAILABLE naming the step that failed, or the call's final status.
// 10 s deadline.
absl::StatusOr<std::string> ReflectionListServices(const std::shared_ptr<grpc::Channel>& channel);

// What an InProcessServer serves besides mita.v1.
struct InProcessServerOptions {
  server::EngineOptions engine;
  // Authentication of both front ends (message_size is set from message_limits below).
  server::FrontEndOptions front_end;
  // Credentials of the gRPC port; null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // > 0: gRPC's receive limit, bytes; else gRPC's default (4 MiB).
  int max_receive_message_bytes = 0;
  // Set: message size limits as mita-server sets them up (a MessageSizeGuard counting rejections in this
  // server's registry, front_end.message_size, and gRPC's transport limits from it).
  std::optional<server::MessageSizeLimits> message_limits;
  // grpc.health.v1 (server/frontend/health_service.h, as mita-server serves it), SERVING for the server and for
  // mita.v1.MitaService.
  bool health = false;
  // Server reflection (a process-wide gRPC plugin: every server started after it has reflection).
  bool reflection = false;
  // The Open Inference Protocol service (server/frontend/open_inference_service.h), ready.
  bool open_inference = false;
  // /metrics of this server's registry on 127.0.0.1:0 (metrics_port()).
  bool metrics_http = false;
  // Set: the models come from this repository through a ModelLifecycle (the registry may be null; every version
  // gets its model's prior cost profile), in `model_control_mode`, and the front ends serve its repository API.
  std::optional<std::string> lifecycle_repository;
  server::ModelControlMode model_control_mode = server::ModelControlMode::kExplicit;
};

// An in-process server for the models of a registry: ServerMetrics, InferenceEngine, the mita.v1 front end and a
// gRPC server on 127.0.0.1:0, with a plaintext client when the port is plaintext. Check status() after
// construction.
class InProcessServer {
 public:
  // `registry` (may be null with options.lifecycle_repository) must outlive the server.
  InProcessServer(const server::ModelRegistry* registry, InProcessServerOptions options);
  // Serves `registry` with `engine_options`; `max_receive_message_bytes` > 0 sets gRPC's receive limit.
  InProcessServer(const server::ModelRegistry* registry, server::EngineOptions engine_options,
                  int max_receive_message_bytes = 0);
  // Shuts gRPC down (5 s for calls in flight), then the engine.
  ~InProcessServer();

  InProcessServer(const InProcessServer&) = delete;
  InProcessServer& operator=(const InProcessServer&) = delete;

  const absl::Status& status() const { return status_; }
  // "127.0.0.1:PORT".
  const std::string& target() const { return target_; }
  // A client of target(); only for a plaintext port.
  const client::MitaClient& client() const { return *client_; }
  server::InferenceEngine& engine() { return *engine_; }
  server::OpenInferenceService* open_inference() { return open_inference_.get(); }
  server::ServerMetrics& metrics() { return *metrics_; }
  // With options.lifecycle_repository; else null.
  server::ModelLifecycle* lifecycle() { return lifecycle_.get(); }
  // The registry, once every call whose answer went out is counted (calls are counted when gRPC is done with them,
  // which can be just after the client has its answer; ServerMetrics::AwaitFinishedCallsCounted).
  const prometheus::Registry& registry() const {
    metrics_->AwaitFinishedCallsCounted();
    return *metrics_->registry();
  }
  // The /metrics port (options.metrics_http), else 0.
  int metrics_port() const { return metrics_server_ != nullptr ? metrics_server_->port() : 0; }
  grpc::Server* grpc_server() { return server_.get(); }

 private:
  absl::Status status_;
  std::unique_ptr<server::ServerMetrics> metrics_;
  std::unique_ptr<server::ModelLifecycle> lifecycle_;
  std::unique_ptr<server::MetricsHttpServer> metrics_server_;
  std::unique_ptr<server::InferenceEngine> engine_;
  std::unique_ptr<server::MitaV1Service> mita_v1_;
  std::unique_ptr<server::OpenInferenceService> open_inference_;
  std::unique_ptr<server::HealthService> health_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
  std::unique_ptr<client::MitaClient> client_;
};

}  // namespace mita::test_util
