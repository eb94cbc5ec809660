#include "server/process/metrics_http_server.h"

#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"
#include "server/process/listen_address.h"

namespace mita::server {
namespace {

constexpr char kTextFormat[] = "text/plain; version=0.0.4; charset=utf-8";
constexpr char kPlainText[] = "text/plain; charset=utf-8";
constexpr unsigned int kConnectionTimeoutS = 10;
constexpr unsigned int kConnectionLimit = 256;
// Per client address: one client holding idle connections cannot take the others' room (a scrape from another
// address is answered at once); libmicrohttpd closes a connection over this limit as soon as it accepts it.
constexpr unsigned int kConnectionLimitPerAddress = 16;

// libmicrohttpd's request callback: answers at the first call, when the request head is in (a body, if any, is
// not read).
MHD_Result AnswerRequest(void* server, MHD_Connection* connection, const char* url, const char* method,
                         const char* /*version*/, const char* /*upload_data*/, size_t* /*upload_data_size*/,
                         void** /*request_state*/) {
  const MetricsHttpServer::Answer answer =
      static_cast<const MetricsHttpServer*>(server)->Respond(method == nullptr ? "" : method, url == nullptr ? "" : url);
  MHD_Response* response = MHD_create_response_from_buffer(answer.body.size(), const_cast<char*>(answer.body.data()),
                                                           MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, answer.content_type.c_str());
  if (answer.status == MHD_HTTP_METHOD_NOT_ALLOWED) MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  const MHD_Result queued = MHD_queue_response(connection, answer.status, response);
  MHD_destroy_response(response);
  return queued;
}

// Binds and listens on `address`; returns the socket.
absl::StatusOr<int> Listen(const std::string& address, bool* ipv6) {
  absl::StatusOr<ListenAddress> parsed = ParseListenAddress(address, "--metrics_listen");
  if (!parsed.ok()) return parsed.status();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* resolved = nullptr;
  const std::string port = std::to_string(parsed->port);
  const int gai = getaddrinfo(parsed->host.empty() || parsed->host == "*" ? nullptr : parsed->host.c_str(),
                              port.c_str(), &hints, &resolved);
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
    *ipv6 = ai->ai_family == AF_INET6;
  }
  freeaddrinfo(resolved);
  if (listen_fd < 0) return absl::UnavailableError(absl::StrCat("metrics: cannot listen on '", address, "': ", error));
  return listen_fd;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
  bool ipv6 = false;
  absl::StatusOr<int> listen_fd = Listen(address, &ipv6);
  if (!listen_fd.ok()) return listen_fd.status();
  sockaddr_storage bound{};
  socklen_t bound_size = sizeof(bound);
  int port = 0;
  if (getsockname(*listen_fd, reinterpret_cast<sockaddr*>(&bound), &bound_size) == 0) {
    port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  }
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer(port, std::move(registry)));
  server->listen_fd_ = *listen_fd;
  // One internal thread with epoll; the socket is ours (bound above), so libmicrohttpd only accepts on it.
  server->daemon_ = MHD_start_daemon(
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | (ipv6 ? MHD_USE_IPv6 : 0), 0, nullptr, nullptr,
      &AnswerRequest, server.get(), MHD_OPTION_LISTEN_SOCKET, *listen_fd, MHD_OPTION_CONNECTION_TIMEOUT,
      kConnectionTimeoutS, MHD_OPTION_CONNECTION_LIMIT, kConnectionLimit, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
      kConnectionLimitPerAddress, MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    close(*listen_fd);
    server->listen_fd_ = -1;
    return absl::UnavailableError(absl::StrCat("metrics: cannot start the HTTP server on '", address, "'"));
  }
  return server;
}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

void MetricsHttpServer::Stop() {
  if (daemon_ != nullptr) {
    MHD_stop_daemon(daemon_);
    daemon_ = nullptr;
  }
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
  }
}

MetricsHttpServer::Answer MetricsHttpServer::Respond(const std::string& method, const std::string& path) const {
  if (method != MHD_HTTP_METHOD_GET && method != MHD_HTTP_METHOD_HEAD) {
    return {MHD_HTTP_METHOD_NOT_ALLOWED, kPlainText, "only GET and HEAD\n"};
  }
  if (path.substr(0, path.find('?')) != "/metrics") return {MHD_HTTP_NOT_FOUND, kPlainText, "metrics are at /metrics\n"};
  std::ostringstream text;
  prometheus::TextSerializer().Serialize(text, registry_->Collect());
  return {MHD_HTTP_OK, kTextFormat, text.str()};
}

}  // namespace mita::server
