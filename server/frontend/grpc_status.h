// The one conversion from absl::Status (used everywhere inside the server) to grpc::Status, applied at the
// service edge only.
#pragma once

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"

namespace mita::server {

// The gRPC status with the same code and message. gRPC and Abseil share the google.rpc.Code numbering (0 OK ..
// 16 UNAUTHENTICATED); a code outside it maps to UNKNOWN.
inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  const bool known = code > 0 && code <= static_cast<int>(grpc::StatusCode::UNAUTHENTICATED);
  return grpc::Status(known ? static_cast<grpc::StatusCode>(code) : grpc::StatusCode::UNKNOWN,
                      std::string(status.message()));
}

}  // namespace mita::server
