// grpc.health.v1.Health (see health_service.h).
#include "server/frontend/health_service.h"

#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/proto_buffer_writer.h>

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/frontend/grpc_status.h"

namespace mita::server {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// A service name as it appears in a message: quoted, its first 100 bytes, with its length when longer.
std::string QuotedName(const std::string& name) {
  constexpr size_t kShown = 100;
  if (name.size() <= kShown) return absl::StrCat("'", name, "'");
  return absl::StrCat("'", name.substr(0, kShown), "...' (", name.size(), " bytes)");
}

grpc::ByteBuffer Serialize(HealthCheckResponse::ServingStatus status) {
  HealthCheckResponse response;
  response.set_status(status);
  grpc::ByteBuffer wire;
  bool own_buffer = false;
  grpc::GenericSerialize<grpc::ProtoBufferWriter, HealthCheckResponse>(response, &wire, &own_buffer);
  return wire;
}

}  // namespace

// One Watch call: writes the current status, then each change (only the latest one when several came while a
// write was in flight), until the client leaves (OnCancel) or the service shuts down.
class HealthService::WatchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit WatchReactor(HealthService* service) : service_(service) {}

  // The status to report next. Called with the service's lock held.
  void Update(ServingStatus status) {
    absl::MutexLock lock(&mu_);
    pending_ = status;
    if (!writing_ && !finishing_ && status != last_sent_) WriteNextLocked();
  }

  // Ends the call with `status` once the write in flight, if any, is done. Called with the service's lock held,
  // or from the constructor's caller before the call is registered.
  void End(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    if (finishing_) return;
    finishing_ = true;
    end_ = status;
    if (!writing_) FinishLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    // A failed write: the stream is gone (the client left, and OnCancel ends the call, now or after this).
    if (ok && pending_.has_value() && *pending_ != last_sent_) {
      WriteNextLocked();  // a status set before the end is written before it
    } else if (finishing_) {
      FinishLocked();
    }
  }

  void OnCancel() override { End(absl::CancelledError("the client left the watch")); }

  void OnDone() override {
    service_->Unregister(this);
    delete this;
  }

 private:
  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    last_sent_ = *pending_;
    pending_.reset();
    response_ = Serialize(last_sent_);
    writing_ = true;
    StartWrite(&response_);
  }

  // The status edge of Watch: the one conversion to grpc::Status.
  void FinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(ToGrpcStatus(end_));
  }

  HealthService* const service_;
  absl::Mutex mu_;
  std::optional<ServingStatus> pending_ ABSL_GUARDED_BY(mu_);
  ServingStatus last_sent_ ABSL_GUARDED_BY(mu_) = HealthCheckResponse::UNKNOWN;
  grpc::ByteBuffer response_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_ ABSL_GUARDED_BY(mu_);
};

HealthService::HealthService(FrontEndOptions options) : options_(std::move(options)) {}

HealthService::ServingStatus HealthService::StatusOf(const std::string& service) const {
  const auto it = serving_.find(service);
  if (it == serving_.end()) return HealthCheckResponse::SERVICE_UNKNOWN;
  return it->second ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

std::string HealthService::KnownServices() const {
  std::vector<std::string> names;
  for (const auto& [name, serving] : serving_) names.push_back(absl::StrCat("'", name, "'"));
  return absl::StrJoin(names, ", ");
}

void HealthService::SetServingStatus(const std::string& service, bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  serving_[service] = serving;
  for (const auto& [watch, name] : watches_) {
    if (name == service) watch->Update(StatusOf(service));
  }
}

void HealthService::SetServingStatus(bool serving) {
  std::vector<std::string> names;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, status] : serving_) names.push_back(name);
  }
  for (const std::string& name : names) SetServingStatus(name, serving);
}

void HealthService::Shutdown() {
  SetServingStatus(false);
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
  for (const auto& [watch, name] : watches_) watch->End(absl::UnavailableError("the server is shutting down"));
}

void HealthService::Unregister(WatchReactor* watch) {
  absl::MutexLock lock(&mu_);
  watches_.erase(watch);
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                               grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  HealthCheckRequest asked;
  absl::Status status = ReceiveRequest(options_, *context, *request, &asked);
  if (status.ok()) {
    ServingStatus serving;
    std::string known;
    {
      absl::MutexLock lock(&mu_);
      serving = StatusOf(asked.service());
      known = KnownServices();
    }
    if (serving == HealthCheckResponse::SERVICE_UNKNOWN) {
      status = absl::NotFoundError(absl::StrCat("unknown service ", QuotedName(asked.service()),
                                                "; this server reports the health of ", known,
                                                " ('' is the whole server)"));
    } else {
      *response = Serialize(serving);
    }
  }
  // The status edge of Check: the one conversion to grpc::Status.
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* HealthService::Watch(grpc::CallbackServerContext* context,
                                                                 const grpc::ByteBuffer* request) {
  auto* watch = new WatchReactor(this);
  HealthCheckRequest asked;
  if (absl::Status status = ReceiveRequest(options_, *context, *request, &asked); !status.ok()) {
    watch->End(status);
    return watch;
  }
  absl::MutexLock lock(&mu_);
  if (shut_down_) {
    watch->End(absl::UnavailableError("the server is shutting down"));
    return watch;
  }
  watches_[watch] = asked.service();
  watch->Update(StatusOf(asked.service()));
  return watch;
}

}  // namespace mita::server
