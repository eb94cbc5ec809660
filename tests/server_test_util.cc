// Helpers shared by the tests of the service (see server_test_util.h).
#include "tests/server_test_util.h"

#include "server/process/health_check_call.h"

#include <grpcpp/client_context.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/byte_buffer.h>

#include <chrono>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "prometheus/metric_family.h"

namespace mita::test_util {
namespace {

// The bytes of a ByteBuffer.
std::string Bytes(grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (!buffer.Dump(&slices).ok()) return bytes;
  for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

}  // namespace

double MetricValue(const prometheus::Registry& registry, const std::string& name,
                   const std::map<std::string, std::string>& labels) {
  double total = 0;
  for (const prometheus::MetricFamily& family : registry.Collect()) {
    if (family.name != name) continue;
    for (const prometheus::ClientMetric& metric : family.metric) {
      bool match = true;
      for (const auto& [key, value] : labels) {
        bool found = false;
        for (const prometheus::ClientMetric::Label& label : metric.label) {
          found = found || (label.name == key && label.value == value);
        }
        match = match && found;
      }
      if (!match) continue;
      switch (family.type) {
        case prometheus::MetricType::Counter:
          total += metric.counter.value;
          break;
        case prometheus::MetricType::Gauge:
          total += metric.gauge.value;
          break;
        case prometheus::MetricType::Histogram:
          total += static_cast<double>(metric.histogram.sample_count);
          break;
        default:
          break;
      }
    }
  }
  return total;
}

std::pair<grpc::StatusCode, std::string> HealthCheck(const std::shared_ptr<grpc::Channel>& channel,
                                                     const std::string& service) {
  std::string bytes;
  const grpc::Status status = server::HealthCheckCall(channel, service, std::chrono::seconds(10), &bytes);
  return {status.error_code(), bytes};
}

absl::StatusOr<std::string> ReflectionListServices(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::CompletionQueue queue;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &queue);
  if (call == nullptr) return absl::UnavailableError("reflection: cannot prepare the call");
  // Waits for the event `expected`; returns its ok bit (false also when another tag came).
  auto await = [&queue](intptr_t expected) {
    void* tag = nullptr;
    bool ok = false;
    return queue.Next(&tag, &ok) && reinterpret_cast<intptr_t>(tag) == expected && ok;
  };
  // Drains the queue after Shutdown (required before it is destroyed).
  auto drain = [&queue] {
    queue.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (queue.Next(&tag, &ok)) {
    }
  };
  absl::StatusOr<std::string> result = absl::UnavailableError("reflection: not run");
  call->StartCall(reinterpret_cast<void*>(1));
  if (!await(1)) {
    context.TryCancel();
    drain();
    return absl::UnavailableError("reflection: the call did not start");
  }
  grpc::Slice slice(std::string("\x3a\x00", 2));
  grpc::ByteBuffer request(&slice, 1);
  call->Write(request, reinterpret_cast<void*>(2));
  const bool written = await(2);
  grpc::ByteBuffer reply;
  const bool read = written && (call->Read(&reply, reinterpret_cast<void*>(3)), await(3));
  call->WritesDone(reinterpret_cast<void*>(4));
  await(4);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  await(5);
  drain();
  if (!written) return absl::UnavailableError("reflection: the request could not be written");
  if (!read) return absl::UnavailableError("reflection: no answer");
  if (!status.ok()) return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  return Bytes(reply);
}

InProcessServer::InProcessServer(const server::ModelRegistry* registry, server::EngineOptions engine_options,
                                 int max_receive_message_bytes)
    : InProcessServer(registry, [&] {
        InProcessServerOptions options;
        options.engine = std::move(engine_options);
        options.max_receive_message_bytes = max_receive_message_bytes;
        return options;
      }()) {}

InProcessServer::InProcessServer(const server::ModelRegistry* registry, InProcessServerOptions options) {
  metrics_ = std::make_unique<server::ServerMetrics>(registry != nullptr ? server::MetricsModelInfos(*registry)
                                                                         : std::vector<server::ServerMetrics::ModelInfo>{});
  if (options.metrics_http) {
    absl::StatusOr<std::unique_ptr<server::MetricsHttpServer>> metrics_server =
        server::MetricsHttpServer::Start("127.0.0.1:0", metrics_->registry());
    if (!metrics_server.ok()) {
      status_ = metrics_server.status();
      return;
    }
    metrics_server_ = *std::move(metrics_server);
  }
  std::shared_ptr<server::MessageSizeGuard> guard;
  if (options.message_limits.has_value()) {
    guard = std::make_shared<server::MessageSizeGuard>(*options.message_limits, metrics_->registry().get());
    options.front_end.message_size = guard;
  }
  absl::StatusOr<std::unique_ptr<server::InferenceEngine>> engine =
      server::InferenceEngine::Create(registry, metrics_.get(), options.engine);
  if (!engine.ok()) {
    status_ = engine.status();
    return;
  }
  engine_ = *std::move(engine);
  if (options.lifecycle_repository.has_value()) {
    server::ModelLifecycleOptions lifecycle;
    lifecycle.repository = *options.lifecycle_repository;
    lifecycle.mode = options.model_control_mode;
    lifecycle.drain_timeout = absl::Seconds(10);
    lifecycle.placement = [](const std::string&) -> absl::StatusOr<models::Placement> { return models::Placement{}; };
    lifecycle.profile = [](const std::string&, const models::Classifier& classifier)
        -> absl::StatusOr<server::CostProfile> { return server::PriorProfile(classifier); };
    lifecycle_ = std::make_unique<server::ModelLifecycle>(engine_.get(), metrics_.get(), lifecycle);
    status_ = lifecycle_->LoadAll({});
    if (!status_.ok()) return;
    options.front_end.lifecycle = lifecycle_.get();
  }
  mita_v1_ = std::make_unique<server::MitaV1Service>(engine_.get(), metrics_.get(), options.front_end);
  if (options.open_inference) {
    open_inference_ =
        std::make_unique<server::OpenInferenceService>(engine_.get(), metrics_.get(), options.front_end, "test");
    open_inference_->SetReady(true);
  }
  if (options.health) health_ = std::make_unique<server::HealthService>(options.front_end);
  if (options.reflection) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(
      "127.0.0.1:0", options.credentials != nullptr ? options.credentials : grpc::InsecureServerCredentials(), &port);
  if (guard != nullptr) guard->ConfigureServer(builder);
  if (options.max_receive_message_bytes > 0) builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  server::ConfigureTransport(builder);  // as mita-server: compressed requests are inflated by the services
  if (health_ != nullptr) builder.RegisterService(health_.get());
  builder.RegisterService(mita_v1_.get());
  if (open_inference_ != nullptr) builder.RegisterService(open_inference_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port == 0) {
    status_ = absl::UnavailableError("cannot start the gRPC server on 127.0.0.1:0");
    return;
  }
  if (health_ != nullptr) {
    health_->SetServingStatus("", true);
    health_->SetServingStatus(v1::MitaService::service_full_name(), true);
  }
  target_ = absl::StrCat("127.0.0.1:", port);
  if (options.credentials == nullptr) client_ = client::MitaClient::Connect(target_);
}

InProcessServer::~InProcessServer() {
  if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (engine_ != nullptr) engine_->Shutdown();
}

}  // namespace mita::test_util
