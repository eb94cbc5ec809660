// grpc.health.v1.Health (proto/grpc/health/v1/health.proto), served by the server itself instead of gRPC's default
// health service: its requests go through the front ends' receiving path (ReceiveRequest: a whole message, inflated
// within the size limit), so a request that is not whole or not parseable is answered with what is wrong, and any
// service name that parses is looked up (gRPC 1.51's default service answers a name over 200 bytes INTERNAL on
// Watch). No token is needed (load balancers and probes call it), and calls are not counted in the metrics.
//
// Check: the service's status (SERVING or NOT_SERVING); a service the server does not report is NOT_FOUND naming
// the ones it does. Watch: the status at once, then every change, until the client leaves or the server stops; an
// unknown service is SERVICE_UNKNOWN (and reported when it becomes known), as the health protocol specifies.
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "server/frontend/unary_call.h"

namespace mita::server {

using HealthRawService = grpc::health::v1::Health::WithRawCallbackMethod_Check<
    grpc::health::v1::Health::WithRawCallbackMethod_Watch<grpc::health::v1::Health::Service>>;

// The health name Kubernetes' livenessProbe asks for: SERVING from the moment the server listens until its gRPC
// server stops, draining included (readiness, "" and the two services' names, turns NOT_SERVING when a drain
// starts); a process that no longer answers it is stuck.
inline constexpr char kLivenessService[] = "liveness";

class HealthService final : public HealthRawService {
 public:
  // `options`: the receive limit (message_size); its authenticator is ignored (health stays open).
  explicit HealthService(FrontEndOptions options);
  // Destroy only after the gRPC server it is registered with has stopped (grpc::Server::Wait returned).
  ~HealthService() override = default;

  // Sets the status of `service` ("" is the whole server), which becomes known if it was not, and tells its
  // watchers. Thread-safe.
  void SetServingStatus(const std::string& service, bool serving);
  // Sets the status of every known service. Thread-safe.
  void SetServingStatus(bool serving);
  // The server is stopping: every service becomes NOT_SERVING, then every open Watch ends with UNAVAILABLE once
  // that status is written, and later watches end at once; statuses set afterwards are ignored.
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Watch(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request) override;

 private:
  class WatchReactor;
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  // The status of `service`: SERVING, NOT_SERVING, or SERVICE_UNKNOWN.
  ServingStatus StatusOf(const std::string& service) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "'', mita.v1.MitaService, ..." for error messages.
  std::string KnownServices() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unregister(WatchReactor* watch);

  const FrontEndOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, bool> serving_ ABSL_GUARDED_BY(mu_);
  // The open watches, with the service each asked for.
  std::map<WatchReactor*, std::string> watches_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace mita::server
