// Flags whose value may differ per model: a comma-separated list of entries, VALUE for every model not named
// otherwise (at most one such entry) and MODEL=VALUE for that model (its folder under --model_repository), e.g.
// --weights_dtype=bfloat16,fashion-mnist-vit=float32 or --batch_threads=1,fashion-mnist-vit=2.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace mita::server {

// One flag's value: the value for models not named, and the models named.
template <typename Value>
struct PerModelValue {
  std::optional<Value> otherwise;
  std::map<std::string, Value> by_model;
};

// Parses the entries of flag --`flag` (`text`; empty: no value) with `parse` (VALUE -> StatusOr<Value>). Errors:
// INVALID_ARGUMENT "flag --NAME: ..." for an empty entry or model name, a value `parse` refuses (its message, after
// the model's name), two entries without a model, or a model named twice.
template <typename Value, typename Parse>
absl::StatusOr<PerModelValue<Value>> ParsePerModel(absl::string_view flag, absl::string_view text, Parse parse) {
  PerModelValue<Value> result;
  if (text.empty()) return result;
  auto error = [flag](absl::string_view message) {
    return absl::InvalidArgumentError(absl::StrCat("flag --", flag, ": ", message));
  };
  for (absl::string_view entry : absl::StrSplit(text, ',')) {
    if (entry.empty()) return error(absl::StrCat("empty entry in '", text, "'"));
    const size_t equals = entry.find('=');
    const absl::string_view model = equals == absl::string_view::npos ? "" : entry.substr(0, equals);
    const absl::string_view value = equals == absl::string_view::npos ? entry : entry.substr(equals + 1);
    if (equals != absl::string_view::npos && model.empty()) {
      return error(absl::StrCat("'", entry, "' names no model (use MODEL=VALUE)"));
    }
    absl::StatusOr<Value> parsed = parse(value);
    if (!parsed.ok()) {
      return error(model.empty() ? std::string(parsed.status().message())
                                 : absl::StrCat("model '", model, "': ", parsed.status().message()));
    }
    if (model.empty()) {
      if (result.otherwise.has_value()) {
        return error(absl::StrCat("two values for the models not named in '", text,
                                  "': give one VALUE and MODEL=VALUE entries"));
      }
      result.otherwise = *parsed;
    } else if (!result.by_model.emplace(std::string(model), *parsed).second) {
      return error(absl::StrCat("model '", model, "' is named twice"));
    }
  }
  return result;
}

// INVALID_ARGUMENT "flag --NAME: no model 'x' in the model repository (models: ...)" when `value` names a model
// that is not in `models`.
template <typename Value>
absl::Status CheckNamedModels(absl::string_view flag, const PerModelValue<Value>& value,
                              const std::set<std::string>& models) {
  for (const auto& [name, unused] : value.by_model) {
    if (models.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("flag --", flag, ": no model '", name,
                                                     "' in the model repository (models: ",
                                                     absl::StrJoin(models, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

// The value of `model`: its own, else the one for models not named, else `fallback`.
template <typename Value>
Value ValueFor(const PerModelValue<Value>& value, const std::string& model, Value fallback) {
  auto it = value.by_model.find(model);
  if (it != value.by_model.end()) return it->second;
  return value.otherwise.value_or(fallback);
}

}  // namespace mita::server
