// Model package loading (see model_package.h).
#include "models/model_package.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "models/safetensors.h"

namespace mita::models {
namespace {

// Reads a whole file; NOT_FOUND naming it when it is missing or unreadable.
absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    return absl::NotFoundError(absl::StrCat("model package: missing file ", path.string()));
  }
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("model package: cannot open ", path.string()));
  std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) return absl::NotFoundError(absl::StrCat("model package: cannot read ", path.string()));
  return bytes;
}

// Keeps the code of `status` and prefixes its message.
absl::Status Prefixed(const absl::Status& status, const std::string& prefix) {
  return absl::Status(status.code(), absl::StrCat(prefix, status.message()));
}

// One label per line ('\n' or "\r\n"); a final newline is optional; empty lines are an error.
absl::StatusOr<std::vector<std::string>> ParseLabels(const std::string& text, int64_t num_classes) {
  std::vector<std::string> labels;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("labels.txt: line ", labels.size() + 1, " is empty"));
    }
    labels.push_back(std::move(line));
    start = end + 1;
  }
  if (static_cast<int64_t>(labels.size()) != num_classes) {
    return absl::InvalidArgumentError(absl::StrCat("labels.txt: holds ", labels.size(),
                                                   " labels, config.json num_classes is ", num_classes));
  }
  return labels;
}

}  // namespace

absl::StatusOr<ModelPackage> LoadModelPackage(const std::string& directory) {
  const std::filesystem::path root(directory);
  std::error_code error;
  if (!std::filesystem::is_directory(root, error)) {
    return absl::NotFoundError(absl::StrCat("model package: no folder ", directory));
  }
  ModelPackage package;
  package.name = root.filename().string();
  if (package.name.empty()) package.name = root.parent_path().filename().string();  // "dir/" form

  absl::StatusOr<std::string> config_text = ReadFile(root / "config.json");
  if (!config_text.ok()) return config_text.status();
  absl::StatusOr<ModelKind> kind = ParseModelKind(*config_text);
  if (!kind.ok()) return kind.status();  // already prefixed with "config.json: "
  package.kind = *kind;
  int64_t num_classes = 0;
  if (package.kind == ModelKind::kImage) {
    absl::StatusOr<VitConfig> config = ParseVitConfig(*config_text);
    if (!config.ok()) return config.status();
    package.config = *std::move(config);
    num_classes = package.config.num_classes;
  } else {
    absl::StatusOr<DocumentConfig> config = ParseDocumentConfig(*config_text);
    if (!config.ok()) return config.status();
    package.document_config = *std::move(config);
    num_classes = package.document_config.num_classes;
  }

  absl::StatusOr<std::string> labels_text = ReadFile(root / "labels.txt");
  if (!labels_text.ok()) return labels_text.status();
  absl::StatusOr<std::vector<std::string>> labels = ParseLabels(*labels_text, num_classes);
  if (!labels.ok()) return labels.status();
  package.labels = *std::move(labels);

  if (package.kind == ModelKind::kDocument) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(package.document_config, root.string());
    if (!tokenizer.ok()) return tokenizer.status();
    package.tokenizer = *std::move(tokenizer);
  }

  absl::StatusOr<std::string> weights_bytes = ReadFile(root / "model.safetensors");
  if (!weights_bytes.ok()) return weights_bytes.status();
  absl::StatusOr<std::map<std::string, at::Tensor>> weights = ParseSafetensors(*weights_bytes);
  if (!weights.ok()) return Prefixed(weights.status(), "model.safetensors: ");
  weights_bytes->clear();
  weights_bytes->shrink_to_fit();
  if (package.kind == ModelKind::kImage) {
    absl::StatusOr<std::unique_ptr<VitClassifier>> model =
        VitClassifier::Create(package.config, *std::move(weights));
    if (!model.ok()) return Prefixed(model.status(), "model.safetensors: ");
    package.model = *std::move(model);
  } else {
    absl::StatusOr<std::unique_ptr<DocumentClassifier>> model =
        DocumentClassifier::Create(package.document_config, *std::move(weights));
    if (!model.ok()) return Prefixed(model.status(), "model.safetensors: ");
    package.document_model = *std::move(model);
  }
  return package;
}

}  // namespace mita::models
