// Graceful shutdown of a real mita-server process: closed-loop traffic runs through SIGTERM; the test checks
// that health turns NOT_SERVING (a grpc.health.v1 Watch stream opened before the signal), that calls after
// the signal get UNAVAILABLE, that the process exits 0 within the drain timeout, and that no admitted request
// is lost: every call the server admitted (its last log line counts them) was answered OK to the client.
// Also the server's threading under load (ServerThreadsTest).
#include <grpcpp/client_context.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <memory>
#include <mutex>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/mita_client.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

#ifndef MITA_SERVER_PATH
#error "MITA_SERVER_PATH (the mita-server binary) must be defined by the build"
#endif

namespace mita {
namespace {

constexpr char kModel[] = "fashion-mnist-vit";
constexpr int kClients = 16;
constexpr int kDrainTimeoutS = 20;

using test_util::ReadFile;
using test_util::RepositoryPath;
using test_util::WaitForExit;

// Starts mita-server with `arguments`, its stderr (the log) going to `log_path`. Returns the pid.
pid_t StartServer(const std::vector<std::string>& arguments, const std::string& log_path) {
  return test_util::StartProcess(MITA_SERVER_PATH, arguments, log_path);
}

// Waits for the log line "serving gRPC ... (port N;" and returns N, or 0 after `bound`.
int WaitForPort(const std::string& log_path, absl::Duration bound) {
  return test_util::WaitForLogPort(log_path, R"(serving gRPC.* \(port (\d+);)", bound);
}

// A started mita-server: its pid, and its gRPC port (0 when it did not start).
struct StartedServer {
  pid_t pid = -1;
  int port = 0;
};

// Starts mita-server with `arguments` (log in `log_path`) and waits up to 120 s for its gRPC port. When the port
// does not appear, the process is killed and reaped and the port is 0.
StartedServer StartServerAndWaitForPort(const std::vector<std::string>& arguments, const std::string& log_path) {
  StartedServer server{StartServer(arguments, log_path), 0};
  if (server.pid <= 0) return server;
  server.port = WaitForPort(log_path, absl::Seconds(120));
  if (server.port == 0) {
    kill(server.pid, SIGKILL);
    waitpid(server.pid, nullptr, 0);
  }
  return server;
}

struct Outcome {
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;
  absl::Time finished;
};

TEST(ShutdownTest, SigtermDrainsAdmittedWorkRefusesNewCallsAndExitsZero) {
  // Inputs: 16 real test images as PNG.
  absl::StatusOr<test_util::TestImages> test_images = test_util::FashionMnistTestPngs(kClients);
  ASSERT_TRUE(test_images.ok()) << test_images.status();
  const std::vector<std::string> images = test_images->pngs;

  const std::string log_path = absl::StrCat(::testing::TempDir(), "/shutdown_test_server_", getpid(), ".log");
  // Batches of 4 that wait up to 20 ms to fill: with 16 clients there is always queued and running work.
  const StartedServer server = StartServerAndWaitForPort(
      {"--model_repository=" + RepositoryPath(), "--listen=127.0.0.1:0", "--metrics_listen=", "--max_batch_size=4",
       "--max_queue_delay_ms=20", "--torch_threads=1", absl::StrCat("--drain_timeout_s=", kDrainTimeoutS)},
      log_path);
  ASSERT_GT(server.pid, 0);
  ASSERT_NE(server.port, 0) << "the server did not start; log:\n" << ReadFile(log_path);
  const pid_t pid = server.pid;
  // It re-executed itself (OMP_WAIT_POLICY) under its own name, so pgrep / pidof / pkill mita-server find it.
  EXPECT_EQ(ReadFile(absl::StrCat("/proc/", pid, "/comm")), "mita-server\n");
  const int port = server.port;
  const std::string target = absl::StrCat("127.0.0.1:", port);

  // A health Watch stream, opened before the signal: SERVING now, NOT_SERVING once draining.
  grpc::GenericStub health_stub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext watch_context;
  grpc::CompletionQueue watch_queue;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> watch =
      health_stub.PrepareCall(&watch_context, "/grpc.health.v1.Health/Watch", &watch_queue);
  auto await = [&watch_queue](intptr_t expected) {
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(watch_queue.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), expected);
    return ok;
  };
  auto read_status = [&](intptr_t tag) {
    grpc::ByteBuffer reply;
    watch->Read(&reply, reinterpret_cast<void*>(tag));
    if (!await(tag)) return std::string("(stream ended)");
    std::vector<grpc::Slice> slices;
    std::string bytes;
    if (reply.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    return bytes;
  };
  watch->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(await(1));
  grpc::Slice empty_request(std::string{});  // HealthCheckRequest{service: ""}: the whole server
  grpc::ByteBuffer request(&empty_request, 1);
  watch->Write(request, reinterpret_cast<void*>(2));
  ASSERT_TRUE(await(2));
  EXPECT_EQ(read_status(3), std::string("\x08\x01", 2)) << "SERVING before the signal";

  // Closed-loop traffic: each client sends until its first failure.
  std::unique_ptr<client::MitaClient> client = client::MitaClient::Connect(target);
  std::mutex outcomes_mu;
  std::vector<Outcome> outcomes;
  std::atomic<int> ok_before_signal{0};
  std::atomic<bool> signalled{false};
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      client::ClassifyOptions options;
      options.model = kModel;
      options.deadline = absl::Seconds(60);
      while (true) {
        absl::StatusOr<v1::ClassifyResponse> response = client->Classify(images[static_cast<size_t>(c)], options);
        Outcome outcome{static_cast<grpc::StatusCode>(response.status().code()),
                        std::string(response.status().message()), absl::Now()};
        if (response.ok() && !signalled.load()) ++ok_before_signal;
        {
          std::lock_guard<std::mutex> lock(outcomes_mu);
          outcomes.push_back(outcome);
        }
        if (!response.ok()) return;
      }
    });
  }
  // Let traffic flow, then signal.
  const absl::Time warm_give_up = absl::Now() + absl::Seconds(60);
  while (ok_before_signal.load() < 100 && absl::Now() < warm_give_up) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_GE(ok_before_signal.load(), 100) << "no traffic before the signal; log:\n" << ReadFile(log_path);
  const absl::Time signal_time = absl::Now();
  signalled.store(true);
  ASSERT_EQ(kill(pid, SIGTERM), 0);

  EXPECT_EQ(read_status(4), std::string("\x08\x02", 2)) << "NOT_SERVING once draining";
  watch_context.TryCancel();
  grpc::Status watch_status;
  watch->Finish(&watch_status, reinterpret_cast<void*>(5));
  await(5);

  for (std::thread& thread : clients) thread.join();
  const int wait_status = WaitForExit(pid, absl::Seconds(kDrainTimeoutS + 30));
  const absl::Duration exit_after = absl::Now() - signal_time;
  const std::string log = ReadFile(log_path);
  ASSERT_NE(wait_status, -1) << "the server did not exit; log:\n" << log;
  ASSERT_TRUE(WIFEXITED(wait_status)) << "log:\n" << log;
  EXPECT_EQ(WEXITSTATUS(wait_status), 0) << "log:\n" << log;

  // Client side: every call OK, except one UNAVAILABLE per client after the signal.
  int ok = 0, ok_after_signal = 0, unavailable = 0;
  for (const Outcome& outcome : outcomes) {
    if (outcome.code == grpc::StatusCode::OK) {
      ++ok;
      if (outcome.finished > signal_time) ++ok_after_signal;
      continue;
    }
    EXPECT_EQ(outcome.code, grpc::StatusCode::UNAVAILABLE) << outcome.message;
    EXPECT_GE(outcome.finished, signal_time) << "a call failed before the signal: " << outcome.message;
    ++unavailable;
  }
  EXPECT_EQ(unavailable, kClients);
  // Work in flight at the signal finished during the drain.
  EXPECT_GT(ok_after_signal, 0);

  // Server side: the last log line counts what it admitted and answered.
  std::smatch match;
  const std::regex counts(R"(requests admitted (\d+), answered ok (\d+), answered with an error (\d+))");
  ASSERT_TRUE(std::regex_search(log, match, counts)) << "log:\n" << log;
  const int admitted = std::stoi(match[1].str());
  const int answered_ok = std::stoi(match[2].str());
  const int answered_error = std::stoi(match[3].str());
  EXPECT_EQ(answered_error, 0);
  EXPECT_EQ(answered_ok, admitted);
  EXPECT_EQ(ok, admitted) << "an admitted request was not answered OK to its client";
  std::printf(
      "shutdown: %d calls OK (%d of them finished after SIGTERM), %d UNAVAILABLE after SIGTERM; server "
      "admitted %d, answered %d OK and %d with an error; exit status %d after %.0f ms\n",
      ok, ok_after_signal, unavailable, admitted, answered_ok, answered_error, WEXITSTATUS(wait_status),
      absl::ToDoubleMilliseconds(exit_after));
  EXPECT_LT(exit_after, absl::Seconds(kDrainTimeoutS)) << "the drain took longer than --drain_timeout_s";
  watch_queue.Shutdown();
  void* tag = nullptr;
  bool ignored = false;
  while (watch_queue.Next(&tag, &ignored)) {
  }
}

// Thread IDs of the running process `pid` (/proc/PID/task).
std::set<int> ThreadIds(pid_t pid) {
  std::set<int> ids;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/task"), error)) {
    ids.insert(std::atoi(entry.path().filename().c_str()));
  }
  return ids;
}

// Drain is bounded by its flag even while a long batch runs: at the drain timeout the server cancels the calls
// still running, and the forward stops within a query chunk of full attention instead of running to its end
// (before 2026-12-02 one running batch held shutdown 3.5 s past --drain_timeout_s=2).
TEST(ShutdownTest, DrainTimeoutStopsARunningLongBatch) {
  const std::string log_path = absl::StrCat(::testing::TempDir(), "/shutdown_long_batch_", getpid(), ".log");
  constexpr int kShortDrainS = 2;
  const StartedServer server = StartServerAndWaitForPort(
      {"--model_repository=" + RepositoryPath(), "--listen=127.0.0.1:0", "--metrics_listen=",
       absl::StrCat("--drain_timeout_s=", kShortDrainS)},
      log_path);
  ASSERT_GT(server.pid, 0);
  ASSERT_NE(server.port, 0) << "the server did not start; log:\n" << ReadFile(log_path);
  std::unique_ptr<client::MitaClient> client = client::MitaClient::Connect(absl::StrCat("127.0.0.1:", server.port));
  // A 65,536-token document under full attention: tens of seconds of forward on a CPU.
  std::string text;
  while (text.size() < 400000) absl::StrAppend(&text, "Interrupts are balanced across processors, ", text.size(), ". ");
  client::ClassifyOptions options;
  options.model = "linux-doc-mita";
  options.full_attention = true;
  options.truncate = true;
  options.deadline = absl::Seconds(600);
  absl::Status answer;
  std::thread caller([&] { answer = client->ClassifyText(text, options).status(); });
  absl::SleepFor(absl::Seconds(3));  // tokenized, admitted and computing
  const absl::Time signalled = absl::Now();
  ASSERT_EQ(kill(server.pid, SIGTERM), 0);
  const int wait_status = WaitForExit(server.pid, absl::Seconds(120));
  const absl::Duration shutdown = absl::Now() - signalled;
  caller.join();
  ASSERT_NE(wait_status, -1) << "the server did not exit; log:\n" << ReadFile(log_path);
  EXPECT_TRUE(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0) << "log:\n" << ReadFile(log_path);
  std::printf("[ info ] SIGTERM to exit with a long batch running: %s (--drain_timeout_s=%d)\n",
              absl::FormatDuration(shutdown).c_str(), kShortDrainS);
  EXPECT_LT(shutdown, absl::Seconds(kShortDrainS + 3)) << "log:\n" << ReadFile(log_path);
  EXPECT_FALSE(answer.ok());
  EXPECT_NE(ReadFile(log_path).find("drain timeout"), std::string::npos) << ReadFile(log_path);
}

// Threading of a loaded server (server/process/main.cc): OpenBLAS gets the --torch_threads count (its pthread build
// otherwise starts a worker per core that spins after each GEMM), and no thread is started per call (gRPC's
// callback API holds no thread for a waiting call; docs/serving.md, "Threads").
TEST(ServerThreadsTest, OpenBlasFollowsTorchThreadsAndHandlerThreadsAreKeptUnderLoad) {
  absl::StatusOr<test_util::TestImages> test_images = test_util::FashionMnistTestPngs(1);
  ASSERT_TRUE(test_images.ok()) << test_images.status();
  const std::string* png = &test_images->pngs[0];

  const std::string log_path = absl::StrCat(::testing::TempDir(), "/server_threads_test_", getpid(), ".log");
  const StartedServer server = StartServerAndWaitForPort(
      {"--model_repository=" + RepositoryPath(), "--listen=127.0.0.1:0", "--metrics_listen=", "--max_batch_size=16",
       "--torch_threads=1"},
      log_path);
  ASSERT_GT(server.pid, 0);
  ASSERT_NE(server.port, 0) << "the server did not start; log:\n" << ReadFile(log_path);
  const pid_t pid = server.pid;
  const int port = server.port;
  EXPECT_NE(ReadFile(log_path).find("torch_threads=1 blas_threads=1 "), std::string::npos)
      << "OpenBLAS's thread count was not set to --torch_threads; log:\n" << ReadFile(log_path);

  std::unique_ptr<client::MitaClient> client = client::MitaClient::Connect(absl::StrCat("127.0.0.1:", port));
  constexpr int kCallsPerClient = 40;
  // One wave: kClients closed-loop clients, kCallsPerClient calls each; returns the number of failed calls.
  auto wave = [&] {
    std::atomic<int> failed{0};
    std::vector<std::thread> clients;
    for (int c = 0; c < kClients; ++c) {
      clients.emplace_back([&] {
        client::ClassifyOptions options;
        options.model = kModel;
        options.deadline = absl::Seconds(60);
        for (int i = 0; i < kCallsPerClient; ++i) {
          if (!client->Classify(*png, options).ok()) ++failed;
        }
      });
    }
    for (std::thread& thread : clients) thread.join();
    return failed.load();
  };
  EXPECT_EQ(wave(), 0);
  const std::set<int> after_first = ThreadIds(pid);
  // During the second wave, list the server's threads every millisecond: a thread started and ended for one
  // call lives for about that call (milliseconds), so the listings catch (most of) them.
  std::atomic<bool> sampling{true};
  std::set<int> seen;
  std::thread sampler([&] {
    while (sampling.load()) {
      for (int id : ThreadIds(pid)) seen.insert(id);
      absl::SleepFor(absl::Milliseconds(1));
    }
  });
  EXPECT_EQ(wave(), 0);
  sampling.store(false);
  sampler.join();
  int started = 0;
  for (int id : seen) started += after_first.count(id) == 0 ? 1 : 0;
  std::printf("server threads: %zu after the first wave, %d started during the second (%d calls)\n",
              after_first.size(), started, kClients * kCallsPerClient);
  // A few threads may still come and go inside gRPC (timers, executor); a thread per call would be hundreds.
  EXPECT_LE(started, 8) << "the server started a thread per call";

  ASSERT_EQ(kill(pid, SIGTERM), 0);
  const int wait_status = WaitForExit(pid, absl::Seconds(kDrainTimeoutS + 30));
  ASSERT_NE(wait_status, -1) << "the server did not exit; log:\n" << ReadFile(log_path);
  EXPECT_TRUE(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0) << "log:\n" << ReadFile(log_path);
}

}  // namespace
}  // namespace mita
