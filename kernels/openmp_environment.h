// OpenMP wait policy for serving processes.
//
// LibTorch's OpenMP runtime here (libgomp) makes idle worker threads spin before they sleep, and reads
// OMP_WAIT_POLICY only once, when the library is loaded. With OpenBLAS's own threads also active, spinning
// threads fight for the 2 cores: measured with tools/evaluate.cc on the embedded model (batch 1, 2 threads,
// 200 images), p95 latency was 24-110 ms with the default policy against 1.8-4.3 ms with
// OMP_WAIT_POLICY=passive, and batched throughput rose by 20-50% (README, "Accuracy and latency").
#pragma once

namespace mita::kernels {

// If OMP_WAIT_POLICY is not set, sets it to "passive" and re-executes the current program (/proc/self/exe)
// with the same arguments, so that libgomp starts with it; an operator's explicit choice is kept. Call first
// thing in main(). Returns only when no re-execution was needed or it failed (then the process goes on with
// libgomp's default policy).
void ReexecWithPassiveOpenMpWaitIfUnset(char** argv);

}  // namespace mita::kernels
