// The repository layout (see model_repository.h).
#include "server/engine/model_repository.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"
#include "models/request_error.h"
#include "nlohmann/json.hpp"
#include "server/engine/model_registry.h"

namespace mita::server {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr char kPolicyFile[] = "version_policy.json";

// Whether `name` names an entry directly inside a folder: not empty, not hidden (so neither "." nor ".."), no
// separator.
bool IsPlainName(const std::string& name) {
  return !name.empty() && name[0] != '.' && name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

// A positive version number from a folder name of digits only; 0 when it is none.
int64_t VersionOf(const std::string& name) {
  if (name.empty() || name.size() > 18 || !std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return 0;
  }
  int64_t version = 0;
  if (!absl::SimpleAtoi(name, &version)) return 0;
  return version;
}

// The paths, sizes and modification times of the regular files under `directory` (recursively), hashed.
std::string Fingerprint(const std::string& directory) {
  std::vector<std::string> entries;
  std::error_code error;
  for (fs::recursive_directory_iterator it(directory, error); !error && it != fs::recursive_directory_iterator();
       it.increment(error)) {
    std::error_code entry_error;
    if (!it->is_regular_file(entry_error)) continue;
    const auto size = it->file_size(entry_error);
    const auto modified = it->last_write_time(entry_error);
    entries.push_back(absl::StrCat(fs::relative(it->path(), directory, entry_error).string(), ":", size, ":",
                                   modified.time_since_epoch().count()));
  }
  if (error) entries.push_back(absl::StrCat("error:", error.message()));
  std::sort(entries.begin(), entries.end());
  return absl::StrFormat("%016x", std::hash<std::string>()(absl::StrJoin(entries, "\n")));
}

// version_policy.json of `directory`, or the default policy without one. Errors: INVALID_ARGUMENT naming the file.
absl::StatusOr<VersionPolicy> ReadPolicy(const std::string& directory, std::string* fingerprint) {
  const fs::path path = fs::path(directory) / kPolicyFile;
  std::error_code error;
  VersionPolicy policy;
  if (!fs::exists(path, error)) return policy;
  std::ifstream file(path, std::ios::binary);
  std::ostringstream text;
  text << file.rdbuf();
  if (!file) return absl::InvalidArgumentError(absl::StrCat("cannot read ", path.string()));
  *fingerprint = absl::StrFormat("%016x", std::hash<std::string>()(text.str()));
  const auto bad = [&path](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(
        path.string(), ": ", what,
        R"( (expected one of {"latest": N}, {"specific": [N, ...]}, {"all": true}, with N a version >= 1))"));
  };
  Json json = Json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) return bad("not a JSON object");
  if (json.size() != 1) return bad(absl::StrCat("has ", json.size(), " keys"));
  const auto& [key, value] = *json.items().begin();
  if (key == "latest") {
    if (!value.is_number_integer() || value.get<int64_t>() < 1) return bad("\"latest\" must be an integer >= 1");
    policy.kind = VersionPolicy::Kind::kLatest;
    policy.latest = value.get<int64_t>();
  } else if (key == "specific") {
    if (!value.is_array() || value.empty()) return bad("\"specific\" must be a non-empty list of versions");
    policy.kind = VersionPolicy::Kind::kSpecific;
    for (const Json& version : value) {
      if (!version.is_number_integer() || version.get<int64_t>() < 1) return bad("a version must be an integer >= 1");
      policy.versions.push_back(version.get<int64_t>());
    }
    std::sort(policy.versions.begin(), policy.versions.end());
    policy.versions.erase(std::unique(policy.versions.begin(), policy.versions.end()), policy.versions.end());
  } else if (key == "all") {
    if (value != true) return bad("\"all\" must be true");
    policy.kind = VersionPolicy::Kind::kAll;
  } else {
    return bad(absl::StrCat("unknown key \"", key, "\""));
  }
  return policy;
}

// OK when `directory` and every entry directly in it resolve to paths inside `repository`.
// Errors: PERMISSION_DENIED naming the entry and where it resolves to.
absl::Status CheckInsideRepository(const std::string& repository, const std::string& directory) {
  const auto outside = [&directory](const absl::Status& status) {
    return absl::Status(status.code(), absl::StrCat("model package '", directory, "': ", status.message(),
                                                    " (packages are read only from inside --model_repository)"));
  };
  if (absl::StatusOr<std::string> resolved = ResolveInsideDirectory(repository, directory); !resolved.ok()) {
    return outside(resolved.status());
  }
  std::error_code error;
  for (fs::directory_iterator it(directory, error); !error && it != fs::directory_iterator(); it.increment(error)) {
    if (absl::StatusOr<std::string> entry = ResolveInsideDirectory(repository, it->path().string()); !entry.ok()) {
      return outside(entry.status());
    }
  }
  if (error) {
    return absl::NotFoundError(absl::StrCat("cannot read model package '", directory, "': ", error.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ModelFolderNames(const std::string& repository) {
  std::error_code error;
  if (!fs::is_directory(repository, error)) {
    return absl::NotFoundError(absl::StrCat("model repository '", repository, "' is not a directory",
                                            error ? absl::StrCat(": ", error.message()) : std::string()));
  }
  std::vector<std::string> folders;
  fs::directory_iterator it(repository, error);
  for (; !error && it != fs::directory_iterator(); it.increment(error)) {
    const std::string name = it->path().filename().string();
    std::error_code type_error;
    if (IsPlainName(name) && it->is_directory(type_error)) folders.push_back(name);
  }
  if (error) {
    return absl::NotFoundError(absl::StrCat("cannot read model repository '", repository, "': ", error.message()));
  }
  if (folders.empty()) {
    return absl::NotFoundError(absl::StrCat("model repository '", repository, "' holds no model package folder"));
  }
  std::sort(folders.begin(), folders.end());
  return folders;
}

absl::StatusOr<ModelFolder> ReadModelFolder(const std::string& repository, const std::string& name) {
  ModelFolder folder;
  folder.name = name;
  folder.directory = (fs::path(repository) / name).string();
  std::error_code error;
  if (!IsPlainName(name) || name.size() > 255) {
    const std::string shown = absl::CHexEscape(name.substr(0, 100));
    return models::InvalidRequest(
        models::RequestField::kModel,
        absl::StrCat("'", shown, name.size() > 100 ? "..." : "",
                     "' is not a model folder name: 1 to 255 bytes, no '/', not starting with '.'"));
  }
  if (!fs::is_directory(folder.directory, error)) {
    return absl::NotFoundError(absl::StrCat("the model repository '", repository, "' has no folder '",
                                            absl::CHexEscape(name.substr(0, 100)), name.size() > 100 ? "..." : "",
                                            "'"));
  }
  if (absl::StatusOr<std::string> inside = ResolveInsideDirectory(repository, folder.directory); !inside.ok()) {
    return inside.status();
  }
  if (fs::exists(fs::path(folder.directory) / "config.json", error)) {
    folder.versions.push_back({1, folder.directory, Fingerprint(folder.directory)});
    folder.fingerprint = folder.versions.back().fingerprint;
    return folder;
  }
  folder.versioned = true;
  std::string policy_fingerprint;
  absl::StatusOr<VersionPolicy> policy = ReadPolicy(folder.directory, &policy_fingerprint);
  if (!policy.ok()) return policy.status();
  folder.policy = *std::move(policy);
  for (fs::directory_iterator it(folder.directory, error); !error && it != fs::directory_iterator();
       it.increment(error)) {
    std::error_code type_error;
    const int64_t version = VersionOf(it->path().filename().string());
    if (version > 0 && it->is_directory(type_error)) {
      folder.versions.push_back({version, it->path().string(), Fingerprint(it->path().string())});
    }
  }
  if (error) {
    return absl::NotFoundError(absl::StrCat("cannot read model folder '", folder.directory, "': ", error.message()));
  }
  if (folder.versions.empty()) {
    return absl::NotFoundError(absl::StrCat("model folder '", folder.directory,
                                            "' holds neither config.json nor a version folder (1, 2, ...)"));
  }
  std::sort(folder.versions.begin(), folder.versions.end(),
            [](const VersionFolder& a, const VersionFolder& b) { return a.version < b.version; });
  std::vector<std::string> parts = {policy_fingerprint};
  for (const VersionFolder& version : folder.versions) parts.push_back(absl::StrCat(version.version, "=", version.fingerprint));
  folder.fingerprint = absl::StrJoin(parts, ";");
  return folder;
}

absl::StatusOr<std::vector<VersionFolder>> ServedVersions(const ModelFolder& folder) {
  const std::vector<VersionFolder>& all = folder.versions;
  switch (folder.policy.kind) {
    case VersionPolicy::Kind::kAll:
      return all;
    case VersionPolicy::Kind::kLatest: {
      const size_t keep = std::min(all.size(), static_cast<size_t>(folder.policy.latest));
      return std::vector<VersionFolder>(all.end() - static_cast<std::ptrdiff_t>(keep), all.end());
    }
    case VersionPolicy::Kind::kSpecific: {
      std::vector<VersionFolder> served;
      for (int64_t wanted : folder.policy.versions) {
        auto found = std::find_if(all.begin(), all.end(), [wanted](const VersionFolder& v) { return v.version == wanted; });
        if (found == all.end()) {
          std::vector<int64_t> present;
          for (const VersionFolder& version : all) present.push_back(version.version);
          return absl::NotFoundError(absl::StrCat(folder.directory, "/", kPolicyFile, " names version ", wanted,
                                                  "; the folder holds ", absl::StrJoin(present, ", ")));
        }
        served.push_back(*found);
      }
      return served;
    }
  }
  return all;
}

absl::StatusOr<models::ModelPackage> LoadModelVersion(const std::string& repository, const ModelFolder& model,
                                                      const VersionFolder& version,
                                                      const models::Placement& placement) {
  if (absl::Status inside = CheckInsideRepository(repository, version.directory); !inside.ok()) return inside;
  absl::StatusOr<models::ModelPackage> package = models::LoadModelPackage(version.directory, placement, model.name);
  if (!package.ok()) {
    return absl::Status(package.status().code(),
                        absl::StrCat("model package '", version.directory, "': ", package.status().message()));
  }
  return package;
}

}  // namespace mita::server
