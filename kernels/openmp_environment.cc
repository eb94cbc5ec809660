#include "kernels/openmp_environment.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace mita::kernels {

void ReexecWithPassiveOpenMpWaitIfUnset(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "passive", /*overwrite=*/1) != 0) return;
  execv("/proc/self/exe", argv);
  std::perror("re-executing with OMP_WAIT_POLICY=passive failed; continuing with the default policy");
}

}  // namespace mita::kernels
