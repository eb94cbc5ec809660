// mita-server-core (started by the mita-server launcher, server/process/launcher.cc): serves the model packages of a model
// repository over gRPC (mita.v1.MitaService, the Open Inference Protocol inference.GRPCInferenceService,
// grpc.health.v1, server reflection) and exports Prometheus metrics over HTTP.
//
// Flags: `mita-server --help` (their help is in the ABSL_FLAG definitions below) and the table in docs/serving.md.
// The gRPC port is bound exclusively: a second server on a port in use fails to start. Shutdown on SIGTERM, SIGINT
// or SIGHUP drains (readiness NOT_SERVING at once, new calls admitted for --drain_notice_ms, then UNAVAILABLE;
// admitted requests answered within --drain_timeout_s) and exits 0: docs/serving.md, "Graceful shutdown". A
// signal during start-up ends it at the next step (after loading, after each model's calibration), exit 0.
#include <grpc/grpc.h>
#include <google/protobuf/stubs/logging.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <signal.h>
#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/flags/usage_config.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/blas_library.h"
#include "kernels/device.h"
#include "kernels/runtime_environment.h"
#include "server/engine/inference_engine.h"
#include "server/engine/model_lifecycle.h"
#include "server/engine/model_repository.h"
#include "server/frontend/health_service.h"
#include "server/frontend/message_limits.h"
#include "server/frontend/mita_v1_service.h"
#include "server/frontend/open_inference_service.h"
#include "server/frontend/security.h"
#include "server/frontend/unary_call.h"
#include "server/metrics/metrics.h"
#include "server/planning/cost_calibration.h"
#include "server/policy/policy_holder.h"
#include "server/process/listen_address.h"
#include "server/process/metrics_http_server.h"
#include "server/process/per_model_flag.h"
#include "server/process/placement.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051",
          "gRPC listening address: host:port, [ipv6]:port, or :port for every address (IPv4 and IPv6).");
ABSL_FLAG(std::string, model_repository, "models/repository",
          "Directory holding one folder per model (the folder name is the model name): a package, or numbered "
          "version folders with an optional version_policy.json.");
ABSL_FLAG(std::string, model_control_mode, "explicit",
          "How models change while serving: none (fixed at start), explicit (the repository API loads, reloads and "
          "unloads them), poll (the repository is re-read every --repository_poll_s). Every mode loads all models "
          "at start.");
ABSL_FLAG(int32_t, repository_poll_s, 5, "With --model_control_mode=poll: seconds between reads of the repository.");
ABSL_FLAG(std::string, device, "cpu",
          "Where models run: cpu or cuda:N; comma-separated MODEL=DEVICE entries place models one by one (an entry "
          "without MODEL= is for the models not named).");
ABSL_FLAG(std::string, weights_dtype, "float32",
          "Dtype of the models' weights and activations: float32, or bfloat16 on a CUDA device or a CPU with "
          "AVX512-BF16 or AMX-BF16; MODEL=DTYPE entries as for --device.");
ABSL_FLAG(double, cuda_memory_fraction, 1.0,
          "Share of each CUDA device's memory (0, 1] that LibTorch's allocator may take for the models on it; a "
          "batch needing more is answered RESOURCE_EXHAUSTED.");
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
ABSL_FLAG(std::string, batch_threads, "1",
          "Threads forming and running batches, per model (its long-document lane has one), in [0, 1024]; they share "
          "--torch_threads. 0: the hardware concurrency. Per model as --weights_dtype: N,MODEL=N.");
ABSL_FLAG(int64_t, long_document_tokens, 8192,
          "Documents of more tokens run in a lane of their own (one batch thread per model), beside shorter "
          "requests instead of ahead of them; 0: one lane.");
ABSL_FLAG(int32_t, torch_threads, 0,
          "Intra-op threads one lane's forwards share: each of its batch threads runs on torch_threads / "
          "batch_threads (at least 1), the long-document lane's one thread on all; also the process-wide count of "
          "LibTorch and of OpenBLAS (whose count is process-wide only). 0: the hardware concurrency.");
ABSL_FLAG(int32_t, preparation_threads, 0,
          "Threads that decode images and tokenize documents before admission; 0: the hardware concurrency.");
ABSL_FLAG(int64_t, preparation_queue_capacity, 1024,
          "Requests waiting for a preparation thread before new ones get RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, preparation_memory_bytes, int64_t{1} << 30,
          "Working memory, bytes, that all inputs being decoded or tokenized may take together; each is admitted by "
          "the estimate from its header (an image's decoded size) and waits for room; one needing more is refused.");
ABSL_FLAG(bool, keep_freed_memory, true,
          "Keep freed memory in the C heap for reuse by the next request (no per-block mmap, no trimming): long "
          "documents skip re-faulting their buffers in; resident memory stays at its high-water mark.");
ABSL_FLAG(int64_t, keep_freed_memory_limit_bytes, int64_t{512} << 20,
          "With --keep_freed_memory: the most resident memory the heap keeps free for reuse, bytes (512 MiB); above "
          "it (checked every second) the freed memory is returned to the system. 0: no limit.");
ABSL_FLAG(int64_t, max_receive_message_bytes, mita::server::MessageSizeLimits::kDefaultBytes,
          "Largest request message, bytes (4 MiB); larger gets RESOURCE_EXHAUSTED naming this flag.");
ABSL_FLAG(int64_t, max_send_message_bytes, mita::server::MessageSizeLimits::kDefaultBytes,
          "Largest response message, bytes (4 MiB); larger gets RESOURCE_EXHAUSTED naming this flag.");
ABSL_FLAG(int32_t, cost_calibration_ms, 2000,
          "Most time per model for the start-up sweep that calibrates its cost model (batch compute "
          "prediction for latency targets and deadline-aware admission), ms; 0: no sweep (prior coefficients, "
          "corrected online).");
ABSL_FLAG(std::string, cost_profile, "",
          "Cost profiles saved by --save_cost_profile: load them instead of calibrating.");
ABSL_FLAG(std::string, save_cost_profile, "", "Write the models' cost profiles to this file after calibration.");
ABSL_FLAG(bool, deadline_admission, true,
          "Answer DEADLINE_EXCEEDED at once for a request predicted to miss its deadline even at the least "
          "accurate budget it allows, instead of running it late.");
ABSL_FLAG(int32_t, planning_slack_percentile, 99,
          "Latency targets and deadline admission plan with time left less this percentile of how much later "
          "than predicted recent requests were answered (per model and lane), so that a request admitted at "
          "the edge of its deadline still meets it; 0: plan with the prediction alone.");
ABSL_FLAG(int32_t, drain_timeout_s, 20,
          "On SIGTERM, SIGINT or SIGHUP, seconds admitted requests may take to finish.");
ABSL_FLAG(int32_t, drain_notice_ms, 1000,
          "On SIGTERM, SIGINT or SIGHUP: milliseconds the server keeps admitting new calls after its health turns "
          "NOT_SERVING, so that clients watching it (client-side health checking) move to other replicas before "
          "calls are refused; within --drain_timeout_s.");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM certificate chain of the gRPC port; with --tls_key_file enables TLS.");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA certificates; when set, clients must present a certificate signed by them (mutual TLS).");
ABSL_FLAG(int32_t, max_concurrent_streams, 256,
          "Calls in flight per client connection (HTTP/2 streams); further calls on it wait for one to end.");
ABSL_FLAG(int32_t, max_connection_idle_s, 300,
          "Seconds a client connection may stay without calls before the server closes it; 0: never.");
ABSL_FLAG(int32_t, keepalive_time_s, 60,
          "Seconds of silence on a connection after which the server pings it (HTTP/2 keepalive).");
ABSL_FLAG(int32_t, keepalive_timeout_s, 20,
          "Seconds the server waits for a keepalive ping's answer before closing the connection and its calls.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a bearer token that every mita.v1 call must send as 'authorization: Bearer <token>' "
          "(health checks and reflection stay open); empty: no authentication.");
ABSL_FLAG(std::string, client_policy_file, "",
          "JSON budget policy per client (README, 'Budget policy per client'): clients by bearer-token SHA-256 or "
          "mTLS certificate subject, their allowed budgets, default preset, compute quota and priority; empty: none.");
ABSL_FLAG(int32_t, client_policy_poll_s, 5,
          "Seconds between checks of --client_policy_file for a new content (a bad file keeps the policy in force).");

namespace {

// After the last admitted request is answered, how long new calls still get UNAVAILABLE before gRPC stops.
constexpr absl::Duration kRefuseAfterDrain = absl::Milliseconds(250);

void Log(const std::string& line) {
  std::fprintf(stderr, "%s mita-server: %s\n",
               absl::FormatTime("%Y-%m-%dT%H:%M:%E3S%Ez", absl::Now(), absl::LocalTimeZone()).c_str(), line.c_str());
  std::fflush(stderr);
}

int Fail(const std::string& message) {
  Log(absl::StrCat("error: ", message));
  return 1;
}

// The shutdown signals, blocked in every thread; the main thread waits for them with sigwait: SIGTERM, SIGINT and
// SIGHUP (a hangup drains like SIGTERM), but not SIGHUP when the process started with it ignored (nohup, or a
// launcher's SIG_IGN, which exec keeps): it stays ignored then.
sigset_t ShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  struct sigaction hangup {};
  if (sigaction(SIGHUP, nullptr, &hangup) != 0 || hangup.sa_handler != SIG_IGN) sigaddset(&signals, SIGHUP);
  return signals;
}

const char* SignalName(int signal_number) {
  switch (signal_number) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "a signal";
  }
}

// The shutdown signal pending (sent during start-up, still blocked), or 0 when none is.
int PendingShutdownSignal(const sigset_t& shutdown_signals) {
  sigset_t pending;
  if (sigpending(&pending) != 0) return 0;
  for (const int signal_number : {SIGTERM, SIGINT, SIGHUP}) {
    if (sigismember(&shutdown_signals, signal_number) == 1 && sigismember(&pending, signal_number) == 1) {
      return signal_number;
    }
  }
  return 0;
}

// Blocks the shutdown signals before any shared library's initialisers run, for a server started directly
// rather than through the mita-server launcher (server/process/launcher.cc, which blocks them within a millisecond of
// exec): a SIGTERM during start-up stays pending, is found after the models load or a model's calibration, and
// the process exits 0 without serving (once serving, sigwait takes it and the server drains).
void BlockShutdownSignals(int, char**, char**) {
  const sigset_t signals = ShutdownSignals();
  sigprocmask(SIG_BLOCK, &signals, nullptr);
}
__attribute__((section(".preinit_array"), used)) void (*const kBlockShutdownSignals)(int, char**, char**) =
    &BlockShutdownSignals;

// Protobuf's log lines, rate-limited: parsing a request with invalid UTF-8 in a string field logs one ERROR line
// per message, which a client could use to flood the log (the request itself is answered INVALID_ARGUMENT and
// counted). At most one line per second reaches stderr, with the number of lines dropped before it.
void RateLimitedProtobufLog(google::protobuf::LogLevel level, const char* filename, int line,
                            const std::string& message) {
  static absl::Mutex mu(absl::kConstInit);
  static absl::Time last = absl::InfinitePast();
  static int64_t dropped = 0;
  absl::MutexLock lock(&mu);
  const absl::Time now = absl::Now();
  if (level < google::protobuf::LOGLEVEL_FATAL && now - last < absl::Seconds(1)) {
    ++dropped;
    return;
  }
  last = now;
  Log(absl::StrCat("protobuf ", filename, ":", line, ": ", message,
                   dropped > 0 ? absl::StrCat(" (", dropped, " earlier protobuf log lines dropped)") : ""));
  dropped = 0;
}

// Checks that a flag is in [low, high] (a NaN is not); the error names the flag and the range.
template <typename Number, typename Bound>
absl::Status CheckFlagRange(const char* flag, Number value, Bound low, Bound high) {
  if (value >= low && value <= high) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("flag --", flag, ": ", value, " is out of range: allowed [", low, ", ", high, "]"));
}

}  // namespace

int main(int argc, char** argv) {
  // Named like its launcher, so that pgrep/pkill mita-server find the server (/proc/PID/comm).
  prctl(PR_SET_NAME, "mita-server", 0, 0, 0);
  // Blocked already, by the launcher or BlockShutdownSignals (the .preinit_array runs before any initialiser).
  sigset_t shutdown_signals = ShutdownSignals();
  mita::kernels::ReexecWithOpenMpWaitSettingsIfUnset(argv);

  google::protobuf::SetLogHandler(&RateLimitedProtobufLog);
  absl::SetProgramUsageMessage("Serves MiTA classifiers over gRPC. mita-server --model_repository=DIR [flags]");
  // --help lists the flags of this file (Abseil would look for a file named after the binary).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "/server/process/main.cc");
  };
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
  const int32_t drain_timeout_s = absl::GetFlag(FLAGS_drain_timeout_s);
  const int32_t drain_notice_ms = absl::GetFlag(FLAGS_drain_notice_ms);

  // Both addresses are checked (their form, and that they can be bound now) before the models load (seconds).
  const std::string listen = absl::GetFlag(FLAGS_listen);
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);  // empty: no /metrics endpoint
  absl::StatusOr<mita::server::ListenAddress> listen_address = mita::server::ParseListenAddress(listen, "--listen");
  if (!listen_address.ok()) return Fail(std::string(listen_address.status().message()));
  if (absl::Status status = mita::server::CheckCanListen(*listen_address, "--listen"); !status.ok()) {
    return Fail(std::string(status.message()));
  }
  if (!metrics_listen.empty()) {
    absl::StatusOr<mita::server::ListenAddress> metrics_address =
        mita::server::ParseListenAddress(metrics_listen, "--metrics_listen");
    if (!metrics_address.ok()) return Fail(std::string(metrics_address.status().message()));
    if (absl::Status status = mita::server::CheckCanListen(*metrics_address, "--metrics_listen"); !status.ok()) {
      return Fail(std::string(status.message()));
    }
  }
  const int32_t max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  const int32_t max_connection_idle_s = absl::GetFlag(FLAGS_max_connection_idle_s);
  const int32_t keepalive_time_s = absl::GetFlag(FLAGS_keepalive_time_s);
  const int32_t keepalive_timeout_s = absl::GetFlag(FLAGS_keepalive_timeout_s);
  int32_t torch_threads = absl::GetFlag(FLAGS_torch_threads);
  const int32_t preparation_threads = absl::GetFlag(FLAGS_preparation_threads);
  const int64_t preparation_queue_capacity = absl::GetFlag(FLAGS_preparation_queue_capacity);
  const int64_t preparation_memory_bytes = absl::GetFlag(FLAGS_preparation_memory_bytes);
  const int64_t long_document_tokens = absl::GetFlag(FLAGS_long_document_tokens);
  const double cuda_memory_fraction = absl::GetFlag(FLAGS_cuda_memory_fraction);
  for (const absl::Status& status :
       {CheckFlagRange("max_batch_size", absl::GetFlag(FLAGS_max_batch_size), int64_t{1}, int64_t{65536}),
        CheckFlagRange("queue_capacity", absl::GetFlag(FLAGS_queue_capacity), int64_t{1}, int64_t{1} << 30),
        CheckFlagRange("max_batch_tokens", absl::GetFlag(FLAGS_max_batch_tokens), int64_t{1}, int64_t{1} << 40),
        CheckFlagRange("max_queue_delay_ms", delay_ms, 0, 60000),
        CheckFlagRange("drain_timeout_s", drain_timeout_s, 0, 86400),
        CheckFlagRange("repository_poll_s", absl::GetFlag(FLAGS_repository_poll_s), 1, 86400),
        CheckFlagRange("drain_notice_ms", drain_notice_ms, 0, 86400000),
        CheckFlagRange("cost_calibration_ms", absl::GetFlag(FLAGS_cost_calibration_ms), 0, 600000),
        CheckFlagRange("planning_slack_percentile", absl::GetFlag(FLAGS_planning_slack_percentile), 0, 100),
        CheckFlagRange("torch_threads", torch_threads, 0, 1024),
        CheckFlagRange("preparation_threads", preparation_threads, 0, 1024),
        CheckFlagRange("preparation_queue_capacity", preparation_queue_capacity, int64_t{1}, int64_t{1} << 30),
        CheckFlagRange("preparation_memory_bytes", preparation_memory_bytes, int64_t{1},
                       std::numeric_limits<int64_t>::max()),
        CheckFlagRange("long_document_tokens", long_document_tokens, int64_t{0},
                       int64_t{std::numeric_limits<int32_t>::max()}),
        CheckFlagRange("max_concurrent_streams", max_concurrent_streams, 1, 1 << 20),
        CheckFlagRange("max_connection_idle_s", max_connection_idle_s, 0, 86400 * 365),
        CheckFlagRange("keepalive_time_s", keepalive_time_s, 1, 86400 * 365),
        CheckFlagRange("keepalive_timeout_s", keepalive_timeout_s, 1, 3600),
        CheckFlagRange("client_policy_poll_s", absl::GetFlag(FLAGS_client_policy_poll_s), 1, 86400),
        CheckFlagRange("keep_freed_memory_limit_bytes", absl::GetFlag(FLAGS_keep_freed_memory_limit_bytes),
                       int64_t{0}, std::numeric_limits<int64_t>::max())}) {
    if (!status.ok()) return Fail(std::string(status.message()));
  }
  if (int64_t{drain_notice_ms} > int64_t{drain_timeout_s} * 1000) {
    return Fail(absl::StrCat("flag --drain_notice_ms: ", drain_notice_ms, " is longer than --drain_timeout_s (",
                             drain_timeout_s, " s): the notice is part of the drain; allowed [0, ",
                             int64_t{drain_timeout_s} * 1000, "]"));
  }
  if (!(cuda_memory_fraction > 0 && cuda_memory_fraction <= 1)) {
    return Fail(absl::StrCat("flag --cuda_memory_fraction: ", cuda_memory_fraction, " is out of range: allowed (0, 1]"));
  }

  const int32_t cores = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
  if (torch_threads == 0) torch_threads = cores;
  absl::StatusOr<mita::server::PerModelValue<int>> batch_threads_flag = mita::server::ParsePerModel<int>(
      "batch_threads", absl::GetFlag(FLAGS_batch_threads), [cores](absl::string_view text) -> absl::StatusOr<int> {
        int value = 0;
        if (!absl::SimpleAtoi(text, &value) || value < 0 || value > 1024) {
          return absl::InvalidArgumentError(
              absl::StrCat("'", text, "' is not a thread count: allowed [0, 1024] (0: the hardware concurrency)"));
        }
        return value == 0 ? cores : value;
      });
  if (!batch_threads_flag.ok()) return Fail(std::string(batch_threads_flag.status().message()));
  // Before any thread allocates: the allocator's arenas are chosen at a thread's first allocation.
  const bool keep_freed_memory =
      absl::GetFlag(FLAGS_keep_freed_memory) && mita::kernels::KeepFreedMemoryForReuse();
  const int blas_threads = mita::kernels::SetIntraOpThreads(torch_threads);
  const int64_t freed_memory_limit_bytes = absl::GetFlag(FLAGS_keep_freed_memory_limit_bytes);
  // Debian's Abseil is built without NDEBUG, so absl::Mutex records every lock order in a global graph to detect
  // deadlocks (GraphCycles showed in server profiles under load); a serving process does not pay for that.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  mita::server::EngineOptions options;
  options.batching.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  options.batching.max_queue_delay = absl::Microseconds(static_cast<int64_t>(delay_ms * 1000.0));
  options.batching.queue_capacity = absl::GetFlag(FLAGS_queue_capacity);
  options.batching.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.batching.queue_compute_units = absl::GetFlag(FLAGS_queue_compute_units);
  options.batching.num_batch_threads = batch_threads_flag->otherwise.value_or(1);
  options.batch_threads_by_model = batch_threads_flag->by_model;
  options.intra_op_threads = torch_threads;
  options.batching.queue_capacity_source = "flag --queue_capacity";
  options.batching.max_batch_size_source = "flag --max_batch_size";
  options.max_encoded_image_bytes = message_limits.max_receive_bytes;
  options.preparation_threads = preparation_threads;
  options.preparation_queue_capacity = preparation_queue_capacity;
  options.preparation_memory_bytes = preparation_memory_bytes;
  options.long_document_tokens = long_document_tokens;
  if (absl::Status status = mita::server::ValidateBatcherOptions(options.batching); !status.ok()) {
    return Fail(std::string(status.message()));
  }

  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = mita::server::MakeServerCredentials(
      {absl::GetFlag(FLAGS_tls_cert_file), absl::GetFlag(FLAGS_tls_key_file), absl::GetFlag(FLAGS_tls_client_ca_file)});
  if (!credentials.ok()) return Fail(std::string(credentials.status().message()));
  std::unique_ptr<mita::server::BearerTokenAuthenticator> authenticator;
  if (const std::string token_file = absl::GetFlag(FLAGS_auth_token_file); !token_file.empty()) {
    absl::StatusOr<std::unique_ptr<mita::server::BearerTokenAuthenticator>> loaded =
        mita::server::BearerTokenAuthenticator::FromFile(token_file);
    if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
    authenticator = *std::move(loaded);
  }
  mita::server::FrontEndOptions front_end;
  front_end.authenticator = authenticator.get();
  std::unique_ptr<mita::server::policy::ClientPolicyHolder> client_policy;
  if (const std::string policy_file = absl::GetFlag(FLAGS_client_policy_file); !policy_file.empty()) {
    absl::StatusOr<std::unique_ptr<mita::server::policy::ClientPolicyHolder>> loaded =
        mita::server::policy::ClientPolicyHolder::Load(policy_file);
    if (!loaded.ok()) return Fail(absl::StrCat(loaded.status().message(), " (flag --client_policy_file)"));
    client_policy = *std::move(loaded);
    front_end.client_policy = client_policy.get();
    Log(absl::StrCat("client policy from ", policy_file, ": clients ",
                     absl::StrJoin(client_policy->client_names(), ", "), "; checked for changes every ",
                     absl::GetFlag(FLAGS_client_policy_poll_s), " s"));
  }

  const std::string repository = absl::GetFlag(FLAGS_model_repository);
  // Where each model runs, checked before any weights are read: a CUDA device that is not there fails here.
  absl::StatusOr<mita::server::PlacementFlags> placement_flags =
      mita::server::PlacementFlags::Parse(absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_weights_dtype));
  if (!placement_flags.ok()) return Fail(std::string(placement_flags.status().message()));
  absl::StatusOr<mita::server::ModelControlMode> control_mode =
      mita::server::ParseModelControlMode(absl::GetFlag(FLAGS_model_control_mode));
  if (!control_mode.ok()) return Fail(std::string(control_mode.status().message()));
  absl::StatusOr<std::vector<std::string>> model_names = mita::server::ModelFolderNames(repository);
  if (!model_names.ok()) return Fail(model_names.status().ToString());
  absl::StatusOr<std::map<std::string, mita::models::Placement>> placements = placement_flags->Resolve(*model_names);
  if (!placements.ok()) return Fail(std::string(placements.status().message()));
  if (absl::Status named = mita::server::CheckNamedModels(
          "batch_threads", *batch_threads_flag, std::set<std::string>(model_names->begin(), model_names->end()));
      !named.ok()) {
    return Fail(std::string(named.message()));
  }
  std::set<std::string> cuda_devices;
  for (const auto& [name, placement] : *placements) {
    if (!placement.device.is_cuda() || !cuda_devices.insert(mita::kernels::DeviceName(placement.device)).second) continue;
    if (cuda_memory_fraction < 1) {
      if (absl::Status limited = mita::kernels::LimitCudaMemory(placement.device, cuda_memory_fraction); !limited.ok()) {
        return Fail(absl::StrCat("flag --cuda_memory_fraction: ", limited.message()));
      }
    }
  }
  if (!cuda_devices.empty()) {
    Log(absl::StrCat("CUDA: ", mita::kernels::CudaBuildSummary(), "; ", mita::kernels::VisibleCudaDevices(),
                     " device(s) visible; models use ", absl::StrJoin(cuda_devices, ", "),
                     cuda_memory_fraction < 1 ? absl::StrCat(", each up to ", cuda_memory_fraction, " of its memory")
                                              : std::string()));
  }
  // A shutdown signal sent while the models load ends start-up after the model loading then (its calibration
  // included) instead of after every model: there is nothing to drain yet.
  bool stop_requested = false;
  auto stopped_before_serving = [&shutdown_signals, &stop_requested]() {
    if (stop_requested) return true;
    const int signal_number = PendingShutdownSignal(shutdown_signals);
    if (signal_number == 0) return false;
    Log(absl::StrCat("received ", SignalName(signal_number), " during start-up; exiting before serving"));
    stop_requested = true;
    return true;
  };

  // Each model version's cost model: read from --cost_profile, or calibrated by a bounded sweep
  // (server/planning/cost_calibration.h) when it loads, at start and when the repository API or a poll loads it.
  options.planning.deadline_admission = absl::GetFlag(FLAGS_deadline_admission);
  options.planning.slack_percentile = absl::GetFlag(FLAGS_planning_slack_percentile);
  const std::string cost_profile_file = absl::GetFlag(FLAGS_cost_profile);
  std::string cost_profile_text;
  if (!cost_profile_file.empty()) {
    std::ifstream file(cost_profile_file, std::ios::binary);
    std::ostringstream text;
    text << file.rdbuf();
    if (!file) return Fail(absl::StrCat("flag --cost_profile: cannot read ", cost_profile_file));
    cost_profile_text = text.str();
  }
  const absl::Duration calibration_time = absl::Milliseconds(absl::GetFlag(FLAGS_cost_calibration_ms));
  auto cost_profile_of = [&](const std::string& name,
                             const mita::models::Classifier& classifier) -> absl::StatusOr<mita::server::CostProfile> {
    // Calibrated on the threads of one batch thread of the short-input lane, where most batches run (the
    // long-input lane's correction learns its own).
    mita::kernels::SetCallingThreadIntraOpThreads(
        mita::server::IntraOpThreadsPerBatchThread(torch_threads, options.BatchThreadsOf(name)));
    absl::StatusOr<mita::server::CostProfile> profile =
        cost_profile_file.empty() ? mita::server::CalibrateCostModel(classifier, calibration_time,
                                                                      options.batching.max_batch_size,
                                                                      options.batching.max_batch_tokens)
                                  : mita::server::FindCostProfile(cost_profile_text, cost_profile_file,
                                                                  classifier.description());
    // Loading and calibrating ran parallel regions on this thread, which runs no forward while serving: its OpenMP
    // team would only keep the batch threads' workers from spinning (kernels/runtime_environment.h).
    mita::kernels::ReleaseCallingThreadIntraOpTeam();
    if (!profile.ok()) {
      return absl::Status(profile.status().code(),
                          absl::StrCat(cost_profile_file.empty() ? "cost calibration: " : "flag --cost_profile: ",
                                       profile.status().message()));
    }
    Log(absl::StrCat("cost model of '", name, "': ", profile->source,
                     profile->source == "calibrated"
                         ? absl::StrCat(" from ", profile->calibration_batches, " batches in ",
                                        absl::FormatDuration(profile->calibration_time), ", median fit error ",
                                        absl::StrFormat("%.1f%%", 100 * profile->fit_error))
                         : std::string()));
    return profile;
  };
  // A model the repository gains while serving is placed by the same flags.
  auto placement_of = [&](const std::string& name) -> absl::StatusOr<mita::models::Placement> {
    if (auto found = placements->find(name); found != placements->end()) return found->second;
    std::vector<std::string> names = *model_names;
    names.push_back(name);
    absl::StatusOr<std::map<std::string, mita::models::Placement>> resolved = placement_flags->Resolve(names);
    if (!resolved.ok()) return resolved.status();
    return resolved->at(name);
  };

  mita::server::ServerMetrics metrics({});
  if (client_policy != nullptr) mita::server::DeclareClientMetrics(*client_policy, metrics);
  absl::StatusOr<std::unique_ptr<mita::server::InferenceEngine>> engine =
      mita::server::InferenceEngine::Create(nullptr, &metrics, options);
  if (!engine.ok()) return Fail(engine.status().ToString());
  mita::server::ModelLifecycleOptions lifecycle_options;
  lifecycle_options.repository = repository;
  lifecycle_options.mode = *control_mode;
  lifecycle_options.poll_interval = absl::Seconds(absl::GetFlag(FLAGS_repository_poll_s));
  lifecycle_options.drain_timeout = absl::Seconds(drain_timeout_s);
  lifecycle_options.placement = placement_of;
  lifecycle_options.profile = cost_profile_of;
  lifecycle_options.log = [](const std::string& line) { Log(line); };
  mita::server::ModelLifecycle lifecycle(engine->get(), &metrics, lifecycle_options);
  const absl::Time load_start = absl::Now();
  if (absl::Status loaded = lifecycle.LoadAll(stopped_before_serving); !loaded.ok()) return Fail(loaded.ToString());
  if (stopped_before_serving()) return 0;
  std::vector<std::string> loaded_names;
  for (const mita::server::ModelHandle& model : (*engine)->models()) loaded_names.push_back(model->name());
  Log(absl::StrCat("loaded ", loaded_names.size(), " model(s) from ", repository, " in ",
                   absl::FormatDuration(absl::Now() - load_start), " (model control: ",
                   mita::server::ModelControlModeName(*control_mode), ")"));
  if (const std::string save = absl::GetFlag(FLAGS_save_cost_profile); !save.empty()) {
    std::map<std::string, mita::server::CostProfile> profiles;
    std::map<std::string, const mita::models::ClassifierDescription*> descriptions;
    const std::vector<mita::server::ModelHandle> models = (*engine)->models();
    for (const mita::server::ModelHandle& model : models) {
      profiles[model->name()] = model->runner().cost_summary().profile;
      descriptions[model->name()] = &model->description();
    }
    std::ofstream file(save, std::ios::binary | std::ios::trunc);
    file << mita::server::CostProfilesToJson(profiles, descriptions);
    if (!file) return Fail(absl::StrCat("flag --save_cost_profile: cannot write ", save));
    Log(absl::StrCat("cost profiles saved to ", save));
  }

  // What the calibration batches freed goes back to the system now, and the heap keeps at most the limit free from
  // here on (kernels::FreedMemoryLimit, checked every second; its figures in mita_heap_*).
  std::unique_ptr<mita::kernels::FreedMemoryLimit> freed_memory_limit;
  int64_t returned_at_start = 0;
  if (keep_freed_memory && freed_memory_limit_bytes > 0) {
    freed_memory_limit = std::make_unique<mita::kernels::FreedMemoryLimit>(
        freed_memory_limit_bytes, absl::Seconds(1), [&metrics](const mita::kernels::FreedMemoryLimit::Stats& stats) {
          metrics.SetHeapMemory(stats.kept_bytes, stats.returned_bytes);
        });
    returned_at_start = freed_memory_limit->stats().returned_bytes;
  } else {
    returned_at_start = mita::kernels::ReturnFreedMemory();
  }
  metrics.SetHeapMemory(0, returned_at_start);
  front_end.message_size = std::make_shared<mita::server::MessageSizeGuard>(message_limits, metrics.registry().get());
  std::unique_ptr<mita::server::MetricsHttpServer> metrics_server;
  if (!metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<mita::server::MetricsHttpServer>> started =
        mita::server::MetricsHttpServer::Start(metrics_listen, metrics.registry());
    if (!started.ok()) {
      const bool names_flag = started.status().code() == absl::StatusCode::kInvalidArgument;
      return Fail(absl::StrCat(started.status().message(), names_flag ? "" : " (flag --metrics_listen)"));
    }
    metrics_server = *std::move(started);
  }

  front_end.lifecycle = &lifecycle;
  mita::server::MitaV1Service mita_v1(engine->get(), &metrics, front_end);
  // Open Inference Protocol (KServe V2) on the same port, on the same engine.
  mita::server::OpenInferenceService open_inference(engine->get(), &metrics, front_end, "0.1.0");

  // grpc.health.v1, served by the server itself (server/frontend/health_service.h), open without a token.
  mita::server::HealthService health(front_end);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int selected_port = 0;
  builder.AddListeningPort(mita::server::GrpcListenTarget(*listen_address), *credentials, &selected_port);
  // Without this gRPC sets SO_REUSEPORT, and a second server on the same port would start and share it.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, max_concurrent_streams);
  if (max_connection_idle_s > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, max_connection_idle_s * 1000);
  }
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, keepalive_time_s * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keepalive_timeout_s * 1000);
  // Clients may ping as often as every 10 s without calls in flight (gRPC's default refuses pings without calls).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  front_end.message_size->ConfigureServer(builder);
  // Compressed requests reach the services as sent, and are inflated after authentication within the limit.
  mita::server::ConfigureTransport(builder);
  builder.RegisterService(&health);
  builder.RegisterService(&mita_v1);
  builder.RegisterService(&open_inference);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || selected_port == 0) {
    return Fail(absl::StrCat("cannot listen on '", listen,
                             "' (flag --listen): the address is not local, or the port is in use"));
  }
  health.SetServingStatus("", true);
  // Liveness (Kubernetes' livenessProbe): SERVING while the process answers, draining included.
  health.SetServingStatus(std::string(mita::server::kLivenessService), true);
  health.SetServingStatus(mita::v1::MitaService::service_full_name(), true);
  health.SetServingStatus(inference::GRPCInferenceService::service_full_name(), true);
  open_inference.SetReady(true);
  std::string metrics_line = "metrics disabled";
  if (metrics_server != nullptr) {
    metrics_line = absl::StrCat("metrics on http://", metrics_listen, "/metrics (port ", metrics_server->port(), ")");
  }
  const bool tls = !absl::GetFlag(FLAGS_tls_cert_file).empty();
  const bool client_certificates = !absl::GetFlag(FLAGS_tls_client_ca_file).empty();
  Log(absl::StrCat("serving gRPC", tls ? " over TLS" : "", client_certificates ? " (client certificates required)" : "",
                   authenticator != nullptr ? " with bearer-token authentication" : "", " on ", listen, " (port ",
                   selected_port, "; mita.v1.MitaService, grpc.health.v1, ",
                   "inference.GRPCInferenceService, reflection), ", metrics_line, "; models: ", absl::StrJoin(loaded_names, ", "),
                   " (model control: ", mita::server::ModelControlModeName(*control_mode), ")",
                   "; max_batch_size=", options.batching.max_batch_size,
                   " max_queue_delay=", absl::FormatDuration(options.batching.max_queue_delay),
                   " max_batch_tokens=", options.batching.max_batch_tokens,
                   " queue_capacity=", options.batching.queue_capacity,
                   " queue_compute_units=", options.batching.queue_compute_units,
                   " batch_threads=", options.batching.num_batch_threads,
                   absl::StrJoin(options.batch_threads_by_model, "",
                                 [](std::string* out, const auto& entry) {
                                   absl::StrAppend(out, ",", entry.first, "=", entry.second);
                                 }),
                   " long_document_tokens=", options.long_document_tokens, " torch_threads=", torch_threads,
                   " blas_threads=", blas_threads, " blas=\"", mita::kernels::BlasLibrary::Get().description(),
                   "\" (", mita::kernels::BlasLibrary::choice_reason(), ") preparation_threads=", preparation_threads,
                   " keep_freed_memory=", keep_freed_memory ? "true" : "false",
                   keep_freed_memory ? absl::StrCat(" keep_freed_memory_limit_bytes=", freed_memory_limit_bytes) : "",
                   "; returned ", returned_at_start >> 20, " MiB of freed memory to the system after start-up"));

  lifecycle.StartPolling();
  // The client policy is reloaded when its file changes; a bad file keeps the policy in force and is logged once.
  absl::Notification stop_policy_poll;
  std::thread policy_poll([&] {
    const absl::Duration interval = absl::Seconds(absl::GetFlag(FLAGS_client_policy_poll_s));
    while (client_policy != nullptr && !stop_policy_poll.WaitForNotificationWithTimeout(interval)) {
      const absl::StatusOr<bool> reloaded = client_policy->ReloadIfChanged();
      if (!reloaded.ok()) Log(absl::StrCat("client policy not reloaded: ", reloaded.status().message()));
      if (reloaded.ok() && *reloaded) {
        mita::server::DeclareClientMetrics(*client_policy, metrics);
        Log(absl::StrCat("client policy reloaded from ", client_policy->path(), ": clients ",
                         absl::StrJoin(client_policy->client_names(), ", ")));
      }
    }
  });

  int signal_number = 0;
  sigwait(&shutdown_signals, &signal_number);
  stop_policy_poll.Notify();
  policy_poll.join();
  Log(absl::StrCat("received ", SignalName(signal_number), "; draining (up to ", drain_timeout_s,
                   " s; health NOT_SERVING, new calls admitted for ", drain_notice_ms, " ms more)"));
  // Readiness turns false at once: "" and both services NOT_SERVING (watchers are told now), liveness stays.
  health.SetServingStatus("", false);
  health.SetServingStatus(mita::v1::MitaService::service_full_name(), false);
  health.SetServingStatus(inference::GRPCInferenceService::service_full_name(), false);
  open_inference.SetReady(false);
  const absl::Time drain_start = absl::Now();
  const absl::Time drain_deadline = drain_start + absl::Seconds(drain_timeout_s);
  // The notice: calls on their way, and those of clients that have not yet seen NOT_SERVING, are still served.
  absl::SleepFor(std::min(absl::Milliseconds(drain_notice_ms), drain_deadline - drain_start));
  // New Classify calls get UNAVAILABLE from now on; queued ones run at once; admitted ones finish.
  (*engine)->BeginDrain();
  const bool idle = (*engine)->WaitUntilIdle(drain_deadline);
  // Keep refusing new calls with UNAVAILABLE a little longer: a call that reaches gRPC while it stops is
  // cancelled instead, which tells its caller less (it cannot know whether the request ran).
  if (idle) absl::SleepFor(std::min(kRefuseAfterDrain, std::max(absl::ZeroDuration(), drain_deadline - absl::Now())));
  // Stop the gRPC server. When idle, what is left are quick calls and streams such as health watches: give
  // them a second. Otherwise calls still running at the drain deadline are cancelled now (their handlers take
  // queued work back and answer).
  const absl::Time stop_deadline = idle ? std::min(drain_deadline, absl::Now() + absl::Seconds(1)) : absl::Now();
  // Open health watches end now (they have seen NOT_SERVING), instead of holding the stop until its deadline.
  health.Shutdown();
  server->Shutdown(absl::ToChronoTime(stop_deadline));
  (*engine)->Shutdown();
  server->Wait();
  if (metrics_server != nullptr) metrics_server->Stop();
  const mita::server::InferenceEngine::AdmissionCounts counts = (*engine)->admission_counts();
  Log(absl::StrCat("stopped after draining for ", absl::FormatDuration(absl::Now() - drain_start),
                   idle ? "" : " (drain timeout: calls still running were cancelled)", "; requests admitted ",
                   counts.admitted, ", answered ok ", counts.ok, ", answered with an error ", counts.failed,
                   "; calls received as retries ", metrics.retried_calls()));
  return 0;
}
