// A fixed set of loaded model packages (tests, tools): every model of a repository directory, or packages given.
// The server's own models change while it serves: server/engine/model_lifecycle.h.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "models/model_package.h"

namespace mita::server {

// An immutable set of loaded model packages, keyed by name (= package folder name). Thread-safe once built.
// Model names from requests are only looked up here, never used to build paths.
class ModelRegistry {
 public:
  // Loads every model folder of `repository` (server/engine/model_repository.h: the latest version its policy
  // serves); the model name is the folder name. Loading is all or nothing: a package that fails to load fails the
  // whole registry. Errors: ModelFolderNames', ReadModelFolder's, ServedVersions' and LoadModelVersion's (the
  // package's own error prefixed with its folder; PERMISSION_DENIED for a package that resolves outside
  // `repository`). `placements`: the device and weights dtype of each model by name (server/process/placement.h);
  // a model not in it runs on the CPU in float32.
  static absl::StatusOr<std::unique_ptr<ModelRegistry>> LoadFromDirectory(
      const std::string& repository, const std::map<std::string, models::Placement>& placements = {});

  // Builds a registry from already loaded packages (tests). Errors: INVALID_ARGUMENT for an empty or
  // duplicate name or a package without a classifier.
  static absl::StatusOr<std::unique_ptr<ModelRegistry>> FromPackages(std::vector<models::ModelPackage> packages);

  // The model called `name`. Errors: INVALID_ARGUMENT (a RequestField::kModel problem) for an empty name;
  // NOT_FOUND "model 'x' not found; available: a, b".
  absl::StatusOr<const models::ModelPackage*> Lookup(const std::string& name) const;

  // Model names, sorted.
  std::vector<std::string> names() const;
  // All packages, sorted by name.
  std::vector<const models::ModelPackage*> packages() const;
  size_t size() const { return packages_.size(); }

 private:
  ModelRegistry() = default;
  std::map<std::string, std::unique_ptr<models::ModelPackage>> packages_;
};

// Repository containment: `path` with symlinks and "." / ".." resolved, when that lies inside `root` (itself
// resolved) or is root, so that model packages are read only from the configured repository; `path` may be
// relative to the working directory. Errors: NOT_FOUND when either does not exist; PERMISSION_DENIED "'path'
// resolves to 'target', outside 'root'" otherwise.
absl::StatusOr<std::string> ResolveInsideDirectory(const std::string& root, const std::string& path);

}  // namespace mita::server
