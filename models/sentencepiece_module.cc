// libmita_sentencepiece.so: libsentencepiece behind the C interface of sentencepiece_adapter.h (see there why).
// Includes no Abseil header.
//
// No C++ exception leaves an entry point: each catches everything and reports it as an error. The library can
// throw (std::bad_alloc; protobuf's FatalException, e.g. from its version check when its bundled protobuf-lite
// is bound to another protobuf), and an exception must not unwind through the C interface into the caller:
// across a separate link-map namespace (sanitizer builds, models/tokenizer.cc) there is no common C++ runtime
// to catch it, and in any build the caller's error handling is the returned status.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <sentencepiece_processor.h>

#include "models/sentencepiece_adapter.h"

namespace {

void CopyError(std::string_view message, char* error, size_t capacity) {
  if (capacity == 0) return;
  const size_t length = std::min(message.size(), capacity - 1);
  std::memcpy(error, message.data(), length);
  error[length] = '\0';
}

// Writes "<operation>: <what()>" of the exception being handled (call only inside a catch block) into `error`,
// allocating nothing (the exception may be std::bad_alloc); returns 1.
int ReportCurrentException(const char* operation, char* error, size_t capacity) noexcept {
  const char* what = "unknown exception";
  try {
    throw;
  } catch (const std::exception& exception) {
    what = exception.what();  // the exception lives on: the caller's handler still holds it
  } catch (...) {
  }
  if (capacity > 0) std::snprintf(error, capacity, "%s: %s", operation, what);
  return 1;
}

int Load(const char* model_bytes, size_t model_size, void** processor, char* error, size_t error_capacity) {
  try {
    auto loaded = std::make_unique<sentencepiece::SentencePieceProcessor>();
    const sentencepiece::util::Status status =
        loaded->LoadFromSerializedProto(std::string_view(model_bytes, model_size));
    if (!status.ok()) {
      CopyError(status.ToString(), error, error_capacity);
      return 1;
    }
    *processor = loaded.release();
    return 0;
  } catch (...) {
    return ReportCurrentException("loading the model", error, error_capacity);
  }
}

int Encode(const void* processor, const char* text, size_t text_size, MitaSentencePieceIdsCallback callback,
           void* context, char* error, size_t error_capacity) {
  try {
    std::vector<int> ids;
    const sentencepiece::util::Status status =
        static_cast<const sentencepiece::SentencePieceProcessor*>(processor)->Encode(
            std::string_view(text, text_size), &ids);
    if (!status.ok()) {
      CopyError(status.ToString(), error, error_capacity);
      return 1;
    }
    callback(context, ids.data(), ids.size());
    return 0;
  } catch (...) {
    return ReportCurrentException("encoding", error, error_capacity);
  }
}

int64_t VocabSize(const void* processor) noexcept {
  return static_cast<const sentencepiece::SentencePieceProcessor*>(processor)->GetPieceSize();
}

void Destroy(void* processor) noexcept { delete static_cast<sentencepiece::SentencePieceProcessor*>(processor); }

}  // namespace

extern "C" __attribute__((visibility("default"))) void mita_sentencepiece_get_api(MitaSentencePieceApi* api) {
  api->load = Load;
  api->encode = Encode;
  api->vocab_size = VocabSize;
  api->destroy = Destroy;
}
