// The exceptions ATen may throw (out of memory, internal checks), turned into a Status: one mapping for the
// kernels (mita_attention.cc) and the classifiers' forward passes (models/), so that running out of memory is
// RESOURCE_EXHAUSTED wherever it happens and every other failure INTERNAL.
//
// This header has no gRPC, proto or model knowledge.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace mita::kernels {

// Whether `message` (a c10::Error's what_without_backtrace()) reports a failed allocation. LibTorch 1.13's CPU
// allocator says "DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes. Error code 12
// (Cannot allocate memory)" when posix_memalign fails, other platforms "not enough memory"; the CUDA caching
// allocator says "CUDA out of memory".
bool IsOutOfMemoryMessage(absl::string_view message);

// The Status of the exception being handled: call it only inside a catch block (it rethrows the current
// exception to look at it). std::bad_alloc -> RESOURCE_EXHAUSTED "<operation>: out of memory";
// c10::OutOfMemoryError or a c10::Error for which IsOutOfMemoryMessage holds -> RESOURCE_EXHAUSTED
// "<operation>: <message>"; any other c10::Error or std::exception -> INTERNAL "<operation> failed: <message>";
// anything else -> INTERNAL "<operation> failed: unknown exception".
absl::Status CurrentExceptionStatus(absl::string_view operation);

}  // namespace mita::kernels
