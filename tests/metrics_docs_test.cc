// The README's metrics table is the one list of exported series: this test reads it from README.md (section
// "Metrics", the table with columns name | type | labels | meaning), scrapes /metrics of a MetricsHttpServer
// serving ServerMetrics for a two-layer model, and checks that every documented series is exposed with the
// documented type and label names, and that nothing undocumented is exposed. The deploy/ dashboard and alert
// queries use these names (scripts/check_deploy.py checks them against the same table).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "server/metrics.h"

namespace mita::server {
namespace {

struct DocumentedSeries {
  std::string type;
  std::set<std::string> labels;
};

// Reads the metrics table of README.md: rows "| `name` | type | label, label | meaning |".
std::map<std::string, DocumentedSeries> ReadReadmeTable(const std::string& path) {
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
    table[name] = series;
  }
  return table;
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
  if (body == std::string::npos) return absl::InternalError("bad HTTP reply");
  return reply.substr(body + 4);
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

TEST(MetricsDocsTest, EveryDocumentedSeriesIsExposedAndNothingElse) {
  const char* source = std::getenv("MITA_SOURCE_DIR");
  const std::map<std::string, DocumentedSeries> documented =
      ReadReadmeTable(absl::StrCat(source != nullptr ? source : ".", "/README.md"));
  ASSERT_GE(documented.size(), 10u) << "the README metrics table was not found or is short";

  ServerMetrics metrics({{"model-a", 2}});
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("127.0.0.1:0", metrics.registry());
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::string> body = HttpGet((*server)->port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  const std::map<std::string, DocumentedSeries> exposed = ParseExposition(*body);

  for (const auto& [name, series] : documented) {
    auto it = exposed.find(name);
    ASSERT_NE(it, exposed.end()) << "documented in README but not exposed: " << name;
    EXPECT_EQ(it->second.type, series.type) << name;
    EXPECT_EQ(absl::StrJoin(it->second.labels, ","), absl::StrJoin(series.labels, ",")) << name;
  }
  for (const auto& [name, series] : exposed) {
    EXPECT_TRUE(documented.count(name)) << "exposed but not in the README metrics table: " << name;
  }
}

}  // namespace
}  // namespace mita::server
