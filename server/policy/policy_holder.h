// The policy in force, reloadable while serving: who a call is (Identify) and that client's rules and quota.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/planning/clock.h"
#include "server/policy/client_policy.h"
#include "server/policy/compute_quota.h"

namespace mita::server::policy {

// One client as the policy in force saw it when its call arrived: its name (a metric label), its rules, and its
// quota (shared with later versions of the policy that still name it; null: no quota). Immutable but for the quota.
struct ClientAdmission {
  std::string name;
  ClientRules rules;
  std::shared_ptr<ComputeQuota> quota;
};

// Holds the policy read from a file and swaps in a new one when the file changes. Thread-safe.
class ClientPolicyHolder {
 public:
  // Reads `path` (ClientPolicy::FromFile). `clock` must outlive the holder. Errors: FromFile's.
  static absl::StatusOr<std::unique_ptr<ClientPolicyHolder>> Load(const std::string& path,
                                                                  const Clock* clock = RealClock::Get());

  // Reads the file again; when its content differs from the last content read, parses it and, when valid, swaps
  // it in (atomically for the callers of Identify: a call holds the version it was identified with). Quotas of
  // clients still named keep their level (with the new rate and burst). Returns true when a new policy is in force,
  // false when the content is unchanged (or is the bad content already reported). Errors: the new file's
  // (FromFile's): the policy in force stays, and the same bad content is reported once.
  absl::StatusOr<bool> ReloadIfChanged() ABSL_LOCKS_EXCLUDED(mu_);

  // The client a call is: the one whose token_sha256 is the SHA-256 of `bearer_token`, else the one whose
  // certificate_subject is `certificate_subject`, else "default" (null pointers: not presented). Never null.
  std::shared_ptr<const ClientAdmission> Identify(const std::string* bearer_token,
                                                  const std::string* certificate_subject) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the policy in force identifies a client by a bearer token that is `bearer_token`.
  bool IsPolicyToken(const std::string& bearer_token) const ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the policy in force names clients by bearer tokens at all.
  bool lists_tokens() const ABSL_LOCKS_EXCLUDED(mu_);
  // Every client name of every policy version held so far, "default" first (the bounded metric labels).
  std::vector<std::string> client_names() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& path() const { return path_; }

 private:
  // One version of the policy with its clients' admissions.
  struct Version {
    ClientPolicy policy;
    std::vector<std::shared_ptr<const ClientAdmission>> clients;  // parallel to policy.clients()
    std::shared_ptr<const ClientAdmission> default_client;
  };

  ClientPolicyHolder(std::string path, const Clock* clock) : path_(std::move(path)), clock_(clock) {}
  // The version of `policy`, reusing the quotas of `previous` (may be null) for the clients it names too.
  std::shared_ptr<const Version> MakeVersion(ClientPolicy policy, const Version* previous) const;
  std::shared_ptr<const Version> current() const ABSL_LOCKS_EXCLUDED(mu_);

  const std::string path_;
  const Clock* const clock_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const Version> current_ ABSL_GUARDED_BY(mu_);
  std::string last_content_ ABSL_GUARDED_BY(mu_);                    // what the file held at the last read
  std::optional<std::string> last_read_error_ ABSL_GUARDED_BY(mu_);  // the file could not be read last time
  std::vector<std::string> names_seen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mita::server::policy
