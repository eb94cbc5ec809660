// The OpenMP wait settings the server and the tools start libgomp with unless the operator set them: an idle worker
// thread spins briefly, then sleeps. One copy for the two places that set them: the libc-only launcher
// (server/process/launcher.cc), before LibTorch loads, and ReexecWithOpenMpWaitSettingsIfUnset
// (kernels/runtime_environment.h) for mita-server-core and the tools.
//
// Why a short spin: a forward is hundreds of parallel regions a few microseconds apart, and a worker that sleeps at
// once must be woken for each, which costs a small forward several times its compute; an unbounded spin takes the
// cores from the batch and preparation threads (measured: docs/kernels.md, "The wait policy").
#pragma once

namespace mita::kernels {

// OMP_WAIT_POLICY: idle workers sleep once their spin (below) is over.
inline constexpr char kOpenMpWaitPolicy[] = "passive";
// GOMP_SPINCOUNT: libgomp's spin iterations before an idle worker sleeps (tens of microseconds). libgomp spins so
// long only while it manages no more threads than the process has CPUs (ReleaseCallingThreadIntraOpTeam says why).
inline constexpr char kOpenMpSpinCount[] = "10000";

}  // namespace mita::kernels
