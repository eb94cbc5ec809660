// The policy in force (see policy_holder.h).
#include "server/policy/policy_holder.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"

namespace mita::server::policy {
namespace {

// The file's content, or NOT_FOUND naming it.
absl::StatusOr<std::string> ReadPolicyFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot read the client policy file '", path, "'"));
  std::stringstream text;
  text << file.rdbuf();
  if (file.bad()) return absl::NotFoundError(absl::StrCat("cannot read the client policy file '", path, "'"));
  return text.str();
}

std::shared_ptr<ComputeQuota> QuotaFor(const ClientRules& rules, std::shared_ptr<ComputeQuota> previous,
                                       const Clock* clock) {
  if (!rules.quota.has_value()) return nullptr;
  if (previous == nullptr) return std::make_shared<ComputeQuota>(*rules.quota, clock);
  previous->Reconfigure(*rules.quota);
  return previous;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ClientPolicyHolder>> ClientPolicyHolder::Load(const std::string& path,
                                                                             const Clock* clock) {
  absl::StatusOr<std::string> content = ReadPolicyFile(path);
  if (!content.ok()) return content.status();
  absl::StatusOr<ClientPolicy> policy = ClientPolicy::Parse(*content, path);
  if (!policy.ok()) return policy.status();
  std::unique_ptr<ClientPolicyHolder> holder(new ClientPolicyHolder(path, clock));
  std::shared_ptr<const Version> version = holder->MakeVersion(*std::move(policy), nullptr);
  absl::MutexLock lock(&holder->mu_);
  holder->last_content_ = *std::move(content);
  holder->names_seen_.push_back(kDefaultClientName);
  for (const PolicyClient& client : version->policy.clients()) holder->names_seen_.push_back(client.name);
  holder->current_ = std::move(version);
  return holder;
}

std::shared_ptr<const ClientPolicyHolder::Version> ClientPolicyHolder::MakeVersion(ClientPolicy policy,
                                                                                   const Version* previous) const {
  std::map<std::string, std::shared_ptr<ComputeQuota>> quotas;
  if (previous != nullptr) {
    for (const auto& client : previous->clients) quotas[client->name] = client->quota;
    quotas[kDefaultClientName] = previous->default_client->quota;
  }
  auto version = std::make_shared<Version>();
  for (const PolicyClient& client : policy.clients()) {
    auto admission = std::make_shared<ClientAdmission>();
    admission->name = client.name;
    admission->rules = client.rules;
    admission->quota = QuotaFor(client.rules, quotas[client.name], clock_);
    version->clients.push_back(std::move(admission));
  }
  auto default_client = std::make_shared<ClientAdmission>();
  default_client->name = kDefaultClientName;
  default_client->rules = policy.default_rules();
  default_client->quota = QuotaFor(policy.default_rules(), quotas[kDefaultClientName], clock_);
  version->default_client = std::move(default_client);
  version->policy = std::move(policy);
  return version;
}

absl::StatusOr<bool> ClientPolicyHolder::ReloadIfChanged() {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::string> content = ReadPolicyFile(path_);
  if (!content.ok()) {
    // Reported once per spell of unreadability.
    if (last_read_error_.has_value()) return false;
    last_read_error_ = content.status().ToString();
    return absl::Status(content.status().code(),
                        absl::StrCat(content.status().message(), "; the client policy in force stays"));
  }
  last_read_error_.reset();
  if (*content == last_content_) return false;
  last_content_ = *content;
  absl::StatusOr<ClientPolicy> policy = ClientPolicy::Parse(*content, path_);
  if (!policy.ok()) {
    return absl::Status(policy.status().code(),
                        absl::StrCat(policy.status().message(), "; the client policy in force stays"));
  }
  std::shared_ptr<const Version> version = MakeVersion(*std::move(policy), current_.get());
  for (const PolicyClient& client : version->policy.clients()) {
    if (std::find(names_seen_.begin(), names_seen_.end(), client.name) == names_seen_.end()) {
      names_seen_.push_back(client.name);
    }
  }
  current_ = std::move(version);
  return true;
}

std::shared_ptr<const ClientPolicyHolder::Version> ClientPolicyHolder::current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

std::shared_ptr<const ClientAdmission> ClientPolicyHolder::Identify(const std::string* bearer_token,
                                                                    const std::string* certificate_subject) const {
  const std::shared_ptr<const Version> version = current();
  const ClientPolicy& policy = version->policy;
  if (bearer_token != nullptr && policy.lists_tokens()) {
    if (const PolicyClient* client = policy.FindByTokenSha256(Sha256Hex(*bearer_token)); client != nullptr) {
      // The admission outlives a later swap: the call keeps the rules it was identified with.
      return version->clients[static_cast<size_t>(client - policy.clients().data())];
    }
  }
  if (certificate_subject != nullptr) {
    if (const PolicyClient* client = policy.FindByCertificateSubject(*certificate_subject); client != nullptr) {
      return version->clients[static_cast<size_t>(client - policy.clients().data())];
    }
  }
  return version->default_client;
}

bool ClientPolicyHolder::IsPolicyToken(const std::string& bearer_token) const {
  const std::shared_ptr<const Version> version = current();
  return version->policy.lists_tokens() && version->policy.FindByTokenSha256(Sha256Hex(bearer_token)) != nullptr;
}

bool ClientPolicyHolder::lists_tokens() const { return current()->policy.lists_tokens(); }

std::vector<std::string> ClientPolicyHolder::client_names() const {
  absl::MutexLock lock(&mu_);
  return names_seen_;
}

}  // namespace mita::server::policy
