// Helpers shared by the tests (see test_util.h).
#include "tests/test_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/fashion_mnist.h"

namespace mita::test_util {
namespace {

// Folders made by MakeTempDirectory, removed when the test program ends.
std::vector<std::string>& TempDirectories() {
  static auto* directories = new std::vector<std::string>();
  return *directories;
}

class TempDirectoryCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    for (const std::string& directory : TempDirectories()) {
      std::error_code error;
      std::filesystem::remove_all(directory, error);
    }
  }
};
[[maybe_unused]] ::testing::Environment* const kCleanup =
    ::testing::AddGlobalTestEnvironment(new TempDirectoryCleanup);

}  // namespace

std::string SourceDirectory() {
  const char* directory = std::getenv("MITA_SOURCE_DIR");
  return directory != nullptr ? directory : ".";
}

std::string RepositoryPath() {
  if (const char* repository = std::getenv("MITA_MODEL_REPOSITORY"); repository != nullptr && *repository) {
    return repository;
  }
  return absl::StrCat(SourceDirectory(), "/models/repository");
}

std::string ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream file(path, std::ios::binary);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(file.good()) << path;
}

std::string MakeTempDirectory(const std::string& name) {
  std::filesystem::path path =
      std::filesystem::path(::testing::TempDir()) / ("mita_test_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(path);
  std::filesystem::create_directories(path);
  TempDirectories().push_back(path.string());
  return path.string();
}

bool PythonHasTorch() {
  static const bool has_torch =
      std::system((std::string(kPython) + " -c 'import torch' > /dev/null 2>&1").c_str()) == 0;
  return has_torch;
}

void ExpectStatus(const absl::Status& status, absl::StatusCode code, const std::string& message_part) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr(message_part));
}

void ExpectStatusParts(const absl::Status& status, absl::StatusCode code,
                       const std::vector<std::string>& message_parts) {
  EXPECT_EQ(status.code(), code) << status;
  for (const std::string& part : message_parts) {
    EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr(part));
  }
}

absl::StatusOr<TestImages> FashionMnistTestPngs(int count) {
  absl::StatusOr<datasets::FashionMnist> test_set = datasets::ReadFashionMnist("t10k");
  if (!test_set.ok()) return test_set.status();
  TestImages images;
  const int64_t pixels = test_set->rows * test_set->columns;
  for (int i = 0; i < count; ++i) {
    std::vector<uint8_t> image(test_set->pixels.begin() + i * pixels, test_set->pixels.begin() + (i + 1) * pixels);
    absl::StatusOr<std::string> png = datasets::EncodePng(image, test_set->columns, test_set->rows, 1);
    if (!png.ok()) return png.status();
    images.pngs.push_back(*std::move(png));
    images.labels.push_back(test_set->labels[i]);
  }
  return images;
}

void AppendBigEndian32(std::string& out, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((value >> shift) & 0xff));
}

std::string PngChunk(const std::string& type, const std::string& data) {
  std::string chunk;
  AppendBigEndian32(chunk, static_cast<uint32_t>(data.size()));
  chunk += type;
  chunk += data;
  uLong crc = crc32(0L, Z_NULL, 0);
  crc = crc32(crc, reinterpret_cast<const Bytef*>(type.data()), static_cast<uInt>(type.size()));
  crc = crc32(crc, reinterpret_cast<const Bytef*>(data.data()), static_cast<uInt>(data.size()));
  AppendBigEndian32(chunk, static_cast<uint32_t>(crc));
  return chunk;
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return absl::UnavailableError("connect");
  }
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (send(fd, request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("send");
  }
  std::string reply;
  char buffer[65536];
  for (ssize_t n; (n = recv(fd, buffer, sizeof(buffer), 0)) > 0;) reply.append(buffer, static_cast<size_t>(n));
  close(fd);
  const size_t body = reply.find("\r\n\r\n");
  if (!absl::StartsWith(reply, "HTTP/1.") || body == std::string::npos) {
    return absl::InternalError(absl::StrCat("bad HTTP reply: ", reply.substr(0, 200)));
  }
  if (reply.find(" 200 ") > reply.find("\r\n")) return absl::InternalError(reply.substr(0, reply.find("\r\n")));
  return reply.substr(body + 4);
}

pid_t StartProcess(const std::string& binary, const std::vector<std::string>& arguments, const std::string& log_path) {
  std::string program = binary;
  std::vector<std::string> copies = arguments;
  std::vector<char*> argv;
  argv.push_back(program.data());
  for (std::string& argument : copies) argv.push_back(argument.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec (the test process has threads).
    const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (log >= 0) dup2(log, STDERR_FILENO);
    execv(program.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

int WaitForLogPort(const std::string& log_path, const std::string& pattern, absl::Duration bound) {
  const std::regex port_pattern(pattern);
  const absl::Time give_up = absl::Now() + bound;
  while (absl::Now() < give_up) {
    std::smatch match;
    const std::string log = ReadFile(log_path);
    if (std::regex_search(log, match, port_pattern)) return std::stoi(match[1].str());
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

int WaitForExit(pid_t pid, absl::Duration bound) {
  const absl::Time give_up = absl::Now() + bound;
  while (absl::Now() < give_up) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    absl::SleepFor(absl::Milliseconds(10));
  }
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  return -1;
}

int ProcessThreadCount() {
  std::error_code error;
  int threads = 0;
  for (std::filesystem::directory_iterator it("/proc/self/task", error), end; !error && it != end;
       it.increment(error)) {
    ++threads;
  }
  return error ? -1 : threads;
}

int WaitForProcessThreadCountAtMost(int threads, absl::Duration bound) {
  const absl::Time give_up = absl::Now() + bound;
  int now = ProcessThreadCount();
  while (now > threads && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
    now = ProcessThreadCount();
  }
  return now;
}

}  // namespace mita::test_util
