// Tokenizers of document models: UTF-8 bytes (built in) and SentencePiece (Debian libsentencepiece).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "models/model_config.h"

namespace mita::models {

// Checks that `text` is well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates U+D800..U+DFFF, nothing
// above U+10FFFF, no truncated sequence). OK for the empty text. Errors: INVALID_ARGUMENT
// "invalid UTF-8 at byte offset <n>" where n is the offset of the first byte of the first bad sequence.
absl::Status ValidateUtf8(std::string_view text);

// Turns valid UTF-8 text into token ids. Implementations are immutable after loading and thread-safe.
class Tokenizer {
 public:
  virtual ~Tokenizer();
  // Token ids of `utf8_text`, each in [0, vocab_size()); call ValidateUtf8 first (bytes: any input works;
  // SentencePiece: invalid UTF-8 is replaced by U+FFFD by the library). Empty text gives no ids (bytes) or
  // none or few (SentencePiece). Errors: INTERNAL when the library fails; RESOURCE_EXHAUSTED when the ids
  // cannot be allocated.
  virtual absl::StatusOr<std::vector<int64_t>> Encode(std::string_view utf8_text) const = 0;
  virtual int64_t vocab_size() const = 0;
  // "bytes" or "sentencepiece".
  virtual std::string name() const = 0;
};

// Whether `utf8_text` (well-formed UTF-8) holds only characters of Unicode's White_Space property (true for the
// empty text): spaces, tabs, line breaks, U+00A0, U+2028, U+3000, ...
bool IsOnlyWhitespace(std::string_view utf8_text);

// Token ids of a text encoded piece by piece (EncodeBounded).
struct BoundedEncoding {
  // At most max_tokens + 1 ids.
  std::vector<int64_t> ids;
  // False when encoding stopped early because more than max_tokens ids were found.
  bool complete = true;
};

// How many bytes EncodeBounded hands the tokenizer at once (8 KiB).
inline constexpr size_t kEncodePieceBytes = size_t{8} << 10;

// Encodes `utf8_text` (checked with ValidateUtf8) in pieces of at most `piece_bytes` bytes, each cut right
// before an ASCII whitespace byte when it has one (SentencePiece never joins pieces across whitespace, so the
// pieces are those of the whole text up to ties between segmentations of equal score, which can fall the other
// way), else at a character boundary. Time and memory grow linearly with the
// bytes read, whatever the text (SentencePiece on one long run of unknown characters grows about as its
// square), and encoding stops once more than `max_tokens` ids exist. `stop` (optional) is asked before every
// piece. Errors: the tokenizer's; `stop`'s status when it says to stop.
absl::StatusOr<BoundedEncoding> EncodeBounded(const Tokenizer& tokenizer, std::string_view utf8_text,
                                              int64_t max_tokens, const std::function<absl::Status()>& stop,
                                              size_t piece_bytes = kEncodePieceBytes);

// OK when every id of `tokenizer` fits config.vocab_size (the embedding table). Errors: INVALID_ARGUMENT
// "tokenizer.model: the sentencepiece tokenizer has 40 tokens, config.json vocab_size is 30".
absl::Status CheckTokenizerFits(const Tokenizer& tokenizer, const DocumentConfig& config);

// The UTF-8 bytes tokenizer (as in Long Range Arena): id = byte value, vocab_size() = 256, one token per byte.
std::unique_ptr<Tokenizer> MakeBytesTokenizer();

// Loads a SentencePiece model file (a serialized ModelProto as written by spm_train). Errors: NOT_FOUND when
// the file cannot be read; INVALID_ARGUMENT "tokenizer.model: ..." when it does not parse.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadSentencePieceTokenizer(const std::string& model_path);

// The tokenizer named by config.tokenizer: "bytes", or "sentencepiece" from `package_directory`/tokenizer.model.
// Errors: those of LoadSentencePieceTokenizer; INVALID_ARGUMENT for an unknown name or a vocabulary that does not
// fit (CheckTokenizerFits).
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const DocumentConfig& config,
                                                         const std::string& package_directory);

}  // namespace mita::models
