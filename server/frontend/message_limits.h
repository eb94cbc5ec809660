// Request and response size limits of the gRPC server (mita-server flags --max_receive_message_bytes and
// --max_send_message_bytes), enforced so that an oversized message gets an error naming the limit and the flag.
//
// gRPC's own limit check answers "Received message larger than max (N vs. L)", which names no flag. So the
// service checks the size itself, with an actionable message, and gRPC's transport limit is set to TWICE ours
// (capped at 2^31 - 1 bytes, gRPC's largest): a message of up to twice the limit reaches the handler and gets
// our error; a larger one is still refused by gRPC's transport, with gRPC's message (it never reaches the
// service, so it is not counted in mita_requests_total). The size checked is the protobuf encoding of the
// parsed message (ByteSizeLong), which equals the bytes received for a canonically encoded message (a
// client-side encoder of any protobuf library produces one).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/server_builder.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "google/protobuf/message_lite.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"

namespace mita::server {

// Limits, bytes of one encoded protobuf message (4 MiB each by default, gRPC's default receive limit).
struct MessageSizeLimits {
  static constexpr int64_t kDefaultBytes = int64_t{4} << 20;
  // Smallest and largest accepted limit (gRPC's transport limit, twice ours, must fit in an int).
  static constexpr int64_t kMinBytes = int64_t{1} << 10;
  static constexpr int64_t kMaxBytes = int64_t{1} << 30;

  int64_t max_receive_bytes = kDefaultBytes;  // largest request
  int64_t max_send_bytes = kDefaultBytes;     // largest response
  // How the operator sets each limit, named in the errors.
  std::string receive_source = "flag --max_receive_message_bytes";
  std::string send_source = "flag --max_send_message_bytes";
};

// Checks both limits are in [kMinBytes, kMaxBytes]. Errors: INVALID_ARGUMENT naming the source and the range.
absl::Status ValidateMessageSizeLimits(const MessageSizeLimits& limits);

// gRPC's transport limit for our limit `bytes`: min(2 x bytes, 2^31 - 1).
int TransportLimitBytes(int64_t bytes);

// Checks request and response sizes against the limits and counts rejections in
// mita_oversized_messages_total{direction="request"|"response"}. Thread-safe.
class MessageSizeGuard {
 public:
  // `registry` may be null (no metric). The limits must be valid (ValidateMessageSizeLimits).
  MessageSizeGuard(MessageSizeLimits limits, prometheus::Registry* registry);

  const MessageSizeLimits& limits() const { return limits_; }

  // Sets gRPC's receive and send limits to TransportLimitBytes of ours.
  void ConfigureServer(grpc::ServerBuilder& builder) const;

  // Errors: RESOURCE_EXHAUSTED when the request's encoding is over max_receive_bytes, e.g. "request message of
  // 4194305 bytes is over the limit of 4194304 bytes (flag --max_receive_message_bytes): send a smaller input
  // or raise the limit".
  absl::Status CheckRequest(const google::protobuf::MessageLite& request) const;
  // Errors: RESOURCE_EXHAUSTED when the response's encoding is over max_send_bytes, naming the limit and its
  // source.
  absl::Status CheckResponse(const google::protobuf::MessageLite& response) const;

  // The checks on a size in bytes (what CheckRequest and CheckResponse apply to ByteSizeLong()).
  absl::Status CheckRequestBytes(int64_t bytes) const;
  absl::Status CheckResponseBytes(int64_t bytes) const;

  // Inflates a request message the client compressed with `encoding` ("gzip": RFC 1952; "deflate": the zlib
  // format of RFC 1950, as gRPC sends it) from `compressed` (its bytes as received, in pieces) into `*message` (in
  // pieces of at most 256 KiB), stopping as soon as the output passes max_receive_bytes: however far the data would
  // inflate, this costs at most the limit in memory and the time of inflating it. Errors: RESOURCE_EXHAUSTED (counted) "request message
  // inflates to more than 4194304 bytes (gzip-compressed, 1061924 bytes on the wire), over the limit of 4194304
  // bytes (flag --max_receive_message_bytes): ..."; INVALID_ARGUMENT when the bytes are not data of `encoding`
  // (naming zlib's reason), end before its end, or go on after it; UNIMPLEMENTED for another encoding.
  absl::Status InflateRequest(absl::string_view encoding, absl::Span<const absl::string_view> compressed,
                              std::vector<std::string>* message) const;

 private:
  MessageSizeLimits limits_;
  prometheus::Counter* oversized_requests_ = nullptr;
  prometheus::Counter* oversized_responses_ = nullptr;
};

}  // namespace mita::server
