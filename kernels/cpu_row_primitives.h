// The CPU kernel's vector row primitives (kernels/mita_attention_cpu.cc): the loops over one row of scores or
// logits whose speed matters at small widths (maximum, first argmax, exp and sum, the unnormalised softmax, the
// threshold mask of the running top-k, the k-th highest of a row), and FastExp. The float ones are written on 16-float
// GCC vectors and compiled once per instruction set (AVX-512, AVX2 and the x86-64 baseline, FloatRowSets); the
// kernel calls the widest set this CPU runs (FloatRows, chosen once), and the tests run every set this CPU runs.
// The double ones (float64 inputs, for tests and the reference) are plain loops.
#pragma once

#include <cstdint>
#include <cstring>

#include "absl/types/span.h"

namespace mita::kernels::internal {

// exp(x) in float for x in [kFastExpMin, 88], written so loops over it vectorise (a libm call does not):
// Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for exp(r) (Cephes expf
// coefficients), and 2^n from the exponent bits. Relative error <= 1e-7 (about 1 ulp) in that range; NaN stays
// NaN. The caller clamps x from below to kFastExpMin, in a separate loop: a clamp inside this function makes
// GCC 12 thread jumps around the polynomial and give up vectorising.
inline constexpr float kFastExpMin = -87.33654f;  // exp(kFastExpMin) = 2^-126, the smallest normal float

// FastExp for `Float` = float (with `Bits` = uint32_t) or a GCC vector of floats (with a vector of as many
// uint32_t): the same operations lane by lane. Always inlined, so GCC's note on passing a 64-byte vector without
// AVX-512 (-Wpsabi) concerns no call that exists.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
template <typename Float, typename Bits>
inline __attribute__((always_inline)) Float FastExpOf(Float x) {
  // Adding 1.5 * 2^23 rounds x / ln2 to the nearest integer n and leaves n in the low mantissa bits.
  constexpr float kRoundingShift = 12582912.0f;
  const Float shifted = x * 1.44269504088896341f + kRoundingShift;
  const Float n = shifted - kRoundingShift;
  const Float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 split in two for an exact n * ln2
  Float p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Float exp_r = p * r * r + r + 1.0f;
  Bits shifted_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof shifted_bits);
  const Bits power_bits = (shifted_bits - 0x4B400000u + 127u) << 23;  // 0x4B400000: the bits of 1.5 * 2^23
  Float power_of_two;
  std::memcpy(&power_of_two, &power_bits, sizeof power_of_two);
  return exp_r * power_of_two;
}
#pragma GCC diagnostic pop

inline float FastExp(float x) { return FastExpOf<float, uint32_t>(x); }

// Scores per AboveMask test (one bit each).
inline constexpr int64_t kScanGroup = 64;

// The float row primitives compiled for one instruction set. Preconditions as at the dispatching functions below.
struct FloatRowPrimitives {
  // "avx512f", "avx2" or "baseline".
  const char* target;
  // Whether this CPU runs the set.
  bool (*cpu_runs)();
  float (*max_of)(const float* values, int64_t count);
  void (*first_argmax_rows)(const float* rows, int64_t count, int64_t length, int64_t* indices);
  float (*exp_and_sum)(float* values, int64_t count, float multiplier, float shift);
  void (*unnormalised_softmax_rows)(float* rows, int64_t count, int64_t length, int64_t stride,
                                    float* inverse_sums);
  uint64_t (*above_mask)(const float* values, float threshold);
  float (*kth_highest)(const float* values, int64_t count, int64_t rank);
};

// Every compiled set, the widest first; the last (the baseline) runs on every x86-64 CPU.
absl::Span<const FloatRowPrimitives> FloatRowSets();

// The widest set this CPU runs, chosen at the first call.
const FloatRowPrimitives& SelectFloatRows();
inline const FloatRowPrimitives& FloatRows() {
  static const FloatRowPrimitives& rows = SelectFloatRows();
  return rows;
}

// Maximum of values[0, count), count >= 1.
inline float MaxOf(const float* values, int64_t count) { return FloatRows().max_of(values, count); }
double MaxOf(const double* values, int64_t count);

// indices[n] = the first argmax of row n of rows[count, length] (contiguous rows, length >= 1): as the loop
// "best = 0; if (row[i] > row[best]) best = i", NaNs included (that loop skips them unless row[0] is one).
inline void FirstArgmaxRows(const float* rows, int64_t count, int64_t length, int64_t* indices) {
  FloatRows().first_argmax_rows(rows, count, length, indices);
}
void FirstArgmaxRows(const double* rows, int64_t count, int64_t length, int64_t* indices);

// values[j] = exp(values[j] * multiplier - shift) over [0, count), for arguments <= 0 (max-subtracted logits);
// returns their sum. float: clamped to FastExp's range (exp(-inf) becomes 2^-126, negligible next to the row
// maximum's term 1), then FastExp; double: std::exp.
inline float ExpAndSum(float* values, int64_t count, float multiplier, float shift) {
  return FloatRows().exp_and_sum(values, count, multiplier, shift);
}
double ExpAndSum(double* values, int64_t count, double multiplier, double shift);

// Row r of rows[count, length] (row stride `stride`) becomes exp(row - max(row)), and inverse_sums[r] = 1 / the
// row's sum: the max-subtracted softmax before its normalisation. One call per chunk of rows: a row of the routed
// path is short (M + k logits, 32 at m = k = 16), and two dispatched calls per row cost as much as its
// exponentials.
inline void UnnormalisedSoftmaxRows(float* rows, int64_t count, int64_t length, int64_t stride, float* inverse_sums) {
  FloatRows().unnormalised_softmax_rows(rows, count, length, stride, inverse_sums);
}
void UnnormalisedSoftmaxRows(double* rows, int64_t count, int64_t length, int64_t stride, double* inverse_sums);

// Bit j of the result is set when values[j] > threshold, j in [0, kScanGroup) (a NaN never is): the running top-k
// visits only the keys that enter.
inline uint64_t AboveMask(const float* values, float threshold) { return FloatRows().above_mask(values, threshold); }
uint64_t AboveMask(const double* values, double threshold);

// The rank-th highest of values[0, count), 1 <= rank <= count, no NaN values (equal to the value at position
// rank - 1 of a descending sort). float: a bitwise search over the values' order-preserving 32-bit keys (kept in a
// buffer of the calling thread), one vectorised count of the keys at or above a candidate per bit, instead of a
// selection whose every comparison is a branch (the running top-k of a single key block); double:
// std::nth_element on a copy.
inline float KthHighest(const float* values, int64_t count, int64_t rank) {
  return FloatRows().kth_highest(values, count, rank);
}
double KthHighest(const double* values, int64_t count, int64_t rank);

}  // namespace mita::kernels::internal
