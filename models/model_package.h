// Model packages: one folder per model holding config.json, model.safetensors and labels.txt.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "models/document_classifier.h"
#include "models/model_config.h"
#include "models/tokenizer.h"
#include "models/vit_classifier.h"

namespace mita::models {

// A loaded model package. `kind` says which half is filled: image models (config.json "architecture":
// "mita_vit") have `config` and `model`; document models ("mita_document") have `document_config`,
// `document_model` and `tokenizer`.
struct ModelPackage {
  std::string name;  // the folder name
  ModelKind kind = ModelKind::kImage;
  std::vector<std::string> labels;  // num_classes entries, one per line of labels.txt
  VitConfig config;                       // image models
  std::unique_ptr<VitClassifier> model;   // image models
  DocumentConfig document_config;                       // document models
  std::unique_ptr<DocumentClassifier> document_model;   // document models
  std::unique_ptr<Tokenizer> tokenizer;                 // document models
};

// Loads the package in `directory`: config.json, model.safetensors and labels.txt, plus tokenizer.model for a
// document model whose tokenizer is "sentencepiece"; dispatches on config.json's "architecture".
// Errors: NOT_FOUND when the folder or one of its files is missing; INVALID_ARGUMENT (prefixed with the file
// name) when config.json, the safetensors header or its tensors are malformed or disagree with the config,
// labels.txt does not hold exactly num_classes non-empty lines, or tokenizer.model is not a SentencePiece model
// or has more tokens than vocab_size.
absl::StatusOr<ModelPackage> LoadModelPackage(const std::string& directory);

}  // namespace mita::models
