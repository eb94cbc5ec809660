// safetensors reader (see safetensors.h). Format: https://huggingface.co/docs/safetensors ("Format"), whose
// reference implementation (crate safetensors, `validate`) also requires the data buffer to be fully indexed:
// sorted by begin offset, each tensor starts where the previous one ended, the last one ends at the buffer end.
#include "models/safetensors.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace mita::models {
namespace {

using Json = nlohmann::json;

static_assert(sizeof(void*) == 8, "64-bit host expected");
// safetensors stores little-endian data; the copy below is a plain memcpy.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "little-endian host expected");

// The reference implementation rejects headers over 100 MB; so do we (a header is a few KB in practice).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct TensorEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  int64_t item_size = 0;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // bytes, relative to the data buffer
  uint64_t end = 0;
};

absl::Status Invalid(absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors: ", message));
}

absl::Status ParseDtype(const Json& value, TensorEntry& entry) {
  if (!value.is_string()) return Invalid(absl::StrCat("tensor \"", entry.name, "\": dtype must be a string"));
  const std::string dtype = value.get<std::string>();
  if (dtype == "F32") {
    entry.dtype = at::kFloat;
    entry.item_size = 4;
  } else if (dtype == "F16") {
    entry.dtype = at::kHalf;
    entry.item_size = 2;
  } else if (dtype == "BF16") {
    entry.dtype = at::kBFloat16;
    entry.item_size = 2;
  } else if (dtype == "F64") {
    entry.dtype = at::kDouble;
    entry.item_size = 8;
  } else {
    return Invalid(absl::StrCat("tensor \"", entry.name, "\": dtype \"", dtype,
                                "\" is not supported: use F32, F16, BF16 or F64"));
  }
  return absl::OkStatus();
}

// Reads a JSON value that must be a non-negative integer.
bool ReadNonNegative(const Json& value, uint64_t& result) {
  if (value.is_number_unsigned()) {
    result = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    result = static_cast<uint64_t>(value.get<int64_t>());
    return true;
  }
  return false;
}

absl::StatusOr<TensorEntry> ParseEntry(const std::string& name, const Json& value, uint64_t buffer_size) {
  TensorEntry entry;
  entry.name = name;
  if (!value.is_object()) return Invalid(absl::StrCat("tensor \"", name, "\": entry must be a JSON object"));
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(key)) return Invalid(absl::StrCat("tensor \"", name, "\": missing \"", key, "\""));
  }
  if (absl::Status status = ParseDtype(value["dtype"], entry); !status.ok()) return status;

  const Json& shape = value["shape"];
  if (!shape.is_array()) return Invalid(absl::StrCat("tensor \"", name, "\": shape must be an array"));
  // Element count, kept below 2^62 / item size so byte counts cannot overflow.
  uint64_t element_count = 1;
  constexpr uint64_t kMaxElements = uint64_t{1} << 58;
  for (const Json& dimension : shape) {
    uint64_t size = 0;
    if (!ReadNonNegative(dimension, size)) {
      return Invalid(absl::StrCat("tensor \"", name, "\": shape ", shape.dump(),
                                  " must hold non-negative integers"));
    }
    if (size > kMaxElements || (size != 0 && element_count > kMaxElements / size)) {
      return Invalid(absl::StrCat("tensor \"", name, "\": shape ", shape.dump(), " is too large"));
    }
    element_count *= size;
    entry.shape.push_back(static_cast<int64_t>(size));
  }

  const Json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !ReadNonNegative(offsets[0], entry.begin) ||
      !ReadNonNegative(offsets[1], entry.end)) {
    return Invalid(absl::StrCat("tensor \"", name, "\": data_offsets ", offsets.dump(),
                                " must be two non-negative integers [begin, end]"));
  }
  if (entry.begin > entry.end) {
    return Invalid(absl::StrCat("tensor \"", name, "\": data_offsets [", entry.begin, ", ", entry.end,
                                "] end before they begin"));
  }
  if (entry.end > buffer_size) {
    return Invalid(absl::StrCat("tensor \"", name, "\": data_offsets [", entry.begin, ", ", entry.end,
                                "] are out of bounds: the data buffer holds ", buffer_size, " bytes"));
  }
  const uint64_t expected_bytes = element_count * static_cast<uint64_t>(entry.item_size);
  if (entry.end - entry.begin != expected_bytes) {
    return Invalid(absl::StrCat("tensor \"", name, "\": data_offsets [", entry.begin, ", ", entry.end, "] span ",
                                entry.end - entry.begin, " bytes but shape ", shape.dump(), " x ",
                                value["dtype"].get<std::string>(), " needs ", expected_bytes));
  }
  return entry;
}

// Builds a float32 CPU tensor from `entry`'s bytes (copied: the file buffer need not be aligned or outlive it).
at::Tensor BuildTensor(const TensorEntry& entry, const char* buffer) {
  at::Tensor raw = at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype).device(at::kCPU));
  if (entry.end > entry.begin) std::memcpy(raw.data_ptr(), buffer + entry.begin, entry.end - entry.begin);
  return entry.dtype == at::kFloat ? raw : raw.to(at::kFloat);
}

absl::StatusOr<std::map<std::string, at::Tensor>> ParseChecked(std::string_view file_bytes) {
  if (file_bytes.size() < 8) {
    return Invalid(absl::StrCat("file is ", file_bytes.size(), " bytes, shorter than the 8-byte header length"));
  }
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | static_cast<uint8_t>(file_bytes[i]);
  const uint64_t available = file_bytes.size() - 8;
  if (header_size > available) {
    return Invalid(absl::StrCat("header length ", header_size, " is beyond the file: only ", available,
                                " bytes follow the length field"));
  }
  if (header_size > kMaxHeaderBytes) {
    return Invalid(absl::StrCat("header length ", header_size, " exceeds the limit of ", kMaxHeaderBytes));
  }
  const std::string_view header_text = file_bytes.substr(8, header_size);
  Json header;
  try {
    header = Json::parse(header_text.begin(), header_text.end());
  } catch (const Json::parse_error& error) {
    return Invalid(absl::StrCat("header is not valid JSON (byte ", error.byte, "): ", error.what()));
  } catch (const Json::exception& error) {  // e.g. out_of_range for a number such as 1e55555
    return Invalid(absl::StrCat("header is not valid JSON: ", error.what()));
  }
  if (!header.is_object()) return Invalid("header must be a JSON object");

  const uint64_t buffer_size = available - header_size;
  std::vector<TensorEntry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return Invalid("__metadata__ must be a JSON object");
      continue;
    }
    absl::StatusOr<TensorEntry> entry = ParseEntry(name, value, buffer_size);
    if (!entry.ok()) return entry.status();
    entries.push_back(*std::move(entry));
  }

  // Ordered, non-overlapping, no holes, the whole buffer indexed.
  std::vector<const TensorEntry*> by_offset;
  for (const TensorEntry& entry : entries) by_offset.push_back(&entry);
  std::stable_sort(by_offset.begin(), by_offset.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t position = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry* entry : by_offset) {
    if (entry->begin < position) {
      return Invalid(absl::StrCat("tensor \"", entry->name, "\": data_offsets [", entry->begin, ", ", entry->end,
                                  "] overlap tensor \"", previous->name, "\" [", previous->begin, ", ",
                                  previous->end, "]"));
    }
    if (entry->begin > position) {
      return Invalid(absl::StrCat("tensor \"", entry->name, "\": data_offsets begin at ", entry->begin,
                                  " leaving a gap after byte ", position, " (the data buffer must be fully indexed)"));
    }
    position = entry->end;
    previous = entry;
  }
  if (position != buffer_size) {
    return Invalid(absl::StrCat("the tensors cover ", position, " bytes of the ", buffer_size,
                                "-byte data buffer (the data buffer must be fully indexed)"));
  }

  const char* buffer = file_bytes.data() + 8 + header_size;
  std::map<std::string, at::Tensor> tensors;
  try {
    for (const TensorEntry& entry : entries) tensors.emplace(entry.name, BuildTensor(entry, buffer));
  } catch (const c10::Error& error) {
    return absl::InternalError(absl::StrCat("safetensors: building tensors failed: ", error.what_without_backtrace()));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("safetensors: out of memory building tensors");
  }
  return tensors;
}

}  // namespace

absl::StatusOr<std::map<std::string, at::Tensor>> ParseSafetensors(std::string_view file_bytes) {
  try {
    return ParseChecked(file_bytes);
  } catch (const nlohmann::json::exception& error) {
    // Every JSON access is type-checked first; this guards the boundary only.
    return Invalid(absl::StrCat("unexpected header structure: ", error.what()));
  }
}

absl::StatusOr<std::map<std::string, at::Tensor>> LoadSafetensors(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  return ParseSafetensors(bytes);
}

}  // namespace mita::models
