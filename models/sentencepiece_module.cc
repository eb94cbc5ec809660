// libmita_sentencepiece.so: libsentencepiece behind the C interface of sentencepiece_adapter.h (see there why).
// Includes no Abseil header.
#include <cstring>
#include <string>
#include <vector>

#include <sentencepiece_processor.h>

#include "models/sentencepiece_adapter.h"

namespace {

void CopyError(const std::string& message, char* error, size_t capacity) {
  if (capacity == 0) return;
  const size_t length = std::min(message.size(), capacity - 1);
  std::memcpy(error, message.data(), length);
  error[length] = '\0';
}

int Load(const char* model_bytes, size_t model_size, void** processor, char* error, size_t error_capacity) {
  auto* loaded = new (std::nothrow) sentencepiece::SentencePieceProcessor();
  if (loaded == nullptr) {
    CopyError("out of memory", error, error_capacity);
    return 1;
  }
  const sentencepiece::util::Status status =
      loaded->LoadFromSerializedProto(std::string_view(model_bytes, model_size));
  if (!status.ok()) {
    CopyError(status.ToString(), error, error_capacity);
    delete loaded;
    return 1;
  }
  *processor = loaded;
  return 0;
}

int Encode(const void* processor, const char* text, size_t text_size, MitaSentencePieceIdsCallback callback,
           void* context, char* error, size_t error_capacity) {
  std::vector<int> ids;
  const sentencepiece::util::Status status =
      static_cast<const sentencepiece::SentencePieceProcessor*>(processor)->Encode(std::string_view(text, text_size),
                                                                                  &ids);
  if (!status.ok()) {
    CopyError(status.ToString(), error, error_capacity);
    return 1;
  }
  callback(context, ids.data(), ids.size());
  return 0;
}

int64_t VocabSize(const void* processor) {
  return static_cast<const sentencepiece::SentencePieceProcessor*>(processor)->GetPieceSize();
}

void Destroy(void* processor) { delete static_cast<sentencepiece::SentencePieceProcessor*>(processor); }

}  // namespace

extern "C" __attribute__((visibility("default"))) void mita_sentencepiece_get_api(MitaSentencePieceApi* api) {
  api->load = Load;
  api->encode = Encode;
  api->vocab_size = VocabSize;
  api->destroy = Destroy;
}
