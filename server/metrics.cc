#include "server/metrics.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "prometheus/text_serializer.h"

namespace mita::server {
namespace {

using prometheus::Histogram;

// Seconds: 50 us .. 10 s, roughly x2-x2.5 per bucket.
const Histogram::BucketBoundaries& SecondsBuckets() {
  static const Histogram::BucketBoundaries* const buckets = new Histogram::BucketBoundaries{
      0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
  return *buckets;
}

// Counts: 1, 2, 4, ... 2^max_power.
Histogram::BucketBoundaries PowersOfTwo(int max_power) {
  Histogram::BucketBoundaries buckets;
  for (int p = 0; p <= max_power; ++p) buckets.push_back(static_cast<double>(int64_t{1} << p));
  return buckets;
}

// max/mean >= 1.
const Histogram::BucketBoundaries& ImbalanceBuckets() {
  static const Histogram::BucketBoundaries* const buckets =
      new Histogram::BucketBoundaries{1.05, 1.1, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16, 32, 64};
  return *buckets;
}

// Fractions in [0, 1].
const Histogram::BucketBoundaries& FractionBuckets() {
  static const Histogram::BucketBoundaries* const buckets =
      new Histogram::BucketBoundaries{0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0};
  return *buckets;
}

constexpr const char* kMethodNames[kNumRpcMethods] = {"Classify",      "ListModels", "GetModel",
                                                     "ModelInfer",    "ModelMetadata", "ModelReady",
                                                     "ServerLive",    "ServerReady", "ServerMetadata",
                                                     "ModelConfig"};

}  // namespace

const char* RpcMethodName(RpcMethod method) {
  const int index = static_cast<int>(method);
  return index >= 0 && index < kNumRpcMethods ? kMethodNames[index] : "unknown";
}

bool IsModelMethod(RpcMethod method) {
  switch (method) {
    case RpcMethod::kClassify:
    case RpcMethod::kGetModel:
    case RpcMethod::kModelInfer:
    case RpcMethod::kModelMetadata:
    case RpcMethod::kModelReady:
    case RpcMethod::kModelConfig:
      return true;
    case RpcMethod::kListModels:
    case RpcMethod::kServerLive:
    case RpcMethod::kServerReady:
    case RpcMethod::kServerMetadata:
      return false;
  }
  return false;
}

const char* StatusCodeName(absl::StatusCode code) {
  static constexpr const char* kNames[kNumStatusCodes] = {
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  const int index = static_cast<int>(code);
  return (index >= 0 && index < kNumStatusCodes) ? kNames[index] : "UNKNOWN";
}

void ModelMetrics::ObserveBudget(const models::AttentionBudget& requested, const models::AttentionBudget& applied) {
  if (requested.full_attention) {
    full_attention_->Increment();
    return;
  }
  expert_count_->Observe(static_cast<double>(requested.expert_count));
  expert_width_->Observe(static_cast<double>(requested.expert_width));
  applied_expert_count_->Observe(static_cast<double>(applied.expert_count));
  applied_expert_width_->Observe(static_cast<double>(applied.expert_width));
}

void ModelMetrics::CountRejection(AdmissionRejection reason) {
  const int index = static_cast<int>(reason);
  if (index <= 0 || index >= kNumAdmissionRejections) return;
  rejections_[static_cast<size_t>(index)]->Increment();
}

void ModelMetrics::ObserveLayer(int64_t layer, double load_imbalance, double routing_entropy,
                                double pruned_key_fraction) {
  if (layer < 0 || layer >= static_cast<int64_t>(layers_.size())) return;
  const Layer& series = layers_[static_cast<size_t>(layer)];
  series.load_imbalance->Observe(load_imbalance);
  series.routing_entropy->Observe(routing_entropy);
  series.pruned_key_fraction->Observe(pruned_key_fraction);
}

ServerMetrics::ServerMetrics(const std::vector<ModelInfo>& models)
    : registry_(std::make_shared<prometheus::Registry>()) {
  auto& requests = prometheus::BuildCounter()
                       .Name("mita_requests_total")
                       .Help("RPCs answered by the service, by method, model and final gRPC status code.")
                       .Register(*registry_);
  auto& latency = prometheus::BuildHistogram()
                      .Name("mita_request_latency_seconds")
                      .Help("Time in the server from receipt to answer of successful Classify and ModelInfer RPCs, "
                            "seconds.")
                      .Register(*registry_);
  auto& queue_delay = prometheus::BuildHistogram()
                          .Name("mita_queue_delay_seconds")
                          .Help("Time from admission to the start of the request's batch, seconds.")
                          .Register(*registry_);
  auto& compute = prometheus::BuildHistogram()
                      .Name("mita_compute_seconds")
                      .Help("Model forward time of the batch that ran the request, seconds (per request).")
                      .Register(*registry_);
  auto& batch_size = prometheus::BuildHistogram()
                         .Name("mita_batch_size")
                         .Help("Requests per batch run (one observation per batch).")
                         .Register(*registry_);
  auto& queue_depth = prometheus::BuildGauge()
                          .Name("mita_queue_depth")
                          .Help("Requests queued in the model's batcher, not yet taken into a batch.")
                          .Register(*registry_);
  auto& queue_compute_units =
      prometheus::BuildGauge()
          .Name("mita_queue_compute_units")
          .Help("Compute units (tokens x attention width: M + k for MiTA, N for full attention) queued in the "
                "model's batcher.")
          .Register(*registry_);
  auto& rejected = prometheus::BuildCounter()
                       .Name("mita_rejected_requests_total")
                       .Help("Classify requests refused at admission, by reason (queue_tasks, queue_compute_units, "
                             "task_over_queue_compute_units, shutting_down).")
                       .Register(*registry_);
  auto& request_tokens = prometheus::BuildHistogram()
                             .Name("mita_request_tokens")
                             .Help("Tokens of each admitted request (documents: after truncation).")
                             .Register(*registry_);
  auto& batch_tokens = prometheus::BuildHistogram()
                           .Name("mita_batch_tokens")
                           .Help("Tokens per packed batch run (one observation per batch).")
                           .Register(*registry_);
  auto& expert_count = prometheus::BuildHistogram()
                           .Name("mita_requested_expert_count")
                           .Help("Expert count m admitted MiTA requests asked for (after the model's defaults "
                                 "and presets).")
                           .Register(*registry_);
  auto& expert_width = prometheus::BuildHistogram()
                           .Name("mita_requested_expert_width")
                           .Help("Expert width k (keys per routed expert) admitted MiTA requests asked for.")
                           .Register(*registry_);
  auto& applied_expert_count = prometheus::BuildHistogram()
                                   .Name("mita_applied_expert_count")
                                   .Help("Expert count m applied to admitted MiTA requests' inputs (at most their "
                                         "tokens).")
                                   .Register(*registry_);
  auto& applied_expert_width = prometheus::BuildHistogram()
                                   .Name("mita_applied_expert_width")
                                   .Help("Expert width k applied to admitted MiTA requests' inputs (at most their "
                                         "tokens).")
                                   .Register(*registry_);
  auto& full_attention = prometheus::BuildCounter()
                             .Name("mita_full_attention_requests_total")
                             .Help("Admitted requests that asked for full attention.")
                             .Register(*registry_);
  auto& executed_after_cancel =
      prometheus::BuildCounter()
          .Name("mita_work_executed_after_cancel_total")
          .Help("Requests whose batch ran although their caller had given up (cancelled, deadline passed) before "
                "the batch started; 0 by design.")
          .Register(*registry_);
  auto& compute_after_caller_left =
      prometheus::BuildCounter()
          .Name("mita_compute_after_caller_left_seconds_total")
          .Help("Forward time spent for callers who had left (cancelled, deadline passed) while their batch ran: "
                "from when each left to when its work stopped, by its share of the batch's tokens; seconds.")
          .Register(*registry_);
  auto& load_imbalance =
      prometheus::BuildHistogram()
          .Name("mita_attention_expert_load_imbalance")
          .Help("Max/mean queries per routed expert (1 = balanced), averaged over heads; per request and layer.")
          .Register(*registry_);
  auto& routing_entropy =
      prometheus::BuildHistogram()
          .Name("mita_attention_routing_entropy")
          .Help(
              "Entropy of the queries-per-expert distribution / log(expert count), in [0, 1]; per request and "
              "layer.")
          .Register(*registry_);
  auto& pruned_key_fraction =
      prometheus::BuildHistogram()
          .Name("mita_attention_pruned_key_fraction")
          .Help("Fraction of keys selected by no routed expert (emergent token pruning); per request and layer.")
          .Register(*registry_);

  auto add_code_counters = [&requests](RpcMethod method, const std::string& model) {
    ModelMetrics::CodeCounters counters{};
    for (int code = 0; code < kNumStatusCodes; ++code) {
      counters[code] = &requests.Add({{"method", kMethodNames[static_cast<int>(method)]},
                                      {"model", model},
                                      {"code", StatusCodeName(static_cast<absl::StatusCode>(code))}});
    }
    return counters;
  };
  for (int m = 0; m < kNumRpcMethods; ++m) {
    const auto method = static_cast<RpcMethod>(m);
    other_requests_[m] = add_code_counters(method, IsModelMethod(method) ? "unknown" : "");
  }

  const Histogram::BucketBoundaries count_buckets = PowersOfTwo(12);  // up to 4096 experts
  const Histogram::BucketBoundaries width_buckets = PowersOfTwo(16);  // up to 65536 keys
  const Histogram::BucketBoundaries batch_buckets = PowersOfTwo(10);  // up to 1024 requests
  const Histogram::BucketBoundaries token_buckets = PowersOfTwo(20);  // up to 1M tokens
  for (const ModelInfo& info : models) {
    if (models_.count(info.name) > 0) continue;
    auto model = std::make_unique<ModelMetrics>();
    model->name_ = info.name;
    const prometheus::Labels labels = {{"model", info.name}};
    for (int m = 0; m < kNumRpcMethods; ++m) {
      const auto method = static_cast<RpcMethod>(m);
      if (IsModelMethod(method)) model->requests_[m] = add_code_counters(method, info.name);
    }
    model->queue_depth_ = &queue_depth.Add(labels);
    model->queue_compute_units_ = &queue_compute_units.Add(labels);
    model->latency_ = &latency.Add(labels, SecondsBuckets());
    model->queue_delay_ = &queue_delay.Add(labels, SecondsBuckets());
    model->compute_ = &compute.Add(labels, SecondsBuckets());
    model->batch_size_ = &batch_size.Add(labels, batch_buckets);
    model->batch_tokens_ = &batch_tokens.Add(labels, token_buckets);
    model->request_tokens_ = &request_tokens.Add(labels, token_buckets);
    for (int reason = 1; reason < kNumAdmissionRejections; ++reason) {
      model->rejections_[static_cast<size_t>(reason)] = &rejected.Add(
          {{"model", info.name}, {"reason", AdmissionRejectionName(static_cast<AdmissionRejection>(reason))}});
    }
    model->expert_count_ = &expert_count.Add(labels, count_buckets);
    model->expert_width_ = &expert_width.Add(labels, width_buckets);
    model->applied_expert_count_ = &applied_expert_count.Add(labels, count_buckets);
    model->applied_expert_width_ = &applied_expert_width.Add(labels, width_buckets);
    model->full_attention_ = &full_attention.Add(labels);
    model->executed_after_cancel_ = &executed_after_cancel.Add(labels);
    model->compute_after_caller_left_ = &compute_after_caller_left.Add(labels);
    for (int64_t layer = 0; layer < info.layers; ++layer) {
      const prometheus::Labels layer_labels = {{"model", info.name}, {"layer", std::to_string(layer)}};
      ModelMetrics::Layer series;
      series.load_imbalance = &load_imbalance.Add(layer_labels, ImbalanceBuckets());
      series.routing_entropy = &routing_entropy.Add(layer_labels, FractionBuckets());
      series.pruned_key_fraction = &pruned_key_fraction.Add(layer_labels, FractionBuckets());
      model->layers_.push_back(series);
    }
    models_.emplace(info.name, std::move(model));
  }
}

ModelMetrics* ServerMetrics::ForModel(const std::string& name) {
  auto it = models_.find(name);
  return it == models_.end() ? nullptr : it->second.get();
}

void ServerMetrics::CountRequest(RpcMethod method, const ModelMetrics* model, absl::StatusCode code) {
  int index = static_cast<int>(code);
  if (index < 0 || index >= kNumStatusCodes) index = static_cast<int>(absl::StatusCode::kUnknown);
  const int m = static_cast<int>(method);
  if (m < 0 || m >= kNumRpcMethods) return;
  const CodeCounters& counters =
      (model == nullptr || !IsModelMethod(method)) ? other_requests_[m] : model->requests_[m];
  counters[index]->Increment();
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
  // Split "host:port", "[v6]:port".
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", address, "' is not host:port"));
  }
  std::string host = address.substr(0, colon);
  const std::string port_text = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port_number = 0;
  if (!absl::SimpleAtoi(port_text, &port_number) || port_number < 0 || port_number > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", address, "': bad port '", port_text, "'"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* resolved = nullptr;
  const int gai =
      getaddrinfo(host.empty() || host == "*" ? nullptr : host.c_str(), port_text.c_str(), &hints, &resolved);
  if (gai != 0) {
    return absl::UnavailableError(absl::StrCat("metrics: cannot resolve '", address, "': ", gai_strerror(gai)));
  }
  int listen_fd = -1;
  std::string error = "no address";
  for (addrinfo* ai = resolved; ai != nullptr && listen_fd < 0; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
      error = std::strerror(errno);
      close(fd);
      continue;
    }
    listen_fd = fd;
  }
  freeaddrinfo(resolved);
  if (listen_fd < 0) return absl::UnavailableError(absl::StrCat("metrics: cannot listen on '", address, "': ", error));
  sockaddr_storage bound{};
  socklen_t bound_size = sizeof(bound);
  int port = port_number;
  if (getsockname(listen_fd, reinterpret_cast<sockaddr*>(&bound), &bound_size) == 0) {
    port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  }
  int wake[2];
  if (pipe2(wake, O_CLOEXEC) != 0) {
    const std::string message = std::strerror(errno);
    close(listen_fd);
    return absl::UnavailableError(absl::StrCat("metrics: pipe: ", message));
  }
  std::unique_ptr<MetricsHttpServer> server(
      new MetricsHttpServer(listen_fd, wake[0], wake[1], port, std::move(registry)));
  server->thread_ = std::thread([raw = server.get()] { raw->Run(); });
  return server;
}

MetricsHttpServer::MetricsHttpServer(int listen_fd, int wake_read_fd, int wake_write_fd, int port,
                                     std::shared_ptr<prometheus::Registry> registry)
    : listen_fd_(listen_fd),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      port_(port),
      registry_(std::move(registry)) {}

MetricsHttpServer::~MetricsHttpServer() {
  Stop();
  close(listen_fd_);
  close(wake_read_fd_);
  close(wake_write_fd_);
}

void MetricsHttpServer::Stop() {
  absl::MutexLock lock(&stop_mu_);
  if (stopped_) return;
  stopped_ = true;
  const char byte = 0;
  while (write(wake_write_fd_, &byte, 1) < 0 && errno == EINTR) {
  }
  if (thread_.joinable()) thread_.join();
}

void MetricsHttpServer::Run() {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int connection = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) continue;
    Serve(connection);
    close(connection);
  }
}

void MetricsHttpServer::Serve(int connection_fd) const {
  timeval timeout{5, 0};
  setsockopt(connection_fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(connection_fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  // Read the request head (the request line is all that matters); at most 16 KiB.
  std::string head;
  char buffer[4096];
  while (head.find("\r\n\r\n") == std::string::npos && head.find("\n\n") == std::string::npos && head.size() < 16384) {
    const ssize_t n = recv(connection_fd, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    head.append(buffer, static_cast<size_t>(n));
  }
  const std::string request_line = head.substr(0, head.find_first_of("\r\n"));
  const std::vector<std::string> parts = absl::StrSplit(request_line, ' ', absl::SkipEmpty());
  std::string status = "200 OK";
  std::string content_type = "text/plain; version=0.0.4; charset=utf-8";
  std::string body;
  const bool head_only = !parts.empty() && parts[0] == "HEAD";
  if (parts.size() < 2) {
    status = "400 Bad Request";
    body = "bad request\n";
    content_type = "text/plain; charset=utf-8";
  } else if (parts[0] != "GET" && parts[0] != "HEAD") {
    status = "405 Method Not Allowed";
    body = "only GET and HEAD\n";
    content_type = "text/plain; charset=utf-8";
  } else if (const std::string path = parts[1].substr(0, parts[1].find('?')); path != "/metrics") {
    status = "404 Not Found";
    body = "metrics are at /metrics\n";
    content_type = "text/plain; charset=utf-8";
  } else {
    std::ostringstream text;
    prometheus::TextSerializer().Serialize(text, registry_->Collect());
    body = text.str();
  }
  std::string response = absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n");
  if (!head_only) response += body;
  size_t sent = 0;
  while (sent < response.size()) {
    const ssize_t n = send(connection_fd, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace mita::server
