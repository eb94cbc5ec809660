// Loading, replacing and unloading models while serving (see model_lifecycle.h).
#include "server/engine/model_lifecycle.h"

#include <algorithm>
#include <exception>
#include <filesystem>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/status_macros.h"

namespace mita::server {
namespace {

constexpr char kReady[] = "READY";
constexpr char kLoading[] = "LOADING";
constexpr char kUnavailable[] = "UNAVAILABLE";
constexpr char kUnloading[] = "UNLOADING";

}  // namespace

absl::StatusOr<ModelControlMode> ParseModelControlMode(const std::string& text) {
  if (text == "none") return ModelControlMode::kNone;
  if (text == "explicit") return ModelControlMode::kExplicit;
  if (text == "poll") return ModelControlMode::kPoll;
  return absl::InvalidArgumentError(absl::StrCat("flag --model_control_mode: '", text.substr(0, 100),
                                                 "' is not a mode: use none, explicit or poll"));
}

const char* ModelControlModeName(ModelControlMode mode) {
  switch (mode) {
    case ModelControlMode::kNone:
      return "none";
    case ModelControlMode::kExplicit:
      return "explicit";
    case ModelControlMode::kPoll:
      return "poll";
  }
  return "none";
}

ModelLifecycle::ModelLifecycle(InferenceEngine* engine, ServerMetrics* metrics, ModelLifecycleOptions options)
    : engine_(engine), metrics_(metrics), options_(std::move(options)) {}

ModelLifecycle::~ModelLifecycle() {
  if (!stop_polling_.HasBeenNotified()) stop_polling_.Notify();
  if (poller_.joinable()) poller_.join();
  {
    absl::MutexLock lock(&posted_mu_);
    stopping_ = true;
  }
  if (operations_thread_.joinable()) operations_thread_.join();
}

void ModelLifecycle::Post(std::function<void()> operation) {
  absl::MutexLock lock(&posted_mu_);
  posted_.push_back(std::move(operation));
  if (operations_thread_.joinable()) return;
  operations_thread_ = std::thread([this] {
    while (true) {
      std::function<void()> next;
      {
        absl::MutexLock lock(&posted_mu_);
        posted_mu_.Await(absl::Condition(
            +[](ModelLifecycle* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->posted_mu_) {
              return self->stopping_ || !self->posted_.empty();
            },
            this));
        if (posted_.empty()) return;  // stopping, nothing left
        next = std::move(posted_.front());
        posted_.pop_front();
      }
      next();
    }
  });
}

void ModelLifecycle::LoadInBackground(const std::string& name, std::function<void(absl::Status)> done) {
  Post([this, name, done = std::move(done)] { done(Load(name)); });
}

void ModelLifecycle::UnloadInBackground(const std::string& name, std::function<void(absl::Status)> done) {
  Post([this, name, done = std::move(done)] { done(Unload(name)); });
}

void ModelLifecycle::Log(const std::string& line) const {
  if (options_.log) options_.log(line);
}

void ModelLifecycle::SetState(const std::string& name, int64_t version, const std::string& state,
                              const std::string& reason) {
  absl::MutexLock lock(&state_mu_);
  VersionState& entry = states_[name].versions[version];
  entry.state = state;
  entry.reason = reason;
}

absl::Status ModelLifecycle::LoadAll(const std::function<bool()>& stop) {
  ASSIGN_OR_RETURN(const std::vector<std::string> names, ModelFolderNames(options_.repository));
  absl::MutexLock lock(&operations_mu_);
  for (const std::string& name : names) {
    RETURN_IF_ERROR(LoadLocked(name));
    if (stop && stop()) return absl::OkStatus();
  }
  return absl::OkStatus();
}

void ModelLifecycle::StartPolling() {
  if (options_.mode != ModelControlMode::kPoll || poller_.joinable()) return;
  poller_ = std::thread([this] {
    while (!stop_polling_.WaitForNotificationWithTimeout(options_.poll_interval)) PollOnce();
  });
}

absl::Status ModelLifecycle::CheckApiAllowed(const char* operation) const {
  if (options_.mode == ModelControlMode::kExplicit) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      operation, " is not allowed: the server runs with --model_control_mode=", ModelControlModeName(options_.mode),
      options_.mode == ModelControlMode::kPoll ? " (it loads what the repository holds)" : " (models are fixed)",
      "; start it with --model_control_mode=explicit to load and unload models by request"));
}

absl::Status ModelLifecycle::Load(const std::string& name) {
  RETURN_IF_ERROR(CheckApiAllowed("loading a model"));
  absl::MutexLock lock(&operations_mu_);
  return LoadLocked(name);
}

absl::Status ModelLifecycle::Unload(const std::string& name) {
  RETURN_IF_ERROR(CheckApiAllowed("unloading a model"));
  absl::MutexLock lock(&operations_mu_);
  return UnloadLocked(name);
}

absl::Status ModelLifecycle::LoadLocked(const std::string& name) {
  absl::StatusOr<ModelFolder> folder = ReadModelFolder(options_.repository, name);
  if (folder.ok()) {
    absl::StatusOr<std::vector<VersionFolder>> chosen = ServedVersions(*folder);
    if (!chosen.ok()) folder = chosen.status();
  }
  if (!folder.ok()) {
    // Not a folder of the repository: NOT_FOUND, and nothing to say in the index unless the model was known.
    absl::StatusOr<std::vector<std::string>> names = ModelFolderNames(options_.repository);
    const bool folder_exists = names.ok() && std::find(names->begin(), names->end(), name) != names->end();
    {
      absl::MutexLock lock(&state_mu_);
      if (!folder_exists && states_.count(name) == 0) return folder.status();
      states_[name].reason = std::string(folder.status().message());
    }
    Log(absl::StrCat("model '", name, "' was not loaded: ", folder.status().message()));
    return absl::FailedPreconditionError(absl::StrCat("model '", name, "' was not loaded: ", folder.status().message(),
                                                      engine_->versions(name).empty() ? "" : "; its served versions stay"));
  }
  const std::vector<VersionFolder> chosen = *ServedVersions(*folder);
  std::map<int64_t, std::string> serving;  // version -> fingerprint of what serves now
  {
    absl::MutexLock lock(&state_mu_);
    ModelState& state = states_[name];
    state.fingerprint = folder->fingerprint;
    state.reason.clear();
    for (const int64_t version : engine_->versions(name)) serving[version] = state.versions[version].fingerprint;
  }
  std::vector<std::string> failures;
  std::set<int64_t> keep;
  for (const VersionFolder& version : chosen) {
    auto current = serving.find(version.version);
    if (current != serving.end() && current->second == version.fingerprint) {
      keep.insert(version.version);
      continue;
    }
    const bool replacing = current != serving.end();
    if (!replacing) SetState(name, version.version, kLoading, "");
    const absl::Time start = absl::Now();
    absl::Status loaded = [&]() -> absl::Status {
      try {
        ASSIGN_OR_RETURN(const models::Placement placement, options_.placement(name));
        ASSIGN_OR_RETURN(models::ModelPackage package,
                         LoadModelVersion(options_.repository, *folder, version, placement));
        ASSIGN_OR_RETURN(CostProfile profile, options_.profile(name, *package.classifier));
        return engine_->ServeVersion(name, version.version,
                                     std::make_shared<const models::ModelPackage>(std::move(package)),
                                     std::move(profile));
      } catch (const std::exception& e) {
        return absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
      }
    }();
    const absl::Duration took = absl::Now() - start;
    metrics_->ObserveModelLoad(name, version.version, loaded.ok(), took);
    if (loaded.ok()) {
      keep.insert(version.version);
      {
        absl::MutexLock lock(&state_mu_);
        VersionState& entry = states_[name].versions[version.version];
        entry = {kReady, "", version.fingerprint};
      }
      absl::StatusOr<ModelHandle> served = engine_->FindModel(name, version.version);
      Log(absl::StrCat(replacing ? "replaced" : "loaded", " model '", name, "' version ", version.version, " in ",
                       absl::FormatDuration(took), served.ok() ? absl::StrCat(": ", (*served)->description().Summary())
                                                               : std::string()));
      continue;
    }
    const std::string failure =
        absl::StrCat("model '", name, "' version ", version.version, " failed to load: ", loaded.message());
    failures.push_back(failure);
    Log(absl::StrCat(failure, replacing ? "; the version loaded before keeps serving" : ""));
    if (replacing) {
      keep.insert(version.version);
      SetState(name, version.version, kReady,
               absl::StrCat("a reload failed (", loaded.message(), "); the version loaded before serves"));
    } else {
      SetState(name, version.version, kUnavailable, std::string(loaded.message()));
    }
  }
  // Versions the policy no longer chooses (or whose folder is gone) stop serving, unless a chosen version failed to
  // load: then what served before keeps serving beside what loaded.
  if (!failures.empty()) {
    for (const auto& [version, fingerprint] : serving) keep.insert(version);
  }
  for (const int64_t version : engine_->RetireVersions(name, keep)) {
    SetState(name, version, kUnavailable, "unloaded: the version policy no longer chooses it");
    Log(absl::StrCat("model '", name, "' version ", version, " is no longer served (version policy)"));
  }
  ReleaseRetired();
  if (!failures.empty()) return absl::FailedPreconditionError(absl::StrJoin(failures, "; "));
  return absl::OkStatus();
}

absl::Status ModelLifecycle::UnloadLocked(const std::string& name) {
  bool known = false;
  {
    absl::MutexLock lock(&state_mu_);
    known = states_.count(name) > 0;
  }
  const std::vector<int64_t> retired = engine_->RetireVersions(name, {});
  if (retired.empty() && !known && !ReadModelFolder(options_.repository, name).ok()) {
    return absl::NotFoundError(absl::StrCat("model '", name.substr(0, 100), "' is neither loaded nor in the repository"));
  }
  for (const int64_t version : retired) SetState(name, version, kUnloading, "");
  Log(absl::StrCat("unloading model '", name, "'", retired.empty() ? " (it was not loaded)" : ""));
  ReleaseRetired();
  {
    absl::MutexLock lock(&state_mu_);
    ModelState& state = states_[name];
    state.fingerprint.clear();  // a poll loads it again only if its folder is there
    state.reason = "unloaded";
  }
  return absl::OkStatus();
}

void ModelLifecycle::ReleaseRetired() {
  for (const auto& [name, version] : engine_->ReleaseRetired(absl::Now() + options_.drain_timeout)) {
    absl::MutexLock lock(&state_mu_);
    VersionState& entry = states_[name].versions[version];
    // A version replaced in place serves again under the same number: its state stays.
    if (engine_->FindModel(name, version).ok()) continue;
    entry.state = kUnavailable;
    if (entry.reason.empty()) entry.reason = "unloaded";
  }
}

void ModelLifecycle::PollOnce() {
  absl::StatusOr<std::vector<std::string>> names = ModelFolderNames(options_.repository);
  absl::MutexLock lock(&operations_mu_);
  std::set<std::string> present;
  if (names.ok()) present.insert(names->begin(), names->end());
  if (!names.ok() && names.status().code() != absl::StatusCode::kNotFound) return;
  if (!names.ok()) {
    // An unreadable repository (a volume being remounted) unloads nothing; an empty one is a removal of every model.
    std::error_code error;
    if (!std::filesystem::is_directory(options_.repository, error)) {
      Log(absl::StrCat("repository poll skipped: ", names.status().message()));
      return;
    }
  }
  for (const std::string& name : present) {
    absl::StatusOr<ModelFolder> folder = ReadModelFolder(options_.repository, name);
    const std::string fingerprint = folder.ok() ? folder->fingerprint : std::string(folder.status().message());
    {
      absl::MutexLock state_lock(&state_mu_);
      auto state = states_.find(name);
      if (state != states_.end() && state->second.fingerprint == fingerprint) continue;
    }
    absl::Status loaded = LoadLocked(name);
    if (!loaded.ok()) {
      // Not again until the folder changes.
      absl::MutexLock state_lock(&state_mu_);
      states_[name].fingerprint = fingerprint;
    }
  }
  std::vector<std::string> gone;
  for (const ModelHandle& model : engine_->models()) {
    if (present.count(model->name()) == 0) gone.push_back(model->name());
  }
  for (const std::string& name : gone) {
    Log(absl::StrCat("model folder '", name, "' left the repository"));
    UnloadLocked(name).IgnoreError();
    absl::MutexLock state_lock(&state_mu_);
    states_.erase(name);
  }
}

std::vector<ModelLifecycle::Entry> ModelLifecycle::Index(bool ready_only) const {
  std::set<std::string> names;
  if (absl::StatusOr<std::vector<std::string>> folders = ModelFolderNames(options_.repository); folders.ok()) {
    names.insert(folders->begin(), folders->end());
  }
  std::vector<Entry> entries;
  absl::MutexLock lock(&state_mu_);
  for (const auto& [name, state] : states_) names.insert(name);
  for (const std::string& name : names) {
    auto state = states_.find(name);
    if (state == states_.end() || state->second.versions.empty() || !state->second.reason.empty()) {
      if (!ready_only) {
        entries.push_back({name, 0, kUnavailable,
                           state == states_.end() ? "not loaded" : state->second.reason.empty() ? "not loaded"
                                                                                                 : state->second.reason});
      }
      if (state == states_.end()) continue;
    }
    for (const auto& [version, entry] : state->second.versions) {
      if (ready_only && entry.state != kReady) continue;
      entries.push_back({name, version, entry.state, entry.reason});
    }
  }
  return entries;
}

}  // namespace mita::server
