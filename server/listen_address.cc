#include "server/listen_address.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace mita::server {

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

}  // namespace mita::server
