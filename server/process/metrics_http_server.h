// The Prometheus scrape endpoint: GET /metrics over HTTP, served by GNU libmicrohttpd.
//
// Why libmicrohttpd and not prometheus::Exposer: the Exposer serves with civetweb, one worker thread per
// connection (an idle keep-alive connection holds a worker until its timeout), and its threads are created with
// a fixed 100 KiB stack that Debian's LibTorch 1.13 build cannot start threads with. libmicrohttpd's
// epoll loop serves every connection from one thread without blocking on any of them.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

struct MHD_Daemon;

namespace mita::server {

// Serves a registry in the Prometheus text format (version 0.0.4) at GET /metrics (HEAD too); other paths get
// 404 and other methods 405. One event-driven thread serves all connections: idle and slow clients do not
// delay others. A connection idle for 10 s is closed; at most 256 connections are open at once, and at most 16 from
// one client address (more are closed as soon as they are accepted), so that one client cannot lock the others
// out. Thread-safe.
class MetricsHttpServer {
 public:
  // Listens on `address`, "host:port" ("0.0.0.0:9464", "127.0.0.1:0", "[::]:9464", "localhost:9464"; port 0
  // picks a free port, see port()). Errors: INVALID_ARGUMENT for a malformed address (naming the flag
  // --metrics_listen); UNAVAILABLE when it cannot be resolved or bound (the message names the address and the
  // system error) or the HTTP daemon cannot start.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address,
                                                                  std::shared_ptr<prometheus::Registry> registry);

  // Stops serving (Stop()).
  ~MetricsHttpServer();

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The bound TCP port.
  int port() const { return port_; }

  // Stops accepting, closes the open connections and joins the thread. Idempotent; not concurrent with itself.
  void Stop();

  // The answer to one request (internal; public for the C callback).
  struct Answer {
    unsigned int status = 200;
    std::string content_type;
    std::string body;
  };
  Answer Respond(const std::string& method, const std::string& path) const;

 private:
  MetricsHttpServer(int port, std::shared_ptr<prometheus::Registry> registry)
      : port_(port), registry_(std::move(registry)) {}

  const int port_;
  const std::shared_ptr<prometheus::Registry> registry_;
  MHD_Daemon* daemon_ = nullptr;
  int listen_fd_ = -1;
};

}  // namespace mita::server
