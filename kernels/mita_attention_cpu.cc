// Production CPU MiTA forward (docs/design.md section 2; arXiv 2602.01219), float32 and float64. The algorithm,
// top-down; its two lower layers are kernels/cpu_blas.h (the GEMMs on raw buffers) and kernels/cpu_row_primitives.h
// (the vectorised loops over one row: max, first argmax, exp and sum, softmax, top-k threshold mask, k-th highest).
//
// Work is split over (batch item, head) pairs with at::parallel_for; each pair runs MitaHead on raw pointers to
// contiguous rows of d values (q, k, v each with its own row stride, so a fused qkv projection is read in
// place), in the precision of its input (float for float32, double for float64):
//   1. key pass, one block of keys at a time (the [M, N] score matrix is never materialised):
//      S_block = l K_block^T (GEMM); each landmark's running top-k candidates take the block's scores; the
//      shared expert A = softmax(S s) v accumulates with an online (running max) softmax and a GEMM with
//      V_block. One pass over K and V serves both the routed experts and the shared expert.
//   2. top-k: per landmark, partial selection (std::nth_element, amortised O(N)) with the tie rule "higher
//      score first, then lower key index"; a key that cannot beat the current k-th best is never stored (blocks of
//      64 scores are tested against it at once, giving a bit mask of the keys that enter; the k-th best is
//      refreshed before a key block once over 2k candidates gathered). When all keys fit one block (no
//      compaction), the k-th highest score comes from a vectorised bitwise search (KthHighest) and one pass in key
//      order takes the keys above it and the lowest-index ties, already sorted.
//   3-4. by query tiles (a few thousand queries, QueryTileRows: their query, gate and output rows stay in the
//      cache, so the random gathers and scatters of step 4 cost the same per query at any N):
//   3. gate: G = Q l^T of the tile (GEMM by query blocks), e(n) = first argmax; queries counted per expert.
//   4. the output, by one of two paths with the same logits and weights (up to rounding):
//      - per routed expert (RoutedExpertOutput): each expert's k keys and values gathered once per head, its
//        values under A (PrepareRoutedExperts); the tile's queries grouped by expert (counting sort); each
//        expert's queries, in chunks, get their M + k logits (G s^2 and one GEMM) in one row buffer, one
//        max-subtracted softmax, and the output from one GEMM (weights x [A; V_expert]), normalised by the
//        softmax sum;
//      - small inputs (SmallInputOutput, where SmallInputPathApplies: e.g. 50 tokens at M = 9, k = 16): one
//        GEMM for all N^2 scores q K^T, the compressed logits from the gate (G s^2), and two GEMMs with dense
//        weight matrices (Wc x A, W x V), instead of 4 BLAS calls of a few hundred multiply-adds per expert.
// The gate G of a tile gives the compressed logits (G s^2) on both output paths (the small-input path is one tile
// of all N). Buffers live in a HeadWorkspace reused by all the (item, head) pairs of one thread. Left for later
// (docs/kernels.md): splitting one head over threads when B * H < threads.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "kernels/cpu_blas.h"
#include "kernels/cpu_row_primitives.h"
#include "kernels/mita_attention_internal.h"

namespace mita::kernels::internal {
namespace {

// Upper bound on the elements of one chunk's logits buffer [chunk, M + k].
constexpr int64_t kMaxLogitElements = int64_t{1} << 20;

// Charges the time since its previous charge to a phase (MitaForwardOptions::phase_seconds); a null test when
// phase timing is off.
class PhaseClock {
 public:
  explicit PhaseClock(double* seconds) : seconds_(seconds) {
    if (seconds_ != nullptr) last_ = std::chrono::steady_clock::now();
  }
  void Charge(MitaPhase phase) {
    if (seconds_ == nullptr) return;
    const std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now();
    seconds_[phase] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  double* seconds_;
  std::chrono::steady_clock::time_point last_;
};

// One (item, head) problem: [rows, head_dim] matrices with contiguous rows; queries, keys and values have their
// own row strides (in elements), so slices of a fused qkv projection are read in place.
template <typename T>
struct HeadProblem {
  const T* queries;    // [N, d], row stride query_stride
  const T* keys;       // [N, d], row stride key_stride
  const T* values;     // [N, d], row stride value_stride
  const T* landmarks;  // [M, d], contiguous
  T* output;           // [N, d], row stride output_stride
  int64_t query_stride;
  int64_t key_stride;
  int64_t value_stride;
  int64_t output_stride;
  int64_t tokens;
  int64_t head_dim;
  int64_t expert_count;
  int64_t width;
  bool include_shared_expert;
  bool small_input_path;    // MitaForwardOptions::small_input_path
  int64_t query_tile_rows;  // MitaForwardOptions::query_tile_rows
};

template <typename T>
struct Candidate {
  T score;
  int64_t index;
};

// The documented tie rule: higher score first, then lower key index. A strict total order (scores are never
// NaN here), so partial selection yields the same set as a stable descending sort.
template <typename T>
bool RanksHigher(const Candidate<T>& a, const Candidate<T>& b) {
  return a.score > b.score || (a.score == b.score && a.index < b.index);
}

// Running top-k of one landmark's scores, fed key blocks in increasing key index from key 0. Reusable: Reset keeps
// the buffers' capacity. Until the first compaction the scores are kept as a plain row in key order (a key's index
// is its position); after it, as (score, index) candidates above a threshold.
template <typename T>
class TopKSelector {
 public:
  void Reset(int64_t width) {
    width_ = width;
    scores_in_key_order_.clear();
    candidates_.clear();
    has_threshold_ = false;
  }

  // scores[j] is the score of key first_index + j; keys arrive in increasing index order.
  void Add(const T* scores, int64_t count, int64_t first_index) {
    // More keys are coming: once over 2k candidates have gathered, keep the k best, whose k-th score is the new
    // threshold. Tightened once per block, the threshold lets few keys in and the vectorised test below skips
    // most groups (compacting only past k + key_block candidates left it stale: at m = k = 64, about one key in
    // 16 entered and nearly every group was walked; docs/kernels.md, "Fourth round"). A single block is never
    // compacted, so Finish can select it in key order.
    if (!has_threshold_ && static_cast<int64_t>(scores_in_key_order_.size()) > 2 * width_) {
      candidates_.clear();
      for (size_t j = 0; j < scores_in_key_order_.size(); ++j) Push(scores_in_key_order_[j], static_cast<int64_t>(j));
      KeepBest();
    } else if (has_threshold_ && static_cast<int64_t>(candidates_.size()) > 2 * width_) {
      KeepBest();
    }
    if (has_threshold_) {
      // A later key has a higher index, so it enters only with a score strictly above the current k-th best
      // (a NaN score never does).
      // Groups of kScanGroup scores are tested at once (vectorised); only the keys that enter are visited.
      int64_t group = 0;
      for (; group + kScanGroup <= count; group += kScanGroup) {
        for (uint64_t above = AboveMask(scores + group, threshold_); above != 0; above &= above - 1) {
          const int64_t j = group + __builtin_ctzll(above);
          Push(scores[j], first_index + j);
        }
      }
      for (int64_t j = group; j < count; ++j) {
        if (scores[j] > threshold_) Push(scores[j], first_index + j);
      }
    } else {
      // A NaN score (NaN in the inputs) ranks below every number: keeps the order total; the output is NaN.
      const size_t size = scores_in_key_order_.size();
      scores_in_key_order_.resize(size + count);
      T* target = scores_in_key_order_.data() + size;
      for (int64_t j = 0; j < count; ++j) {
        target[j] = scores[j] != scores[j] ? -std::numeric_limits<T>::infinity() : scores[j];
      }
    }
  }

  // The selected keys in ascending index order (at most `width`; exactly `width` once all N keys were added).
  void Finish(std::vector<int64_t>* keys) {
    keys->clear();
    if (has_threshold_) {
      // Compacted before: select by the full order, then sort the keys.
      if (static_cast<int64_t>(candidates_.size()) > width_) KeepBest();
      for (const Candidate<T>& candidate : candidates_) keys->push_back(candidate.index);
      std::sort(keys->begin(), keys->end());
      return;
    }
    // Never compacted (every input of at most one key block): the scores are in key order, so one pass in that
    // order after finding the width-th highest score t yields the keys sorted. Every key above t is selected, and
    // of the keys at t the lowest indices (the tie rule).
    const T* scores = scores_in_key_order_.data();
    const int64_t count = static_cast<int64_t>(scores_in_key_order_.size());
    if (count <= width_) {
      for (int64_t j = 0; j < count; ++j) keys->push_back(j);
      return;
    }
    const T threshold = KthHighest(scores, count, width_);
    int64_t ties_to_take = width_;
    for (int64_t j = 0; j < count; ++j) ties_to_take -= scores[j] > threshold ? 1 : 0;
    for (int64_t j = 0; j < count; ++j) {
      if (scores[j] > threshold) {
        keys->push_back(j);
      } else if (scores[j] == threshold && ties_to_take > 0) {
        keys->push_back(j);
        --ties_to_take;
      }
    }
  }

  // Bytes its buffers hold.
  size_t CapacityBytes() const {
    return scores_in_key_order_.capacity() * sizeof(T) + candidates_.capacity() * sizeof(Candidate<T>);
  }

 private:
  // Appends a candidate field by field: a braced {score, index} was built on the stack and copied as one 16-byte
  // load, which waits for the two narrower stores (store forwarding fails; docs/kernels.md, "Third round").
  void Push(T score, int64_t index) {
    Candidate<T>& candidate = candidates_.emplace_back();
    candidate.score = score;
    candidate.index = index;
  }

  void KeepBest() {
    std::nth_element(candidates_.begin(), candidates_.begin() + (width_ - 1), candidates_.end(), RanksHigher<T>);
    candidates_.resize(width_);
    threshold_ = candidates_[width_ - 1].score;  // the k-th best so far: every kept key ranks at least as high
    has_threshold_ = true;
  }

  int64_t width_ = 1;
  std::vector<T> scores_in_key_order_;  // before the first compaction: every score so far, NaN as -infinity
  std::vector<Candidate<T>> candidates_;  // after it: the keys above the threshold
  bool has_threshold_ = false;
  T threshold_ = 0;
};

template <typename U>
size_t CapacityBytesOf(const std::vector<U>& buffer) {
  return buffer.capacity() * sizeof(U);
}

// Buffers of MitaHead, kept across the (item, head) pairs one thread runs, and across calls while small
// (ThreadWorkspace), so they are allocated (and their pages touched) once. Every field is (re)sized by MitaHead
// before use.
template <typename T>
struct HeadWorkspace {
  std::vector<TopKSelector<T>> selectors;         // [M]
  std::vector<T> block_scores;                    // [M, key_block]
  std::vector<T> shared_output;                   // A: [M, d]
  std::vector<T> running_max, running_sum;        // [M]
  std::vector<std::vector<int64_t>> expert_keys;  // [M][k], ascending
  std::vector<int32_t> selections;                // [N]: experts that selected each key
  std::vector<T> gate;                            // G = Q l^T of one query tile: [tile, M]
  std::vector<int64_t> expert_of_query;           // [N]
  std::vector<int64_t> expert_offsets;            // [M + 1], in the tile's query order
  std::vector<int64_t> next_slot;                 // [M]
  std::vector<int64_t> query_order;               // [tile], grouped by expert
  std::vector<T> expert_key_rows;                 // [M, k, d]: each expert's keys
  std::vector<T> expert_value_rows;               // [M, M + k, d]: A over each expert's values
  int64_t chunk_capacity = 0;                     // queries per chunk of RoutedExpertOutput
  std::vector<T> chunk_queries;                   // [chunk, d], times s
  std::vector<T> logits;                          // [chunk, M + k]
  std::vector<T> chunk_output;                    // [chunk, d]
  std::vector<T> inverse_sums;                    // [chunk]
  std::vector<T> dense_scores;                    // small inputs: [N, N], q K^T
  std::vector<T> dense_weights;                   // small inputs: [N, N], routed softmax weights
  std::vector<T> compressed_weights;              // small inputs: [N, M], shared-expert weights

  size_t CapacityBytes() const {
    size_t bytes = CapacityBytesOf(selectors) + CapacityBytesOf(expert_keys);
    for (const TopKSelector<T>& selector : selectors) bytes += selector.CapacityBytes();
    for (const std::vector<int64_t>& keys : expert_keys) bytes += CapacityBytesOf(keys);
    for (const auto* buffer : {&block_scores, &shared_output, &running_max, &running_sum, &gate, &expert_key_rows,
                               &expert_value_rows, &chunk_queries, &logits, &chunk_output, &inverse_sums,
                               &dense_scores, &dense_weights, &compressed_weights}) {
      bytes += CapacityBytesOf(*buffer);
    }
    for (const auto* buffer : {&expert_of_query, &expert_offsets, &next_slot, &query_order}) {
      bytes += CapacityBytesOf(*buffer);
    }
    return bytes + CapacityBytesOf(selections);
  }
};

// Most bytes a thread's workspace keeps between calls: the buffers of the budgets and lengths served most (an image
// model's heads, a document head at m = k = 64) outlive the call, those of a very large budget are freed with it.
constexpr size_t kKeptWorkspaceBytes = size_t{8} << 20;

// The calling thread's workspace: reused by its next call, so a call on a short input (a few hundred tokens) does not
// spend its time in malloc and in growing vectors (docs/kernels.md, "The MiTA kernel on short inputs").
template <typename T>
HeadWorkspace<T>& ThreadWorkspace() {
  thread_local HeadWorkspace<T> workspace;
  return workspace;
}

// Rows ahead that the query gather and the output scatter of step 4 prefetch: their rows are in expert order,
// scattered over the tile, so the hardware prefetcher cannot predict them.
constexpr int64_t kPrefetchRows = 8;

// Prefetches the cache lines of row[0, count) (for writing when `write`).
template <typename T>
inline void PrefetchRow(const T* row, int64_t count, bool write) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(T)); offset += 64) {
    if (write) {
      __builtin_prefetch(bytes + offset, 1);
    } else {
      __builtin_prefetch(bytes + offset, 0);
    }
  }
}

// Bytes of one query tile's query, gate and output rows (QueryTileRows): about half of one core's L2 here (2 MiB).
constexpr int64_t kQueryTileBytes = int64_t{1} << 20;
// Fewest queries per routed expert in a tile, on average, so that the per-expert GEMMs keep their size.
constexpr int64_t kTileQueriesPerExpert = 256;

// Queries per tile of steps 3-4: the rows a tile gathers and scatters at random (queries, gate, output) stay in
// the cache while it is worked on, so their cost per query does not grow with N (at N 64K a head's [N, d] rows do
// not fit; docs/kernels.md, "Third round").
int64_t QueryTileRows(int64_t tokens, int64_t head_dim, int64_t expert_count, int64_t element_bytes) {
  const int64_t cache_rows = kQueryTileBytes / ((2 * head_dim + expert_count) * element_bytes);
  return std::clamp<int64_t>(std::max(cache_rows, kTileQueriesPerExpert * expert_count), 1, tokens);
}

// Step 3 of MitaHead for the queries [tile_start, tile_start + tile_count): the gate G = Q l^T of the tile into
// work.gate ([tile_count, M], no scale), e(n) = first argmax into expert_of_query, and where each expert's
// queries of the tile start in the tile's query order (expert_offsets); adds the tile's queries per expert to
// the statistics.
template <typename T>
void GateTile(const HeadProblem<T>& problem, HeadWorkspace<T>& work, int64_t tile_start, int64_t tile_count,
              HeadCounts* counts) {
  const int64_t head_dim = problem.head_dim, expert_count = problem.expert_count;
  const int64_t query_block = BlockRows(expert_count * head_dim);
  work.gate.resize(tile_count * expert_count);
  for (int64_t start = 0; start < tile_count; start += query_block) {
    const int64_t count = std::min(query_block, tile_count - start);
    T* gate = work.gate.data() + start * expert_count;
    MatmulTransposed(problem.queries + (tile_start + start) * problem.query_stride, problem.query_stride,
                     problem.landmarks, head_dim, gate, expert_count, count, expert_count, head_dim);
    FirstArgmaxRows(gate, count, expert_count, work.expert_of_query.data() + tile_start + start);
  }
  work.expert_offsets.assign(expert_count + 1, 0);
  for (int64_t n = tile_start; n < tile_start + tile_count; ++n) ++work.expert_offsets[work.expert_of_query[n] + 1];
  for (int64_t i = 0; i < expert_count; ++i) {
    counts->queries_per_expert[i] += work.expert_offsets[i + 1];
    work.expert_offsets[i + 1] += work.expert_offsets[i];
  }
}

// Before the tiles of step 4 on the per-expert path: every expert's k keys gathered once ([M, k, d]) and its
// value rows stacked under the shared expert's output, [A; V_expert] ([M, M + k, d]; [M, k, d] without the
// shared expert), so that the output of a chunk is one GEMM with its logits row [compressed | routed]; none of
// this when width == tokens. And the chunk buffers sized.
template <typename T>
void PrepareRoutedExperts(const HeadProblem<T>& problem, HeadWorkspace<T>& work) {
  const int64_t head_dim = problem.head_dim, expert_count = problem.expert_count, width = problem.width;
  const int64_t logit_count = (problem.include_shared_expert ? expert_count : 0) + width;
  // Queries per chunk: GEMMs [chunk x k x d] and back ([chunk x d x M], [chunk x d x k]); logits buffer
  // [chunk, M + k].
  work.chunk_capacity = std::min(BlockRows(std::max(expert_count, width) * head_dim),
                                 std::max<int64_t>(1, kMaxLogitElements / logit_count));
  work.chunk_queries.resize(work.chunk_capacity * head_dim);
  work.logits.resize(work.chunk_capacity * logit_count);
  work.chunk_output.resize(work.chunk_capacity * head_dim);
  work.inverse_sums.resize(work.chunk_capacity);
  if (width == problem.tokens) return;
  const int64_t compressed_count = logit_count - width;
  work.expert_key_rows.resize(expert_count * width * head_dim);
  work.expert_value_rows.resize(expert_count * logit_count * head_dim);
  for (int64_t i = 0; i < expert_count; ++i) {
    T* value_rows = work.expert_value_rows.data() + i * logit_count * head_dim;
    std::copy_n(work.shared_output.data(), compressed_count * head_dim, value_rows);
    for (int64_t j = 0; j < width; ++j) {
      const int64_t key = work.expert_keys[i][j];
      std::copy_n(problem.keys + key * problem.key_stride, head_dim,
                  work.expert_key_rows.data() + (i * width + j) * head_dim);
      std::copy_n(problem.values + key * problem.value_stride, head_dim,
                  value_rows + (compressed_count + j) * head_dim);
    }
  }
}

// Step 4 of MitaHead, per routed expert, for one query tile (after GateTile of the same tile and
// PrepareRoutedExperts): the tile's queries grouped by expert, then each expert's queries in chunks.
template <typename T>
void RoutedExpertOutput(const HeadProblem<T>& problem, HeadWorkspace<T>& work, int64_t tile_start,
                        int64_t tile_count, PhaseClock& clock) {
  const int64_t head_dim = problem.head_dim, expert_count = problem.expert_count, width = problem.width;
  const T scale = T(1) / std::sqrt(static_cast<T>(head_dim));
  const bool shared = problem.include_shared_expert;
  const bool all_keys = width == problem.tokens;
  // The tile's queries grouped by expert (counting sort): those of expert i are query_order[expert_offsets[i],
  // expert_offsets[i + 1]), ascending.
  work.next_slot.assign(work.expert_offsets.begin(), work.expert_offsets.end() - 1);
  work.query_order.resize(tile_count);
  for (int64_t n = tile_start; n < tile_start + tile_count; ++n) {
    work.query_order[work.next_slot[work.expert_of_query[n]]++] = n;
  }
  // Queries are scaled by s when gathered: (s q) . k = q . k s (routed logits); the compressed logits are the
  // gate's q . l times s^2.
  const int64_t compressed_count = shared ? expert_count : 0;
  const int64_t logit_count = compressed_count + width;
  const int64_t chunk_capacity = work.chunk_capacity;
  clock.Charge(kPhaseGrouping);
  for (int64_t i = 0; i < expert_count; ++i) {
    const int64_t first = work.expert_offsets[i], query_count = work.expert_offsets[i + 1] - first;
    if (query_count == 0) continue;
    const T* key_rows = all_keys ? problem.keys : work.expert_key_rows.data() + i * width * head_dim;
    const int64_t key_rows_stride = all_keys ? problem.key_stride : head_dim;
    for (int64_t chunk_start = 0; chunk_start < query_count; chunk_start += chunk_capacity) {
      const int64_t count = std::min(chunk_capacity, query_count - chunk_start);
      const int64_t* chunk_order = work.query_order.data() + first + chunk_start;
      for (int64_t r = 0; r < count; ++r) {
        if (r + kPrefetchRows < count) {
          PrefetchRow(problem.queries + chunk_order[r + kPrefetchRows] * problem.query_stride, head_dim, false);
        }
        const T* query = problem.queries + chunk_order[r] * problem.query_stride;
        T* target = work.chunk_queries.data() + r * head_dim;
        for (int64_t c = 0; c < head_dim; ++c) target[c] = query[c] * scale;
      }
      // Logits row r: [compressed (M) | routed (k)].
      for (int64_t r = 0; shared && r < count; ++r) {
        const T* gate = work.gate.data() + (chunk_order[r] - tile_start) * expert_count;  // the tile's gate row
        T* target = work.logits.data() + r * logit_count;
        for (int64_t j = 0; j < expert_count; ++j) target[j] = gate[j] * (scale * scale);
      }
      MatmulTransposed(work.chunk_queries.data(), head_dim, key_rows, key_rows_stride,
                       work.logits.data() + compressed_count, logit_count, count, width, head_dim);
      clock.Charge(kPhaseRoutedLogits);
      // One softmax over the M + k logits, max-subtracted; normalised after the output GEMMs.
      UnnormalisedSoftmaxRows(work.logits.data(), count, logit_count, logit_count, work.inverse_sums.data());
      clock.Charge(kPhaseRoutedSoftmax);
      if (all_keys) {
        // weights x A, then + weights x V (every key: V read in place).
        if (shared) {
          MatmulAccumulate(work.logits.data(), logit_count, work.shared_output.data(), head_dim,
                           work.chunk_output.data(), head_dim, count, head_dim, expert_count, /*accumulate=*/false);
        }
        MatmulAccumulate(work.logits.data() + compressed_count, logit_count, problem.values, problem.value_stride,
                         work.chunk_output.data(), head_dim, count, head_dim, width, /*accumulate=*/shared);
      } else {
        // [compressed | routed] weights x [A; V_expert]: one GEMM, M + k deep.
        MatmulAccumulate(work.logits.data(), logit_count, work.expert_value_rows.data() + i * logit_count * head_dim,
                         head_dim, work.chunk_output.data(), head_dim, count, head_dim, logit_count,
                         /*accumulate=*/false);
      }
      for (int64_t r = 0; r < count; ++r) {
        if (r + kPrefetchRows < count) {
          PrefetchRow(problem.output + chunk_order[r + kPrefetchRows] * problem.output_stride, head_dim, true);
        }
        T* target = problem.output + chunk_order[r] * problem.output_stride;
        const T* source = work.chunk_output.data() + r * head_dim;
        for (int64_t c = 0; c < head_dim; ++c) target[c] = source[c] * work.inverse_sums[r];
      }
      clock.Charge(kPhaseRoutedOutput);
    }
  }
}

// Step 4 of MitaHead for small inputs (SmallInputPathApplies). Per expert, RoutedExpertOutput makes 4 BLAS calls
// of a few hundred multiply-adds each (at N = 50, M = 9: about 40 calls per head), whose call overhead outweighs
// the arithmetic. Here: S = q K^T for all N^2 pairs (one GEMM); each query's M + k logits are read from the gate G
// of step 3 (compressed: q . l s^2 = G s^2) and from S at its expert's keys (routed: q . k s); one
// max-subtracted softmax; then the output from two GEMMs with dense weight matrices, Wc [N, M] x A and
// W [N, N] x V, W zero outside each query's expert keys. The same logits and weights as RoutedExpertOutput, up to
// float rounding (docs/design.md section 2).
template <typename T>
void SmallInputOutput(const HeadProblem<T>& problem, HeadWorkspace<T>& work) {
  const int64_t tokens = problem.tokens, head_dim = problem.head_dim, expert_count = problem.expert_count;
  const int64_t width = problem.width;
  const T scale = T(1) / std::sqrt(static_cast<T>(head_dim));
  const bool all_keys = width == tokens;
  const int64_t logit_count = expert_count + width;
  work.dense_scores.resize(tokens * tokens);
  MatmulTransposed(problem.queries, problem.query_stride, problem.keys, problem.key_stride, work.dense_scores.data(),
                   tokens, tokens, tokens, head_dim);
  work.dense_weights.assign(tokens * tokens, T(0));
  work.compressed_weights.resize(tokens * expert_count);
  work.logits.resize(logit_count);
  T* row = work.logits.data();
  for (int64_t n = 0; n < tokens; ++n) {
    const T* gate = work.gate.data() + n * expert_count;
    const T* scores = work.dense_scores.data() + n * tokens;
    const int64_t* keys = all_keys ? nullptr : work.expert_keys[work.expert_of_query[n]].data();
    for (int64_t j = 0; j < expert_count; ++j) row[j] = gate[j] * (scale * scale);
    for (int64_t j = 0; j < width; ++j) row[expert_count + j] = scores[all_keys ? j : keys[j]] * scale;
    const T inverse_sum = T(1) / ExpAndSum(row, logit_count, T(1), MaxOf(row, logit_count));
    T* compressed = work.compressed_weights.data() + n * expert_count;
    for (int64_t j = 0; j < expert_count; ++j) compressed[j] = row[j] * inverse_sum;
    T* weights = work.dense_weights.data() + n * tokens;
    for (int64_t j = 0; j < width; ++j) weights[all_keys ? j : keys[j]] = row[expert_count + j] * inverse_sum;
  }
  MatmulAccumulate(work.compressed_weights.data(), expert_count, work.shared_output.data(), head_dim, problem.output,
                   problem.output_stride, tokens, head_dim, expert_count, /*accumulate=*/false);
  MatmulAccumulate(work.dense_weights.data(), tokens, problem.values, problem.value_stride, problem.output,
                   problem.output_stride, tokens, head_dim, tokens, /*accumulate=*/true);
}

template <typename T>
void MitaHead(const HeadProblem<T>& problem, HeadWorkspace<T>& work, HeadCounts* counts,
              MitaHeadRouting* routing, PhaseClock& clock) {
  const int64_t tokens = problem.tokens, head_dim = problem.head_dim, expert_count = problem.expert_count;
  const int64_t width = problem.width;
  const T scale = T(1) / std::sqrt(static_cast<T>(head_dim));
  const bool shared = problem.include_shared_expert;
  const bool all_keys = width == tokens;  // every expert owns every key: no selection, no gather

  // 1. Key pass: routed-expert top-k and the shared expert A = softmax(S s) v.
  // Keys per block: S_block [M, key_block] (d deep) and the A update (M x d, key_block deep).
  const int64_t key_block = BlockRows(expert_count * head_dim);
  if (!all_keys) {
    work.selectors.resize(expert_count);
    for (TopKSelector<T>& selector : work.selectors) selector.Reset(width);
  }
  if (shared) {
    work.shared_output.assign(expert_count * head_dim, T(0));
    work.running_max.assign(expert_count, -std::numeric_limits<T>::infinity());
    work.running_sum.assign(expert_count, T(0));
  }
  if (shared || !all_keys) {
    work.block_scores.resize(expert_count * key_block);
    clock.Charge(kPhaseSetup);
    for (int64_t start = 0; start < tokens; start += key_block) {
      const int64_t count = std::min(key_block, tokens - start);
      MatmulTransposed(problem.landmarks, head_dim, problem.keys + start * problem.key_stride, problem.key_stride,
                       work.block_scores.data(), key_block, expert_count, count, head_dim);
      clock.Charge(kPhaseLandmarkScores);
      if (!all_keys) {
        for (int64_t i = 0; i < expert_count; ++i) {
          work.selectors[i].Add(work.block_scores.data() + i * key_block, count, start);
        }
        clock.Charge(kPhaseTopKSelection);
      }
      for (int64_t i = 0; shared && i < expert_count; ++i) {
        // Online softmax of S[i, :] * s: rescale what was accumulated when the running max grows.
        T* row = work.block_scores.data() + i * key_block;
        const T old_max = work.running_max[i];
        const T new_max = std::max(old_max, MaxOf(row, count) * scale);  // s > 0: max(S s) = max(S) s
        const T factor = old_max == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(old_max - new_max);
        if (factor != T(1)) {
          for (int64_t c = 0; c < head_dim; ++c) work.shared_output[i * head_dim + c] *= factor;
        }
        work.running_sum[i] = work.running_sum[i] * factor + ExpAndSum(row, count, scale, new_max);
        work.running_max[i] = new_max;
      }
      if (shared) {
        MatmulAccumulate(work.block_scores.data(), key_block, problem.values + start * problem.value_stride,
                         problem.value_stride,
                         work.shared_output.data(), head_dim, expert_count, head_dim, count, /*accumulate=*/true);
        clock.Charge(kPhaseSharedExpert);
      }
    }
    for (int64_t i = 0; shared && i < expert_count; ++i) {
      const T inverse_sum = T(1) / work.running_sum[i];
      for (int64_t c = 0; c < head_dim; ++c) work.shared_output[i * head_dim + c] *= inverse_sum;
    }
    clock.Charge(kPhaseSharedExpert);
  }

  // 2. Each expert's keys, ascending; and how many experts selected each key (statistics).
  work.expert_keys.resize(expert_count);
  if (all_keys) {
    counts->pruned_keys = 0;
    counts->overlapping_keys = expert_count >= 2 ? tokens : 0;
  } else {
    work.selections.assign(tokens, 0);
    for (int64_t i = 0; i < expert_count; ++i) {
      work.selectors[i].Finish(&work.expert_keys[i]);
      for (int64_t key : work.expert_keys[i]) ++work.selections[key];
    }
    counts->pruned_keys = std::count(work.selections.begin(), work.selections.end(), 0);
    counts->overlapping_keys = std::count_if(work.selections.begin(), work.selections.end(),
                                             [](int32_t selected) { return selected >= 2; });
    clock.Charge(kPhaseTopKSelection);
  }

  // 3-4. Gate and output by query tiles (QueryTileRows; the whole N on the small-input path): per tile, the gate
  // G = Q l^T (no scale) and e(n) = first argmax over experts (GateTile), then the tile's output. The gate rows
  // give the compressed logits: q . l s^2 = G s^2.
  work.expert_of_query.resize(tokens);
  counts->queries_per_expert.assign(expert_count, 0);
  const bool small_input = problem.small_input_path && SmallInputPathApplies(tokens, head_dim, expert_count,
                                                                            width, problem.include_shared_expert);
  const int64_t tile_rows = small_input                     ? tokens
                            : problem.query_tile_rows > 0 ? problem.query_tile_rows
                                                          : QueryTileRows(tokens, head_dim, expert_count, sizeof(T));
  if (!small_input) {
    PrepareRoutedExperts(problem, work);
    clock.Charge(kPhaseGather);
  }
  for (int64_t tile_start = 0; tile_start < tokens; tile_start += tile_rows) {
    const int64_t tile_count = std::min(tile_rows, tokens - tile_start);
    GateTile(problem, work, tile_start, tile_count, counts);
    clock.Charge(kPhaseGate);
    if (small_input) {
      SmallInputOutput(problem, work);
      clock.Charge(kPhaseSmallInput);
    } else {
      RoutedExpertOutput(problem, work, tile_start, tile_count, clock);
    }
  }

  if (routing != nullptr) {
    routing->expert_of_query = work.expert_of_query;
    routing->expert_keys.assign(work.expert_keys.begin(), work.expert_keys.end());
    if (all_keys) {
      std::vector<int64_t> every_key(tokens);
      for (int64_t j = 0; j < tokens; ++j) every_key[j] = j;
      routing->expert_keys.assign(expert_count, every_key);
    }
  }
}

template <typename T>
at::Tensor MitaAttentionCpuTyped(const at::Tensor& q_input, const at::Tensor& k_input, const at::Tensor& v_input,
                                 absl::Span<const MitaItem> items, std::vector<MitaItemStatistics>* statistics,
                                 const MitaForwardOptions& options) {
  const at::Tensor q = WithContiguousRows(q_input), k = WithContiguousRows(k_input), v = WithContiguousRows(v_input);
  const int64_t batch = q.size(0), heads = q.size(1), tokens = q.size(2), head_dim = q.size(3);
  std::vector<at::Tensor> landmarks(batch);
  for (int64_t b = 0; b < batch; ++b) landmarks[b] = items[b].landmarks.contiguous();
  // The output is written heads-merged, [B, N, H, d], and returned as a [B, H, N, d] view: a model's head merge
  // ([B, N, H d]) is then a view, not a copy.
  at::Tensor output = at::empty({batch, tokens, heads, head_dim}, q.options());

  std::vector<HeadCounts> counts(batch * heads);
  if (options.routing != nullptr) options.routing->assign(batch * heads, MitaHeadRouting{});
  if (options.phase_seconds != nullptr) options.phase_seconds->assign(batch * heads, MitaPhaseSeconds{});
  if (options.gemm_totals != nullptr) options.gemm_totals->assign(batch * heads, MitaGemmTotals{});
  T* output_data = output.data_ptr<T>();
  const int64_t output_stride = heads * head_dim;  // between tokens of one head in the [B, N, H, d] output
  at::parallel_for(0, batch * heads, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
    HeadWorkspace<T>& workspace = ThreadWorkspace<T>();
    OneThreadBlas one_thread_blas;
    for (int64_t task = begin; task < end; ++task) {
      PhaseClock clock(options.phase_seconds != nullptr ? (*options.phase_seconds)[task].data() : nullptr);
      const int64_t b = task / heads, h = task % heads;
      const int64_t expert_count = landmarks[b].size(1);
      const int64_t item_tokens = ItemTokens(items[b], tokens);
      // Padding rows of a shorter item: zero output.
      T* head_output = output_data + b * tokens * output_stride + h * head_dim;
      for (int64_t n = item_tokens; n < tokens; ++n) std::fill_n(head_output + n * output_stride, head_dim, T(0));
      const HeadRows<T> queries = RowsOf<T>(q, b, h), keys = RowsOf<T>(k, b, h), values = RowsOf<T>(v, b, h);
      HeadProblem<T> problem{queries.data,
                             keys.data,
                             values.data,
                             landmarks[b].data_ptr<T>() + h * expert_count * head_dim,
                             head_output,
                             queries.stride,
                             keys.stride,
                             values.stride,
                             output_stride,
                             item_tokens,
                             head_dim,
                             expert_count,
                             items[b].expert_width,
                             options.include_shared_expert,
                             options.small_input_path,
                             options.query_tile_rows};
      clock.Charge(kPhaseSetup);
      const CountGemmsOfThread count_gemms(options.gemm_totals != nullptr ? &(*options.gemm_totals)[task] : nullptr);
      MitaHead(problem, workspace, &counts[task],
               options.routing != nullptr ? &(*options.routing)[task] : nullptr, clock);
    }
    if (workspace.CapacityBytes() > kKeptWorkspaceBytes) workspace = HeadWorkspace<T>();
  });

  if (statistics != nullptr) {
    statistics->resize(batch);
    for (int64_t b = 0; b < batch; ++b) {
      (*statistics)[b] =
          AverageOverHeads(absl::MakeConstSpan(counts).subspan(b * heads, heads), ItemTokens(items[b], tokens));
    }
  }
  return output.transpose(1, 2);
}

}  // namespace

const char* const kMitaPhaseNames[kPhaseCount] = {"setup",   "scores",     "top-k",   "shared",
                                                  "gate",    "grouping",   "gather",  "logits",
                                                  "softmax", "output",     "small"};

bool SmallInputPathApplies(int64_t tokens, int64_t head_dim, int64_t expert_count, int64_t expert_width,
                           bool include_shared_expert) {
  // The shared expert already carries any non-finite value of V to every output (through A), so the dense
  // product W V, which multiplies the zero weights of unselected keys too, adds no new way for one to spread.
  return include_shared_expert && tokens <= 2 * (expert_count + expert_width) &&
         tokens * tokens * head_dim <= kSingleThreadGemmVolume;
}

// Per-item statistics: each head's load, entropy, pruning and overlap, averaged over heads (docs/design.md
// section 2.8).
MitaItemStatistics AverageOverHeads(absl::Span<const HeadCounts> heads, int64_t tokens) {
  MitaItemStatistics statistics;
  const int64_t expert_count = static_cast<int64_t>(heads.front().queries_per_expert.size());
  const double head_count = static_cast<double>(heads.size());
  const double token_count = static_cast<double>(tokens);
  statistics.queries_per_expert.assign(expert_count, 0.0);
  for (const HeadCounts& head : heads) {
    int64_t max_load = 0;
    double entropy = 0;
    for (int64_t i = 0; i < expert_count; ++i) {
      const int64_t load = head.queries_per_expert[i];
      statistics.queries_per_expert[i] += static_cast<double>(load) / head_count;
      max_load = std::max(max_load, load);
      if (load > 0) {
        const double share = static_cast<double>(load) / token_count;
        entropy -= share * std::log(share);
      }
    }
    // max / mean, with mean = N / M.
    statistics.load_imbalance += static_cast<double>(max_load) * static_cast<double>(expert_count) / token_count;
    statistics.routing_entropy += expert_count == 1 ? 1.0 : entropy / std::log(static_cast<double>(expert_count));
    statistics.pruned_key_fraction += static_cast<double>(head.pruned_keys) / token_count;
    statistics.expert_overlap_fraction += static_cast<double>(head.overlapping_keys) / token_count;
  }
  statistics.load_imbalance /= head_count;
  statistics.routing_entropy /= head_count;
  statistics.pruned_key_fraction /= head_count;
  statistics.expert_overlap_fraction /= head_count;
  return statistics;
}

at::Tensor MitaAttentionCpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            absl::Span<const MitaItem> items, std::vector<MitaItemStatistics>* statistics,
                            const MitaForwardOptions& options) {
  if (q.scalar_type() == at::kDouble) return MitaAttentionCpuTyped<double>(q, k, v, items, statistics, options);
  if (q.scalar_type() == at::kBFloat16) {
    // bfloat16 models: the kernel computes in float32 on widened copies and rounds its output once.
    std::vector<MitaItem> widened(items.begin(), items.end());
    for (MitaItem& item : widened) item.landmarks = item.landmarks.to(at::kFloat);
    return MitaAttentionCpuTyped<float>(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), widened, statistics,
                                        options)
        .to(at::kBFloat16);
  }
  return MitaAttentionCpuTyped<float>(q, k, v, items, statistics, options);
}

}  // namespace mita::kernels::internal
