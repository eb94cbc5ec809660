// --device and --weights_dtype (see placement.h).
#include "server/process/placement.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/device.h"
#include "server/process/per_model_flag.h"

namespace mita::server {

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
