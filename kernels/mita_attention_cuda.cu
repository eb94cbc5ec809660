// CUDA MiTA forward (docs/design.md section 2; arXiv 2602.01219). Interface and semantics: mita_attention_cuda.h.
// No torch headers: raw device pointers only.
//
// Per batch item (items differ in M and k), all heads at once, seven kernels on one stream:
//   1. ScoresKernel       S = l k^T, float32 [H, M, N] in scratch memory; each thread owns one key and a group
//                         of landmarks (kept in shared memory), so each key row is read once per group.
//   2. TopKKernel         one block per (head, landmark): exact top-k by an 8-pass radix select over 64-bit
//                         keys (ordered score bits << 32 | (2^32 - 1 - key index)), which are all distinct and
//                         order "higher score first, then lower key index"; the k keys at or above the k-th
//                         largest are written in ascending key order by an ordered block compaction.
//   3. Shared expert A_i = softmax(S[i, :] s) v in three kernels: RowMaxKernel (row maxima of S),
//                         SharedPartialKernel (8 landmarks x one chunk of keys per block: weights once per
//                         (landmark, key) in shared memory, each value row read once for the 8), and
//                         SharedFinishKernel (partials summed over chunks in a fixed order, then divided).
//   4. QueryKernel        one warp per query: the gate l_i . q_n for 32 landmarks at a time (each a coalesced row
//                         read and a warp reduction) gives both e(n) (first maximum) and the compressed logits
//                         (times s^2), merged into an online softmax with values A_i; then expert e(n)'s keys,
//                         32 at a time, with values v_j; one running max and sum over all M + k logits (the
//                         same single softmax). Until 2026-11-30 each lane read its own row (32 rows per
//                         load): 28 ms at N = 64K, H 8, d 64, m = k = 64 on an H200 (docs/kernels.md).
//   5. CountKernel        statistics only: keys selected by no expert / by two or more.
// Simple and exact rather than tuned: no tensor cores, no grouping of queries by expert (gathered rows come
// from L2). docs/kernels.md says what has been measured on hardware.
#include "kernels/mita_attention_cuda.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace mita::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kChannelsPerLane = static_cast<int>(kMaxCudaHeadDim / kWarp);  // register tile of one query's output
constexpr int kLandmarkGroup = 32;     // landmarks per ScoresKernel thread (each key row read once per group)
constexpr int kScoreThreads = 128;
constexpr int kRowThreads = 256;       // TopKKernel, RowMaxKernel, SharedPartialKernel, CountKernel
constexpr int kQueriesPerBlock = 4;    // QueryKernel: warps per block
constexpr int kSharedGroup = 8;        // landmarks per SharedPartialKernel block
constexpr int64_t kMaxSharedChunks = 64;  // SharedPartialKernel: N is split into at most this many chunks

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void Store(float* target, float x) { *target = x; }
__device__ __forceinline__ void Store(__nv_bfloat16* target, float x) { *target = __float2bfloat16(x); }

// Element offsets of (item, head) and of a token, from [item, head, token] strides.
struct Strides {
  int64_t item, head, token;
};

// 1. S[h, i, j] = l_i . k_j (no scale). grid (ceil(N / kScoreThreads), ceil(M / kLandmarkGroup), H).
template <typename T>
__global__ void ScoresKernel(const T* __restrict__ keys, Strides key_strides, const T* __restrict__ landmarks,
                             float* __restrict__ scores, int64_t tokens, int64_t expert_count, int64_t head_dim) {
  extern __shared__ float group_landmarks[];  // [kLandmarkGroup, d]
  const int64_t head = blockIdx.z;
  const int64_t first_landmark = static_cast<int64_t>(blockIdx.y) * kLandmarkGroup;
  const int64_t group = min(static_cast<int64_t>(kLandmarkGroup), expert_count - first_landmark);
  const T* head_landmarks = landmarks + (head * expert_count + first_landmark) * head_dim;
  for (int64_t e = threadIdx.x; e < group * head_dim; e += blockDim.x) group_landmarks[e] = ToFloat(head_landmarks[e]);
  __syncthreads();
  const int64_t key = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (key >= tokens) return;
  const T* row = keys + head * key_strides.head + key * key_strides.token;
  float sums[kLandmarkGroup] = {};
  for (int64_t c = 0; c < head_dim; ++c) {
    const float value = ToFloat(row[c]);
#pragma unroll
    for (int g = 0; g < kLandmarkGroup; ++g) {
      if (g < group) sums[g] = fmaf(group_landmarks[g * head_dim + c], value, sums[g]);
    }
  }
  float* head_scores = scores + (head * expert_count + first_landmark) * tokens;
#pragma unroll
  for (int g = 0; g < kLandmarkGroup; ++g) {
    if (g < group) head_scores[g * tokens + key] = sums[g];
  }
}

// Order-preserving map of a float to uint32 (larger float -> larger integer); NaN maps to 0, below -inf.
__device__ __forceinline__ uint32_t OrderedBits(float score) {
  if (isnan(score)) return 0u;
  const uint32_t bits = __float_as_uint(score);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The distinct 64-bit rank key of (score, index): larger key = higher score, then lower index.
__device__ __forceinline__ uint64_t RankKey(float score, int64_t index) {
  return (static_cast<uint64_t>(OrderedBits(score)) << 32) | (0xFFFFFFFFull - static_cast<uint64_t>(index));
}

// 2. Top-k of each row S[h, i, :]. grid (M, H), block kRowThreads. expert_keys: [H, M, k], ascending.
// selections: [H, N] counts of experts that selected each key (statistics; may be null).
__global__ void TopKKernel(const float* __restrict__ scores, int32_t* __restrict__ expert_keys,
                           int32_t* __restrict__ selections, int64_t tokens, int64_t expert_count, int64_t width) {
  __shared__ unsigned int histogram[256];
  __shared__ uint64_t prefix_shared;
  __shared__ int64_t remaining_shared;
  __shared__ int64_t segment_counts[kRowThreads];
  const int64_t head = blockIdx.y, landmark = blockIdx.x;
  const float* row = scores + (head * expert_count + landmark) * tokens;
  int32_t* keys_out = expert_keys + (head * expert_count + landmark) * width;

  uint64_t prefix = 0, mask = 0;
  int64_t remaining = width;  // rank of the wanted key among those matching the prefix (1 = largest)
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) histogram[b] = 0;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < tokens; j += blockDim.x) {
      const uint64_t key = RankKey(row[j], j);
      if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xFF], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t left = remaining;
      int bucket = 255;
      for (; bucket > 0; --bucket) {
        if (static_cast<int64_t>(histogram[bucket]) >= left) break;
        left -= histogram[bucket];
      }
      prefix_shared = prefix | (static_cast<uint64_t>(bucket) << shift);
      remaining_shared = left;
    }
    __syncthreads();
    prefix = prefix_shared;
    remaining = remaining_shared;
    mask |= 0xFFull << shift;
    __syncthreads();
  }
  const uint64_t threshold = prefix;  // the k-th largest rank key: exactly k keys are >= it

  // Ordered compaction: thread t owns keys [t * segment, (t + 1) * segment).
  const int64_t segment = (tokens + blockDim.x - 1) / blockDim.x;
  const int64_t begin = min(tokens, threadIdx.x * segment), end = min(tokens, begin + segment);
  int64_t count = 0;
  for (int64_t j = begin; j < end; ++j) count += RankKey(row[j], j) >= threshold ? 1 : 0;
  segment_counts[threadIdx.x] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t running = 0;
    for (int t = 0; t < static_cast<int>(blockDim.x); ++t) {
      const int64_t here = segment_counts[t];
      segment_counts[t] = running;
      running += here;
    }
  }
  __syncthreads();
  int64_t slot = segment_counts[threadIdx.x];
  for (int64_t j = begin; j < end; ++j) {
    if (RankKey(row[j], j) >= threshold) {
      if (slot < width) keys_out[slot] = static_cast<int32_t>(j);
      ++slot;
      if (selections != nullptr) atomicAdd(&selections[head * tokens + j], 1);
    }
  }
}

// 3. A[h, i, :] = softmax(S[h, i, :] s) v, in three steps so that each value row is read once per group of
// kSharedGroup landmarks and N is split over blocks (deterministic: partial sums are combined in a fixed order).
// 3a. RowMaxKernel: maxima[h, i] = max_j S[h, i, j]. grid (M, H), block kRowThreads.
__global__ void RowMaxKernel(const float* __restrict__ scores, float* __restrict__ maxima, int64_t tokens,
                             int64_t expert_count) {
  __shared__ float reduce[kRowThreads];
  const int64_t head = blockIdx.y, landmark = blockIdx.x;
  const float* row = scores + (head * expert_count + landmark) * tokens;
  float local_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < tokens; j += blockDim.x) local_max = fmaxf(local_max, row[j]);
  reduce[threadIdx.x] = local_max;
  __syncthreads();
  for (int width = blockDim.x / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) reduce[threadIdx.x] = fmaxf(reduce[threadIdx.x], reduce[threadIdx.x + width]);
    __syncthreads();
  }
  if (threadIdx.x == 0) maxima[head * expert_count + landmark] = reduce[0];
}

// 3b. SharedPartialKernel: for landmarks i0 .. i0 + kSharedGroup - 1 and the keys of one chunk,
// partial[chunk, h, i, :] = sum_j w_ij v_j and partial_sums[chunk, h, i] = sum_j w_ij with
// w_ij = exp(S_ij s - max_i s). grid (ceil(M / kSharedGroup), H, chunks), block kRowThreads; keys in tiles of
// kRowThreads: each thread computes the weights of one key for the whole group (shared memory), then thread
// (stripe, channel) accumulates value rows of its stripe for every landmark of the group.
template <typename T>
__global__ void SharedPartialKernel(const float* __restrict__ scores, const float* __restrict__ maxima,
                                    const T* __restrict__ values, Strides value_strides,
                                    float* __restrict__ partial, float* __restrict__ partial_sums, int64_t tokens,
                                    int64_t expert_count, int64_t head_dim, int64_t chunk_tokens, float scale) {
  __shared__ float weights[kSharedGroup][kRowThreads];
  extern __shared__ float stripe_totals[];  // [stripes, kSharedGroup, d], then [kSharedGroup, kRowThreads] sums
  const int64_t head = blockIdx.y, chunk = blockIdx.z;
  const int64_t first_landmark = static_cast<int64_t>(blockIdx.x) * kSharedGroup;
  const int group = static_cast<int>(min(static_cast<int64_t>(kSharedGroup), expert_count - first_landmark));
  const int64_t begin = chunk * chunk_tokens, end = min(tokens, begin + chunk_tokens);
  const int stripes = static_cast<int>(blockDim.x / head_dim);
  const int stripe = static_cast<int>(threadIdx.x / head_dim), channel = static_cast<int>(threadIdx.x % head_dim);
  const float* head_scores = scores + (head * expert_count + first_landmark) * tokens;
  const T* head_values = values + head * value_strides.head;
  float shifted_max[kSharedGroup];
#pragma unroll
  for (int g = 0; g < kSharedGroup; ++g) {
    shifted_max[g] = g < group ? maxima[head * expert_count + first_landmark + g] * scale : 0.0f;
  }
  float accumulators[kSharedGroup] = {};
  float sums[kSharedGroup] = {};
  for (int64_t tile = begin; tile < end; tile += blockDim.x) {
    const int64_t key = tile + threadIdx.x;
#pragma unroll
    for (int g = 0; g < kSharedGroup; ++g) {
      const float weight = (g < group && key < end) ? expf(head_scores[g * tokens + key] * scale - shifted_max[g]) : 0.0f;
      weights[g][threadIdx.x] = weight;
      sums[g] += weight;
    }
    __syncthreads();
    if (stripe < stripes) {
      const int64_t tile_keys = min(static_cast<int64_t>(blockDim.x), end - tile);
      for (int64_t t = stripe; t < tile_keys; t += stripes) {
        const float value = ToFloat(head_values[(tile + t) * value_strides.token + channel]);
#pragma unroll
        for (int g = 0; g < kSharedGroup; ++g) accumulators[g] = fmaf(weights[g][t], value, accumulators[g]);
      }
    }
    __syncthreads();
  }
  float* sum_slots = stripe_totals + stripes * kSharedGroup * head_dim;  // [kSharedGroup, blockDim.x]
  if (stripe < stripes) {
#pragma unroll
    for (int g = 0; g < kSharedGroup; ++g) stripe_totals[(stripe * kSharedGroup + g) * head_dim + channel] = accumulators[g];
  }
#pragma unroll
  for (int g = 0; g < kSharedGroup; ++g) sum_slots[g * blockDim.x + threadIdx.x] = sums[g];
  __syncthreads();
  const int64_t slot = (chunk * gridDim.y + head) * expert_count + first_landmark;  // [chunk, h, i]
  for (int64_t e = threadIdx.x; e < static_cast<int64_t>(group) * head_dim; e += blockDim.x) {
    const int64_t g = e / head_dim, c = e % head_dim;
    float total = 0;
    for (int s = 0; s < stripes; ++s) total += stripe_totals[(s * kSharedGroup + g) * head_dim + c];
    partial[(slot + g) * head_dim + c] = total;
  }
  if (threadIdx.x < group) {
    float total = 0;
    for (int t = 0; t < static_cast<int>(blockDim.x); ++t) total += sum_slots[threadIdx.x * blockDim.x + t];
    partial_sums[slot + threadIdx.x] = total;
  }
}

// 3c. SharedFinishKernel: A[h, i, :] = sum over chunks of partial / sum over chunks of partial_sums, chunks in
// increasing order. grid (M, H), block d threads.
__global__ void SharedFinishKernel(const float* __restrict__ partial, const float* __restrict__ partial_sums,
                                   float* __restrict__ shared_output, int64_t expert_count, int64_t head_dim,
                                   int64_t chunks) {
  const int64_t head = blockIdx.y, landmark = blockIdx.x, heads = gridDim.y;
  const int64_t channel = threadIdx.x;
  float total = 0, total_sum = 0;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t slot = (chunk * heads + head) * expert_count + landmark;
    total += partial[slot * head_dim + channel];
    total_sum += partial_sums[slot];
  }
  shared_output[(head * expert_count + landmark) * head_dim + channel] = total / total_sum;
}

// Running softmax state of one query (every lane holds the same max and sum, and its own output channels).
struct OnlineSoftmax {
  float maximum = -INFINITY;
  float sum = 0;
  float output[kChannelsPerLane] = {0, 0, 0, 0, 0, 0, 0, 0};
};

__device__ __forceinline__ float WarpMax(float value) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
  }
  return value;
}

__device__ __forceinline__ float WarpSum(float value) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
  return value;
}

// Adds one tile of up to 32 logits (lane l holds logit l; `present` false for lanes without an entry) to the
// state. row_of(l) returns the value row (float or T elements) of lane l's entry; every lane calls it with the
// same l (it may shuffle), and only for present entries.
template <typename RowOf>
__device__ __forceinline__ void AddTile(OnlineSoftmax& state, float logit, bool present, int64_t head_dim,
                                        RowOf row_of) {
  const int lane = threadIdx.x % kWarp;
  const float tile_max = WarpMax(present ? logit : -INFINITY);
  if (tile_max == -INFINITY) return;  // uniform: no entry, or all logits -inf, contributes nothing
  const float new_max = fmaxf(state.maximum, tile_max);
  const float factor = state.maximum == -INFINITY ? 0.0f : expf(state.maximum - new_max);
  const float weight = present ? expf(logit - new_max) : 0.0f;
  state.sum = state.sum * factor + WarpSum(weight);
  state.maximum = new_max;
#pragma unroll
  for (int r = 0; r < kChannelsPerLane; ++r) state.output[r] *= factor;
  const unsigned present_lanes = __ballot_sync(0xFFFFFFFFu, present);
  for (int source = 0; source < kWarp; ++source) {
    if (((present_lanes >> source) & 1u) == 0) continue;  // uniform across the warp
    const float source_weight = __shfl_sync(0xFFFFFFFFu, weight, source);
    const auto* row = row_of(source);
#pragma unroll
    for (int r = 0; r < kChannelsPerLane; ++r) {
      const int64_t channel = lane + r * kWarp;
      if (channel < head_dim) state.output[r] = fmaf(source_weight, ToFloat(row[channel]), state.output[r]);
    }
  }
}

// Dot product of `row` (d elements) with the query held across the warp (lane l owns channels l + 32 r), read
// coalesced (32 consecutive elements per load); every lane gets the full sum (butterfly reduction).
template <typename T>
__device__ __forceinline__ float WarpDot(const T* row, const float (&query_part)[kChannelsPerLane],
                                         int64_t head_dim) {
  const int lane = threadIdx.x % kWarp;
  float partial = 0;
#pragma unroll
  for (int r = 0; r < kChannelsPerLane; ++r) {
    const int64_t channel = lane + r * kWarp;
    if (channel < head_dim) partial = fmaf(ToFloat(row[channel]), query_part[r], partial);
  }
  return WarpSum(partial);
}

// 4. One warp per query. grid (ceil(N / kQueriesPerBlock), H), block kQueriesPerBlock * 32. Every dot product
// (gate, routed logits) is one coalesced row read plus a warp reduction; lane e then keeps entry e of the tile.
template <typename T>
__global__ void QueryKernel(const T* __restrict__ queries, Strides query_strides, const T* __restrict__ keys,
                            Strides key_strides, const T* __restrict__ values, Strides value_strides,
                            const T* __restrict__ landmarks, const float* __restrict__ shared_output,
                            const int32_t* __restrict__ expert_keys, T* __restrict__ output,
                            int32_t* __restrict__ load, int64_t tokens, int64_t output_tokens,
                            int64_t expert_count, int64_t width, int64_t head_dim, float scale) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t head = blockIdx.y;
  const int64_t query = static_cast<int64_t>(blockIdx.x) * kQueriesPerBlock + warp;
  if (query >= tokens) return;  // whole warp leaves together
  const T* source = queries + head * query_strides.head + query * query_strides.token;
  float query_part[kChannelsPerLane];
#pragma unroll
  for (int r = 0; r < kChannelsPerLane; ++r) {
    const int64_t channel = lane + r * kWarp;
    query_part[r] = channel < head_dim ? ToFloat(source[channel]) : 0.0f;
  }

  const T* head_landmarks = landmarks + head * expert_count * head_dim;
  const float* head_shared = shared_output + head * expert_count * head_dim;
  const float compressed_scale = scale * scale;
  OnlineSoftmax state;
  float best_gate = -INFINITY;
  int64_t best_expert = -1;
  // Gate and compressed logits: lane e holds landmark first + e.
  for (int64_t first = 0; first < expert_count; first += kWarp) {
    const int64_t count = min(static_cast<int64_t>(kWarp), expert_count - first);
    float gate = 0;
    for (int64_t e = 0; e < count; ++e) {
      const float dot = WarpDot(head_landmarks + (first + e) * head_dim, query_part, head_dim);
      if (lane == e) gate = dot;
    }
    const bool present = lane < count;
    const int64_t landmark = first + lane;
    // First maximum: this lane sees its landmarks in increasing order, so only a strictly larger gate wins.
    if (present && (best_expert < 0 || gate > best_gate)) {
      best_gate = gate;
      best_expert = landmark;
    }
    AddTile(state, gate * compressed_scale, present, head_dim,
            [&](int entry) { return head_shared + (first + entry) * head_dim; });
  }
  // Warp argmax: larger gate, then lower landmark index (lanes without a landmark have index -1: they lose).
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const float other_gate = __shfl_xor_sync(0xFFFFFFFFu, best_gate, offset);
    const int64_t other_expert = __shfl_xor_sync(0xFFFFFFFFu, best_expert, offset);
    const bool other_wins = other_expert >= 0 &&
                            (best_expert < 0 || other_gate > best_gate ||
                             (!(other_gate < best_gate) && !(other_gate > best_gate) && other_expert < best_expert));
    if (other_wins) {
      best_gate = other_gate;
      best_expert = other_expert;
    }
  }
  const int64_t expert = best_expert;
  if (load != nullptr && lane == 0) atomicAdd(&load[head * expert_count + expert], 1);

  // Routed logits over expert e(n)'s keys, 32 at a time (lane e holds key first + e).
  const int32_t* expert_key_list = expert_keys + (head * expert_count + expert) * width;
  const T* head_keys = keys + head * key_strides.head;
  const T* head_values = values + head * value_strides.head;
  for (int64_t first = 0; first < width; first += kWarp) {
    const int64_t count = min(static_cast<int64_t>(kWarp), width - first);
    const bool present = lane < count;
    const int64_t key = present ? expert_key_list[first + lane] : 0;
    float logit = 0;
    for (int64_t e = 0; e < count; ++e) {
      const int64_t entry_key = __shfl_sync(0xFFFFFFFFu, key, static_cast<int>(e));
      const float dot = WarpDot(head_keys + entry_key * key_strides.token, query_part, head_dim);
      if (lane == e) logit = dot * scale;
    }
    AddTile(state, logit, present, head_dim, [&](int entry) {
      const int64_t entry_key = __shfl_sync(0xFFFFFFFFu, key, entry);
      return head_values + entry_key * value_strides.token;
    });
  }

  T* target = output + (head * output_tokens + query) * head_dim;
  const float inverse_sum = 1.0f / state.sum;
#pragma unroll
  for (int r = 0; r < kChannelsPerLane; ++r) {
    const int64_t channel = lane + r * kWarp;
    if (channel < head_dim) Store(&target[channel], state.output[r] * inverse_sum);
  }
}

// 5. counts[h] = {keys selected by no expert, keys selected by two or more}. grid H, block kRowThreads.
__global__ void CountKernel(const int32_t* __restrict__ selections, unsigned long long* __restrict__ counts,
                            int64_t tokens) {
  const int64_t head = blockIdx.x;
  unsigned long long pruned = 0, overlapping = 0;
  for (int64_t j = threadIdx.x; j < tokens; j += blockDim.x) {
    const int32_t selected = selections[head * tokens + j];
    pruned += selected == 0 ? 1 : 0;
    overlapping += selected >= 2 ? 1 : 0;
  }
  atomicAdd(&counts[2 * head], pruned);
  atomicAdd(&counts[2 * head + 1], overlapping);
}

std::string CudaError(cudaError_t error, const char* what) {
  return std::string(what) + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")";
}

// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  DeviceGuard() { has_previous_ = cudaGetDevice(&previous_) == cudaSuccess; }
  ~DeviceGuard() {
    if (has_previous_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool has_previous_ = false;
};

// Keys per SharedPartialKernel chunk: a multiple of kRowThreads giving at most kMaxSharedChunks chunks (so small
// N still uses several chunks, which the correctness check covers).
int64_t SharedChunkTokens(int64_t tokens) {
  const int64_t per_chunk_tiles = (tokens + kRowThreads * kMaxSharedChunks - 1) / (kRowThreads * kMaxSharedChunks);
  return std::max<int64_t>(1, per_chunk_tiles) * kRowThreads;
}

// The scratch layout of one call: scores [H, M_max, N] f32 | shared output [H, M_max, d] f32 | expert keys
// [H, M_max, k_max] i32 | selections [H, N] i32 | loads [H, M_b] i32 per item b, back to back | counts [B, H, 2]
// u64 | row maxima [H, M_max] f32 | shared-expert partials [chunks, H, M_max, d] f32 and their sums [chunks, H,
// M_max] f32. Selections are reused item after item (stream order); loads and counts stay until one copy to
// the host at the end of the call.
struct Layout {
  size_t scores = 0, shared = 0, keys = 0, selections = 0, loads = 0, counts = 0, maxima = 0, partial = 0,
         partial_sums = 0;
  static size_t Aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }
  size_t Total() const {
    return Aligned(scores) + Aligned(shared) + Aligned(keys) + Aligned(selections) + Aligned(loads) +
           Aligned(counts) + Aligned(maxima) + Aligned(partial) + Aligned(partial_sums);
  }
};

Layout LayoutOf(const CudaMitaProblem& problem) {
  const int64_t heads = problem.heads, max_tokens = problem.tokens, head_dim = problem.head_dim;
  const bool want_counts = problem.head_counts != nullptr;
  int64_t max_experts = 0, max_width = 0, all_experts = 0;
  for (int64_t b = 0; b < problem.batch; ++b) {
    max_experts = std::max(max_experts, problem.items[b].expert_count);
    max_width = std::max(max_width, problem.items[b].expert_width);
    all_experts += problem.items[b].expert_count;
  }
  // Every item's chunk count is at most min(kMaxSharedChunks, ceil(N / kRowThreads)) (SharedChunkTokens).
  const int64_t max_chunks = std::min<int64_t>(kMaxSharedChunks, (max_tokens + kRowThreads - 1) / kRowThreads);
  Layout layout;
  layout.scores = sizeof(float) * heads * max_experts * max_tokens;
  layout.shared = sizeof(float) * heads * max_experts * head_dim;
  layout.keys = sizeof(int32_t) * heads * max_experts * max_width;
  layout.selections = want_counts ? sizeof(int32_t) * heads * max_tokens : 0;
  layout.loads = want_counts ? sizeof(int32_t) * heads * all_experts : 0;
  layout.counts = want_counts ? sizeof(unsigned long long) * problem.batch * heads * 2 : 0;
  layout.maxima = sizeof(float) * heads * max_experts;
  layout.partial = sizeof(float) * max_chunks * heads * max_experts * head_dim;
  layout.partial_sums = sizeof(float) * max_chunks * heads * max_experts;
  return layout;
}

template <typename T>
std::string Run(const CudaMitaProblem& problem, cudaStream_t stream) {
  const int64_t heads = problem.heads, head_dim = problem.head_dim;
  const bool want_counts = problem.head_counts != nullptr;
  const Layout layout = LayoutOf(problem);
  const size_t total = layout.Total();
  void* scratch = problem.workspace;
  const bool own_scratch = scratch == nullptr;
  if (own_scratch) {
    if (cudaError_t error = cudaMallocAsync(&scratch, total, stream); error != cudaSuccess) {
      return CudaError(error, "cudaMallocAsync of the MiTA scratch memory");
    }
  }
  char* cursor = static_cast<char*>(scratch);
  auto take = [&](size_t bytes) {
    char* here = cursor;
    cursor += Layout::Aligned(bytes);
    return here;
  };
  float* scores = reinterpret_cast<float*>(take(layout.scores));
  float* shared_output = reinterpret_cast<float*>(take(layout.shared));
  int32_t* expert_keys = reinterpret_cast<int32_t*>(take(layout.keys));
  int32_t* selections = want_counts ? reinterpret_cast<int32_t*>(take(layout.selections)) : nullptr;
  int32_t* loads = want_counts ? reinterpret_cast<int32_t*>(take(layout.loads)) : nullptr;
  auto* counts = want_counts ? reinterpret_cast<unsigned long long*>(take(layout.counts)) : nullptr;
  float* maxima = reinterpret_cast<float*>(take(layout.maxima));
  float* partial = reinterpret_cast<float*>(take(layout.partial));
  float* partial_sums = reinterpret_cast<float*>(take(layout.partial_sums));
  if (want_counts) {
    cudaMemsetAsync(loads, 0, layout.loads, stream);
    cudaMemsetAsync(counts, 0, layout.counts, stream);
  }

  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const Strides q_strides{problem.q_strides[0], problem.q_strides[1], problem.q_strides[2]};
  const Strides k_strides{problem.k_strides[0], problem.k_strides[1], problem.k_strides[2]};
  const Strides v_strides{problem.v_strides[0], problem.v_strides[1], problem.v_strides[2]};
  std::string failure;
  int64_t load_offset = 0;  // this item's loads start at loads + load_offset
  for (int64_t b = 0; b < problem.batch && failure.empty(); ++b) {
    const CudaMitaItem& item = problem.items[b];
    const int64_t experts = item.expert_count, width = item.expert_width;
    const int64_t tokens = item.token_count == 0 ? problem.tokens : item.token_count;  // this item's N
    const T* q = static_cast<const T*>(problem.q) + b * q_strides.item;
    const T* k = static_cast<const T*>(problem.k) + b * k_strides.item;
    const T* v = static_cast<const T*>(problem.v) + b * v_strides.item;
    const T* landmarks = static_cast<const T*>(item.landmarks);
    T* output = static_cast<T*>(problem.output) + b * heads * problem.tokens * head_dim;
    int32_t* load = want_counts ? loads + load_offset : nullptr;
    load_offset += heads * experts;
    if (tokens < problem.tokens) cudaMemsetAsync(output, 0, sizeof(T) * heads * problem.tokens * head_dim, stream);
    if (want_counts) cudaMemsetAsync(selections, 0, layout.selections, stream);
    const dim3 score_grid(static_cast<unsigned>((tokens + kScoreThreads - 1) / kScoreThreads),
                          static_cast<unsigned>((experts + kLandmarkGroup - 1) / kLandmarkGroup),
                          static_cast<unsigned>(heads));
    ScoresKernel<T><<<score_grid, kScoreThreads, sizeof(float) * kLandmarkGroup * head_dim, stream>>>(
        k, k_strides, landmarks, scores, tokens, experts, head_dim);
    const dim3 row_grid(static_cast<unsigned>(experts), static_cast<unsigned>(heads));
    TopKKernel<<<row_grid, kRowThreads, 0, stream>>>(scores, expert_keys, selections, tokens, experts, width);
    RowMaxKernel<<<row_grid, kRowThreads, 0, stream>>>(scores, maxima, tokens, experts);
    const int64_t chunk_tokens = SharedChunkTokens(tokens), chunks = (tokens + chunk_tokens - 1) / chunk_tokens;
    const int64_t stripes = kRowThreads / head_dim;
    const dim3 partial_grid(static_cast<unsigned>((experts + kSharedGroup - 1) / kSharedGroup),
                            static_cast<unsigned>(heads), static_cast<unsigned>(chunks));
    SharedPartialKernel<T><<<partial_grid, kRowThreads,
                             sizeof(float) * (stripes * kSharedGroup * head_dim + kSharedGroup * kRowThreads),
                             stream>>>(scores, maxima, v, v_strides, partial, partial_sums, tokens, experts,
                                       head_dim, chunk_tokens, scale);
    SharedFinishKernel<<<row_grid, static_cast<unsigned>(head_dim), 0, stream>>>(partial, partial_sums,
                                                                                shared_output, experts, head_dim,
                                                                                chunks);
    const dim3 query_grid(static_cast<unsigned>((tokens + kQueriesPerBlock - 1) / kQueriesPerBlock),
                          static_cast<unsigned>(heads));
    QueryKernel<T><<<query_grid, kQueriesPerBlock * kWarp, 0, stream>>>(
        q, q_strides, k, k_strides, v, v_strides, landmarks, shared_output, expert_keys, output, load, tokens,
        problem.tokens, experts, width, head_dim, scale);
    if (want_counts) {
      CountKernel<<<static_cast<unsigned>(heads), kRowThreads, 0, stream>>>(selections, counts + 2 * heads * b,
                                                                           tokens);
    }
    if (cudaError_t error = cudaGetLastError(); error != cudaSuccess) failure = CudaError(error, "MiTA kernel launch");
  }
  if (want_counts && failure.empty()) {
    // The statistics of every item come back in one copy each for loads and counts, and one wait.
    std::vector<int32_t> host_loads(layout.loads / sizeof(int32_t));
    std::vector<unsigned long long> host_counts(layout.counts / sizeof(unsigned long long));
    cudaMemcpyAsync(host_loads.data(), loads, layout.loads, cudaMemcpyDeviceToHost, stream);
    cudaMemcpyAsync(host_counts.data(), counts, layout.counts, cudaMemcpyDeviceToHost, stream);
    if (cudaError_t error = cudaStreamSynchronize(stream); error != cudaSuccess) {
      failure = CudaError(error, "MiTA statistics");
    } else {
      int64_t offset = 0;
      for (int64_t b = 0; b < problem.batch; ++b) {
        const int64_t experts = problem.items[b].expert_count;
        for (int64_t h = 0; h < heads; ++h) {
          CudaHeadCounts& head_counts = problem.head_counts[b * heads + h];
          for (int64_t i = 0; i < experts; ++i) head_counts.queries_per_expert[i] = host_loads[offset + h * experts + i];
          head_counts.pruned_keys = static_cast<int64_t>(host_counts[2 * (b * heads + h)]);
          head_counts.overlapping_keys = static_cast<int64_t>(host_counts[2 * (b * heads + h) + 1]);
        }
        offset += heads * experts;
      }
    }
  }
  if (own_scratch) {
    if (cudaError_t error = cudaFreeAsync(scratch, stream); error != cudaSuccess && failure.empty()) {
      failure = CudaError(error, "cudaFreeAsync of the MiTA scratch memory");
    }
  }
  if (failure.empty()) {
    if (cudaError_t error = cudaGetLastError(); error != cudaSuccess) failure = CudaError(error, "MiTA forward");
  }
  return failure;
}

}  // namespace

std::string MitaAttentionForwardCuda(const CudaMitaProblem& problem) {
  if (problem.batch < 0) return "batch size B must be >= 0";
  if (problem.batch == 0) return "";
  if (problem.heads < 1 || problem.tokens < 1 || problem.head_dim < 1) return "H, N and d must be >= 1";
  if (problem.head_dim > kMaxCudaHeadDim) {
    return "head dimension d = " + std::to_string(problem.head_dim) + " is above the CUDA kernel's limit " +
           std::to_string(kMaxCudaHeadDim);
  }
  if (problem.tokens > 0x7FFFFFFF) return "N must be < 2^31 (key indices are int32)";
  if (problem.q == nullptr || problem.k == nullptr || problem.v == nullptr || problem.output == nullptr ||
      problem.items == nullptr) {
    return "q, k, v, output and items must not be null";
  }
  for (int64_t b = 0; b < problem.batch; ++b) {
    const CudaMitaItem& item = problem.items[b];
    if (item.landmarks == nullptr) return "items[" + std::to_string(b) + "].landmarks is null";
    if (item.expert_count < 1) return "items[" + std::to_string(b) + "].expert_count must be >= 1";
    if (item.token_count < 0 || item.token_count > problem.tokens) {
      return "items[" + std::to_string(b) + "].token_count " + std::to_string(item.token_count) +
             " is outside [0, " + std::to_string(problem.tokens) + "]";
    }
    const int64_t item_tokens = item.token_count == 0 ? problem.tokens : item.token_count;
    if (item.expert_width < 1 || item.expert_width > item_tokens) {
      return "items[" + std::to_string(b) + "].expert_width " + std::to_string(item.expert_width) +
             " is outside [1, " + std::to_string(item_tokens) + "]";
    }
    if (problem.head_counts != nullptr) {
      for (int64_t h = 0; h < problem.heads; ++h) {
        if (problem.head_counts[b * problem.heads + h].queries_per_expert == nullptr) {
          return "head_counts[" + std::to_string(b * problem.heads + h) + "].queries_per_expert is null";
        }
      }
    }
  }
  if (problem.workspace != nullptr && problem.workspace_bytes < LayoutOf(problem).Total()) {
    return "workspace_bytes " + std::to_string(problem.workspace_bytes) + " is below the " +
           std::to_string(LayoutOf(problem).Total()) + " bytes the call needs (MitaCudaWorkspaceBytes)";
  }
  DeviceGuard guard;
  if (cudaError_t error = cudaSetDevice(problem.device); error != cudaSuccess) {
    return CudaError(error, "cudaSetDevice");
  }
  const cudaStream_t stream = static_cast<cudaStream_t>(problem.stream);
  if (problem.type == ElementType::kBFloat16) return Run<__nv_bfloat16>(problem, stream);
  return Run<float>(problem, stream);
}

size_t MitaCudaWorkspaceBytes(const CudaMitaProblem& problem) {
  if (problem.batch < 1 || problem.items == nullptr) return 0;
  return LayoutOf(problem).Total();
}

#define MITA_STRINGIFY_VALUE(...) #__VA_ARGS__
#define MITA_STRINGIFY(...) MITA_STRINGIFY_VALUE(__VA_ARGS__)

std::string KernelBuildSummary() {
  // nvcc defines __CUDA_ARCH_LIST__ (e.g. 900 or 800,900) in every pass, host included.
  std::string architectures = MITA_STRINGIFY(__CUDA_ARCH_LIST__);
  std::string names;
  size_t start = 0;
  while (start < architectures.size()) {
    size_t end = architectures.find(',', start);
    if (end == std::string::npos) end = architectures.size();
    const std::string number = architectures.substr(start, end - start);  // e.g. 900 (sm_90)
    const std::string name = "sm_" + (number.size() > 1 ? number.substr(0, number.size() - 1) : number);
    if (names.find(name) == std::string::npos) names += (names.empty() ? "" : ", ") + name;
    start = end + 1;
  }
  return names + " (CUDA " + std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10) +
         ")";
}

int64_t DeviceMemoryBytes(int device) {
  DeviceGuard guard;
  size_t free = 0, total = 0;
  if (cudaSetDevice(device) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return static_cast<int64_t>(total);
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state
    return 0;
  }
  return count;
}

}  // namespace mita::kernels::cuda
