// mita-server: a launcher that starts mita-server-core (server/process/main.cc, installed beside it) with what must be
// in place before the server's libraries load.
//
// The server links LibTorch with CUDA; the dynamic loader takes one to two seconds to map and relocate it before
// any code of the server runs, and a SIGTERM in that time would kill the process (exit by signal, not the
// drain and exit 0 of any other time). This launcher links only libc, so within a millisecond of exec it
// blocks SIGTERM, SIGINT and SIGHUP (SIGHUP unless it is ignored, as under nohup; the blocked mask and pending
// signals survive execve: the server takes them with sigwait once it serves) and sets OpenMP's wait settings
// unless set (kernels/openmp_wait.h: libgomp reads them when it loads; idle threads spin briefly, then sleep), then
// executes the server with the same arguments.
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/openmp_wait.h"

int main(int argc, char** argv) {
  (void)argc;
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  struct sigaction hangup;
  memset(&hangup, 0, sizeof(hangup));
  if (sigaction(SIGHUP, nullptr, &hangup) != 0 || hangup.sa_handler != SIG_IGN) sigaddset(&signals, SIGHUP);
  sigprocmask(SIG_BLOCK, &signals, nullptr);
  setenv("OMP_WAIT_POLICY", mita::kernels::kOpenMpWaitPolicy, /*overwrite=*/0);
  setenv("GOMP_SPINCOUNT", mita::kernels::kOpenMpSpinCount, /*overwrite=*/0);
  // mita-server-core in the folder of this binary's real path.
  char path[PATH_MAX];
  const ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (length <= 0) {
    perror("mita-server: cannot read /proc/self/exe");
    return 1;
  }
  path[length] = '\0';
  char* slash = strrchr(path, '/');
  const char kCore[] = "mita-server-core";
  if (slash == nullptr || static_cast<size_t>(slash + 1 - path) + sizeof(kCore) > sizeof(path)) {
    fprintf(stderr, "mita-server: unexpected path %s\n", path);
    return 1;
  }
  memcpy(slash + 1, kCore, sizeof(kCore));
  execv(path, argv);
  fprintf(stderr, "mita-server: cannot execute %s: %s\n", path, strerror(errno));
  return 1;
}
