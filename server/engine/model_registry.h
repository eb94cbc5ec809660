// The models this server hosts: every package folder under a model repository directory, loaded at start.
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
  // Loads every sub-folder of `repository` (hidden entries and plain files are skipped) with
  // models::LoadModelPackage; the model name is the folder name. Loading is all or nothing: a package that
  // fails to load fails the whole registry.
  // Errors: NOT_FOUND when `repository` is not a readable directory or holds no package folder; the package's
  // own error (NOT_FOUND or INVALID_ARGUMENT), prefixed with its folder, when one fails to load;
  // PERMISSION_DENIED when a package folder or a file directly in it is a symlink that resolves outside
  // `repository` (packages are read only from inside it; symlinks that stay inside are followed).
  // `placements`: the device and weights dtype of each model by name (server/process/placement.h); a model not in it
  // runs on the CPU in float32.
  static absl::StatusOr<std::unique_ptr<ModelRegistry>> LoadFromDirectory(
      const std::string& repository, const std::map<std::string, models::Placement>& placements = {});

  // The package folders LoadFromDirectory would load (so the model names), sorted. Errors: NOT_FOUND as
  // LoadFromDirectory's for the repository itself.
  static absl::StatusOr<std::vector<std::string>> PackageFolders(const std::string& repository);

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
