// Errors of the classifiers' forward passes (see classifier_errors.h).
#include "models/classifier_errors.h"

#include "absl/strings/str_cat.h"

namespace mita::models::internal {

absl::Status KernelFault(const absl::Status& status) {
  if (status.ok() || status.code() == absl::StatusCode::kResourceExhausted) return status;
  return absl::InternalError(absl::StrCat("attention kernel: ", status.message()));
}

}  // namespace mita::models::internal
