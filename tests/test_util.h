// Helpers shared by the GoogleTest binaries of tests/ (library mita_test_util: GoogleTest, Abseil, zlib and the
// Fashion-MNIST reader; no LibTorch, no gRPC): where the sources and the model repository are, files and temporary
// folders, status expectations, real test images and PNG chunks, an HTTP GET over loopback, a child process with its
// log, and this process's thread count. The helpers for in-process servers are in server_test_util.h.
#pragma once

#include <cstdlib>

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace mita::test_util {

// The source tree: $MITA_SOURCE_DIR (tests/CMakeLists.txt sets it for every test), else ".".
std::string SourceDirectory();

// The model repository: $MITA_MODEL_REPOSITORY when set and not empty (development with another package),
// else SourceDirectory() + "/models/repository" (the embedded models).
std::string RepositoryPath();

// The bytes of the file at `path` ("" when it cannot be read).
std::string ReadFile(const std::string& path);

// Writes `bytes` to `path` (replacing it); a failed write fails the test.
void WriteFile(const std::string& path, const std::string& bytes);

// A fresh empty folder "mita_test_<pid>_<name>" under the test temp dir, removed when the test program ends.
std::string MakeTempDirectory(const std::string& name);

// The Python that runs tools/*.py (Debian's, with python3-torch for the PyTorch twins).
inline constexpr char kPython[] = "/usr/bin/python3";
// Whether kPython can import torch (checked once).
bool PythonHasTorch();
// For a test whose independent reference or data is missing here (a Debian package, Fashion-MNIST, a trained
// package): fails when the environment sets CI (a comparison must not pass unchecked there), is skipped
// elsewhere. `message` is streamed (e.g. `MITA_MISSING_DEPENDENCY("no spm_encode: " << why)`). Use it in the test
// body or SetUp, where GTEST_SKIP and FAIL return.
#define MITA_MISSING_DEPENDENCY(message)                        \
  do {                                                          \
    if (std::getenv("CI") != nullptr) FAIL() << message << " (CI set)"; \
    GTEST_SKIP() << message;                                    \
  } while (0)

// In a test (or SetUp) that compares with a PyTorch twin run by kPython: MITA_MISSING_DEPENDENCY when that Python
// has no torch.
#define MITA_REQUIRE_PYTHON_TORCH()                                                                              \
  do {                                                                                                            \
    if (!::mita::test_util::PythonHasTorch()) {                                                                   \
      MITA_MISSING_DEPENDENCY(::mita::test_util::kPython << " cannot import torch: the comparison with the "   \
                                                            "PyTorch twin needs python3-torch");                 \
    }                                                                                                             \
  } while (0)

// Expects `status` to have `code` and a message containing `message_part`.
void ExpectStatus(const absl::Status& status, absl::StatusCode code, const std::string& message_part);
// Expects `status` to have `code` and a message containing each of `message_parts`.
void ExpectStatusParts(const absl::Status& status, absl::StatusCode code,
                       const std::vector<std::string>& message_parts);

// The first `count` images of the Fashion-MNIST test split encoded as PNG, and their labels.
struct TestImages {
  std::vector<std::string> pngs;
  std::vector<int> labels;
};
absl::StatusOr<TestImages> FashionMnistTestPngs(int count);

// Appends `value` as 4 big-endian bytes.
void AppendBigEndian32(std::string& out, uint32_t value);

// One PNG chunk: length, type, data, CRC-32 of type + data (PNG spec 5.3).
std::string PngChunk(const std::string& type, const std::string& data);

// An HTTP/1.0 GET of `path` from 127.0.0.1:`port` over a plain socket; returns the body of a 200 answer.
// Errors: UNAVAILABLE when the connection or the request fails; INTERNAL for a reply that is not HTTP or not
// 200 (the message holds its start).
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

// Starts `binary` with `arguments` in a child process, its stderr (the log) going to `log_path`. Returns the
// pid (<= 0 when fork failed).
pid_t StartProcess(const std::string& binary, const std::vector<std::string>& arguments, const std::string& log_path);

// Waits until the file `log_path` matches `pattern` (an ECMAScript regex whose first group is a port number)
// and returns that number, or 0 after `bound`.
int WaitForLogPort(const std::string& log_path, const std::string& pattern, absl::Duration bound);

// Waits for `pid` to exit within `bound`; returns its wait status, or -1 (after killing it) on timeout.
int WaitForExit(pid_t pid, absl::Duration bound);

// The threads of this process now (the entries of /proc/self/task), or -1 when it cannot be read.
int ProcessThreadCount();

// Waits until this process has at most `threads` threads (a thread that was told to end may take a moment to go);
// returns the count it saw last, after at most `bound`.
int WaitForProcessThreadCountAtMost(int threads, absl::Duration bound);

}  // namespace mita::test_util
