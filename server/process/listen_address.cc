#include "server/process/listen_address.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace mita::server {
namespace {

// Binds and closes one socket of `info`'s family; 0 or the errno of socket() or bind().
int TryBind(const addrinfo& info) {
  const int socket_fd = socket(info.ai_family, info.ai_socktype, info.ai_protocol);
  if (socket_fd < 0) return errno;
  const int on = 1, off = 0;
  setsockopt(socket_fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  if (info.ai_family == AF_INET6) setsockopt(socket_fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);
  const int result = bind(socket_fd, info.ai_addr, info.ai_addrlen) == 0 ? 0 : errno;
  close(socket_fd);
  return result;
}

}  // namespace

absl::StatusOr<ListenAddress> ParseListenAddress(absl::string_view address, absl::string_view flag) {
  auto error = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("flag ", flag, ": address '", address, "' ", what));
  };
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon + 1 == address.size()) {
    return error("has no port: use host:port, [ipv6]:port or :port");
  }
  ListenAddress parsed;
  absl::string_view host = address.substr(0, colon);
  const absl::string_view port = address.substr(colon + 1);
  if (!host.empty() && (host.front() == '[') != (host.back() == ']')) return error("has an unbalanced '['");
  if (host.size() >= 2 && host.front() == '[') {
    host = host.substr(1, host.size() - 2);
    if (host.empty()) return error("has an empty IPv6 address");
  } else if (host.find(':') != absl::string_view::npos) {
    return error("has an IPv6 host without brackets: use [host]:port");
  }
  // A negative port is a number out of range, not a malformed one.
  const absl::string_view digits = absl::StripPrefix(port, "-");
  if (digits.empty() || digits.find_first_not_of("0123456789") != absl::string_view::npos) {
    return error(absl::StrCat("has port '", port, "', which is not a number"));
  }
  int64_t number = 0;
  if (port.size() > 5 || !absl::SimpleAtoi(port, &number) || number < 0 || number > 65535) {
    return error(absl::StrCat("has port ", port, ", which is out of range: allowed [0, 65535]"));
  }
  parsed.host = std::string(host);
  parsed.port = static_cast<int>(number);
  return parsed;
}

std::string GrpcListenTarget(const ListenAddress& address) {
  if (address.host.empty() || address.host == "*") return absl::StrCat("[::]:", address.port);
  if (address.host.find(':') != std::string::npos) return absl::StrCat("[", address.host, "]:", address.port);
  return absl::StrCat(address.host, ":", address.port);
}

absl::Status CheckCanListen(const ListenAddress& address, absl::string_view flag) {
  if (address.port == 0) return absl::OkStatus();
  const bool wildcard = address.host.empty() || address.host == "*";
  const std::string port = std::to_string(address.port);
  // Like gRPC, the address can be listened on when one of its resolutions binds (a host name such as localhost
  // may resolve to ::1 as well as 127.0.0.1); the wildcard is IPv6's (IPv4 mapped), or IPv4's without IPv6.
  int error = EADDRNOTAVAIL;
  for (const int family : wildcard ? std::vector<int>{AF_INET6, AF_INET} : std::vector<int>{AF_UNSPEC}) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_family = family;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    if (getaddrinfo(wildcard ? nullptr : address.host.c_str(), port.c_str(), &hints, &found) != 0) continue;
    for (const addrinfo* info = found; info != nullptr; info = info->ai_next) {
      const int result = TryBind(*info);
      if (result == 0 || error != EADDRINUSE) error = result;
      if (result == 0) break;
    }
    freeaddrinfo(found);
    if (error == 0 || error == EADDRINUSE) break;
  }
  const std::string shown = wildcard ? absl::StrCat(":", address.port) : absl::StrCat(address.host, ":", address.port);
  if (error == 0) return absl::OkStatus();
  if (error == EADDRINUSE) {
    return absl::FailedPreconditionError(
        absl::StrCat("flag ", flag, ": port ", address.port, " of '", shown, "' is in use (another server?)"));
  }
  if (error == EADDRNOTAVAIL) {
    return absl::InvalidArgumentError(absl::StrCat("flag ", flag, ": '", shown, "' is not an address of this machine"));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("flag ", flag, ": cannot listen on '", shown, "': ", std::strerror(error)));
}

}  // namespace mita::server
