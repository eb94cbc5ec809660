// The client policy file (see client_policy.h).
#include "server/policy/client_policy.h"

#include <openssl/sha.h>

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace mita::server::policy {
namespace {

using Json = nlohmann::json;

constexpr int kMinPriority = -10;
constexpr int kMaxPriority = 10;
constexpr size_t kMaxNameLength = 32;

// Errors of one object of the file: each names the file, the client ("default" for the default object) and the key.
class Where {
 public:
  Where(const std::string& file, std::string client) : file_(file), client_(std::move(client)) {}
  absl::Status Error(const std::string& key, const std::string& problem) const {
    return absl::InvalidArgumentError(absl::StrCat("client policy '", file_, "': ", client_,
                                                   key.empty() ? std::string() : absl::StrCat(": key '", key, "'"),
                                                   ": ", problem));
  }

 private:
  const std::string& file_;
  const std::string client_;
};

std::string TypeName(const Json& value) { return value.type_name(); }

absl::Status CheckKeys(const Json& object, const std::set<std::string>& allowed, const Where& where) {
  for (const auto& [key, value] : object.items()) {
    if (allowed.count(key) == 0) {
      return where.Error(key, absl::StrCat("unknown key; allowed: ", absl::StrJoin(allowed, ", ")));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ReadInteger(const Json& value, const std::string& key, int64_t minimum, const Where& where) {
  if (!value.is_number_integer()) {
    return where.Error(key, absl::StrCat("must be an integer >= ", minimum, " (got ", TypeName(value), ")"));
  }
  const int64_t number = value.get<int64_t>();
  if (number < minimum || (value.is_number_unsigned() && value.get<uint64_t>() > uint64_t{INT64_MAX})) {
    return where.Error(key, absl::StrCat(value.dump(), " is out of range: allowed >= ", minimum));
  }
  return number;
}

absl::StatusOr<double> ReadPositiveNumber(const Json& value, const std::string& key, const Where& where) {
  if (!value.is_number()) return where.Error(key, absl::StrCat("must be a number > 0 (got ", TypeName(value), ")"));
  const double number = value.get<double>();
  if (!std::isfinite(number) || number <= 0) {
    return where.Error(key, absl::StrCat(value.dump(), " is out of range: allowed > 0"));
  }
  return number;
}

absl::StatusOr<std::string> ReadString(const Json& value, const std::string& key, const Where& where) {
  if (!value.is_string()) return where.Error(key, absl::StrCat("must be a string (got ", TypeName(value), ")"));
  std::string text = value.get<std::string>();
  if (text.empty()) return where.Error(key, "must not be empty");
  return text;
}

absl::StatusOr<int> ReadPriority(const Json& value, const Where& where) {
  if (value.is_string()) {
    const std::string name = value.get<std::string>();
    if (name == "interactive") return kInteractivePriority;
    if (name == "normal") return kNormalPriority;
    if (name == "batch") return kBatchPriority;
    return where.Error(
        "priority", absl::StrCat("unknown priority \"", name, "\"; use interactive, normal, batch or an integer in [",
                                 kMinPriority, ", ", kMaxPriority, "]"));
  }
  if (!value.is_number_integer()) {
    return where.Error("priority", absl::StrCat("must be \"interactive\", \"normal\", \"batch\" or an integer (got ",
                                                TypeName(value), ")"));
  }
  const int64_t number = value.get<int64_t>();
  if (number < kMinPriority || number > kMaxPriority) {
    return where.Error("priority",
                       absl::StrCat(number, " is out of range: allowed [", kMinPriority, ", ", kMaxPriority, "]"));
  }
  return static_cast<int>(number);
}

// The rule keys of a client object and of the default object.
const std::set<std::string>& RuleKeys() {
  static const std::set<std::string>* const keys = new std::set<std::string>{
      "presets", "max_expert_count", "max_expert_width", "full_attention_max_tokens", "default_preset",
      "quota",   "priority"};
  return *keys;
}

absl::StatusOr<ClientRules> ReadRules(const Json& object, const Where& where) {
  ClientRules rules;
  if (auto it = object.find("presets"); it != object.end()) {
    if (!it->is_array())
      return where.Error("presets", absl::StrCat("must be a list of preset names (got ", TypeName(*it), ")"));
    std::vector<std::string> presets;
    for (const Json& entry : *it) {
      absl::StatusOr<std::string> name = ReadString(entry, "presets", where);
      if (!name.ok()) return name.status();
      presets.push_back(*std::move(name));
    }
    rules.presets = std::move(presets);
  }
  if (auto it = object.find("max_expert_count"); it != object.end()) {
    absl::StatusOr<int64_t> value = ReadInteger(*it, "max_expert_count", 1, where);
    if (!value.ok()) return value.status();
    rules.max_expert_count = *value;
  }
  if (auto it = object.find("max_expert_width"); it != object.end()) {
    absl::StatusOr<int64_t> value = ReadInteger(*it, "max_expert_width", 1, where);
    if (!value.ok()) return value.status();
    rules.max_expert_width = *value;
  }
  if (auto it = object.find("full_attention_max_tokens"); it != object.end()) {
    absl::StatusOr<int64_t> value = ReadInteger(*it, "full_attention_max_tokens", 0, where);
    if (!value.ok()) return value.status();
    rules.full_attention_max_tokens = *value;
  }
  if (auto it = object.find("default_preset"); it != object.end()) {
    absl::StatusOr<std::string> value = ReadString(*it, "default_preset", where);
    if (!value.ok()) return value.status();
    rules.default_preset = *std::move(value);
    if (rules.presets.has_value()) {
      bool listed = false;
      for (const std::string& preset : *rules.presets) listed = listed || preset == rules.default_preset;
      if (!listed) {
        return where.Error("default_preset", absl::StrCat("\"", rules.default_preset, "\" is not one of its presets: ",
                                                          absl::StrJoin(*rules.presets, ", ")));
      }
    }
  }
  if (auto it = object.find("quota"); it != object.end()) {
    if (!it->is_object()) return where.Error("quota", absl::StrCat("must be an object (got ", TypeName(*it), ")"));
    const std::set<std::string> quota_keys{"compute_units_per_second", "burst_compute_units"};
    for (const auto& [key, value] : it->items()) {
      if (quota_keys.count(key) == 0) {
        return where.Error(absl::StrCat("quota.", key),
                           "unknown key; allowed: burst_compute_units, compute_units_per_second");
      }
    }
    ClientRules::Quota quota;
    for (const std::string& key : quota_keys) {
      if (!it->contains(key)) return where.Error(absl::StrCat("quota.", key), "missing");
    }
    absl::StatusOr<double> rate =
        ReadPositiveNumber(it->at("compute_units_per_second"), "quota.compute_units_per_second", where);
    if (!rate.ok()) return rate.status();
    absl::StatusOr<double> burst =
        ReadPositiveNumber(it->at("burst_compute_units"), "quota.burst_compute_units", where);
    if (!burst.ok()) return burst.status();
    rules.quota = ClientRules::Quota{*rate, *burst};
  }
  if (auto it = object.find("priority"); it != object.end()) {
    absl::StatusOr<int> priority = ReadPriority(*it, where);
    if (!priority.ok()) return priority.status();
    rules.priority = *priority;
  }
  return rules;
}

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > kMaxNameLength) return false;
  for (char c : name) {
    if (!(absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '_' || c == '-')) return false;
  }
  return true;
}

bool ValidSha256Hex(const std::string& text) {
  if (text.size() != 64) return false;
  for (char c : text) {
    if (!(absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<ClientPolicy> ClientPolicy::Parse(const std::string& text, const std::string& file) {
  const Where top(file, "top level");
  Json document = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (document.is_discarded()) return top.Error("", "not valid JSON");
  if (!document.is_object()) return top.Error("", absl::StrCat("must be a JSON object (got ", TypeName(document), ")"));
  if (absl::Status keys = CheckKeys(document, {"clients", "default"}, top); !keys.ok()) return keys;
  ClientPolicy policy;
  if (auto it = document.find("default"); it != document.end()) {
    const Where where(file, "client 'default'");
    if (!it->is_object()) return where.Error("", absl::StrCat("must be an object (got ", TypeName(*it), ")"));
    if (absl::Status keys = CheckKeys(*it, RuleKeys(), where); !keys.ok()) return keys;
    absl::StatusOr<ClientRules> rules = ReadRules(*it, where);
    if (!rules.ok()) return rules.status();
    policy.default_rules_ = *std::move(rules);
  }
  if (auto it = document.find("clients"); it != document.end()) {
    if (!it->is_array()) return top.Error("clients", absl::StrCat("must be a list (got ", TypeName(*it), ")"));
    std::set<std::string> names;
    for (size_t index = 0; index < it->size(); ++index) {
      const Json& object = (*it)[index];
      std::string label = absl::StrCat("client #", index + 1);
      if (object.is_object() && object.contains("name") && object.at("name").is_string()) {
        label = absl::StrCat("client '", object.at("name").get<std::string>(), "'");
      }
      const Where where(file, label);
      if (!object.is_object()) return where.Error("", absl::StrCat("must be an object (got ", TypeName(object), ")"));
      std::set<std::string> keys = RuleKeys();
      keys.insert({"name", "token_sha256", "certificate_subject"});
      if (absl::Status checked = CheckKeys(object, keys, where); !checked.ok()) return checked;
      PolicyClient client;
      if (!object.contains("name")) return where.Error("name", "missing");
      absl::StatusOr<std::string> name = ReadString(object.at("name"), "name", where);
      if (!name.ok()) return name.status();
      if (!ValidName(*name)) return where.Error("name", "must match [a-z0-9_-]{1,32} (it is a metric label)");
      if (*name == kDefaultClientName) {
        return where.Error("name", "\"default\" is reserved: give its rules in the top-level \"default\" object");
      }
      if (!names.insert(*name).second) return where.Error("name", "a client of this name is listed already");
      client.name = *std::move(name);
      if (auto token = object.find("token_sha256"); token != object.end()) {
        absl::StatusOr<std::string> hash = ReadString(*token, "token_sha256", where);
        if (!hash.ok()) return hash.status();
        const std::string lowered = absl::AsciiStrToLower(*hash);
        if (!ValidSha256Hex(lowered)) {
          return where.Error("token_sha256",
                             "must be the token's SHA-256 as 64 hex digits (e.g. `printf %s TOKEN | sha256sum`)");
        }
        if (policy.by_token_.count(lowered) > 0) {
          return where.Error("token_sha256", absl::StrCat("the same token identifies client '",
                                                          policy.clients_[policy.by_token_[lowered]].name, "'"));
        }
        client.token_sha256 = lowered;
      }
      if (auto subject = object.find("certificate_subject"); subject != object.end()) {
        absl::StatusOr<std::string> value = ReadString(*subject, "certificate_subject", where);
        if (!value.ok()) return value.status();
        if (policy.by_subject_.count(*value) > 0) {
          return where.Error("certificate_subject",
                             absl::StrCat("the same subject identifies client '",
                                          policy.clients_[policy.by_subject_[*value]].name, "'"));
        }
        client.certificate_subject = *std::move(value);
      }
      if (client.token_sha256.empty() && client.certificate_subject.empty()) {
        return where.Error("", "has no identity: give token_sha256 and/or certificate_subject");
      }
      absl::StatusOr<ClientRules> rules = ReadRules(object, where);
      if (!rules.ok()) return rules.status();
      client.rules = *std::move(rules);
      if (!client.token_sha256.empty()) policy.by_token_[client.token_sha256] = policy.clients_.size();
      if (!client.certificate_subject.empty()) {
        policy.by_subject_[client.certificate_subject] = policy.clients_.size();
      }
      policy.clients_.push_back(std::move(client));
    }
  }
  return policy;
}

absl::StatusOr<ClientPolicy> ClientPolicy::FromFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot read the client policy file '", path, "'"));
  std::stringstream text;
  text << file.rdbuf();
  if (file.bad()) return absl::NotFoundError(absl::StrCat("cannot read the client policy file '", path, "'"));
  return Parse(text.str(), path);
}

const PolicyClient* ClientPolicy::FindByTokenSha256(const std::string& token_sha256) const {
  auto it = by_token_.find(token_sha256);
  return it == by_token_.end() ? nullptr : &clients_[it->second];
}

const PolicyClient* ClientPolicy::FindByCertificateSubject(const std::string& subject) const {
  auto it = by_subject_.find(subject);
  return it == by_subject_.end() ? nullptr : &clients_[it->second];
}

std::string Sha256Hex(const std::string& data) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * SHA256_DIGEST_LENGTH);
  for (unsigned char byte : digest) {
    hex.push_back(kHex[byte >> 4]);
    hex.push_back(kHex[byte & 0xf]);
  }
  return hex;
}

std::string PriorityName(int priority) {
  if (priority == kInteractivePriority) return "interactive";
  if (priority == kNormalPriority) return "normal";
  if (priority == kBatchPriority) return "batch";
  return absl::StrCat(priority);
}

}  // namespace mita::server::policy
