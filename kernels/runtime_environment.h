// Runtime environment of serving and benchmark processes: OpenMP's wait policy, the intra-op thread count
// shared by LibTorch and the BLAS library, and how the C heap keeps freed memory.
//
// LibTorch's OpenMP runtime here (libgomp) makes idle worker threads spin before they sleep, and reads
// OMP_WAIT_POLICY only once, when the library is loaded. With OpenBLAS's own threads also active, spinning
// threads fight for the cores and batch-1 latency suffers (measured: docs/image_model.md).
#pragma once

namespace mita::kernels {

// If OMP_WAIT_POLICY is not set, sets it to "passive" and re-executes the current program (the file
// /proc/self/exe points to, so that the process keeps its name) with the same arguments, so that libgomp starts
// with it; an operator's explicit choice is kept. Call first
// thing in main(). Returns only when no re-execution was needed or it failed (then the process goes on with
// libgomp's default policy).
void ReexecWithPassiveOpenMpWaitIfUnset(char** argv);

// Sets the intra-op thread count, `threads` >= 1, of LibTorch (at::set_num_threads) and of the BLAS library
// when it is OpenBLAS (openblas_set_num_threads, looked up at run time, so that another BLAS works unchanged
// and keeps its own setting). Returns the BLAS thread count now in effect: OpenBLAS's, else MKL's (the PyPI
// wheel's LibTorch links MKL in, and at::set_num_threads sets it), or 0 when the BLAS reports none.
//
// Why both: LibTorch's setting does not reach OpenBLAS, whose pthread build (Debian's libopenblas0-pthread)
// starts one worker per core and lets it spin in sched_yield after every multi-threaded GEMM, taking CPU from
// the batch thread (measured: docs/serving.md, "Threads").
int SetIntraOpThreads(int threads);

// Makes glibc's malloc keep freed memory for reuse: no allocation is served by its own mmap
// (mallopt(M_MMAP_MAX, 0)) and the heap is never trimmed (mallopt(M_TRIM_THRESHOLD, INT_MAX)). Process-wide; call
// before serving starts. Returns false when glibc refused either setting.
//
// Why: LibTorch's CPU tensors come from malloc, and glibc maps every block over 32 MiB (its largest mmap
// threshold) afresh and unmaps it when freed, so a long document's multi-MiB activations are page-faulted in again
// at every layer of every request. The process keeps its high-water heap instead, which it reuses for the next
// request (measured: docs/long_documents.md).
bool KeepFreedMemoryForReuse();

}  // namespace mita::kernels
