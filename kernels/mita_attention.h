// MiTA (Mixture-of-Top-k Attention) forward and full attention, on CPU.
//
// Source: Wen et al., "MiTA: Mixture-of-Top-k Attention", NeurIPS 2026 (arXiv 2602.01219), and
// shared/DESIGN.md section 2, which fixes the details trained checkpoints depend on. Per batch item and head,
// with q, k, v: [N, d], landmarks l: [M, d] (M = expert count) and s = 1/sqrt(d):
//   routed experts   S = l k^T (no scale); expert i owns the k (= expert width) keys with the largest S[i, :].
//                    Ties: higher score first, then lower key index.
//   shared expert    A = softmax(S * s) v, [M, d]: the landmarks attend over all keys.
//   routing          G = l q^T (no scale); query n goes to expert e(n) = argmax_i G[i, n] (first maximum).
//   output           one softmax over M + k logits per query: compressed logits q_n . l_i * s * s with values
//                    A_i, and routed logits q_n . k_j * s for j in expert e(n)'s keys with values v_j.
// Cost per head: O(M N d) for landmarks and experts, O(N (M + k) d) for queries.
//
// This header has no gRPC, proto or model knowledge.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace mita::kernels {

// The per-item inputs that differ between batch items: each item has its own landmarks (so its own expert
// count M) and its own expert width k.
struct MitaItem {
  // Landmarks of this item, [H, M, d], same dtype as q. M >= 1.
  at::Tensor landmarks;
  // Expert width k, 1 <= k <= N.
  int64_t expert_width = 0;
};

// Routing and pruning statistics of one batch item, averaged over heads (DESIGN.md section 2,
// "Statistics that come for free").
struct MitaItemStatistics {
  // Queries routed to each expert, averaged over heads, length M.
  std::vector<double> queries_per_expert;
  // max / mean of queries per expert, averaged over heads (1 = balanced, M = all queries on one expert).
  double load_imbalance = 0;
  // Entropy of the queries-per-expert distribution / log(M), averaged over heads, in [0, 1]; 1 when M == 1.
  double routing_entropy = 0;
  // Fraction of the N keys selected by no routed expert, averaged over heads.
  double pruned_key_fraction = 0;
  // Fraction of the N keys selected by two or more routed experts, averaged over heads.
  double expert_overlap_fraction = 0;
};

// Which implementation runs the MiTA forward.
enum class MitaBackend {
  // The fastest implementation for the tensors' device (the CPU kernel on CPU).
  kAuto,
  // Plain ATen ops (sort, gather, softmax): slow, obviously correct; kept for tests.
  kReference,
};

// MiTA forward for a batch whose items may each have their own expert count and expert width.
//
// q, k, v: [B, H, N, d], float32 or float64, on CPU (contiguity not required). items: B entries.
// Returns the attention output [B, H, N, d] (before the head merge and output projection).
// When `statistics` is not null it is resized to B and filled per item.
// Errors: INVALID_ARGUMENT when shapes, dtypes or devices disagree, when items.size() != B, or when an item's
// expert width is outside [1, N] or its landmarks are not [H, M >= 1, d].
absl::StatusOr<at::Tensor> MitaAttentionForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                absl::Span<const MitaItem> items,
                                                std::vector<MitaItemStatistics>* statistics = nullptr,
                                                MitaBackend backend = MitaBackend::kAuto);

// Full softmax attention softmax(q k^T / sqrt(d)) v. q, k, v: [B, H, N, d] -> [B, H, N, d].
// Errors: INVALID_ARGUMENT when shapes, dtypes or devices disagree.
absl::StatusOr<at::Tensor> FullAttentionForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Image landmarks (official DeiT MiTA code, DESIGN.md section 2.1): the q tokens 0 .. N-2 (the cls token
// included, the last patch token dropped) laid row-major on an S x S grid, S = sqrt(N - 1), average-pooled
// adaptively to a P x P grid: window i covers rows/columns [floor(i*S/P), ceil((i+1)*S/P)).
// q: [B, H, N, d] -> [B, H, P*P, d], landmark index = row * P + column.
// Errors: INVALID_ARGUMENT when N - 1 is not a perfect square or pool_side is outside [1, S].
absl::StatusOr<at::Tensor> ImageLandmarks(const at::Tensor& q, int64_t pool_side);

// Sequence landmarks (DESIGN.md section 2.1): adaptive 1-D average pooling of q over all N tokens into M
// windows [floor(i*N/M), ceil((i+1)*N/M)). q: [B, H, N, d] -> [B, H, M, d].
// Errors: INVALID_ARGUMENT when expert_count is outside [1, N].
absl::StatusOr<at::Tensor> SequenceLandmarks(const at::Tensor& q, int64_t expert_count);

}  // namespace mita::kernels
