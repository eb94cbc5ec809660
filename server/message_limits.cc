// Message size limits with actionable errors (see message_limits.h).
#include "server/message_limits.h"

#include <algorithm>
#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"

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

absl::Status MessageSizeGuard::CheckRequest(const google::protobuf::MessageLite& request) const {
  return CheckRequestBytes(static_cast<int64_t>(request.ByteSizeLong()));
}

absl::Status MessageSizeGuard::CheckResponse(const google::protobuf::MessageLite& response) const {
  return CheckResponseBytes(static_cast<int64_t>(response.ByteSizeLong()));
}

}  // namespace mita::server
