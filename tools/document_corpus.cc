// See document_corpus.h.
#include "tools/document_corpus.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace mita::datasets {

absl::StatusOr<std::vector<CorpusDocument>> ReadCorpusSplit(const std::string& corpus_directory,
                                                            const std::string& split) {
  const std::filesystem::path root(corpus_directory);
  std::ifstream index(root / (split + ".tsv"));
  if (!index) {
    return absl::NotFoundError(absl::StrCat("corpus: cannot open ", (root / (split + ".tsv")).string(),
                                            " (build it with tools/build_document_corpus.py)"));
  }
  std::vector<CorpusDocument> documents;
  std::string line;
  int64_t line_number = 0;
  while (std::getline(index, line)) {
    ++line_number;
    if (line.empty()) continue;
    const std::vector<std::string> fields = absl::StrSplit(line, '\t');
    CorpusDocument document;
    if (fields.size() != 3 || !absl::SimpleAtoi(fields[1], &document.label)) {
      return absl::InvalidArgumentError(absl::StrCat("corpus: ", split, ".tsv line ", line_number,
                                                     " is not 'file<TAB>label<TAB>source'"));
    }
    std::ifstream text_file(root / fields[0], std::ios::binary);
    if (!text_file) return absl::NotFoundError(absl::StrCat("corpus: cannot open ", (root / fields[0]).string()));
    document.text.assign(std::istreambuf_iterator<char>(text_file), std::istreambuf_iterator<char>());
    document.source = fields[2];
    documents.push_back(std::move(document));
  }
  return documents;
}

}  // namespace mita::datasets
