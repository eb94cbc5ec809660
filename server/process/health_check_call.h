// One grpc.health.v1.Health/Check call with the request and response encoded by hand (HealthCheckRequest
// {string service = 1}; HealthCheckResponse {ServingStatus status = 1}), so that callers need no generated
// health stubs: mita-health-probe (server/process/health_probe.cc, no LibTorch) and the tests.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/support/status.h>

#include <chrono>
#include <memory>
#include <string>

namespace mita::server {

// Sends Health/Check for `service` ("" = the whole server; any length) on `channel` with a deadline `timeout`
// from now. Returns the call's status; when OK, `*response_bytes` holds
// the response message ("\x08\x01" for SERVING).
grpc::Status HealthCheckCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                             std::chrono::milliseconds timeout, std::string* response_bytes);

}  // namespace mita::server
