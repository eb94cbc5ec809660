// The budget policy per client (mita-server --client_policy_file): who a caller is, which budgets it may use, how
// much compute per second it gets and its priority. The file is JSON:
//
//   {
//     "clients": [
//       {"name": "frontend", "token_sha256": "<64 hex digits>", "priority": "interactive"},
//       {"name": "nightly", "certificate_subject": "CN=nightly,O=Example", "priority": "batch",
//        "quota": {"compute_units_per_second": 20000, "burst_compute_units": 40000}},
//       {"name": "free", "token_sha256": "<64 hex digits>", "presets": ["fast"], "max_expert_count": 9,
//        "max_expert_width": 16, "full_attention_max_tokens": 0, "default_preset": "fast"}
//     ],
//     "default": {"priority": "normal"}
//   }
//
// A client is named ([a-z0-9_-]{1,32}: the name is a metric label) and identified by the SHA-256 of its bearer
// token (hex, so the file holds no secret) and/or its mTLS certificate subject; anyone else is the "default" client,
// whose rules are the "default" object (no restriction when absent). Rules, each optional (absent: no limit):
//   presets                    the presets it may ask for by name ("default" names the model's default budget)
//   max_expert_count           the largest expert count m of a MiTA budget
//   max_expert_width           the largest expert width k of a MiTA budget
//   full_attention_max_tokens  full attention up to this many tokens; 0: never
//   default_preset             the preset used when the request asks for the model's default (on a model that has it)
//   quota                      compute_units_per_second and burst_compute_units (models::ComputeUnits), a token bucket
//   priority                   "interactive" (1), "normal" (0, the default), "batch" (-1), or an integer in [-10, 10]
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mita::server::policy {

// The name of the client everyone unnamed is (metric label client="default").
inline constexpr char kDefaultClientName[] = "default";

// Priorities by name; higher is served first.
inline constexpr int kInteractivePriority = 1;
inline constexpr int kNormalPriority = 0;
inline constexpr int kBatchPriority = -1;

// What one client may do. Every limit is optional: absent means no limit.
struct ClientRules {
  // Presets it may ask for by name ("default": the model's default budget); nullopt: every preset.
  std::optional<std::vector<std::string>> presets;
  // Largest expert count m and expert width k of a MiTA budget.
  std::optional<int64_t> max_expert_count;
  std::optional<int64_t> max_expert_width;
  // Full attention on inputs of up to this many tokens; 0: never; nullopt: always.
  std::optional<int64_t> full_attention_max_tokens;
  // Replaces the model's default budget when the request asks for the default and the model has this preset.
  std::string default_preset;
  // Compute quota: compute units per second (> 0) and the burst (> 0), compute units; nullopt: no quota.
  struct Quota {
    double compute_units_per_second = 0;
    double burst_compute_units = 0;
  };
  std::optional<Quota> quota;
  // Admission and batch order: higher first (kInteractivePriority, kNormalPriority, kBatchPriority, or [-10, 10]).
  int priority = kNormalPriority;
};

// One named client of the policy.
struct PolicyClient {
  std::string name;
  // SHA-256 of its bearer token, 64 lowercase hex digits; "" when it is not identified by a token.
  std::string token_sha256;
  // The subject of its mTLS certificate as gRPC's AuthContext gives it ("x509_subject"); "" when none.
  std::string certificate_subject;
  ClientRules rules;
};

// A parsed policy file. Immutable.
class ClientPolicy {
 public:
  // Parses the policy `text` read from `file` (named in errors). Errors: INVALID_ARGUMENT naming the file, the
  // client and the key: not JSON, an unknown key, a wrong type, a value out of range, a client name outside
  // [a-z0-9_-]{1,32} or "default", a token_sha256 that is not 64 hex digits, a client with no identity, a duplicate
  // name, token or certificate subject.
  static absl::StatusOr<ClientPolicy> Parse(const std::string& text, const std::string& file);
  // Reads and parses `path`. Errors: NOT_FOUND when it cannot be read; Parse's.
  static absl::StatusOr<ClientPolicy> FromFile(const std::string& path);

  // The named clients, in file order.
  const std::vector<PolicyClient>& clients() const { return clients_; }
  // The rules of everyone else.
  const ClientRules& default_rules() const { return default_rules_; }
  // Whether some client is identified by a bearer token (then such a token is a credential of the server).
  bool lists_tokens() const { return !by_token_.empty(); }
  // The client whose token_sha256 is `token_sha256` (lowercase hex), or nullptr.
  const PolicyClient* FindByTokenSha256(const std::string& token_sha256) const;
  // The client whose certificate_subject is `subject`, or nullptr.
  const PolicyClient* FindByCertificateSubject(const std::string& subject) const;

 private:
  std::vector<PolicyClient> clients_;
  ClientRules default_rules_;
  std::map<std::string, size_t> by_token_;    // token_sha256 -> index in clients_
  std::map<std::string, size_t> by_subject_;  // certificate_subject -> index in clients_
};

// SHA-256 of `data` as 64 lowercase hex digits (a bearer token's identity in the policy).
std::string Sha256Hex(const std::string& data);

// "interactive", "normal", "batch", or the integer for another priority.
std::string PriorityName(int priority);

}  // namespace mita::server::policy
