// Model package loading (see model_package.h).
#include "models/model_package.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <vector>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/status_macros.h"
#include "models/safetensors.h"
#include "models/tokenizer.h"

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

// What every package has: its folder, name, and config.json and labels.txt texts (the weights are read after
// the config is known to be valid: model.safetensors is the large file).
struct PackageFiles {
  std::filesystem::path root;
  std::string name;
  std::string config_text;
  std::string labels_text;
};

// Reads config.json and labels.txt of the package in `directory`.
absl::StatusOr<PackageFiles> ReadPackageFiles(const std::string& directory, const std::string& name = "") {
  PackageFiles files;
  files.root = std::filesystem::path(directory);
  std::error_code error;
  if (!std::filesystem::is_directory(files.root, error)) {
    return absl::NotFoundError(absl::StrCat("model package: no folder ", directory));
  }
  files.name = files.root.filename().string();
  if (files.name.empty()) files.name = files.root.parent_path().filename().string();  // "dir/" form
  if (!name.empty()) files.name = name;
  ASSIGN_OR_RETURN(files.config_text, ReadFile(files.root / "config.json"));
  ASSIGN_OR_RETURN(files.labels_text, ReadFile(files.root / "labels.txt"));
  return files;
}

// The tensors of the package's model.safetensors.
absl::StatusOr<std::map<std::string, at::Tensor>> ReadWeights(const PackageFiles& files) {
  ASSIGN_OR_RETURN(const std::string bytes, ReadFile(files.root / "model.safetensors"));
  absl::StatusOr<std::map<std::string, at::Tensor>> weights = ParseSafetensors(bytes);
  if (!weights.ok()) return Prefixed(weights.status(), "model.safetensors: ");
  return weights;
}

absl::StatusOr<std::unique_ptr<VitClassifier>> LoadVit(PackageFiles files, const Placement& placement) {
  RETURN_IF_ERROR(CheckPlacement(placement));  // before the weights are read
  ASSIGN_OR_RETURN(VitConfig config, ParseVitConfig(files.config_text));
  ASSIGN_OR_RETURN(std::vector<std::string> labels, ParseLabels(files.labels_text, config.num_classes));
  ASSIGN_OR_RETURN(auto weights, ReadWeights(files));
  absl::StatusOr<std::unique_ptr<VitClassifier>> model =
      VitClassifier::Create(files.name, config, std::move(labels), std::move(weights), placement);
  if (!model.ok()) return Prefixed(model.status(), "model.safetensors: ");
  return model;
}

absl::StatusOr<std::unique_ptr<DocumentClassifier>> LoadDocument(PackageFiles files, const Placement& placement) {
  RETURN_IF_ERROR(CheckPlacement(placement));  // before the weights are read
  ASSIGN_OR_RETURN(DocumentConfig config, ParseDocumentConfig(files.config_text));
  ASSIGN_OR_RETURN(std::vector<std::string> labels, ParseLabels(files.labels_text, config.num_classes));
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, LoadTokenizer(config, files.root.string()));
  ASSIGN_OR_RETURN(auto weights, ReadWeights(files));
  absl::StatusOr<std::unique_ptr<DocumentClassifier>> model = DocumentClassifier::Create(
      files.name, config, std::move(labels), std::move(weights), std::move(tokenizer), placement);
  if (!model.ok()) return Prefixed(model.status(), "model.safetensors: ");
  return model;
}

// The loader of each architecture.
struct Architecture {
  const char* name;
  absl::StatusOr<std::unique_ptr<Classifier>> (*load)(PackageFiles files, const Placement& placement);
};
constexpr Architecture kArchitectures[] = {
    {"mita_vit", [](PackageFiles files, const Placement& placement) -> absl::StatusOr<std::unique_ptr<Classifier>> {
       ASSIGN_OR_RETURN(std::unique_ptr<VitClassifier> model, LoadVit(std::move(files), placement));
       return std::unique_ptr<Classifier>(std::move(model));
     }},
    {"mita_document",
     [](PackageFiles files, const Placement& placement) -> absl::StatusOr<std::unique_ptr<Classifier>> {
       ASSIGN_OR_RETURN(std::unique_ptr<DocumentClassifier> model, LoadDocument(std::move(files), placement));
       return std::unique_ptr<Classifier>(std::move(model));
     }},
};

// INVALID_ARGUMENT when `files` are not of `architecture`.
absl::Status CheckArchitecture(const PackageFiles& files, absl::string_view architecture) {
  ASSIGN_OR_RETURN(const std::string found, ParseArchitecture(files.config_text));
  if (found == architecture) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("config.json: architecture \"", found, "\" is not \"", architecture,
                                                 "\""));
}

}  // namespace

absl::StatusOr<ModelPackage> LoadModelPackage(const std::string& directory, const Placement& placement,
                                              const std::string& name) {
  ASSIGN_OR_RETURN(PackageFiles files, ReadPackageFiles(directory, name));
  ASSIGN_OR_RETURN(const std::string architecture, ParseArchitecture(files.config_text));
  std::vector<std::string> known;
  for (const Architecture& candidate : kArchitectures) {
    known.push_back(absl::StrCat("\"", candidate.name, "\""));
    if (architecture != candidate.name) continue;
    ModelPackage package;
    package.name = files.name;
    ASSIGN_OR_RETURN(package.classifier, candidate.load(std::move(files), placement));
    return package;
  }
  return absl::InvalidArgumentError(absl::StrCat("config.json: architecture \"", architecture,
                                                 "\" is not supported: use ", absl::StrJoin(known, " or ")));
}

absl::StatusOr<std::unique_ptr<VitClassifier>> LoadVitClassifier(const std::string& directory,
                                                                 const Placement& placement) {
  ASSIGN_OR_RETURN(PackageFiles files, ReadPackageFiles(directory));
  RETURN_IF_ERROR(CheckArchitecture(files, "mita_vit"));
  return LoadVit(std::move(files), placement);
}

absl::StatusOr<std::unique_ptr<DocumentClassifier>> LoadDocumentClassifier(const std::string& directory,
                                                                           const Placement& placement) {
  ASSIGN_OR_RETURN(PackageFiles files, ReadPackageFiles(directory));
  RETURN_IF_ERROR(CheckArchitecture(files, "mita_document"));
  return LoadDocument(std::move(files), placement);
}

}  // namespace mita::models
