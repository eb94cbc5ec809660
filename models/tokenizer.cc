// Tokenizers (see tokenizer.h).
#include "models/tokenizer.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "models/sentencepiece_adapter.h"

#ifndef MITA_SENTENCEPIECE_MODULE
#define MITA_SENTENCEPIECE_MODULE "libmita_sentencepiece.so"
#endif

namespace mita::models {
namespace {

class BytesTokenizer final : public Tokenizer {
 public:
  absl::StatusOr<std::vector<int64_t>> Encode(std::string_view utf8_text) const override {
    std::vector<int64_t> ids(utf8_text.size());
    for (size_t i = 0; i < utf8_text.size(); ++i) ids[i] = static_cast<unsigned char>(utf8_text[i]);
    return ids;
  }
  int64_t vocab_size() const override { return 256; }
  std::string name() const override { return "bytes"; }
};

// How the module is loaded. Normally dlopen with RTLD_DEEPBIND, which keeps the module's own protobuf copy
// (inside Debian's libsentencepiece) bound to itself rather than to LibTorch's and gRPC's libprotobuf.
//
// Sanitizer and fuzzer builds (MITA_SENTENCEPIECE_OWN_NAMESPACE, set by models/CMakeLists.txt) cannot: the
// sanitizer runtime's dlopen refuses RTLD_DEEPBIND (it aborts the process), and without it libsentencepiece's
// protobuf references bind to libprotobuf.so.32 (3.21) already in the global scope, whose version check
// throws on the first model load ("compiled against version 3.14.0 ... not compatible with the installed
// version (3.21.12)"). Those builds therefore build the module uninstrumented and load it with
// dlmopen(LM_ID_NEWLM): a link-map namespace of its own, holding only the module, libsentencepiece and their
// own copies of libstdc++ and libc, so nothing binds across (the C interface of sentencepiece_adapter.h
// shares no heap and passes no exception). The module is uninstrumented there because the sanitizer and
// coverage runtimes live in the executable, which that namespace does not see. The sanitizers then check our
// side of the interface; libsentencepiece itself is a Debian build and never instrumented.
void* OpenModule(const std::string& path) {
#ifdef MITA_SENTENCEPIECE_OWN_NAMESPACE
  return dlmopen(LM_ID_NEWLM, path.c_str(), RTLD_NOW | RTLD_LOCAL);
#else
  return dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
#endif
}

// The SentencePiece module (sentencepiece_adapter.h), loaded once per process: $MITA_SENTENCEPIECE_MODULE, else
// the path CMake compiled in (the build tree's module), else "libmita_sentencepiece.so" on the library path.
absl::StatusOr<const MitaSentencePieceApi*> SentencePieceApi() {
  static const auto* loaded = new absl::StatusOr<MitaSentencePieceApi>([]() -> absl::StatusOr<MitaSentencePieceApi> {
    std::vector<std::string> candidates;
    if (const char* path = std::getenv("MITA_SENTENCEPIECE_MODULE"); path != nullptr && *path != '\0') {
      candidates.push_back(path);
    }
    candidates.push_back(MITA_SENTENCEPIECE_MODULE);
    candidates.push_back("libmita_sentencepiece.so");
    std::string errors;
    for (const std::string& candidate : candidates) {
      void* module = OpenModule(candidate);
      if (module == nullptr) {
        const char* message = dlerror();
        absl::StrAppend(&errors, errors.empty() ? "" : "; ", message != nullptr ? message : candidate);
        continue;
      }
      auto* get_api = reinterpret_cast<void (*)(MitaSentencePieceApi*)>(dlsym(module, "mita_sentencepiece_get_api"));
      if (get_api == nullptr) {
        absl::StrAppend(&errors, errors.empty() ? "" : "; ", candidate, ": no mita_sentencepiece_get_api");
        continue;
      }
      MitaSentencePieceApi api{};
      get_api(&api);
      return api;  // the module stays loaded for the life of the process
    }
    return absl::FailedPreconditionError(
        absl::StrCat("sentencepiece: cannot load the SentencePiece module (set MITA_SENTENCEPIECE_MODULE): ", errors));
  }());
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const MitaSentencePieceApi* api, void* processor) : api_(api), processor_(processor) {}
  ~SentencePieceTokenizer() override { api_->destroy(processor_); }

  absl::StatusOr<std::vector<int64_t>> Encode(std::string_view utf8_text) const override {
    // The callback must not throw (sentencepiece_adapter.h): a failed copy is reported after the call.
    struct Collected {
      std::vector<int64_t> ids;
      bool out_of_memory = false;
    } collected;
    char error[512] = {0};
    const MitaSentencePieceIdsCallback collect = [](void* context, const int* values, size_t count) {
      auto* target = static_cast<Collected*>(context);
      try {
        target->ids.assign(values, values + count);
      } catch (const std::bad_alloc&) {
        target->out_of_memory = true;
      }
    };
    if (api_->encode(processor_, utf8_text.data(), utf8_text.size(), collect, &collected, error, sizeof(error)) !=
        0) {
      return absl::InternalError(absl::StrCat("sentencepiece: ", error));
    }
    if (collected.out_of_memory) {
      return absl::ResourceExhaustedError(
          absl::StrCat("sentencepiece: out of memory for the token ids of a ", utf8_text.size(), "-byte text"));
    }
    return std::move(collected.ids);
  }
  int64_t vocab_size() const override { return api_->vocab_size(processor_); }
  std::string name() const override { return "sentencepiece"; }

 private:
  const MitaSentencePieceApi* api_;
  void* processor_;
};

// Length of the UTF-8 sequence starting at text[i] when it is well formed, else 0 (RFC 3629, table 3-7 of the
// Unicode standard: the second byte's range depends on the first byte).
size_t WellFormedSequenceLength(std::string_view text, size_t i) {
  const auto byte = [&](size_t j) { return static_cast<unsigned char>(text[j]); };
  const unsigned char first = byte(i);
  if (first < 0x80) return 1;
  size_t length = 0;
  unsigned char second_min = 0x80, second_max = 0xBF;
  if (first >= 0xC2 && first <= 0xDF) {
    length = 2;
  } else if (first >= 0xE0 && first <= 0xEF) {
    length = 3;
    if (first == 0xE0) second_min = 0xA0;  // no overlong 3-byte forms
    if (first == 0xED) second_max = 0x9F;  // no surrogates
  } else if (first >= 0xF0 && first <= 0xF4) {
    length = 4;
    if (first == 0xF0) second_min = 0x90;  // no overlong 4-byte forms
    if (first == 0xF4) second_max = 0x8F;  // nothing above U+10FFFF
  } else {
    return 0;  // continuation byte, C0/C1 (overlong 2-byte), F5..FF
  }
  if (i + length > text.size()) return 0;
  if (byte(i + 1) < second_min || byte(i + 1) > second_max) return 0;
  for (size_t j = 2; j < length; ++j) {
    if (byte(i + j) < 0x80 || byte(i + j) > 0xBF) return 0;
  }
  return length;
}

}  // namespace

Tokenizer::~Tokenizer() = default;

absl::Status ValidateUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const size_t length = WellFormedSequenceLength(text, i);
    if (length == 0) return absl::InvalidArgumentError(absl::StrCat("invalid UTF-8 at byte offset ", i));
    i += length;
  }
  return absl::OkStatus();
}

absl::Status CheckTokenizerFits(const Tokenizer& tokenizer, const DocumentConfig& config) {
  if (tokenizer.vocab_size() <= config.vocab_size) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.model: the ", tokenizer.name(), " tokenizer has ",
                                                 tokenizer.vocab_size(), " tokens, config.json vocab_size is ",
                                                 config.vocab_size));
}

std::unique_ptr<Tokenizer> MakeBytesTokenizer() { return std::make_unique<BytesTokenizer>(); }

namespace {

bool IsAsciiWhitespace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// The code point of the well-formed UTF-8 sequence at text[i] of `length` bytes.
uint32_t CodePoint(std::string_view text, size_t i, size_t length) {
  const auto byte = [&](size_t j) { return static_cast<uint32_t>(static_cast<unsigned char>(text[j])); };
  if (length == 1) return byte(i);
  uint32_t value = byte(i) & (0xFFu >> (length + 1));
  for (size_t j = 1; j < length; ++j) value = value << 6 | (byte(i + j) & 0x3F);
  return value;
}

// Unicode's White_Space property (PropList.txt): 25 code points.
bool IsUnicodeWhitespace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

}  // namespace

bool IsOnlyWhitespace(std::string_view utf8_text) {
  size_t i = 0;
  while (i < utf8_text.size()) {
    const size_t length = WellFormedSequenceLength(utf8_text, i);
    if (length == 0 || !IsUnicodeWhitespace(CodePoint(utf8_text, i, length))) return false;
    i += length;
  }
  return true;
}

absl::StatusOr<BoundedEncoding> EncodeBounded(const Tokenizer& tokenizer, std::string_view utf8_text,
                                              int64_t max_tokens, const std::function<absl::Status()>& stop,
                                              size_t piece_bytes) {
  BoundedEncoding encoding;
  piece_bytes = std::max<size_t>(piece_bytes, 8);
  size_t start = 0;
  while (start < utf8_text.size()) {
    if (stop) {
      if (absl::Status go_on = stop(); !go_on.ok()) return go_on;
    }
    size_t end = std::min(utf8_text.size(), start + piece_bytes);
    if (end < utf8_text.size()) {
      // Cut right before the last whitespace byte of the piece: no piece of a text spans whitespace, so the ids
      // are the whole text's up to ties between equal-score segmentations. Without whitespace, cut at a character
      // boundary.
      size_t cut = end;
      while (cut > start + 1 && !IsAsciiWhitespace(utf8_text[cut])) --cut;
      if (cut > start + 1) {
        end = cut;
      } else {
        while (end > start + 1 && (static_cast<unsigned char>(utf8_text[end]) & 0xC0) == 0x80) --end;
      }
    }
    ASSIGN_OR_RETURN(std::vector<int64_t> ids, tokenizer.Encode(utf8_text.substr(start, end - start)));
    const size_t room = static_cast<size_t>(max_tokens) + 1 - encoding.ids.size();
    encoding.ids.insert(encoding.ids.end(), ids.begin(), ids.begin() + std::min(room, ids.size()));
    start = end;
    if (static_cast<int64_t>(encoding.ids.size()) > max_tokens) {
      encoding.complete = start >= utf8_text.size() && ids.size() <= room;
      if (!encoding.complete) return encoding;
    }
  }
  return encoding;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadSentencePieceTokenizer(const std::string& model_path) {
  std::error_code error_code;
  if (!std::filesystem::is_regular_file(model_path, error_code)) {
    return absl::NotFoundError(absl::StrCat("model package: missing file ", model_path));
  }
  std::ifstream file(model_path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (!file.good() && !file.eof()) return absl::NotFoundError(absl::StrCat("model package: cannot read ", model_path));
  absl::StatusOr<const MitaSentencePieceApi*> api = SentencePieceApi();
  if (!api.ok()) return api.status();
  void* processor = nullptr;
  char error[512] = {0};
  if ((*api)->load(bytes.data(), bytes.size(), &processor, error, sizeof(error)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.model: not a SentencePiece model: ", error));
  }
  return std::unique_ptr<Tokenizer>(std::make_unique<SentencePieceTokenizer>(*api, processor));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const DocumentConfig& config,
                                                         const std::string& package_directory) {
  std::unique_ptr<Tokenizer> tokenizer;
  if (config.tokenizer == "bytes") {
    tokenizer = MakeBytesTokenizer();
  } else if (config.tokenizer == "sentencepiece") {
    absl::StatusOr<std::unique_ptr<Tokenizer>> loaded =
        LoadSentencePieceTokenizer((std::filesystem::path(package_directory) / "tokenizer.model").string());
    if (!loaded.ok()) return loaded.status();
    tokenizer = *std::move(loaded);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("config.json: tokenizer \"", config.tokenizer,
                                                   "\" is not supported: use \"bytes\" or \"sentencepiece\""));
  }
  if (absl::Status fits = CheckTokenizerFits(*tokenizer, config); !fits.ok()) return fits;
  return tokenizer;
}

}  // namespace mita::models
