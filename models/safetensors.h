// Reader for the safetensors format (https://huggingface.co/docs/safetensors, "Format"): an 8-byte
// little-endian header length L, L bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]},
// "__metadata__": {...}}, then the data buffer; offsets are relative to the buffer start.
#pragma once

#include <map>
#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace mita::models {

// Parses a whole safetensors file held in memory into float32 CPU tensors (F32, F16, BF16 and F64 are
// accepted and converted). Every check is done before any tensor is built: header length within the file,
// valid JSON, known dtype, non-negative shape, data_offsets in bounds, ordered, non-overlapping and equal to
// shape x dtype size. Errors: INVALID_ARGUMENT with the tensor name and the fault.
absl::StatusOr<std::map<std::string, at::Tensor>> ParseSafetensors(std::string_view file_bytes);

// Reads and parses a safetensors file. Errors: NOT_FOUND when the file cannot be read, else as above.
absl::StatusOr<std::map<std::string, at::Tensor>> LoadSafetensors(const std::string& path);

}  // namespace mita::models
