// --device and --weights_dtype (see placement.h).
#include "server/process/placement.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/device.h"

namespace mita::server {
namespace {

// Parses "VALUE" and "MODEL=VALUE" entries of `flag` with `parse` (VALUE -> StatusOr<Value>).
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

// INVALID_ARGUMENT when `value` names a model that is not in `models`.
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

template <typename Value>
Value ValueFor(const PerModelValue<Value>& value, const std::string& model, Value fallback) {
  auto it = value.by_model.find(model);
  if (it != value.by_model.end()) return it->second;
  return value.otherwise.value_or(fallback);
}

}  // namespace

absl::StatusOr<PlacementFlags> PlacementFlags::Parse(absl::string_view device_flag, absl::string_view dtype_flag) {
  PlacementFlags flags;
  absl::StatusOr<PerModelValue<c10::Device>> devices =
      ParsePerModel<c10::Device>("device", device_flag, kernels::ParseDevice);
  if (!devices.ok()) return devices.status();
  absl::StatusOr<PerModelValue<at::ScalarType>> dtypes =
      ParsePerModel<at::ScalarType>("weights_dtype", dtype_flag, kernels::ParseWeightsDtype);
  if (!dtypes.ok()) return dtypes.status();
  flags.devices_ = *std::move(devices);
  flags.dtypes_ = *std::move(dtypes);
  return flags;
}

absl::StatusOr<std::map<std::string, models::Placement>> PlacementFlags::Resolve(
    const std::vector<std::string>& models) const {
  const std::set<std::string> names(models.begin(), models.end());
  if (absl::Status status = CheckNamedModels("device", devices_, names); !status.ok()) return status;
  if (absl::Status status = CheckNamedModels("weights_dtype", dtypes_, names); !status.ok()) return status;
  std::map<std::string, models::Placement> placements;
  std::set<std::string> checked_devices;
  for (const std::string& model : models) {
    models::Placement placement;
    placement.device = ValueFor(devices_, model, c10::Device(c10::kCPU));
    placement.weights_dtype = ValueFor(dtypes_, model, at::kFloat);
    const std::string device = kernels::DeviceName(placement.device);
    if (absl::Status dtype = kernels::CheckWeightsDtypeOnDevice(placement.weights_dtype, placement.device);
        !dtype.ok()) {
      return absl::Status(dtype.code(), absl::StrCat("flag --weights_dtype: model '", model, "' on ", device, ": ",
                                                     dtype.message()));
    }
    if (checked_devices.insert(device).second) {
      if (absl::Status usable = kernels::CheckDeviceUsable(placement.device); !usable.ok()) {
        return absl::Status(usable.code(), absl::StrCat("flag --device: ", usable.message()));
      }
    }
    placements.emplace(model, placement);
  }
  return placements;
}

}  // namespace mita::server
