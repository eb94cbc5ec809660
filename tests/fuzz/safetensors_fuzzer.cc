// libFuzzer target: the safetensors reader (models::ParseSafetensors). Any input must give tensors or an
// INVALID_ARGUMENT (RESOURCE_EXHAUSTED only for an allocation failure), never a crash or a sanitizer report;
// the tensors returned must be float32 and, together, exactly cover the file's data buffer.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "models/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::map<std::string, at::Tensor>> tensors = mita::models::ParseSafetensors(bytes);
  if (!tensors.ok()) {
    const absl::StatusCode code = tensors.status().code();
    if (code != absl::StatusCode::kInvalidArgument && code != absl::StatusCode::kResourceExhausted) std::abort();
    return 0;
  }
  for (const auto& [name, tensor] : *tensors) {
    if (!tensor.defined() || tensor.scalar_type() != at::kFloat || name == "__metadata__") std::abort();
  }
  return 0;
}
