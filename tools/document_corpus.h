// Reading the document corpus written by tools/build_document_corpus.py (for mita-eval-documents and
// mita-bench-documents).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace mita::datasets {

struct CorpusDocument {
  std::string text;      // the document's UTF-8 text
  int64_t label = 0;     // index into the corpus's labels.txt
  std::string source;    // path under Documentation/
};

// Reads `corpus_directory`/<split>.tsv ("train" or "heldout") and the text files it lists, in order.
// Errors: NOT_FOUND when a file is missing; INVALID_ARGUMENT for a malformed line.
absl::StatusOr<std::vector<CorpusDocument>> ReadCorpusSplit(const std::string& corpus_directory,
                                                            const std::string& split);

}  // namespace mita::datasets
