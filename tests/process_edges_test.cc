// The edges of a real mita-server process: its listening port (exclusive, validated, ":PORT" on every address),
// SIGTERM during start-up, SIGHUP, and the threads held by calls that never send their request (stuck streams).
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mita/v1/mita.grpc.pb.h"
#include "server/process/health_check_call.h"
#include "tests/test_util.h"

#ifndef MITA_SERVER_PATH
#error "MITA_SERVER_PATH (the mita-server binary) must be defined by the build"
#endif

namespace mita {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using test_util::MakeTempDirectory;
using test_util::ReadFile;
using test_util::RepositoryPath;
using test_util::WaitForExit;
using test_util::WriteFile;

std::string LogPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/process_edges_", name, "_", getpid(), ".log");
}

pid_t StartServer(const std::vector<std::string>& extra, const std::string& log_path) {
  std::vector<std::string> arguments = {"--model_repository=" + RepositoryPath(), "--metrics_listen=",
                                        "--torch_threads=1", "--preparation_threads=1"};
  arguments.insert(arguments.end(), extra.begin(), extra.end());
  return test_util::StartProcess(MITA_SERVER_PATH, arguments, log_path);
}

int WaitForPort(const std::string& log_path) {
  return test_util::WaitForLogPort(log_path, R"(serving gRPC.* \(port (\d+);)", absl::Seconds(120));
}

// Sends SIGTERM and expects exit status 0 within the drain.
void StopAndExpectZero(pid_t pid, const std::string& log_path) {
  kill(pid, SIGTERM);
  const int status = WaitForExit(pid, absl::Seconds(60));
  ASSERT_TRUE(WIFEXITED(status)) << "wait status " << status << "\n" << ReadFile(log_path);
  EXPECT_EQ(WEXITSTATUS(status), 0) << ReadFile(log_path);
}

// The number of threads of `pid` (/proc/<pid>/status).
int ThreadCount(pid_t pid) {
  std::istringstream status(ReadFile(absl::StrCat("/proc/", pid, "/status")));
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  }
  return -1;
}

// Whether `pid` has SIGTERM blocked (/proc/<pid>/status SigBlk, a hex mask whose bit signal-1 is set).
bool SigtermBlocked(pid_t pid) {
  std::istringstream status(ReadFile(absl::StrCat("/proc/", pid, "/status")));
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("SigBlk:", 0) == 0) return (std::strtoull(line.c_str() + 7, nullptr, 16) >> (SIGTERM - 1)) & 1;
  }
  return false;
}

// Before 2026-12-02 gRPC bound with SO_REUSEPORT: a second server on a port in use started and shared it.
TEST(ProcessEdgesTest, APortInUseIsAStartUpError) {
  const std::string first_log = LogPath("first");
  const pid_t first = StartServer({"--listen=127.0.0.1:0"}, first_log);
  const int port = WaitForPort(first_log);
  ASSERT_GT(port, 0) << ReadFile(first_log);
  // Found before the models load (no "loaded" line): the port is tried first. The gRPC port, the metrics port, an
  // address that is not this machine's.
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{absl::StrCat("--listen=127.0.0.1:", port)},
       absl::StrCat("flag --listen: port ", port, " of '127.0.0.1:", port, "' is in use (another server?)")},
      {{"--listen=127.0.0.1:0", absl::StrCat("--metrics_listen=127.0.0.1:", port)},
       absl::StrCat("flag --metrics_listen: port ", port, " of '127.0.0.1:", port, "' is in use (another server?)")},
      {{"--listen=192.0.2.1:50051"}, "flag --listen: '192.0.2.1:50051' is not an address of this machine"},
  };
  for (const auto& [flags, expected] : cases) {
    SCOPED_TRACE(flags.back());
    const std::string second_log = LogPath("second");
    const pid_t second = StartServer(flags, second_log);
    const int status = WaitForExit(second, absl::Seconds(120));
    ASSERT_TRUE(WIFEXITED(status)) << ReadFile(second_log);
    EXPECT_EQ(WEXITSTATUS(status), 1);
    EXPECT_THAT(ReadFile(second_log), HasSubstr(expected));
    EXPECT_THAT(ReadFile(second_log), Not(HasSubstr("loaded ")));
  }
  StopAndExpectZero(first, first_log);
}

TEST(ProcessEdgesTest, InvalidListenAddressesAreStartUpErrors) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"127.0.0.1:99999", "has port 99999, which is out of range: allowed [0, 65535]"},
      {"127.0.0.1:-1", "has port -1, which is out of range: allowed [0, 65535]"},
      {"127.0.0.1:50051x", "has port '50051x', which is not a number"},
      {"127.0.0.1", "has no port"},
      {"[::1:50051", "has an unbalanced '['"},
      {"::1:50051", "has an IPv6 host without brackets"},
  };
  for (const auto& [address, expected] : cases) {
    SCOPED_TRACE(address);
    const std::string log = LogPath("invalid");
    const pid_t pid = StartServer({"--listen=" + address}, log);
    const int status = WaitForExit(pid, absl::Seconds(60));
    ASSERT_TRUE(WIFEXITED(status)) << ReadFile(log);
    EXPECT_EQ(WEXITSTATUS(status), 1);
    EXPECT_THAT(ReadFile(log), HasSubstr(absl::StrCat("flag --listen: address '", address, "' ", expected)));
  }
  // --metrics_listen's form is checked with --listen's, before the models load (no "loaded" line).
  {
    const std::string log = LogPath("invalid_metrics");
    const pid_t pid = StartServer({"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:70000"}, log);
    const int status = WaitForExit(pid, absl::Seconds(60));
    ASSERT_TRUE(WIFEXITED(status)) << ReadFile(log);
    EXPECT_EQ(WEXITSTATUS(status), 1);
    EXPECT_THAT(ReadFile(log), HasSubstr("flag --metrics_listen: address '127.0.0.1:70000' has port 70000"));
    EXPECT_THAT(ReadFile(log), Not(HasSubstr("loaded ")));
  }
  // Every numeric flag out of its range: one wording, naming the flag and the range.
  const std::vector<std::pair<std::string, std::string>> flags = {
      {"--keepalive_timeout_s=0", "flag --keepalive_timeout_s: 0 is out of range: allowed [1, 3600]"},
      {"--max_queue_delay_ms=-1", "flag --max_queue_delay_ms: -1 is out of range: allowed [0, 60000]"},
      {"--preparation_queue_capacity=0", "flag --preparation_queue_capacity: 0 is out of range: allowed [1, "},
      {"--max_batch_size=99999999999", "flag --max_batch_size: 99999999999 is out of range: allowed [1, 65536]"},
      {"--queue_capacity=0", "flag --queue_capacity: 0 is out of range: allowed [1, "},
      {"--max_batch_tokens=0", "flag --max_batch_tokens: 0 is out of range: allowed [1, "},
      {"--cuda_memory_fraction=1.5", "flag --cuda_memory_fraction: 1.5 is out of range: allowed (0, 1]"},
      {"--cost_calibration_ms=-1", "flag --cost_calibration_ms: -1 is out of range: allowed [0, 600000]"},
      {"--drain_notice_ms=30000", "flag --drain_notice_ms: 30000 is longer than --drain_timeout_s (20 s): the notice "
                                  "is part of the drain; allowed [0, 20000]"},
      {"--cost_profile=/nonexistent/profile.json", "flag --cost_profile: cannot read /nonexistent/profile.json"},
  };
  for (const auto& [flag, expected] : flags) {
    SCOPED_TRACE(flag);
    const std::string log = LogPath("invalid_flag");
    const pid_t pid = StartServer({"--listen=127.0.0.1:0", flag}, log);
    const int status = WaitForExit(pid, absl::Seconds(60));
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 1);
    EXPECT_THAT(ReadFile(log), HasSubstr(expected));
  }
}

// The local addresses a client can reach the server at: 127.0.0.1, ::1 when the machine has IPv6 loopback, and
// the machine's other IPv4 and global IPv6 addresses (getifaddrs), as gRPC targets ("ipv4:A:P", "ipv6:[A]:P").
std::vector<std::string> LocalTargets(int port) {
  std::vector<std::string> targets = {absl::StrCat("ipv4:127.0.0.1:", port)};
  ifaddrs* addresses = nullptr;
  if (getifaddrs(&addresses) != 0) return targets;
  for (ifaddrs* a = addresses; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ifa_addr->sa_family == AF_INET) {
      const in_addr address = reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr;
      if (ntohl(address.s_addr) == INADDR_LOOPBACK) continue;
      inet_ntop(AF_INET, &address, text, sizeof(text));
      targets.push_back(absl::StrCat("ipv4:", text, ":", port));
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      const in6_addr& address = reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr;
      if (IN6_IS_ADDR_LINKLOCAL(&address)) continue;  // needs a scope id
      inet_ntop(AF_INET6, &address, text, sizeof(text));
      targets.push_back(absl::StrCat("ipv6:[", text, "]:", port));
    }
  }
  freeifaddrs(addresses);
  return targets;
}

// --listen=:PORT (the form the flag's own error message recommends) listens on every address, IPv4 and IPv6;
// gRPC itself refuses ":PORT", and before 2026-12-05 the server loaded its models and then exited "cannot listen".
TEST(ProcessEdgesTest, ListenOnColonPortServesEveryAddress) {
  const std::string log = LogPath("colon_port");
  const pid_t pid = StartServer({"--listen=:0"}, log);
  const int port = WaitForPort(log);
  ASSERT_GT(port, 0) << ReadFile(log);
  const std::vector<std::string> targets = LocalTargets(port);
  std::printf("--listen=:0 bound port %d; health checked at %s\n", port, absl::StrJoin(targets, ", ").c_str());
  for (const std::string& target : targets) {
    std::string bytes;
    const grpc::Status status = server::HealthCheckCall(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()),
                                                        "", std::chrono::seconds(10), &bytes);
    EXPECT_TRUE(status.ok()) << target << ": " << status.error_message();
    EXPECT_EQ(bytes, std::string("\x08\x01", 2)) << target;
  }
  StopAndExpectZero(pid, log);
}

// SIGHUP drains like SIGTERM (health NOT_SERVING, admitted requests answered, exit 0): before 2026-12-05 it killed
// the server at once. A server started with SIGHUP ignored (nohup) keeps ignoring it.
TEST(ProcessEdgesTest, SighupDrainsLikeSigtermUnlessStartedIgnoringIt) {
  {
    const std::string log = LogPath("sighup");
    const pid_t pid = StartServer({"--listen=127.0.0.1:0"}, log);
    ASSERT_GT(WaitForPort(log), 0) << ReadFile(log);
    kill(pid, SIGHUP);
    const int status = WaitForExit(pid, absl::Seconds(60));
    ASSERT_TRUE(WIFEXITED(status)) << "wait status " << status << "\n" << ReadFile(log);
    EXPECT_EQ(WEXITSTATUS(status), 0) << ReadFile(log);
    EXPECT_THAT(ReadFile(log), HasSubstr("received SIGHUP; draining"));
    EXPECT_THAT(ReadFile(log), HasSubstr("stopped after draining"));
  }
  {
    const std::string log = LogPath("nohup");
    struct sigaction ignore {}, previous {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGHUP, &ignore, &previous);
    const pid_t pid = StartServer({"--listen=127.0.0.1:0"}, log);  // inherits SIG_IGN, as under nohup
    sigaction(SIGHUP, &previous, nullptr);
    const int port = WaitForPort(log);
    ASSERT_GT(port, 0) << ReadFile(log);
    kill(pid, SIGHUP);
    std::string bytes;
    EXPECT_TRUE(server::HealthCheckCall(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                                            grpc::InsecureChannelCredentials()),
                                        "", std::chrono::seconds(10), &bytes)
                    .ok());
    EXPECT_EQ(bytes, std::string("\x08\x01", 2)) << "still SERVING after the ignored SIGHUP";
    StopAndExpectZero(pid, log);
    EXPECT_THAT(ReadFile(log), Not(HasSubstr("received SIGHUP")));
    EXPECT_THAT(ReadFile(log), HasSubstr("received SIGTERM; draining"));
  }
}

// A saved cost profile is loaded by the next start instead of a calibration sweep; a profile of another model
// shape is refused at start-up.
TEST(ProcessEdgesTest, SavedCostProfileSkipsCalibration) {
  const std::string profile = absl::StrCat(MakeTempDirectory("cost_profile"), "/profile.json");
  {
    const std::string log = LogPath("save_profile");
    const pid_t pid = StartServer({"--listen=127.0.0.1:0", "--cost_calibration_ms=300",
                                   absl::StrCat("--save_cost_profile=", profile)}, log);
    ASSERT_GT(WaitForPort(log), 0) << ReadFile(log);
    StopAndExpectZero(pid, log);
    EXPECT_THAT(ReadFile(log), HasSubstr("cost model of 'fashion-mnist-vit': calibrated from "));
    EXPECT_THAT(ReadFile(log), HasSubstr(absl::StrCat("cost profiles saved to ", profile)));
  }
  {
    const std::string log = LogPath("load_profile");
    const pid_t pid = StartServer({"--listen=127.0.0.1:0", absl::StrCat("--cost_profile=", profile)}, log);
    ASSERT_GT(WaitForPort(log), 0) << ReadFile(log);
    StopAndExpectZero(pid, log);
    EXPECT_THAT(ReadFile(log), HasSubstr("cost model of 'fashion-mnist-vit': loaded\n"));
  }
  std::string text = ReadFile(profile);
  const std::string layers = "\"layers\": 4";
  ASSERT_NE(text.find(layers), std::string::npos) << text;
  text.replace(text.find(layers), layers.size(), "\"layers\": 5");
  WriteFile(profile, text);
  const std::string log = LogPath("wrong_profile");
  const pid_t pid = StartServer({"--listen=127.0.0.1:0", absl::StrCat("--cost_profile=", profile)}, log);
  const int status = WaitForExit(pid, absl::Seconds(60));
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  EXPECT_THAT(ReadFile(log), HasSubstr("flag --cost_profile: " + profile +
                                       ": the profile of model 'fashion-mnist-vit' was saved for cpu float32 d=96 "
                                       "L=5; the model runs as cpu float32 d=96 L=4"));
}

// SIGTERM while the server starts (before 2026-12-02, during the first second it killed the process: the
// signals were blocked only after the OpenMP re-exec and LibTorch's initialisers). Sent as soon as the process
// has the signal blocked, and at fixed times into start-up; every time the process exits 0, without serving: the
// signal is found pending after the models load (or after a model's cost calibration).
TEST(ProcessEdgesTest, SigtermDuringStartUpExitsZero) {
  {
    const std::string log = LogPath("sigterm_early");
    const pid_t pid = StartServer({"--listen=127.0.0.1:0"}, log);
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (!SigtermBlocked(pid) && absl::Now() < give_up) absl::SleepFor(absl::Microseconds(200));
    ASSERT_TRUE(SigtermBlocked(pid));
    StopAndExpectZero(pid, log);
    EXPECT_THAT(ReadFile(log), HasSubstr("received SIGTERM during start-up; exiting before serving"));
    EXPECT_THAT(ReadFile(log), Not(HasSubstr("serving gRPC")));
  }
  for (const int delay_ms : {50, 300, 1000}) {
    SCOPED_TRACE(absl::StrCat("SIGTERM after ", delay_ms, " ms"));
    const std::string log = LogPath("sigterm_delay");
    const pid_t pid = StartServer({"--listen=127.0.0.1:0"}, log);
    absl::SleepFor(absl::Milliseconds(delay_ms));
    StopAndExpectZero(pid, log);
    EXPECT_THAT(ReadFile(log), HasSubstr("received SIGTERM during start-up; exiting before serving"));
  }
}

// 2,000 calls that open their stream and never send the request hold no server thread: the callback API waits
// for their message without a thread, and they are gone when their clients are (before 2026-12-02, with the
// synchronous API, 2,000 stuck streams left 1,216 threads after the clients had gone).
TEST(ProcessEdgesTest, StuckStreamsHoldNoThreads) {
  const std::string log = LogPath("stuck");
  const pid_t pid = StartServer({"--listen=127.0.0.1:0", "--max_concurrent_streams=256"}, log);
  const int port = WaitForPort(log);
  ASSERT_GT(port, 0) << ReadFile(log);
  const int idle_threads = ThreadCount(pid);
  constexpr int kConnections = 10;
  constexpr int kStreamsPerConnection = 200;
  {
    grpc::CompletionQueue queue;
    std::vector<std::shared_ptr<grpc::Channel>> channels;
    std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
    std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
    std::vector<std::unique_ptr<grpc::GenericClientAsyncReaderWriter>> calls;
    for (int c = 0; c < kConnections; ++c) {
      grpc::ChannelArguments arguments;
      arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // one connection per channel
      arguments.SetInt("mita.test.connection", c);
      channels.push_back(grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                                   grpc::InsecureChannelCredentials(), arguments));
      stubs.push_back(std::make_unique<grpc::GenericStub>(channels.back()));
      for (int s = 0; s < kStreamsPerConnection; ++s) {
        contexts.push_back(std::make_unique<grpc::ClientContext>());
        calls.push_back(
            stubs.back()->PrepareCall(contexts.back().get(), "/mita.v1.MitaService/Classify", &queue));
        calls.back()->StartCall(reinterpret_cast<void*>(calls.size()));
      }
    }
    // Every stream is started (its headers sent): the server has seen 2,000 calls that wait for a message.
    for (size_t started = 0; started < calls.size(); ++started) {
      void* tag = nullptr;
      bool ok = false;
      ASSERT_TRUE(queue.Next(&tag, &ok));
      EXPECT_TRUE(ok);
    }
    absl::SleepFor(absl::Seconds(1));
    const int stuck_threads = ThreadCount(pid);
    std::printf("server threads: idle %d, with %d stuck streams %d\n", idle_threads, kConnections * kStreamsPerConnection,
                stuck_threads);
    EXPECT_LE(stuck_threads, idle_threads + 8);
    // The clients go: streams cancelled, connections closed.
    for (auto& context : contexts) context->TryCancel();
    calls.clear();
    contexts.clear();
    stubs.clear();
    channels.clear();
    queue.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (queue.Next(&tag, &ok)) {
    }
  }
  absl::SleepFor(absl::Seconds(2));
  const int after_threads = ThreadCount(pid);
  std::printf("server threads after the clients left: %d\n", after_threads);
  EXPECT_LE(after_threads, idle_threads + 8);
  // Still serving: a health check answers.
  std::string serving;
  EXPECT_TRUE(server::HealthCheckCall(
                  grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()), "",
                  std::chrono::seconds(10), &serving)
                  .ok());
  EXPECT_EQ(serving, "\x08\x01") << "SERVING";
  StopAndExpectZero(pid, log);
}

// Requests with invalid UTF-8 in a string field are INVALID_ARGUMENT, and protobuf's log line for each is
// rate-limited (one per second), so that a client cannot flood the server's log with them.
// mita-client's --input=auto looks the model's input kind up first; a tiny --deadline_ms is for the Classify
// calls (before 2026-12-02 the lookup spent it and the client reported "GetModel ...: DEADLINE_EXCEEDED").
TEST(ProcessEdgesTest, ATinyClientDeadlineIsSpentOnClassify) {
  const std::string log = LogPath("client_deadline");
  const pid_t pid = StartServer({"--listen=127.0.0.1:0"}, log);
  const int port = WaitForPort(log);
  ASSERT_GT(port, 0) << ReadFile(log);
  const std::string document = absl::StrCat(::testing::TempDir(), "/process_edges_document_", getpid(), ".txt");
  {
    std::ofstream out(document);
    for (int i = 0; i < 2000; ++i) out << "The font package defines the shapes of mathematical symbols. ";
  }
  const std::string client_log = LogPath("client_deadline_client");
  const pid_t client = test_util::StartProcess(
      MITA_CLIENT_PATH, {absl::StrCat("--server=127.0.0.1:", port), "--model=texlive-doc-mita", "--deadline_ms=1",
                         document},
      client_log);
  const int status = WaitForExit(client, absl::Seconds(60));
  ASSERT_TRUE(WIFEXITED(status)) << ReadFile(client_log);
  const std::string output = ReadFile(client_log);
  EXPECT_THAT(output, Not(HasSubstr("GetModel"))) << output;
  EXPECT_THAT(output, HasSubstr("DEADLINE_EXCEEDED")) << output;
  StopAndExpectZero(pid, log);
}

TEST(ProcessEdgesTest, InvalidUtf8RequestsDoNotFloodTheLog) {
  const std::string log = LogPath("utf8");
  const pid_t pid = StartServer({"--listen=127.0.0.1:0"}, log);
  const int port = WaitForPort(log);
  ASSERT_GT(port, 0) << ReadFile(log);
  std::unique_ptr<mita::v1::MitaService::Stub> stub = mita::v1::MitaService::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  constexpr int kCalls = 50;
  for (int i = 0; i < kCalls; ++i) {
    mita::v1::ClassifyRequest request;
    request.set_model("fashion-\xff\xfe-vit");
    request.set_image("x");
    mita::v1::ClassifyResponse response;
    grpc::ClientContext context;
    const grpc::Status status = stub->Classify(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  }
  const std::string text = ReadFile(log);
  int protobuf_lines = 0;
  for (size_t at = text.find("mita-server: protobuf "); at != std::string::npos;
       at = text.find("mita-server: protobuf ", at + 1)) {
    ++protobuf_lines;
  }
  EXPECT_GE(protobuf_lines, 1) << text;
  EXPECT_LE(protobuf_lines, 5) << "one line per second at most, for " << kCalls << " calls\n" << text;
  StopAndExpectZero(pid, log);
}

}  // namespace
}  // namespace mita
