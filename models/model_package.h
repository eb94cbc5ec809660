// Model packages: one folder per model holding config.json, model.safetensors and labels.txt.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "models/model_config.h"
#include "models/vit_classifier.h"

namespace mita::models {

struct ModelPackage {
  std::string name;  // the folder name
  VitConfig config;
  std::vector<std::string> labels;  // num_classes entries, one per line of labels.txt
  std::unique_ptr<VitClassifier> model;
};

// Loads the package in `directory`. Errors: NOT_FOUND when the folder or one of its three files is missing;
// INVALID_ARGUMENT (prefixed with the file name) when config.json, the safetensors header or its tensors are
// malformed or disagree with the config, or labels.txt does not hold exactly num_classes non-empty lines.
absl::StatusOr<ModelPackage> LoadModelPackage(const std::string& directory);

}  // namespace mita::models
