// Internal interface of kernels/: what mita_attention.cc (validation, dispatch), mita_attention_cpu.cc (the
// production CPU forward) and mita_attention_reference.cc (plain ATen ops) share, plus hooks for tests.
// Not part of the public API: models/ and server/ use kernels/mita_attention.h only.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/mita_attention.h"

namespace mita::kernels::internal {

// The routing of one (batch item, head): which keys each routed expert owns and which expert each query uses.
struct MitaHeadRouting {
  // e(n) = argmax_i G[i, n] for each query n (first maximum on ties), length N.
  std::vector<int64_t> expert_of_query;
  // expert_keys[i]: the expert_width keys routed expert i owns (top-k of S[i, :], ties to the lower key
  // index), listed in ascending key index. M lists of expert_width entries.
  std::vector<std::vector<int64_t>> expert_keys;
};

// The phases of the CPU kernel's work on one (item, head), in the order it runs them (mita_attention_cpu.cc),
// timed when MitaForwardOptions::phase_seconds is set.
enum MitaPhase : int {
  kPhaseSetup,           // output padding, workspace sizing
  kPhaseLandmarkScores,  // S_block = l K_block^T
  kPhaseTopKSelection,   // running top-k per landmark, and its final selection
  kPhaseSharedExpert,    // online softmax of S s and A += weights V_block
  kPhaseGate,            // G = Q l^T, first argmax, queries per expert
  kPhaseGrouping,        // queries grouped by expert (counting sort), scaled landmarks
  kPhaseGather,          // each expert's k key and value rows copied together
  kPhaseRoutedLogits,    // query chunks gathered, M + k logits per query
  kPhaseRoutedSoftmax,   // max-subtracted softmax of each query's logits
  kPhaseRoutedOutput,    // weights x A and weights x V_expert, normalised, scattered to the output rows
  kPhaseSmallInput,      // the whole output on the small-input path
  kPhaseCount
};
// Seconds of thread time per phase.
using MitaPhaseSeconds = std::array<double, kPhaseCount>;
// Short names of the phases, for tables (mita-kernel-bench --phases).
extern const char* const kMitaPhaseNames[kPhaseCount];

// The BLAS calls of the CPU kernel on one (item, head), counted when MitaForwardOptions::gemm_totals is set.
struct MitaGemmTotals {
  int64_t calls = 0;
  double flops = 0;    // 2 m n k per call (a multiply-add is 2 FLOPs)
  double seconds = 0;  // thread time inside the calls
};

// Options of the MiTA forward that the public API does not expose.
struct MitaForwardOptions {
  // Testing hook. When false the compressed (shared-expert) logits are left out of the softmax, so each query
  // attends only to its routed expert's keys. With expert width N every query then attends to all N keys:
  // exactly full attention softmax(q k^T s) v (docs/design.md section 2.7).
  bool include_shared_expert = true;
  // When not null, resized to B * H and filled with the routing of item b, head h at index b * H + h.
  std::vector<MitaHeadRouting>* routing = nullptr;
  // Testing and benchmarking hook of the CPU kernel. When false, every (item, head) computes its output per
  // routed expert, also where SmallInputPathApplies (so that tests and mita-kernel-bench compare both paths on
  // the same inputs).
  bool small_input_path = true;
  // Testing hook of the CPU kernel: queries per tile of its gate and per-expert output (0: chosen by the kernel
  // for the cache, QueryTileRows in mita_attention_cpu.cc), so that tests cover many tiles at small N.
  int64_t query_tile_rows = 0;
  // Benchmarking hook of the CPU kernel. When not null, resized to B * H and filled with the thread time of
  // each phase of item b, head h at index b * H + h (two steady_clock reads per phase and key block or query
  // chunk; when null, one pointer test each).
  std::vector<MitaPhaseSeconds>* phase_seconds = nullptr;
  // Benchmarking hook of the CPU kernel. When not null, resized to B * H and filled with the BLAS calls of item
  // b, head h at index b * H + h: the rate of the kernel's own GEMMs at their shapes (two steady_clock reads per
  // call; when null, one thread-local pointer test per call).
  std::vector<MitaGemmTotals>* gemm_totals = nullptr;
};

// Whether the CPU kernel computes the output of an (item, head) with N = `tokens` tokens of d = `head_dim`
// values, M = `expert_count` experts and expert width k = `expert_width` by its small-input path (one GEMM for
// all N^2 query-key scores, dense weight matrices) instead of per routed expert (4 small BLAS calls per expert).
// It does when: the shared expert is included; N <= 2 (M + k), so that it does at most about twice the
// per-expert path's arithmetic (N keys per query against M + k); N^2 d <= 64^3 multiply-adds (one
// single-threaded BLAS call). Measured with
// mita-kernel-bench (docs/kernels.md, "Small inputs").
bool SmallInputPathApplies(int64_t tokens, int64_t head_dim, int64_t expert_count, int64_t expert_width,
                           bool include_shared_expert);

// What the statistics need from one (item, head); every backend produces these, AverageOverHeads turns them
// into MitaItemStatistics.
struct HeadCounts {
  std::vector<int64_t> queries_per_expert;  // [M], sums to N
  int64_t pruned_keys = 0;                  // keys in no expert's set
  int64_t overlapping_keys = 0;             // keys in two or more experts' sets
};

// Per-item statistics from the counts of its H heads: each head's load imbalance, entropy, pruning and overlap
// (formulas at MitaItemStatistics), averaged over heads (docs/design.md section 2.8).
MitaItemStatistics AverageOverHeads(absl::Span<const HeadCounts> heads, int64_t tokens);

// `tensor` ([B, H, N, d]) itself when each (item, head, token) row of d values is contiguous and rows do not
// overlap: e.g. q, k, v sliced from a fused [B, N, 3, H, d] qkv projection are read in place, without a copy.
// Otherwise a contiguous copy (on the tensor's device).
inline at::Tensor WithContiguousRows(const at::Tensor& tensor) {
  const bool rows_contiguous = tensor.stride(3) == 1 || tensor.size(3) == 1;
  const bool rows_apart = tensor.stride(2) >= tensor.size(3) || tensor.size(2) == 1;
  return rows_contiguous && rows_apart ? tensor : tensor.contiguous();
}

// Row stride (elements) of a [B, H, N, d] tensor from WithContiguousRows, for BLAS: d when N == 1 (any stride is
// valid for a single row, BLAS needs one >= d).
inline int64_t RowStride(const at::Tensor& tensor) {
  return tensor.size(2) == 1 ? tensor.size(3) : tensor.stride(2);
}

// The rows of one (item, head) of a [B, H, N, d] tensor from WithContiguousRows: both CPU attention kernels read
// q, k and v through it.
template <typename T>
struct HeadRows {
  const T* data;
  int64_t stride;  // elements from one token's row to the next (RowStride)
};

template <typename T>
HeadRows<T> RowsOf(const at::Tensor& tensor, int64_t item, int64_t head) {
  return {tensor.data_ptr<T>() + item * tensor.stride(0) + head * tensor.stride(1), RowStride(tensor)};
}

// The most tokens FullAttentionForward computes with ShortFullAttentionCpu on the CPU: a block's scores against all
// N keys stay within a core's L2 (128 x 4096 floats). Longer inputs go to LibTorch's flash kernel, which streams the
// keys (docs/kernels.md, "Full attention on short inputs": the short path was as fast or faster from 50 to 4,096).
inline constexpr int64_t kMaxShortFullAttentionTokens = 4096;

// Whether FullAttentionForward computes q's attention with ShortFullAttentionCpu: float32 or float64 on the CPU,
// N <= kMaxShortFullAttentionTokens, and a BLAS that runs each block's GEMMs on the calling thread at any size
// (BlasLibrary::has_thread_local_threads: MKL). OpenBLAS threads any product over 64^3 multiply-adds itself, and
// blocks small enough to stay on one thread lost to the flash kernel (docs/kernels.md).
bool UsesShortFullAttention(const at::Tensor& q);

// Full softmax attention softmax(q k^T / sqrt(d)) v (full_attention_cpu.cc). q, k, v: [B, H, N, d], float32 or
// float64 CPU tensors of one shape, read in place where their rows are contiguous. Returns [B, H, N, d] whose
// memory is [B, N, H, d] (heads merged: transpose(1, 2) is contiguous). The items in `skipped_items` get zero rows.
at::Tensor ShortFullAttentionCpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 absl::Span<const int64_t> skipped_items);

// The token count of item `item` in a batch of N tokens (MitaItem::token_count, 0 = all N).
inline int64_t ItemTokens(const MitaItem& item, int64_t tokens) {
  return item.token_count == 0 ? tokens : item.token_count;
}

// Checks the MiTA forward's arguments (see MitaAttentionForward in mita_attention.h). OK, or
// INVALID_ARGUMENT naming the argument and the allowed values.
absl::Status ValidateMitaArguments(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   absl::Span<const MitaItem> items);

// MitaAttentionForward with the internal options: validates, then dispatches to the backend. Never throws:
// ATen failures (e.g. out of memory) come back as RESOURCE_EXHAUSTED or INTERNAL.
absl::StatusOr<at::Tensor> MitaAttentionForwardWithOptions(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, absl::Span<const MitaItem> items,
                                                           std::vector<MitaItemStatistics>* statistics,
                                                           MitaBackend backend, const MitaForwardOptions& options);

// The backends. Preconditions: ValidateMitaArguments(q, k, v, items) is OK. They may throw c10::Error or
// std::bad_alloc (the caller converts); `statistics`, when not null, is resized to B and filled.

// Production CPU forward (mita_attention_cpu.cc): CPU tensors, float32 or float64; bfloat16 is computed in float32
// and the output rounded to bfloat16.
at::Tensor MitaAttentionCpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            absl::Span<const MitaItem> items, std::vector<MitaItemStatistics>* statistics,
                            const MitaForwardOptions& options);

// CUDA forward (mita_attention_cuda_dispatch.cc, built when MITA_HAVE_CUDA): float32 or bfloat16 tensors on
// one CUDA device, through the raw-pointer API of mita_attention_cuda.h. Runs on the legacy default stream.
// Throws std::runtime_error with the CUDA error message when the kernel fails.
at::Tensor MitaAttentionCuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             absl::Span<const MitaItem> items, std::vector<MitaItemStatistics>* statistics);

// Reference forward from plain ATen ops (mita_attention_reference.cc): any device ATen supports.
at::Tensor MitaAttentionReference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  absl::Span<const MitaItem> items, std::vector<MitaItemStatistics>* statistics,
                                  const MitaForwardOptions& options);

}  // namespace mita::kernels::internal
