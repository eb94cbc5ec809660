// mita-server's --device and --weights_dtype: where each hosted model runs and in what precision.
//
// Each flag's value is per model (per_model_flag.h): VALUE for every model not named otherwise, MODEL=VALUE for
// that model. Unset: cpu, float32.
//   --device=cuda:0                                   every model on the first GPU
//   --device=cuda:0,linux-doc-mita=cuda:1             the document model on the second
//   --device=cuda:0 --weights_dtype=bfloat16,fashion-mnist-vit=float32
// Devices: cpu, cuda:N (kernels::ParseDevice). Dtypes: float32, bfloat16 (on a CUDA device, or a CPU with
// bfloat16 dot products).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "models/classifier.h"
#include "server/process/per_model_flag.h"

namespace mita::server {

// The parsed --device and --weights_dtype flags.
class PlacementFlags {
 public:
  // Parses both flags' values (empty: the defaults). Errors: INVALID_ARGUMENT naming the flag ("flag --device:
  // ...") for an entry that is not a device or dtype (the allowed values in the message), an empty entry or model
  // name, two entries without a model, or a model named twice.
  static absl::StatusOr<PlacementFlags> Parse(absl::string_view device_flag, absl::string_view dtype_flag);

  // The placement of every model of `models` (the repository's package folders). Errors: INVALID_ARGUMENT
  // naming the flag for a named model that is not in `models` (listing them); FAILED_PRECONDITION "flag
  // --weights_dtype: model 'M' on cpu: bfloat16 on the CPU needs AVX512-BF16 or AMX-BF16, ..." on a CPU without
  // them (kernels::CheckWeightsDtypeOnDevice), and "flag --device: cuda:0: no CUDA device is visible to this
  // process (...)" when a device cannot be used (kernels::CheckDeviceUsable).
  absl::StatusOr<std::map<std::string, models::Placement>> Resolve(const std::vector<std::string>& models) const;

 private:
  PerModelValue<c10::Device> devices_;
  PerModelValue<at::ScalarType> dtypes_;
};

}  // namespace mita::server
