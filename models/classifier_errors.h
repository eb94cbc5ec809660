// Errors of the classifiers' forward passes (vit_classifier.cc, document_classifier.cc), one mapping for both.
// Exceptions ATen throws in a forward go through kernels::CurrentExceptionStatus (kernels/aten_errors.h).
// Internal to models/.
#pragma once

#include "absl/status/status.h"

namespace mita::models::internal {

// The error of an attention kernel call (kernels/mita_attention.h) on inputs the classifier has validated.
// RESOURCE_EXHAUSTED (memory ran out) stays RESOURCE_EXHAUSTED with its message: the request may succeed later
// or smaller. Any other failed code is a fault of this code, not of the request: INTERNAL "attention kernel:
// <message>". OK stays OK.
absl::Status KernelFault(const absl::Status& status);

}  // namespace mita::models::internal
