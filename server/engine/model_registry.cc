#include "server/engine/model_registry.h"

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "models/request_error.h"
#include "server/engine/model_repository.h"

namespace mita::server {
absl::StatusOr<std::unique_ptr<ModelRegistry>> ModelRegistry::LoadFromDirectory(
    const std::string& repository, const std::map<std::string, models::Placement>& placements) {
  absl::StatusOr<std::vector<std::string>> folders = ModelFolderNames(repository);
  if (!folders.ok()) return folders.status();
  std::vector<models::ModelPackage> packages;
  for (const std::string& name : *folders) {
    absl::StatusOr<ModelFolder> folder = ReadModelFolder(repository, name);
    if (!folder.ok()) return folder.status();
    absl::StatusOr<std::vector<VersionFolder>> versions = ServedVersions(*folder);
    if (!versions.ok()) return versions.status();
    auto placement = placements.find(name);
    absl::StatusOr<models::ModelPackage> package = LoadModelVersion(
        repository, *folder, versions->back(), placement == placements.end() ? models::Placement{} : placement->second);
    if (!package.ok()) return package.status();
    packages.push_back(*std::move(package));
  }
  return FromPackages(std::move(packages));
}

absl::StatusOr<std::unique_ptr<ModelRegistry>> ModelRegistry::FromPackages(std::vector<models::ModelPackage> packages) {
  std::unique_ptr<ModelRegistry> registry(new ModelRegistry());
  for (models::ModelPackage& package : packages) {
    if (package.name.empty()) return absl::InvalidArgumentError("model package without a name");
    if (package.classifier == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("model package '", package.name, "' has no model"));
    }
    std::string name = package.name;
    auto [it, inserted] = registry->packages_.emplace(name, std::make_unique<models::ModelPackage>(std::move(package)));
    if (!inserted) return absl::InvalidArgumentError(absl::StrCat("duplicate model name '", name, "'"));
  }
  return registry;
}

absl::StatusOr<const models::ModelPackage*> ModelRegistry::Lookup(const std::string& name) const {
  if (name.empty()) {
    return models::InvalidRequest(models::RequestField::kModel,
                                  absl::StrCat("the model name is empty; available: ", absl::StrJoin(names(), ", ")));
  }
  auto it = packages_.find(name);
  if (it == packages_.end()) {
    // The name comes from a request: echo at most 100 bytes of it.
    constexpr size_t kMaxEcho = 100;
    const std::string shown = name.size() > kMaxEcho ? absl::StrCat(name.substr(0, kMaxEcho), "...") : name;
    return absl::NotFoundError(
        absl::StrCat("model '", shown, "' not found; available: ", absl::StrJoin(names(), ", ")));
  }
  return it->second.get();
}

std::vector<std::string> ModelRegistry::names() const {
  std::vector<std::string> result;
  for (const auto& [name, package] : packages_) result.push_back(name);
  return result;
}

std::vector<const models::ModelPackage*> ModelRegistry::packages() const {
  std::vector<const models::ModelPackage*> result;
  for (const auto& [name, package] : packages_) result.push_back(package.get());
  return result;
}

absl::StatusOr<std::string> ResolveInsideDirectory(const std::string& root, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path resolved_root = fs::canonical(root, error);
  if (error) return absl::NotFoundError(absl::StrCat("cannot resolve '", root, "': ", error.message()));
  const fs::path resolved = fs::canonical(path, error);
  if (error) return absl::NotFoundError(absl::StrCat("cannot resolve '", path, "': ", error.message()));
  // Inside means: root's components are a prefix of the path's components.
  auto root_it = resolved_root.begin();
  auto path_it = resolved.begin();
  for (; root_it != resolved_root.end(); ++root_it, ++path_it) {
    if (path_it == resolved.end() || *path_it != *root_it) {
      return absl::PermissionDeniedError(
          absl::StrCat("'", path, "' resolves to '", resolved.string(), "', outside '", resolved_root.string(), "'"));
    }
  }
  return resolved.string();
}

}  // namespace mita::server
