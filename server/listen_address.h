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

}  // namespace mita::server
