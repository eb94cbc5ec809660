// The metrics table of docs/metrics.md is the one list of exported series: this test reads it (the table with
// columns name | type | labels | meaning) and compares it with what the server can
// export, two ways:
//   - a real mita-server process (the binary, started on the embedded model repository as an operator would)
//     is scraped at /metrics: every documented family must be exposed with the documented type and label
//     names, and every exposed family (its "# TYPE" line, so a family whose series are all 0 counts too) must
//     be documented. Scraping the real process, not a registry assembled by the test, sees every family any
//     part of the server registers (mita_oversized_messages_total, registered by server/frontend/message_limits.cc in
//     main.cc, was once missing from the table while a test that built only ServerMetrics passed);
//     Rows whose meaning starts with "CUDA devices only" (the GPU memory gauges) are exported only by a server
//     with a model on a CUDA device: the CPU server here need not expose them (scripts/gpu_check.sh scrapes a
//     server on cuda:0 for them);
//   - prometheus-cpp exports nothing, not even "# TYPE", for a family that has no series yet, so the sources
//     of kernels/, models/ and server/ are read as well: every family name registered with
//     prometheus::Build*().Name("...") must be documented, whether or not the scrape shows it.
// The deploy/ dashboard and alert queries use these names (scripts/check_deploy.py checks them against the
// same table).
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

#ifndef MITA_SERVER_PATH
#error "MITA_SERVER_PATH (the mita-server binary) must be defined by the build"
#endif

namespace mita::server {
namespace {

using test_util::HttpGet;
using test_util::ReadFile;
using test_util::SourceDirectory;

struct DocumentedSeries {
  std::string type;
  std::set<std::string> labels;
  bool cuda_only = false;  // the meaning starts with "CUDA devices only"
};

// Reads the metrics table of docs/metrics.md: rows "| `name` | type | label, label | meaning |".
std::map<std::string, DocumentedSeries> ReadDocumentedTable(const std::string& path) {
  std::ifstream file(path);
  EXPECT_TRUE(file.good()) << path;
  std::map<std::string, DocumentedSeries> table;
  bool in_table = false;
  for (std::string line; std::getline(file, line);) {
    if (absl::StartsWith(line, "| name | type | labels | meaning |")) {
      in_table = true;
      continue;
    }
    if (!in_table) continue;
    if (!absl::StartsWith(line, "|")) break;
    if (absl::StartsWith(line, "|---")) continue;
    std::vector<std::string> cells = absl::StrSplit(line, '|');
    EXPECT_GE(cells.size(), 6u) << line;
    if (cells.size() < 6) continue;
    absl::string_view name_cell = absl::StripAsciiWhitespace(cells[1]);
    EXPECT_TRUE(absl::ConsumePrefix(&name_cell, "`") && absl::ConsumeSuffix(&name_cell, "`")) << line;
    const std::string name(name_cell);
    DocumentedSeries series;
    series.type = std::string(absl::StripAsciiWhitespace(cells[2]));
    for (absl::string_view label : absl::StrSplit(cells[3], ',', absl::SkipWhitespace())) {
      series.labels.insert(std::string(absl::StripAsciiWhitespace(label)));
    }
    series.cuda_only = absl::StartsWith(absl::StripAsciiWhitespace(cells[4]), "CUDA devices only");
    table[name] = series;
  }
  return table;
}

// Families of a text exposition: name -> (type, label names other than "le").
std::map<std::string, DocumentedSeries> ParseExposition(const std::string& text) {
  std::map<std::string, DocumentedSeries> families;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ');
      if (parts.size() == 2) families[parts[0]].type = parts[1];
      continue;
    }
    if (absl::StartsWith(line, "#")) continue;
    const size_t brace = line.find('{');
    std::string sample(line.substr(0, std::min(brace, line.find(' '))));
    // Histogram samples end in _bucket, _sum, _count; their family is the name without it.
    std::string family = sample;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      absl::string_view trimmed = sample;
      if (absl::ConsumeSuffix(&trimmed, suffix) && families.count(std::string(trimmed)) &&
          families[std::string(trimmed)].type == "histogram") {
        family = std::string(trimmed);
      }
    }
    if (brace == absl::string_view::npos) {
      families[family];
      continue;
    }
    const absl::string_view labels = line.substr(brace + 1, line.find('}') - brace - 1);
    for (absl::string_view pair : absl::StrSplit(labels, ',', absl::SkipEmpty())) {
      const std::string name(pair.substr(0, pair.find('=')));
      if (name != "le") families[family].labels.insert(name);
    }
  }
  return families;
}

// Waits for the log line "... metrics on http://ADDRESS/metrics (port N)" and returns N, or 0 after `bound`.
int WaitForMetricsPort(const std::string& log_path, absl::Duration bound) {
  return test_util::WaitForLogPort(log_path, R"(metrics on http://\S+ \(port (\d+)\))", bound);
}

// Stops `pid` with SIGTERM (SIGKILL when it has not exited after 30 s) and reaps it.
void StopServer(pid_t pid) {
  kill(pid, SIGTERM);
  test_util::WaitForExit(pid, absl::Seconds(30));
}

// The metric family names registered in the C++ sources of the server (kernels/, models/, server/): the
// argument of every .Name("...") in a file that calls a prometheus-cpp builder (prometheus::Build...).
std::set<std::string> RegisteredFamilyNames(const std::string& source_directory) {
  std::set<std::string> names;
  const std::regex name_call(R"re(\.Name\(\s*"([^"]+)"\s*\))re");
  for (const char* directory : {"kernels", "models", "server"}) {
    for (const auto& entry : std::filesystem::recursive_directory_iterator(source_directory + "/" + directory)) {
      const std::string extension = entry.path().extension().string();
      if (!entry.is_regular_file() || (extension != ".cc" && extension != ".h")) continue;
      const std::string text = ReadFile(entry.path().string());
      if (text.find("prometheus::Build") == std::string::npos) continue;
      for (auto it = std::sregex_iterator(text.begin(), text.end(), name_call); it != std::sregex_iterator(); ++it) {
        names.insert((*it)[1].str());
      }
    }
  }
  return names;
}

TEST(MetricsDocsTest, EveryFamilyTheServerExportsIsDocumentedAndNothingElse) {
  const std::map<std::string, DocumentedSeries> documented =
      ReadDocumentedTable(absl::StrCat(SourceDirectory(), "/docs/metrics.md"));
  ASSERT_GE(documented.size(), 10u) << "the docs/metrics.md table was not found or is short";

  // The real server on the embedded models (an image and a document model), as scripts/run_main_job.sh runs it,
  // with a client policy (its per-client families are exported only with one).
  const std::string policy_path = absl::StrCat(::testing::TempDir(), "/metrics_docs_test_policy_", getpid(), ".json");
  test_util::WriteFile(policy_path, R"({"clients": [{"name": "batch", "certificate_subject": "CN=batch"}]})");
  const std::string log_path = absl::StrCat(::testing::TempDir(), "/metrics_docs_test_server_", getpid(), ".log");
  const pid_t pid = test_util::StartProcess(
      MITA_SERVER_PATH,
      {absl::StrCat("--model_repository=", SourceDirectory(), "/models/repository"), "--listen=127.0.0.1:0",
       "--metrics_listen=127.0.0.1:0", "--torch_threads=1", absl::StrCat("--client_policy_file=", policy_path)},
      log_path);
  ASSERT_GT(pid, 0);
  const int port = WaitForMetricsPort(log_path, absl::Seconds(120));
  absl::StatusOr<std::string> body =
      port > 0 ? HttpGet(port, "/metrics") : absl::UnavailableError("the server did not start");
  StopServer(pid);
  ASSERT_TRUE(body.ok()) << body.status() << "; log:\n" << ReadFile(log_path);
  const std::map<std::string, DocumentedSeries> exposed = ParseExposition(*body);

  for (const auto& [name, series] : documented) {
    auto it = exposed.find(name);
    if (series.cuda_only && it == exposed.end()) continue;  // this server runs on the CPU
    ASSERT_NE(it, exposed.end()) << "documented in docs/metrics.md but not exposed: " << name;
    EXPECT_EQ(it->second.type, series.type) << name;
    EXPECT_EQ(absl::StrJoin(it->second.labels, ","), absl::StrJoin(series.labels, ",")) << name;
  }
  for (const auto& [name, series] : exposed) {
    EXPECT_TRUE(documented.count(name)) << "exposed but not in the docs/metrics.md table: " << name;
  }
}

TEST(MetricsDocsTest, EveryFamilyRegisteredInTheSourcesIsDocumented) {
  const std::map<std::string, DocumentedSeries> documented =
      ReadDocumentedTable(absl::StrCat(SourceDirectory(), "/docs/metrics.md"));
  const std::set<std::string> registered = RegisteredFamilyNames(SourceDirectory());
  // The scan works: the families of server/metrics/metrics.cc are found.
  ASSERT_TRUE(registered.count("mita_requests_total")) << "no .Name(\"...\") found under server/";
  ASSERT_GE(registered.size(), documented.size()) << "the scan found fewer families than docs/metrics.md documents";
  for (const std::string& name : registered) {
    EXPECT_TRUE(documented.count(name)) << "registered in the sources but not in the docs/metrics.md table: " << name;
  }
}

}  // namespace
}  // namespace mita::server
