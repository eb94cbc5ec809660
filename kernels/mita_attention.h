// MiTA (Mixture-of-Top-k Attention) forward and full attention, on the CPU and on CUDA devices.
//
// Source: Wen et al., "MiTA: Mixture-of-Top-k Attention", NeurIPS 2026 (arXiv 2602.01219), and
// docs/design.md section 2, which fixes the details trained checkpoints depend on. Per batch item and head,
// with q, k, v: [N, d], landmarks l: [M, d] (M = expert count) and s = 1/sqrt(d):
//   routed experts   S = l k^T (no scale); expert i owns the k (= expert width) keys with the largest S[i, :].
//                    Ties: higher score first, then lower key index (what a stable descending sort gives).
//                    Experts may share keys.
//   shared expert    A = softmax(S * s) v, [M, d]: the landmarks attend over all keys.
//   routing          G = l q^T (no scale); query n goes to expert e(n) = argmax_i G[i, n] (first maximum).
//   output           one softmax over M + k logits per query: compressed logits q_n . l_i * s * s with values
//                    A_i, and routed logits q_n . k_j * s for j in expert e(n)'s keys with values v_j.
// Cost per head: O(M N d) for landmarks and experts, O(N (M + k) d) for queries.
//
// All functions are inference-only (no autograd graph is recorded, whatever the inputs' requires_grad; they
// also work under c10::InferenceMode), never throw, and report bad arguments as INVALID_ARGUMENT with the
// argument's name and allowed range. NaN or infinity in the inputs propagates to the outputs, never a crash.
//
// This header has no gRPC, proto or model knowledge.
#pragma once

#include <cstdint>
#include <functional>
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
  // Expert width k, 1 <= k <= the item's token count.
  int64_t expert_width = 0;
  // Tokens of this item: 0 (the default) means all N. 1 <= token_count <= N makes the item its first
  // token_count tokens, for batches of different lengths padded to N: queries, keys and values beyond are
  // ignored (the padding never enters a top-k or a softmax) and the item's output rows beyond are 0.
  int64_t token_count = 0;
};

// Routing and pruning statistics of one batch item, averaged over heads (docs/design.md section 2.8). Per head,
// with load_i = number of queries n with e(n) = i (sum N); N here is the item's token count
// (MitaItem::token_count when set):
struct MitaItemStatistics {
  // load_i averaged over heads, length M (each head's loads sum to N).
  std::vector<double> queries_per_expert;
  // max_i load_i / (N / M), averaged over heads: 1 = balanced, M = all queries on one expert.
  double load_imbalance = 0;
  // -sum_i p_i ln p_i / ln M with p_i = load_i / N (0 ln 0 = 0), averaged over heads, in [0, 1]:
  // 1 = uniform routing, 0 = all queries on one expert; defined as 1 when M == 1.
  double routing_entropy = 0;
  // (keys in no routed expert's set) / N, averaged over heads: the paper's emergent token pruning. 0 when k = N.
  double pruned_key_fraction = 0;
  // (keys in the sets of two or more routed experts) / N, averaged over heads.
  double expert_overlap_fraction = 0;
};

// Which implementation runs the MiTA forward.
enum class MitaBackend {
  // The fastest implementation for the tensors' device: the CPU kernel on CPU (mita_attention_cpu.cc); on a
  // CUDA device the CUDA kernel (mita_attention_cuda.cu; float32 and bfloat16, d <= 256) when the build has
  // it (MITA_CUDA, docs/kernels.md), otherwise the reference.
  kAuto,
  // Plain ATen ops (sort, gather, softmax): slow, obviously correct; kept for tests.
  kReference,
};

// MiTA forward for a batch whose items may each have their own expert count and expert width (docs/design.md
// section 2, formulas above).
//
// q, k, v: [B, H, N, d] (the same shape), float32, float64 or bfloat16 (the same dtype; the CPU kernel computes
// bfloat16 in float32 and rounds its output once), on one device. Any strides: slices of
// a fused [B, N, 3, H, d] qkv projection are read in place; other layouts are copied once. items: B entries
// (B = 0 gives an empty output). Returns a new [B, H, N, d] tensor of q's dtype: the attention output before the
// head merge and output projection; from the CPU kernel its memory is [B, N, H, d] (heads merged: transpose(1, 2)
// is contiguous), from the others contiguous. Softmaxes accumulate in the input's precision with the
// maximum subtracted. When `statistics` is not null it is resized to B and filled per item.
// The CPU kernel runs (item, head) pairs in parallel on at::get_num_threads() threads; its result does not
// depend on the thread count.
// Errors: INVALID_ARGUMENT when q, k or v is undefined, not 4-D, of another dtype or shape or device than q,
// or has H, N or d < 1; when items.size() != B; when items[b].token_count is outside [0, N]; when
// items[b].expert_width is outside [1, N_b] (N_b = the item's token count); when
// items[b].landmarks is undefined, not [H, M >= 1, d], or of another dtype or device than q. RESOURCE_EXHAUSTED
// when memory runs out; INTERNAL for an unexpected ATen failure.
absl::StatusOr<at::Tensor> MitaAttentionForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                absl::Span<const MitaItem> items,
                                                std::vector<MitaItemStatistics>* statistics = nullptr,
                                                MitaBackend backend = MitaBackend::kAuto);

// Asked during long attention work: true stops the work on batch item `item`.
using AttentionInterrupt = std::function<bool(int64_t item)>;

// Full softmax attention softmax(q k^T / sqrt(d)) v: the serving path for "full attention" budgets and, per
// docs/design.md section 2.7, what MiTA equals with k = N and no compressed branch. On the CPU in float32 and
// float64 up to 4,096 tokens (images, short documents) with MKL as the BLAS, this project's own: per (item, head,
// block of queries) on one thread, scores against all keys, softmax and output, with q, k, v read in place
// (full_attention_cpu.cc).
// Otherwise LibTorch's fused scaled-dot-product attention (at::scaled_dot_product_attention: FlashAttention or
// memory-efficient attention on CUDA, the flash kernel on the CPU; O(N) memory, no N x N scores): on CUDA over the
// batch; on the CPU over groups of items of at most 2^24 scores (H N^2 per item), and items with more (documents of
// thousands of tokens) one at a time in chunks of their queries against all their keys, at most 2^24 scores each.
// q, k, v: [B, H, N, d], same shape, float32, float64 or bfloat16 -> new [B, H, N, d] of q's dtype: contiguous,
// except from the short CPU path, whose memory is [B, N, H, d] (heads merged: transpose(1, 2) is contiguous).
// `interrupt` (optional) is asked for each item before its group, or before each chunk of a long item; when it
// answers true the rest of that item is skipped and its remaining output rows are 0 (the caller knows why it
// stopped): a long input on the CPU stops within one chunk (2^24 scores, tens of ms) of its caller leaving.
// Errors: INVALID_ARGUMENT when a tensor is undefined or not 4-D, when dtypes are not float32, float64 or
// bfloat16 or differ, or when shapes or devices differ; RESOURCE_EXHAUSTED when memory runs out (CUDA's included).
absl::StatusOr<at::Tensor> FullAttentionForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const AttentionInterrupt& interrupt = nullptr);

// Image landmarks (official DeiT MiTA code, docs/design.md section 2.1): the q tokens 0 .. N-2 (the cls token
// included, the last patch token dropped) laid row-major on an S x S grid, S = sqrt(N - 1), average-pooled
// adaptively to a P x P grid: window i covers rows/columns [floor(i*S/P), ceil((i+1)*S/P)).
// This is at::adaptive_avg_pool2d, whose windows are exactly these. Pooling is per head; since it is a per-channel
// average, pooling all C channels then splitting heads (the official code) gives the same landmarks.
// q: [B, H, N, d], float32, float64 or bfloat16 -> new contiguous [B, H, P*P, d] on q's
// device, landmark index = row * P + column.
// Errors: INVALID_ARGUMENT when q is undefined, not 4-D or not float32, float64 or bfloat16, when N - 1 is not a
// positive perfect square, or when pool_side is outside [1, S].
absl::StatusOr<at::Tensor> ImageLandmarks(const at::Tensor& q, int64_t pool_side);

// Sequence landmarks (docs/design.md section 2.1): adaptive 1-D average pooling of q over all N tokens into M
// windows [floor(i*N/M), ceil((i+1)*N/M)) (at::adaptive_avg_pool1d; windows overlap when M does not divide N).
// q: [B, H, N, d], float32, float64 or bfloat16 -> new contiguous [B, H, M, d] on q's
// device.
// Errors: INVALID_ARGUMENT when q is undefined, not 4-D or not float32, float64 or bfloat16, or when expert_count is
// outside [1, N].
absl::StatusOr<at::Tensor> SequenceLandmarks(const at::Tensor& q, int64_t expert_count);

}  // namespace mita::kernels
