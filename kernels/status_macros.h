// Early-return macros for absl::Status and absl::StatusOr, as TensorFlow Serving and Triton have them. In the
// lowest layer (kernels/) so that every layer above can include it; no dependency beyond Abseil.
//
//   RETURN_IF_ERROR(CheckShape(x));                 // returns the status when it is not OK
//   ASSIGN_OR_RETURN(at::Tensor y, Compute(x));     // declares y, or returns the error
//   ASSIGN_OR_RETURN(existing, Compute(x));         // assigns to an existing variable
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Evaluates `expression` (an absl::Status) once and returns it from the enclosing function when it is not OK.
#define RETURN_IF_ERROR(expression)                                    \
  do {                                                                 \
    ::absl::Status mita_status_macro_status = (expression);            \
    if (!mita_status_macro_status.ok()) return mita_status_macro_status; \
  } while (false)

#define MITA_STATUS_MACROS_CONCAT_INNER(x, y) x##y
#define MITA_STATUS_MACROS_CONCAT(x, y) MITA_STATUS_MACROS_CONCAT_INNER(x, y)

// Evaluates `expression` (an absl::StatusOr<T>) once; on error returns its status from the enclosing function,
// else moves the value into `lhs` (a declaration such as `auto x` or an existing variable).
#define ASSIGN_OR_RETURN(lhs, expression) \
  MITA_ASSIGN_OR_RETURN_IMPL(MITA_STATUS_MACROS_CONCAT(mita_status_or_, __LINE__), lhs, expression)

#define MITA_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expression) \
  auto statusor = (expression);                               \
  if (!statusor.ok()) return std::move(statusor).status();    \
  lhs = *std::move(statusor)
