// The layout of a model repository on disk: which model folders it holds, the numbered versions of each, which of
// them the model's version policy serves, and loading one version's package from inside the repository.
//
//   repository/
//     image-model/            a package directly: config.json, model.safetensors, ... (version 1)
//     document-model/         numbered versions, each a package
//       version_policy.json   optional: {"latest": 2} | {"specific": [1, 3]} | {"all": true}; default {"latest": 1}
//       1/ 2/ 3/
//
// (docs/serving.md "Model repository"; the versions and policy follow Triton's model repository.)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "models/model_package.h"

namespace mita::server {

// Which versions of a model are served (Triton's version_policy).
struct VersionPolicy {
  enum class Kind { kLatest, kSpecific, kAll };
  Kind kind = Kind::kLatest;
  int64_t latest = 1;              // kLatest: how many of the highest versions
  std::vector<int64_t> versions;   // kSpecific: these versions, ascending
};

// One version folder of a model.
struct VersionFolder {
  int64_t version = 1;
  std::string directory;
  // Changes when any file of the version changes (its path, size or modification time): what a poll compares.
  std::string fingerprint;
};

// One model folder: its versions (ascending) and policy.
struct ModelFolder {
  std::string name;
  std::string directory;
  // False: the folder is a package itself (version 1).
  bool versioned = false;
  std::vector<VersionFolder> versions;
  VersionPolicy policy;
  // Changes when the policy file or any version changes.
  std::string fingerprint;
};

// The model folders of `repository` (hidden entries and plain files skipped), sorted. Errors: NOT_FOUND when it is
// not a readable directory or holds no folder.
absl::StatusOr<std::vector<std::string>> ModelFolderNames(const std::string& repository);

// Reads model folder `name` of `repository`: a package when it holds config.json, else its sub-folders named by
// positive integers, and version_policy.json. Errors: INVALID_ARGUMENT (a RequestField::kModel problem) for a name
// that cannot be a folder name of it (empty, over 255 bytes, with '/' or NUL, or starting with '.'); NOT_FOUND when
// `name` is not a folder of the repository or it holds neither config.json nor a version folder;
// INVALID_ARGUMENT for a bad version_policy.json (naming the file and what is wrong); PERMISSION_DENIED when the
// folder resolves outside the repository.
absl::StatusOr<ModelFolder> ReadModelFolder(const std::string& repository, const std::string& name);

// The versions `folder.policy` serves, ascending. Errors: NOT_FOUND when the policy names a version without a
// folder ("version_policy.json names version 3; the folder holds 1, 2").
absl::StatusOr<std::vector<VersionFolder>> ServedVersions(const ModelFolder& folder);

// Loads version `version` of `model` with `placement`; the package's name is the model's. Packages are read only
// from inside `repository`. Errors: PERMISSION_DENIED when the version folder or a file in it resolves outside the
// repository; models::LoadModelPackage's (NOT_FOUND, INVALID_ARGUMENT), each prefixed with the version's folder.
absl::StatusOr<models::ModelPackage> LoadModelVersion(const std::string& repository, const ModelFolder& model,
                                                      const VersionFolder& version,
                                                      const models::Placement& placement);

}  // namespace mita::server
