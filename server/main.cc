// mita-server: serves the model packages of a model repository over gRPC (mita.v1.MitaService, the Open
// Inference Protocol inference.GRPCInferenceService, grpc.health.v1, server reflection) and exports Prometheus
// metrics over HTTP.
//
// Flags (defaults):
//   --listen=0.0.0.0:50051                 gRPC address.
//   --model_repository=models/repository   One sub-folder per model package; the folder name is the model name.
//   --metrics_listen=0.0.0.0:9464          Prometheus /metrics address (9464: the usual Prometheus exporter
//                                          port); empty disables the exporter.
//   --max_batch_size=16                    Requests per batch, per model.
//   --max_queue_delay_ms=2                 Longest wait of the oldest queued request for its batch to fill, ms.
//   --max_batch_tokens=131072              Tokens per packed batch, per model (a longer document is refused).
//   --queue_capacity=256                   Requests queued per model before RESOURCE_EXHAUSTED.
//   --queue_compute_units=4294967296       Compute units (tokens x attention width: M + k for MiTA, N for full
//                                          attention) queued per model before RESOURCE_EXHAUSTED.
//   --batch_threads=1                      Batch threads per model.
//   --torch_threads=0                      LibTorch intra-op threads; 0: the hardware concurrency (LibTorch 1.13
//                                          otherwise starts with half the cores).
//   --max_receive_message_bytes=4194304    Largest request message (4 MiB), and so largest encoded image;
//                                          larger gets RESOURCE_EXHAUSTED naming the limit and this flag
//                                          (server/message_limits.h).
//   --max_send_message_bytes=4194304       Largest response message (4 MiB); likewise.
//   --drain_timeout_s=20                   On SIGTERM/SIGINT: how long in-flight RPCs may take to finish.
//
// Shutdown: on SIGTERM or SIGINT the health status goes NOT_SERVING, the gRPC server stops accepting calls and
// waits up to --drain_timeout_s for in-flight calls (then cancels them), the batchers run what is queued, and
// the process exits 0.
#include <ATen/Parallel.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/openmp_environment.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/flags/usage_config.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/classify_service.h"
#include "server/kserve_service.h"
#include "server/message_limits.h"
#include "server/metrics.h"
#include "server/model_registry.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "gRPC listening address, host:port.");
ABSL_FLAG(std::string, model_repository, "models/repository",
          "Directory holding one model package folder per model; the folder name is the model name.");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9464",
          "Prometheus exporter address, host:port (serves /metrics); empty disables it.");
ABSL_FLAG(int64_t, max_batch_size, 16, "Largest batch, requests (per model).");
ABSL_FLAG(double, max_queue_delay_ms, 2.0,
          "Longest time the oldest queued request waits for its batch to fill, milliseconds.");
ABSL_FLAG(int64_t, queue_capacity, 256, "Requests queued per model before new ones get RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, max_batch_tokens, int64_t{1} << 17,
          "Largest packed batch, tokens (per model); documents longer than this are refused.");
ABSL_FLAG(int64_t, queue_compute_units, int64_t{1} << 32,
          "Compute units queued per model before new requests get RESOURCE_EXHAUSTED; a request costs tokens x "
          "attention width (expert_count + expert_width under MiTA, tokens under full attention).");
ABSL_FLAG(int32_t, batch_threads, 1, "Threads forming and running batches, per model.");
ABSL_FLAG(int32_t, torch_threads, 0, "LibTorch intra-op threads; 0: the hardware concurrency.");
ABSL_FLAG(int64_t, max_receive_message_bytes, mita::server::MessageSizeLimits::kDefaultBytes,
          "Largest request message, bytes (4 MiB); larger gets RESOURCE_EXHAUSTED naming this flag.");
ABSL_FLAG(int64_t, max_send_message_bytes, mita::server::MessageSizeLimits::kDefaultBytes,
          "Largest response message, bytes (4 MiB); larger gets RESOURCE_EXHAUSTED naming this flag.");
ABSL_FLAG(int32_t, drain_timeout_s, 20, "On SIGTERM/SIGINT, seconds in-flight RPCs may take to finish.");

namespace {

void Log(const std::string& line) {
  std::fprintf(stderr, "%s mita-server: %s\n",
               absl::FormatTime("%Y-%m-%dT%H:%M:%E3S%Ez", absl::Now(), absl::LocalTimeZone()).c_str(), line.c_str());
  std::fflush(stderr);
}

int Fail(const std::string& message) {
  Log(absl::StrCat("error: ", message));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  mita::kernels::ReexecWithPassiveOpenMpWaitIfUnset(argv);
  // Block the shutdown signals in every thread; the main thread waits for them with sigwait.
  sigset_t shutdown_signals;
  sigemptyset(&shutdown_signals);
  sigaddset(&shutdown_signals, SIGTERM);
  sigaddset(&shutdown_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &shutdown_signals, nullptr);

  absl::SetProgramUsageMessage("Serves MiTA classifiers over gRPC. mita-server --model_repository=DIR [flags]");
  // --help lists the flags of this file (Abseil would look for a file named after the binary).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) { return absl::EndsWith(file, "/server/main.cc"); };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::ParseCommandLine(argc, argv);

  mita::server::MessageSizeLimits message_limits;
  message_limits.max_receive_bytes = absl::GetFlag(FLAGS_max_receive_message_bytes);
  message_limits.max_send_bytes = absl::GetFlag(FLAGS_max_send_message_bytes);
  if (absl::Status status = mita::server::ValidateMessageSizeLimits(message_limits); !status.ok()) {
    return Fail(std::string(status.message()));
  }
  const double delay_ms = absl::GetFlag(FLAGS_max_queue_delay_ms);
  if (!(delay_ms >= 0 && delay_ms <= 60000)) return Fail("--max_queue_delay_ms must be in [0, 60000]");
  const int32_t drain_timeout_s = absl::GetFlag(FLAGS_drain_timeout_s);
  if (drain_timeout_s < 0) return Fail("--drain_timeout_s must be >= 0");

  int32_t torch_threads = absl::GetFlag(FLAGS_torch_threads);
  if (torch_threads < 0) return Fail("--torch_threads must be >= 0");
  if (torch_threads == 0) torch_threads = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(torch_threads);

  mita::server::ServiceOptions options;
  options.batching.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  options.batching.max_queue_delay = absl::Microseconds(static_cast<int64_t>(delay_ms * 1000.0));
  options.batching.queue_capacity = absl::GetFlag(FLAGS_queue_capacity);
  options.batching.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.batching.queue_compute_units = absl::GetFlag(FLAGS_queue_compute_units);
  options.batching.num_batch_threads = absl::GetFlag(FLAGS_batch_threads);
  options.batching.queue_capacity_source = "flag --queue_capacity";
  options.batching.max_batch_size_source = "flag --max_batch_size";
  options.max_encoded_image_bytes = message_limits.max_receive_bytes;
  if (absl::Status status = mita::server::ValidateBatcherOptions(options.batching); !status.ok()) {
    return Fail(std::string(status.message()));
  }

  const std::string repository = absl::GetFlag(FLAGS_model_repository);
  const absl::Time load_start = absl::Now();
  absl::StatusOr<std::unique_ptr<mita::server::ModelRegistry>> registry =
      mita::server::ModelRegistry::LoadFromDirectory(repository);
  if (!registry.ok()) return Fail(registry.status().ToString());

  std::vector<mita::server::ServerMetrics::ModelInfo> model_infos;
  std::vector<std::string> model_lines;
  for (const mita::models::ModelPackage* package : (*registry)->packages()) {
    model_infos.push_back({package->name, mita::server::AttentionLayers(*package)});
    if (package->kind == mita::models::ModelKind::kDocument) {
      const mita::models::DocumentConfig& config = package->document_config;
      model_lines.push_back(absl::StrCat(package->name, " (", config.architecture, ", documents up to ",
                                         config.max_tokens, " tokens, tokenizer ", config.tokenizer, ", ",
                                         config.depth, " layers, ", config.num_classes,
                                         " classes, default budget expert_count=", config.default_budget.expert_count,
                                         " expert_width=", config.default_budget.expert_width, ")"));
      continue;
    }
    const mita::models::VitConfig& config = package->config;
    model_lines.push_back(absl::StrCat(package->name, " (", config.architecture, ", ", config.image_size, "x",
                                       config.image_size, "x", config.in_channels, ", ", config.tokens(), " tokens, ",
                                       config.depth, " layers, ", config.num_classes,
                                       " classes, default budget expert_count=", config.default_budget.expert_count,
                                       " expert_width=", config.default_budget.expert_width, ")"));
  }
  Log(absl::StrCat("loaded ", model_lines.size(), " model(s) from ", repository, " in ",
                   absl::FormatDuration(absl::Now() - load_start), ": ", absl::StrJoin(model_lines, "; ")));

  mita::server::ServerMetrics metrics(model_infos);
  options.message_size = std::make_shared<mita::server::MessageSizeGuard>(message_limits, metrics.registry().get());
  std::unique_ptr<mita::server::MetricsHttpServer> metrics_server;
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (!metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<mita::server::MetricsHttpServer>> started =
        mita::server::MetricsHttpServer::Start(metrics_listen, metrics.registry());
    if (!started.ok()) return Fail(absl::StrCat(started.status().message(), " (flag --metrics_listen)"));
    metrics_server = *std::move(started);
  }

  absl::StatusOr<std::unique_ptr<mita::server::ClassifyService>> service =
      mita::server::ClassifyService::Create(registry->get(), &metrics, options);
  if (!service.ok()) return Fail(service.status().ToString());
  // Open Inference Protocol (KServe V2) on the same port, translated onto the same ClassifyService.
  mita::server::KserveService kserve(registry->get(), service->get(), &metrics, options.max_encoded_image_bytes,
                                     "0.1.0");

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  int selected_port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &selected_port);
  options.message_size->ConfigureServer(builder);
  builder.RegisterService(service->get());
  builder.RegisterService(&kserve);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || selected_port == 0) {
    return Fail(absl::StrCat("cannot listen on '", listen, "' (flag --listen)"));
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus(true);
    health->SetServingStatus(mita::v1::MitaService::service_full_name(), true);
    health->SetServingStatus(inference::GRPCInferenceService::service_full_name(), true);
  }
  kserve.SetReady(true);
  std::string metrics_line = "metrics disabled";
  if (metrics_server != nullptr) {
    metrics_line = absl::StrCat("metrics on http://", metrics_listen, "/metrics (port ", metrics_server->port(), ")");
  }
  Log(absl::StrCat("serving gRPC on ", listen, " (port ", selected_port, "; mita.v1.MitaService, grpc.health.v1, ",
                   "inference.GRPCInferenceService, reflection), ", metrics_line,
                   "; models: ", absl::StrJoin((*registry)->names(), ", "),
                   "; max_batch_size=", options.batching.max_batch_size,
                   " max_queue_delay=", absl::FormatDuration(options.batching.max_queue_delay),
                   " max_batch_tokens=", options.batching.max_batch_tokens,
                   " queue_capacity=", options.batching.queue_capacity,
                   " queue_compute_units=", options.batching.queue_compute_units,
                   " batch_threads=", options.batching.num_batch_threads, " torch_threads=", at::get_num_threads()));

  int signal_number = 0;
  sigwait(&shutdown_signals, &signal_number);
  Log(absl::StrCat("received ", signal_number == SIGTERM ? "SIGTERM" : "SIGINT", "; draining (up to ", drain_timeout_s,
                   " s)"));
  if (health != nullptr) {
    health->SetServingStatus(false);
    health->SetServingStatus(mita::v1::MitaService::service_full_name(), false);
    health->SetServingStatus(inference::GRPCInferenceService::service_full_name(), false);
  }
  kserve.SetReady(false);
  const absl::Time drain_start = absl::Now();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(drain_timeout_s));
  (*service)->Shutdown();
  server->Wait();
  if (metrics_server != nullptr) metrics_server->Stop();
  Log(absl::StrCat("stopped after draining for ", absl::FormatDuration(absl::Now() - drain_start)));
  return 0;
}
