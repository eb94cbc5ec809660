// ATen exceptions to Status (see aten_errors.h).
#include "kernels/aten_errors.h"

#include <exception>
#include <new>
#include <string>

#include <c10/util/Exception.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace mita::kernels {

bool IsOutOfMemoryMessage(absl::string_view message) {
  for (absl::string_view marker : {"can't allocate memory", "not enough memory", "out of memory"}) {
    if (absl::StrContains(message, marker)) return true;
  }
  return false;
}

absl::Status CurrentExceptionStatus(absl::string_view operation) {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(operation, ": out of memory"));
  } catch (const c10::Error& error) {
    const std::string message = error.what_without_backtrace();
    if (dynamic_cast<const c10::OutOfMemoryError*>(&error) != nullptr || IsOutOfMemoryMessage(message)) {
      return absl::ResourceExhaustedError(absl::StrCat(operation, ": ", message));
    }
    return absl::InternalError(absl::StrCat(operation, " failed: ", message));
  } catch (const std::exception& error) {
    return absl::InternalError(absl::StrCat(operation, " failed: ", error.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(operation, " failed: unknown exception"));
  }
}

}  // namespace mita::kernels
