// Model packages: one folder per model holding config.json, model.safetensors and labels.txt (and tokenizer.model
// for a SentencePiece document model). A package holds one Classifier, whichever its architecture.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "models/classifier.h"
#include "models/document_classifier.h"
#include "models/vit_classifier.h"

namespace mita::models {

// A loaded model package.
struct ModelPackage {
  std::string name;  // the folder name
  std::unique_ptr<Classifier> classifier;
};

// Loads the package in `directory` with the loader of config.json's "architecture" ("mita_vit": VitClassifier,
// "mita_document": DocumentClassifier); the model's name is `name`, or the folder name when empty (a numbered
// version folder takes its model's name: server/engine/model_repository.h).
// Errors: NOT_FOUND when the folder or one of its files is missing; INVALID_ARGUMENT (prefixed with the file
// name) when config.json names no known architecture, when it, the safetensors header or its tensors are
// malformed or disagree with the config, labels.txt does not hold exactly num_classes non-empty lines, or
// tokenizer.model is not a SentencePiece model or has more tokens than vocab_size. The model's weights go to
// `placement` (CheckPlacement's errors; RESOURCE_EXHAUSTED when the device's memory runs out).
absl::StatusOr<ModelPackage> LoadModelPackage(const std::string& directory, const Placement& placement = {},
                                              const std::string& name = "");

// The same loaders, typed, for tools and tests that need an architecture's own API (e.g. Forward on tensors).
// Errors: as LoadModelPackage; INVALID_ARGUMENT when the package has another architecture.
absl::StatusOr<std::unique_ptr<VitClassifier>> LoadVitClassifier(const std::string& directory,
                                                                 const Placement& placement = {});
absl::StatusOr<std::unique_ptr<DocumentClassifier>> LoadDocumentClassifier(const std::string& directory,
                                                                           const Placement& placement = {});

}  // namespace mita::models
