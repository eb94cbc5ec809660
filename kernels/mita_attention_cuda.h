// CUDA MiTA forward behind a raw-pointer interface: no torch, CUDA or Abseil headers, so that
// mita_attention.cc (compiled by the host compiler against CPU-only LibTorch) can dispatch to it, and so that
// the .cu file needs no torch headers.
//
// Same operation and semantics as MitaAttentionForward in kernels/mita_attention.h (docs/design.md section 2;
// arXiv 2602.01219): per batch item and head, S = l k^T; expert i owns the k keys with the largest S[i, :]
// (ties: higher score first, then lower key index); shared expert A = softmax(S s) v; gate G = l q^T, query n
// goes to the first maximum e(n) = argmax_i G[i, n]; output = one softmax over the M compressed logits
// q_n . l_i s^2 (values A_i) and the k routed logits q_n . k_j s (values v_j, j in expert e(n)'s keys).
// Arithmetic is float32 for both input types (bfloat16 inputs are widened on load, the output is rounded to
// bfloat16 once at the end); scores that are NaN rank below every number in the top-k.
//
// Status: compiled with nvcc for sm_90 when nvcc is found (CMake option MITA_CUDA); its correctness check is
// tests/cuda/mita_cuda_check.cc, run by scripts/gpu_check.sh on a GPU machine. See docs/kernels.md for
// whether it has been verified on hardware.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mita::kernels::cuda {

// Element type of q, k, v, landmarks and the output (all the same).
enum class ElementType { kFloat32, kBFloat16 };

// The per-item inputs (device memory).
struct CudaMitaItem {
  // Landmarks [H, M, d], contiguous, device memory of the problem's element type.
  const void* landmarks = nullptr;
  // Expert count M >= 1.
  int64_t expert_count = 0;
  // Expert width k, 1 <= k <= the item's token count.
  int64_t expert_width = 0;
  // Tokens of this item, 0 = all N; otherwise its first token_count tokens (MitaItem::token_count): the rest is
  // padding, ignored, with zero output rows.
  int64_t token_count = 0;
};

// Counts behind MitaItemStatistics for one (item, head); the caller averages over heads
// (mita_attention.cc does, with the same formulas as the CPU kernel).
struct CudaHeadCounts {
  // Queries routed to each expert, M entries (they sum to N). Caller-owned host memory.
  int64_t* queries_per_expert = nullptr;
  int64_t pruned_keys = 0;       // keys in no routed expert's set
  int64_t overlapping_keys = 0;  // keys in the sets of two or more routed experts
};

// One MiTA forward on the GPU. q, k, v: device pointers to [B, H, N, d] tensors whose last dimension is
// contiguous; *_strides are the element strides of the item, head and token dimensions. output: device
// pointer to a contiguous [B, H, N, d] tensor of the same element type. items: host array of B entries.
struct CudaMitaProblem {
  ElementType type = ElementType::kFloat32;
  int device = 0;  // CUDA device ordinal of all pointers
  int64_t batch = 0, heads = 0, tokens = 0, head_dim = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_strides[3] = {0, 0, 0};
  int64_t k_strides[3] = {0, 0, 0};
  int64_t v_strides[3] = {0, 0, 0};
  void* output = nullptr;
  const CudaMitaItem* items = nullptr;
  // When not null: host array of B * H entries (index b * H + h), each with queries_per_expert pointing to
  // M(b) host int64 values; filled before the call returns. The counts of all items are computed on the device
  // and come back in one copy at the end of the call (one wait for the stream).
  CudaHeadCounts* head_counts = nullptr;
  // cudaStream_t to run on, as void* (nullptr: the legacy default stream). The call returns once the work is
  // queued, except that it waits for the stream when head_counts is requested.
  void* stream = nullptr;
  // Scratch device memory on `device` of at least MitaCudaWorkspaceBytes(problem) bytes, 256-byte aligned (e.g.
  // from LibTorch's caching allocator, so that it is counted, reused and fails as LibTorch's out of memory);
  // it must stay allocated until the stream has run the call's work. nullptr: the call allocates its own with
  // cudaMallocAsync on `stream` and frees it at the end.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Largest head dimension the kernels take (the per-lane register tiles are sized for it).
constexpr int64_t kMaxCudaHeadDim = 256;

// Runs the forward. Returns an empty string on success, otherwise a message: the argument that is out of range
// (B, H, N, d < 1 or d > kMaxCudaHeadDim; M < 1; token count outside [0, N]; k outside [1, token count];
// null pointers; a workspace smaller than MitaCudaWorkspaceBytes) or the CUDA error. Scratch memory: about
// 4 * (H * M_max * N + H * N) + 4 * H * M_max * k_max bytes (float32 scores, int32 indices), from `workspace`
// or allocated for the call.
std::string MitaAttentionForwardCuda(const CudaMitaProblem& problem);

// Bytes of scratch memory a call with `problem`'s sizes, items and statistics request needs (0 for B = 0).
// Reads only the sizes, problem.items and whether head_counts is set (no pointer is dereferenced but items).
size_t MitaCudaWorkspaceBytes(const CudaMitaProblem& problem);

// What this object was compiled for: "sm_90 (CUDA 13.0)" (nvcc's __CUDA_ARCH_LIST__ and CUDART_VERSION).
std::string KernelBuildSummary();

// Number of CUDA devices visible to this process; 0 when there is no driver or no device (never an error).
int CudaDeviceCount();

// The whole memory of CUDA device `device`, bytes (cudaMemGetInfo's total); 0 when it cannot be read.
int64_t DeviceMemoryBytes(int device);

}  // namespace mita::kernels::cuda
