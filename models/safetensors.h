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
// accepted and converted; data is copied, so `file_bytes` need not be aligned or outlive the result; a
// little-endian host is assumed, as by the format). Every check is done before any tensor is built: header
// length within the file (and at most 100 MB, the reference implementation's limit), valid JSON object, known
// dtype, shape of non-negative integers, data_offsets two integers in bounds with begin <= end and
// end - begin == numel x dtype size, and, as the reference implementation requires, the data buffer fully
// indexed: sorted by begin, tensors neither overlap nor leave gaps, the last one ends at the end of the file.
// "__metadata__" must be an object and is otherwise ignored.
// Errors: INVALID_ARGUMENT ("safetensors: " + the tensor name and the fault); INTERNAL if ATen fails to
// allocate a validated tensor.
absl::StatusOr<std::map<std::string, at::Tensor>> ParseSafetensors(std::string_view file_bytes);

// Reads and parses a safetensors file. Errors: NOT_FOUND when the file cannot be read, else as above.
absl::StatusOr<std::map<std::string, at::Tensor>> LoadSafetensors(const std::string& path);

}  // namespace mita::models
