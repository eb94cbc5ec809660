// The CPU kernel's vector row primitives (see cpu_row_primitives.h).
//
// The loops are kept free of std::min/std::max (whose branches stop GCC 12 from vectorising them). The float ones
// are written on FloatVector, 16 floats as one GCC vector: one AVX-512 register, two AVX2 or four SSE2 ones. GCC
// 12 keeps an `omp simd` reduction's lanes in a stack array and sums them one by one (about 90 ns of a 32-value
// row: docs/kernels.md, "History"), so the float reductions are written on vectors by hand. Each body is
// always_inline and compiled into every set of MITA_FLOAT_ROW_SET below: a 64-byte vector never crosses a call
// (Clang refuses one as the argument or result of a call from a function compiled without AVX-512, and GCC's
// -Wpsabi note about it concerns no call that exists).
#include "kernels/cpu_row_primitives.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <vector>

namespace mita::kernels::internal {
namespace {

#pragma GCC diagnostic ignored "-Wpsabi"
constexpr int64_t kVectorFloats = 16;
using FloatVector = float __attribute__((vector_size(kVectorFloats * sizeof(float))));
using WordVector = uint32_t __attribute__((vector_size(kVectorFloats * sizeof(float))));
using LaneVector = int32_t __attribute__((vector_size(kVectorFloats * sizeof(float))));
// (A comparison is written with vectors on both sides: GCC 12 lowers a vector-scalar comparison lane by lane.)
static_assert(kScanGroup == 4 * kVectorFloats, "AboveMask packs four vectors of lanes into 64 bits");

inline __attribute__((always_inline)) FloatVector LoadFloats(const float* values) {
  FloatVector vector;
  std::memcpy(&vector, values, sizeof vector);
  return vector;
}

inline __attribute__((always_inline)) void StoreFloats(float* values, FloatVector vector) {
  std::memcpy(values, &vector, sizeof vector);
}

inline __attribute__((always_inline)) FloatVector Broadcast(float value) { return FloatVector{} + value; }

template <typename Vector>
inline __attribute__((always_inline)) Vector MaxOfVectors(Vector a, Vector b) {
  return a > b ? a : b;
}

// Half vectors, 8 floats (one AVX2 register): rows of 8 to 15 values.
constexpr int64_t kHalfVectorFloats = kVectorFloats / 2;
using HalfFloatVector = float __attribute__((vector_size(kHalfVectorFloats * sizeof(float))));
using HalfWordVector = uint32_t __attribute__((vector_size(kHalfVectorFloats * sizeof(float))));
using HalfLaneVector = int32_t __attribute__((vector_size(kHalfVectorFloats * sizeof(float))));

inline __attribute__((always_inline)) HalfFloatVector LoadHalfFloats(const float* values) {
  HalfFloatVector vector;
  std::memcpy(&vector, values, sizeof vector);
  return vector;
}

// Lane 0 of the result is the maximum (HorizontalMax), the sum (HorizontalSum), the least (HorizontalMin) or the
// bitwise or (HorizontalOr) of the 16 lanes: four halving steps.
inline __attribute__((always_inline)) float HorizontalMax(FloatVector v) {
  v = MaxOfVectors(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = MaxOfVectors(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = MaxOfVectors(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = MaxOfVectors(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

template <typename Vector>
inline __attribute__((always_inline)) auto HorizontalSum(Vector v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

inline __attribute__((always_inline)) int32_t HorizontalMin(LaneVector v) {
  LaneVector other = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v < other ? v : other;
  other = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v < other ? v : other;
  other = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v < other ? v : other;
  other = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  v = v < other ? v : other;
  return v[0];
}

inline __attribute__((always_inline)) uint32_t HorizontalOr(WordVector v) {
  v |= __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v |= __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v |= __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v |= __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// MaxOf: the plain loop (double, and float rows shorter than a vector).
template <typename T>
inline __attribute__((always_inline)) T MaxOfBody(const T* values, int64_t count) {
  T maximum = values[0];
#pragma omp simd reduction(max : maximum)
  for (int64_t j = 1; j < count; ++j) maximum = maximum > values[j] ? maximum : values[j];
  return maximum;
}

// MaxOf of floats: whole vectors, the last one overlapping the one before where 16 does not divide count (a value
// counted twice does not change a maximum).
inline __attribute__((always_inline)) float MaxOfFloats(const float* values, int64_t count) {
  if (count < kVectorFloats) {
    if (count < kHalfVectorFloats) return MaxOfBody(values, count);
    // Two overlapping half vectors (a row copied into a padded vector on the stack is read back before its narrower
    // stores retire: slower than the scalar loop).
    const HalfFloatVector maxima =
        MaxOfVectors(LoadHalfFloats(values), LoadHalfFloats(values + count - kHalfVectorFloats));
    float maximum = maxima[0];
    for (int32_t l = 1; l < kHalfVectorFloats; ++l) maximum = maximum > maxima[l] ? maximum : maxima[l];
    return maximum;
  }
  FloatVector maxima = LoadFloats(values + count - kVectorFloats);
  for (int64_t j = 0; j + kVectorFloats <= count; j += kVectorFloats) {
    maxima = MaxOfVectors(maxima, LoadFloats(values + j));
  }
  return HorizontalMax(maxima);
}

// The first argmax of one row: the maximum and whether any value is NaN in one vectorised pass, the least index
// holding the maximum in a second; the defining loop where a value is NaN.
template <typename T>
inline __attribute__((always_inline)) int64_t FirstArgmaxBody(const T* values, int64_t count) {
  T maximum = values[0];
  int unordered = 0;
#pragma omp simd reduction(max : maximum) reduction(| : unordered)
  for (int64_t j = 0; j < count; ++j) {
    maximum = maximum > values[j] ? maximum : values[j];
    unordered |= values[j] != values[j] ? 1 : 0;
  }
  if (unordered != 0) {
    int64_t best = 0;
    for (int64_t i = 1; i < count; ++i) {
      if (values[i] > values[best]) best = i;
    }
    return best;
  }
  int64_t first = count;
#pragma omp simd reduction(min : first)
  for (int64_t j = 0; j < count; ++j) first = values[j] == maximum && j < first ? j : first;
  return first;
}

// The float version on whole vectors (the last one overlapping, as MaxOfFloats).
inline __attribute__((always_inline)) int64_t FirstArgmaxOfFloats(const float* values, int64_t count) {
  if (count < kVectorFloats) {
    // The defining loop itself, keeping values[best] in a register (conditional moves; M = 9 at the image model).
    int64_t best = 0;
    float best_value = values[0];
    for (int64_t i = 1; i < count; ++i) {
      const bool above = values[i] > best_value;
      best = above ? i : best;
      best_value = above ? values[i] : best_value;
    }
    return best;
  }
  if (count > std::numeric_limits<int32_t>::max()) return FirstArgmaxBody(values, count);
  const int64_t last = count - kVectorFloats;
  FloatVector maxima = LoadFloats(values + last);
  FloatVector unordered = maxima != maxima ? Broadcast(1.0f) : FloatVector{};
  for (int64_t j = 0; j + kVectorFloats <= count; j += kVectorFloats) {
    const FloatVector group = LoadFloats(values + j);
    maxima = MaxOfVectors(maxima, group);
    unordered = group != group ? Broadcast(1.0f) : unordered;
  }
  if (HorizontalMax(unordered) != 0.0f) return FirstArgmaxBody(values, count);
  const FloatVector maximum = Broadcast(HorizontalMax(maxima));
  LaneVector lane;
  for (int32_t l = 0; l < kVectorFloats; ++l) lane[l] = l;
  const LaneVector none = LaneVector{} + static_cast<int32_t>(count);
  LaneVector first = LoadFloats(values + last) == maximum ? lane + static_cast<int32_t>(last) : none;
  for (int64_t j = 0; j + kVectorFloats <= count; j += kVectorFloats) {
    const LaneVector at = LoadFloats(values + j) == maximum ? lane + static_cast<int32_t>(j) : none;
    first = first < at ? first : at;
  }
  return HorizontalMin(first);
}

// exp(values * multiplier - shift) lane by lane, clamped as ExpAndSum.
inline __attribute__((always_inline)) FloatVector ExpOfArguments(FloatVector values, float multiplier, float shift) {
  const FloatVector arguments = values * multiplier - shift;
  const FloatVector lowest = Broadcast(kFastExpMin);
  return FastExpOf<FloatVector, WordVector>(arguments < lowest ? lowest : arguments);
}

inline __attribute__((always_inline)) HalfFloatVector HalfExpOfArguments(HalfFloatVector values, float multiplier,
                                                                         float shift) {
  const HalfFloatVector arguments = values * multiplier - shift;
  const HalfFloatVector lowest = HalfFloatVector{} + kFastExpMin;
  return FastExpOf<HalfFloatVector, HalfWordVector>(arguments < lowest ? lowest : arguments);
}

inline __attribute__((always_inline)) float ExpAndSumOfFloats(float* values, int64_t count, float multiplier,
                                                              float shift) {
  if (count < kVectorFloats) {
    if (count < kHalfVectorFloats) {
      for (int64_t j = 0; j < count; ++j) {
        const float argument = values[j] * multiplier - shift;
        values[j] = argument < kFastExpMin ? kFastExpMin : argument;
      }
      float sum = 0;
      for (int64_t j = 0; j < count; ++j) {
        values[j] = FastExp(values[j]);
        sum += values[j];
      }
      return sum;
    }
    // The logits rows of small budgets (M + k in [8, 16)): two overlapping half vectors, both computed before either
    // is stored; of the second, only the lanes past the first are summed.
    const HalfFloatVector head = HalfExpOfArguments(LoadHalfFloats(values), multiplier, shift);
    const HalfFloatVector tail =
        HalfExpOfArguments(LoadHalfFloats(values + count - kHalfVectorFloats), multiplier, shift);
    HalfLaneVector lane;
    for (int32_t l = 0; l < kHalfVectorFloats; ++l) lane[l] = l;
    const HalfFloatVector sums =
        head + (lane >= static_cast<int32_t>(2 * kHalfVectorFloats - count) ? tail : HalfFloatVector{});
    std::memcpy(values + count - kHalfVectorFloats, &tail, sizeof tail);
    std::memcpy(values, &head, sizeof head);
    float sum = 0;
    for (int32_t l = 0; l < kHalfVectorFloats; ++l) sum += sums[l];
    return sum;
  }
  LaneVector lane;
  for (int32_t l = 0; l < kVectorFloats; ++l) lane[l] = l;
  // The last 16 values, taken before the whole vectors overwrite any of them; only the lanes past the last whole
  // vector are summed (the others are stored again with the same exponentials).
  const int64_t tail = count % kVectorFloats, last = count - kVectorFloats;
  const FloatVector last_exponentials = ExpOfArguments(LoadFloats(values + last), multiplier, shift);
  const LaneVector first_tail_lane = LaneVector{} + static_cast<int32_t>(kVectorFloats - tail);
  FloatVector sums = tail == 0 ? FloatVector{} : (lane >= first_tail_lane ? last_exponentials : FloatVector{});
  for (int64_t j = 0; j + kVectorFloats <= count; j += kVectorFloats) {
    const FloatVector exponentials = ExpOfArguments(LoadFloats(values + j), multiplier, shift);
    StoreFloats(values + j, exponentials);
    sums += exponentials;
  }
  StoreFloats(values + last, last_exponentials);
  return HorizontalSum(sums);
}

inline __attribute__((always_inline)) void UnnormalisedSoftmaxRowsOfFloats(float* rows, int64_t count,
                                                                           int64_t length, int64_t stride,
                                                                           float* inverse_sums) {
  for (int64_t r = 0; r < count; ++r) {
    float* row = rows + r * stride;
    inverse_sums[r] = 1.0f / ExpAndSumOfFloats(row, length, 1.0f, MaxOfFloats(row, length));
  }
}

// Bits of vector `vector` of a group of kScanGroup values: lane i -> bit i (lane_bit[i] = 1 << i).
inline __attribute__((always_inline)) WordVector LaneBitsAbove(const float* values, int64_t vector,
                                                               FloatVector limit, WordVector lane_bit) {
  return reinterpret_cast<WordVector>(LoadFloats(values + vector * kVectorFloats) > limit) & lane_bit;
}

inline __attribute__((always_inline)) uint64_t AboveMaskOfFloats(const float* values, float threshold) {
  const FloatVector limit = Broadcast(threshold);
  const WordVector lane_bit = {1u << 0, 1u << 1, 1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
                               1u << 8, 1u << 9, 1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15};
  // The second vector of each half lands 16 bits up.
  const WordVector low = LaneBitsAbove(values, 0, limit, lane_bit) | (LaneBitsAbove(values, 1, limit, lane_bit) << 16);
  const WordVector high = LaneBitsAbove(values, 2, limit, lane_bit) | (LaneBitsAbove(values, 3, limit, lane_bit) << 16);
  return static_cast<uint64_t>(HorizontalOr(low)) | (static_cast<uint64_t>(HorizontalOr(high)) << 32);
}

// The order-preserving key of each lane's float bits: a < b as floats (no NaN; -0 below +0) exactly when key(a) <
// key(b) as unsigned integers. Negative floats have every bit flipped, the others only the sign bit.
inline __attribute__((always_inline)) WordVector OrderedKeys(FloatVector values) {
  const LaneVector bits = reinterpret_cast<LaneVector>(values);
  return reinterpret_cast<WordVector>(bits ^ ((bits >> 31) | std::numeric_limits<int32_t>::min()));
}

// How many of keys[0, vectors * kVectorFloats) are at or above `key`.
inline __attribute__((always_inline)) int64_t CountKeysAtLeast(const uint32_t* keys, int64_t vectors, uint32_t key) {
  const WordVector limit = WordVector{} + key;
  LaneVector counts{};
  for (int64_t j = 0; j < vectors; ++j) {
    WordVector group;
    std::memcpy(&group, keys + j * kVectorFloats, sizeof group);
    counts -= group >= limit;
  }
  return HorizontalSum(counts);
}

// The least of keys[0, vectors * kVectorFloats) at or above `key` (one exists).
inline __attribute__((always_inline)) uint32_t LeastKeyAtLeast(const uint32_t* keys, int64_t vectors, uint32_t key) {
  const WordVector limit = WordVector{} + key;
  const WordVector none = WordVector{} + std::numeric_limits<uint32_t>::max();
  WordVector least = none;
  for (int64_t j = 0; j < vectors; ++j) {
    WordVector group;
    std::memcpy(&group, keys + j * kVectorFloats, sizeof group);
    group = group >= limit ? group : none;
    least = least < group ? least : group;
  }
  for (int32_t l = 1; l < kVectorFloats; ++l) least[0] = least[0] < least[l] ? least[0] : least[l];
  return least[0];
}

// KthHighest of floats. The values' keys are written once to a thread's buffer, padded to whole vectors with key 0
// (below every candidate tried); then the highest key with at least `rank` keys at or above it, built bit by bit
// from the top, is the rank-th highest value's key. A candidate with exactly `rank` keys at or above it ends the
// search early: the least of those is the answer (distinct values settle a few bits below their leading ones).
inline __attribute__((always_inline)) float KthHighestOfFloats(const float* values, int64_t count, int64_t rank) {
  thread_local std::vector<uint32_t> key_buffer;
  const int64_t vectors = (count + kVectorFloats - 1) / kVectorFloats;
  if (static_cast<int64_t>(key_buffer.size()) < vectors * kVectorFloats) key_buffer.resize(vectors * kVectorFloats);
  uint32_t* keys = key_buffer.data();
  for (int64_t j = 0; j + kVectorFloats <= count; j += kVectorFloats) {
    const WordVector group = OrderedKeys(LoadFloats(values + j));
    std::memcpy(keys + j, &group, sizeof group);
  }
  for (int64_t j = count / kVectorFloats * kVectorFloats; j < vectors * kVectorFloats; ++j) {
    uint32_t bits = 0;
    if (j < count) std::memcpy(&bits, values + j, sizeof bits);
    keys[j] = j < count ? bits ^ ((bits >> 31) != 0 ? 0xFFFFFFFFu : 0x80000000u) : 0;
  }
  uint32_t key = 0;
  for (uint32_t bit = uint32_t{1} << 31; bit != 0; bit >>= 1) {
    const int64_t at_least = CountKeysAtLeast(keys, vectors, key | bit);
    if (at_least == rank) {
      key = LeastKeyAtLeast(keys, vectors, key | bit);
      break;
    }
    if (at_least > rank) key |= bit;
  }
  const uint32_t bits = (key & 0x80000000u) != 0 ? key ^ 0x80000000u : ~key;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// One set of the float primitives, compiled with `TARGET` (an attribute, or nothing for the baseline), in
// namespace NAME, and its FloatRowPrimitives entry `NAME::kSet`.
#define MITA_FLOAT_ROW_SET(NAME, TARGET_NAME, TARGET, CPU_RUNS)                                                    \
  namespace NAME {                                                                                                 \
  TARGET float MaxOf(const float* values, int64_t count) { return MaxOfFloats(values, count); }                    \
  TARGET void FirstArgmaxRows(const float* rows, int64_t count, int64_t length, int64_t* indices) {                \
    for (int64_t n = 0; n < count; ++n) indices[n] = FirstArgmaxOfFloats(rows + n * length, length);              \
  }                                                                                                                \
  TARGET float ExpAndSum(float* values, int64_t count, float multiplier, float shift) {                            \
    return ExpAndSumOfFloats(values, count, multiplier, shift);                                                    \
  }                                                                                                                \
  TARGET void UnnormalisedSoftmaxRows(float* rows, int64_t count, int64_t length, int64_t stride,                  \
                                      float* inverse_sums) {                                                       \
    UnnormalisedSoftmaxRowsOfFloats(rows, count, length, stride, inverse_sums);                                    \
  }                                                                                                                \
  TARGET uint64_t AboveMask(const float* values, float threshold) { return AboveMaskOfFloats(values, threshold); } \
  TARGET float KthHighest(const float* values, int64_t count, int64_t rank) {                                      \
    return KthHighestOfFloats(values, count, rank);                                                                \
  }                                                                                                                \
  bool CpuRuns() { return CPU_RUNS; }                                                                              \
  constexpr FloatRowPrimitives kSet = {TARGET_NAME, &CpuRuns,   &MaxOf,          &FirstArgmaxRows,                \
                                       &ExpAndSum,  &UnnormalisedSoftmaxRows,   &AboveMask, &KthHighest};          \
  }  // namespace NAME

MITA_FLOAT_ROW_SET(avx512, "avx512f", __attribute__((target("avx512f"))), __builtin_cpu_supports("avx512f"))
MITA_FLOAT_ROW_SET(avx2, "avx2", __attribute__((target("avx2"))), __builtin_cpu_supports("avx2"))
MITA_FLOAT_ROW_SET(baseline, "baseline", , true)
#undef MITA_FLOAT_ROW_SET

constexpr FloatRowPrimitives kFloatRowSets[] = {avx512::kSet, avx2::kSet, baseline::kSet};

}  // namespace

absl::Span<const FloatRowPrimitives> FloatRowSets() { return kFloatRowSets; }

const FloatRowPrimitives& SelectFloatRows() {
  for (const FloatRowPrimitives& set : kFloatRowSets) {
    if (set.cpu_runs()) return set;
  }
  return kFloatRowSets[std::size(kFloatRowSets) - 1];
}

double MaxOf(const double* values, int64_t count) { return MaxOfBody(values, count); }

void FirstArgmaxRows(const double* rows, int64_t count, int64_t length, int64_t* indices) {
  for (int64_t n = 0; n < count; ++n) indices[n] = FirstArgmaxBody(rows + n * length, length);
}

double ExpAndSum(double* values, int64_t count, double multiplier, double shift) {
  double sum = 0;
  for (int64_t j = 0; j < count; ++j) {
    values[j] = std::exp(values[j] * multiplier - shift);
    sum += values[j];
  }
  return sum;
}

void UnnormalisedSoftmaxRows(double* rows, int64_t count, int64_t length, int64_t stride, double* inverse_sums) {
  for (int64_t r = 0; r < count; ++r) {
    double* row = rows + r * stride;
    inverse_sums[r] = 1.0 / ExpAndSum(row, length, 1.0, MaxOf(row, length));
  }
}

uint64_t AboveMask(const double* values, double threshold) {
  uint64_t mask = 0;
  for (int64_t j = 0; j < kScanGroup; ++j) mask |= static_cast<uint64_t>(values[j] > threshold) << j;
  return mask;
}

double KthHighest(const double* values, int64_t count, int64_t rank) {
  std::vector<double> copy(values, values + count);
  std::nth_element(copy.begin(), copy.begin() + (rank - 1), copy.end(), std::greater<double>());
  return copy[rank - 1];
}

}  // namespace mita::kernels::internal
