// libFuzzer target: document text validation and tokenization (models::ValidateUtf8 and the built-in UTF-8
// bytes tokenizer). Any input must be accepted or get INVALID_ARGUMENT naming a byte offset inside the input, never a crash or a sanitizer report; accepted text must tokenize to one id per byte, each
// within the vocabulary. (SentencePiece is not fuzzed: its module and libsentencepiece run uninstrumented in
// instrumented builds, models/tokenizer.cc.)
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "models/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::unique_ptr<mita::models::Tokenizer> tokenizer = mita::models::MakeBytesTokenizer();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const absl::Status valid = mita::models::ValidateUtf8(text);
  if (!valid.ok()) {
    const std::string message(valid.message());
    if (valid.code() != absl::StatusCode::kInvalidArgument) std::abort();
    if (message.find("byte offset") == std::string::npos) std::abort();
    if (size == 0) std::abort();  // the empty text is valid UTF-8
    return 0;
  }
  absl::StatusOr<std::vector<int64_t>> ids = tokenizer->Encode(text);
  if (!ids.ok() || ids->size() != size) std::abort();
  for (int64_t id : *ids) {
    if (id < 0 || id >= tokenizer->vocab_size()) std::abort();
  }
  return 0;
}
