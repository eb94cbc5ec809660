// Parsing of "host:port" listening addresses (--listen, --metrics_listen).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mita::server {

// A listening address split into its parts.
struct ListenAddress {
  std::string host;  // without IPv6 brackets; "" or "*" for every interface
  int port = 0;      // 0..65535; 0 picks a free port
};

// Parses "host:port", "[v6]:port" or ":port". `flag` names the flag in errors (e.g. "--listen").
// Errors: INVALID_ARGUMENT naming the flag, the address and what is wrong (no port, a port that is not a
// number, a port out of range [0, 65535], an empty or unbalanced IPv6 bracket).
absl::StatusOr<ListenAddress> ParseListenAddress(absl::string_view address, absl::string_view flag);

// The address gRPC is given to listen on `address`: "[::]:PORT" for every address (host "" or "*"; gRPC binds a
// wildcard address on IPv6 and IPv4, or IPv4 alone where the machine has no IPv6), "[HOST]:PORT" for an IPv6 host,
// "HOST:PORT" otherwise. (gRPC itself refuses ":PORT".)
std::string GrpcListenTarget(const ListenAddress& address);

// Whether `address` can be bound now: binds a TCP socket as the servers will (SO_REUSEADDR, no SO_REUSEPORT; the
// wildcard host on IPv6 with IPv4 mapped, or IPv4 where there is no IPv6) and closes it at once, so that a port in
// use is a start-up error before the models load. Port 0 is always free. Errors, naming `flag`: FAILED_PRECONDITION
// when the port is in use, INVALID_ARGUMENT when the host is not an address of this machine. (The servers' own
// bind stays the final check: another process may take the port in between.)
absl::Status CheckCanListen(const ListenAddress& address, absl::string_view flag);

}  // namespace mita::server
