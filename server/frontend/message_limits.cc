// Message size limits with actionable errors (see message_limits.h).
#include "server/frontend/message_limits.h"

#include <algorithm>
#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "zlib.h"

namespace mita::server {

absl::Status ValidateMessageSizeLimits(const MessageSizeLimits& limits) {
  auto check = [](int64_t value, const std::string& source) {
    if (value < MessageSizeLimits::kMinBytes || value > MessageSizeLimits::kMaxBytes) {
      return absl::InvalidArgumentError(absl::StrCat(source, " is ", value, " bytes: allowed [",
                                                     MessageSizeLimits::kMinBytes, ", ", MessageSizeLimits::kMaxBytes,
                                                     "]"));
    }
    return absl::OkStatus();
  };
  if (absl::Status status = check(limits.max_receive_bytes, limits.receive_source); !status.ok()) return status;
  return check(limits.max_send_bytes, limits.send_source);
}

int TransportLimitBytes(int64_t bytes) {
  return static_cast<int>(std::clamp<int64_t>(2 * std::max<int64_t>(bytes, 0), 0, INT_MAX));
}

MessageSizeGuard::MessageSizeGuard(MessageSizeLimits limits, prometheus::Registry* registry)
    : limits_(std::move(limits)) {
  if (registry != nullptr) {
    auto& family = prometheus::BuildCounter()
                       .Name("mita_oversized_messages_total")
                       .Help("Messages rejected for their size (RESOURCE_EXHAUSTED naming the limit and its flag)")
                       .Register(*registry);
    oversized_requests_ = &family.Add({{"direction", "request"}});
    oversized_responses_ = &family.Add({{"direction", "response"}});
  }
}

void MessageSizeGuard::ConfigureServer(grpc::ServerBuilder& builder) const {
  builder.SetMaxReceiveMessageSize(TransportLimitBytes(limits_.max_receive_bytes));
  builder.SetMaxSendMessageSize(TransportLimitBytes(limits_.max_send_bytes));
}

absl::Status MessageSizeGuard::CheckRequestBytes(int64_t bytes) const {
  if (bytes <= limits_.max_receive_bytes) return absl::OkStatus();
  if (oversized_requests_ != nullptr) oversized_requests_->Increment();
  return absl::ResourceExhaustedError(absl::StrCat("request message of ", bytes, " bytes is over the limit of ",
                                                   limits_.max_receive_bytes, " bytes (", limits_.receive_source,
                                                   "): send a smaller input or raise the limit"));
}

absl::Status MessageSizeGuard::CheckResponseBytes(int64_t bytes) const {
  if (bytes <= limits_.max_send_bytes) return absl::OkStatus();
  if (oversized_responses_ != nullptr) oversized_responses_->Increment();
  return absl::ResourceExhaustedError(absl::StrCat("response message of ", bytes, " bytes is over the limit of ",
                                                   limits_.max_send_bytes, " bytes (", limits_.send_source,
                                                   "): ask for less (top_n, return_statistics) or raise the limit"));
}

absl::Status MessageSizeGuard::InflateRequest(absl::string_view encoding,
                                              absl::Span<const absl::string_view> compressed,
                                              std::vector<std::string>* message) const {
  // zlib's window bits: 15 (the largest window) for the zlib format, + 16 for the gzip format.
  int window_bits = 0;
  if (encoding == "gzip") {
    window_bits = 15 + 16;
  } else if (encoding == "deflate") {
    window_bits = 15;
  } else {
    return absl::UnimplementedError(
        absl::StrCat("the request message is compressed with '", encoding, "', which this server does not inflate; "
                     "send it uncompressed, or gzip- or deflate-compressed"));
  }
  int64_t wire_bytes = 0;
  for (absl::string_view piece : compressed) wire_bytes += static_cast<int64_t>(piece.size());
  z_stream stream{};
  if (inflateInit2(&stream, window_bits) != Z_OK) return absl::ResourceExhaustedError("cannot start inflating the request");
  // The output goes into pieces of at most 256 KiB (no copies as it grows), up to one byte past the limit:
  // reaching that byte means the message is over it.
  constexpr int64_t kPieceBytes = int64_t{256} << 10;
  const int64_t ceiling = limits_.max_receive_bytes + 1;
  message->clear();
  int64_t produced = 0;
  int result = Z_OK;
  size_t next_input = 0;
  while (result != Z_STREAM_END) {
    if (stream.avail_in == 0) {
      while (next_input < compressed.size() && compressed[next_input].empty()) ++next_input;
      if (next_input == compressed.size()) break;  // all input consumed before the end of the data
      stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(compressed[next_input].data()));
      stream.avail_in = static_cast<uInt>(compressed[next_input].size());
      ++next_input;
    }
    if (message->empty() || stream.avail_out == 0) {
      if (produced == ceiling) break;
      message->emplace_back(static_cast<size_t>(std::min(kPieceBytes, ceiling - produced)), '\0');
      stream.next_out = reinterpret_cast<Bytef*>(message->back().data());
      stream.avail_out = static_cast<uInt>(message->back().size());
    }
    const uInt room = stream.avail_out;
    result = inflate(&stream, Z_NO_FLUSH);
    produced += room - stream.avail_out;
    if (result == Z_BUF_ERROR) result = Z_OK;  // no progress possible until more input or output room
    if (result != Z_OK && result != Z_STREAM_END) break;
  }
  const std::string reason = stream.msg != nullptr ? stream.msg : "";
  bool trailing = result == Z_STREAM_END && stream.avail_in > 0;
  for (size_t i = next_input; i < compressed.size(); ++i) trailing = trailing || !compressed[i].empty();
  if (!message->empty()) message->back().resize(message->back().size() - stream.avail_out);
  inflateEnd(&stream);
  if (produced > limits_.max_receive_bytes) {
    message->clear();
    if (oversized_requests_ != nullptr) oversized_requests_->Increment();
    return absl::ResourceExhaustedError(absl::StrCat(
        "request message inflates to more than ", limits_.max_receive_bytes, " bytes (", encoding, "-compressed, ",
        wire_bytes, " bytes on the wire), over the limit of ", limits_.max_receive_bytes, " bytes (",
        limits_.receive_source, "): send a smaller input or raise the limit"));
  }
  if (result == Z_STREAM_END && !trailing) return absl::OkStatus();
  message->clear();
  const std::string flagged =
      absl::StrCat("the request message is flagged ", encoding, "-compressed (grpc-encoding: ", encoding, "), but its ",
                   wire_bytes, " bytes ");
  if (result == Z_STREAM_END) {
    return absl::InvalidArgumentError(absl::StrCat(flagged, "go on after the end of the ", encoding, " data"));
  }
  if (result == Z_OK) {
    return absl::InvalidArgumentError(absl::StrCat(flagged, "end before the end of the ", encoding, " data"));
  }
  if (result == Z_MEM_ERROR) return absl::ResourceExhaustedError("out of memory inflating the request");
  return absl::InvalidArgumentError(
      absl::StrCat(flagged, "are not ", encoding, " data", reason.empty() ? "" : absl::StrCat(": ", reason)));
}

absl::Status MessageSizeGuard::CheckRequest(const google::protobuf::MessageLite& request) const {
  return CheckRequestBytes(static_cast<int64_t>(request.ByteSizeLong()));
}

absl::Status MessageSizeGuard::CheckResponse(const google::protobuf::MessageLite& response) const {
  return CheckResponseBytes(static_cast<int64_t>(response.ByteSizeLong()));
}

}  // namespace mita::server
