// The models' lifecycle while the server serves: loading a model's versions from the repository (read, cost
// profile, then served by the engine), replacing them when their files change, and unloading them, on an operator's
// call (the repository API of both front ends) or by polling the repository. One operation runs at a time; a
// version that fails to load leaves the one serving in place, and the index says why.
//
// Control modes (mita-server --model_control_mode, after Triton's): "none" loads every model at start and refuses
// the API; "explicit" loads every model at start and lets the API load, reload and unload; "poll" loads every
// model at start, then re-reads the repository every --repository_poll_s (new, changed and removed folders) and
// refuses the API.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "models/classifier.h"
#include "server/engine/inference_engine.h"
#include "server/engine/model_repository.h"
#include "server/metrics/metrics.h"
#include "server/planning/cost_calibration.h"

namespace mita::server {

enum class ModelControlMode { kNone, kExplicit, kPoll };

// Parses "none", "explicit" or "poll". Errors: INVALID_ARGUMENT naming --model_control_mode and the choices.
absl::StatusOr<ModelControlMode> ParseModelControlMode(const std::string& text);
const char* ModelControlModeName(ModelControlMode mode);

struct ModelLifecycleOptions {
  std::string repository;
  ModelControlMode mode = ModelControlMode::kExplicit;
  // kPoll: time between two reads of the repository.
  absl::Duration poll_interval = absl::Seconds(5);
  // How long an unload or a replacement waits for the old version's requests before leaving it to a later
  // operation (it is no longer served either way).
  absl::Duration drain_timeout = absl::Seconds(30);
  // The device and dtype of model `name`. Required.
  std::function<absl::StatusOr<models::Placement>(const std::string& name)> placement;
  // The cost profile of a loaded version (calibrated, or read from --cost_profile). Required.
  std::function<absl::StatusOr<CostProfile>(const std::string& name, const models::Classifier& classifier)> profile;
  // Where operations are logged (one line each). Optional.
  std::function<void(const std::string&)> log;
};

class ModelLifecycle {
 public:
  // `engine` and `metrics` must outlive this object.
  ModelLifecycle(InferenceEngine* engine, ServerMetrics* metrics, ModelLifecycleOptions options);
  // Stops polling; runs the operations posted (LoadInBackground, UnloadInBackground) and joins their thread.
  ~ModelLifecycle();

  // Loads every model folder of the repository (start-up); `stop` is asked between models. Errors: the first
  // model that fails (start-up is all or nothing), or ModelFolderNames'.
  absl::Status LoadAll(const std::function<bool()>& stop);
  // In kPoll mode starts the thread that re-reads the repository; nothing otherwise.
  void StartPolling();

  // The repository API (RepositoryModelLoad, LoadModel): loads model `name`'s versions chosen by its policy; a
  // version already served with the same files stays, a changed one is replaced (admitted requests finish on the
  // old one; new ones go to the new one), versions no longer chosen are unloaded. Returns when done.
  // Errors: FAILED_PRECONDITION outside kExplicit mode; NOT_FOUND when the repository has no such folder;
  // FAILED_PRECONDITION "model 'x' version 2 failed to load: ..." (the versions serving before stay).
  absl::Status Load(const std::string& name);
  // The repository API (RepositoryModelUnload, UnloadModel): stops serving every version of `name` and frees each
  // once its admitted requests are answered (waiting up to the drain timeout). Unloading a model not loaded is OK.
  // Errors: FAILED_PRECONDITION outside kExplicit mode; NOT_FOUND for a name neither served nor in the repository.
  absl::Status Unload(const std::string& name);
  // Load or Unload on the lifecycle's own thread; `done` gets its status there. For the front ends: an operation
  // takes seconds (calibration, draining), and one that held a gRPC thread could hold the very threads that answer
  // the requests it waits for. Operations run in the order they were posted; the destructor runs those posted.
  void LoadInBackground(const std::string& name, std::function<void(absl::Status)> done);
  void UnloadInBackground(const std::string& name, std::function<void(absl::Status)> done);
  // One read of the repository (the poll thread's step; tests call it directly).
  void PollOnce();

  // One line of the index (Triton's RepositoryIndex): a model version and its state, "READY", "LOADING",
  // "UNLOADING" or "UNAVAILABLE", with why (empty when ready without remark). Version 0: the model as a whole (its
  // folder or policy could not be read, or it is not loaded).
  struct Entry {
    std::string name;
    int64_t version = 0;
    std::string state;
    std::string reason;
  };
  // Every model folder of the repository and every version known, sorted; `ready_only`: only READY ones.
  std::vector<Entry> Index(bool ready_only) const;

  ModelControlMode mode() const { return options_.mode; }

 private:
  struct VersionState {
    std::string state;
    std::string reason;
    std::string fingerprint;  // of the files being served
  };
  struct ModelState {
    std::string fingerprint;  // of the folder at the last operation (what a poll compares)
    std::string reason;       // why the model as a whole is unavailable; empty otherwise
    std::map<int64_t, VersionState> versions;
  };

  absl::Status CheckApiAllowed(const char* operation) const;
  // The operations, under operations_mu_.
  absl::Status LoadLocked(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(operations_mu_);
  absl::Status UnloadLocked(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(operations_mu_);
  // Frees the retired versions (engine's ReleaseRetired) and marks them unloaded.
  void ReleaseRetired() ABSL_EXCLUSIVE_LOCKS_REQUIRED(operations_mu_);
  void SetState(const std::string& name, int64_t version, const std::string& state, const std::string& reason);
  void Log(const std::string& line) const;

  InferenceEngine* const engine_;
  ServerMetrics* const metrics_;
  const ModelLifecycleOptions options_;
  absl::Mutex operations_mu_;  // one operation at a time
  mutable absl::Mutex state_mu_;
  std::map<std::string, ModelState> states_ ABSL_GUARDED_BY(state_mu_);
  absl::Notification stop_polling_;
  std::thread poller_;
  // The operations posted for the lifecycle's thread, and that thread (started with the first).
  void Post(std::function<void()> operation) ABSL_LOCKS_EXCLUDED(posted_mu_);
  absl::Mutex posted_mu_;
  std::deque<std::function<void()>> posted_ ABSL_GUARDED_BY(posted_mu_);
  bool stopping_ ABSL_GUARDED_BY(posted_mu_) = false;
  std::thread operations_thread_;
};

}  // namespace mita::server
