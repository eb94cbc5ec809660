// The CPU kernel's vector row primitives (kernels/cpu_row_primitives.h), every compiled set this CPU runs
// (AVX-512, AVX2, the baseline) against plain loops: lengths around the vector width (a short row, whole
// vectors, an overlapping last vector), NaNs and ties for the first argmax, ties and both zeros for the k-th
// highest. The kernel is also tested end to end (kernels_test); these tests name the set and the primitive that
// breaks.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cpu_row_primitives.h"

namespace mita::kernels::internal {
namespace {

constexpr int64_t kLengths[] = {1, 2, 9, 15, 16, 17, 31, 32, 33, 50, 64, 100, 257};

std::vector<float> RandomRow(std::mt19937& random, int64_t length, float low = -8, float high = 8) {
  std::uniform_real_distribution<float> value(low, high);
  std::vector<float> row(static_cast<size_t>(length));
  for (float& x : row) x = value(random);
  return row;
}

// The sets this CPU runs; the baseline always does.
std::vector<FloatRowPrimitives> RunnableSets() {
  std::vector<FloatRowPrimitives> sets;
  for (const FloatRowPrimitives& set : FloatRowSets()) {
    if (set.cpu_runs()) sets.push_back(set);
  }
  return sets;
}

TEST(FloatRowSets, TheBaselineRunsAndTheKernelUsesTheWidest) {
  ASSERT_EQ(FloatRowSets().size(), 3u);
  EXPECT_EQ(std::string(FloatRowSets().back().target), "baseline");
  EXPECT_TRUE(FloatRowSets().back().cpu_runs());
  EXPECT_EQ(std::string(FloatRows().target), RunnableSets().front().target);
  for (const FloatRowPrimitives& set : RunnableSets()) std::cout << "runs the " << set.target << " set\n";
}

TEST(FloatRowSets, MaxOf) {
  std::mt19937 random(1);
  for (const FloatRowPrimitives& set : RunnableSets()) {
    for (int64_t length : kLengths) {
      const std::vector<float> row = RandomRow(random, length);
      EXPECT_EQ(set.max_of(row.data(), length), *std::max_element(row.begin(), row.end()))
          << set.target << " length " << length;
    }
  }
}

// The defining loop: "best = 0; if (row[i] > row[best]) best = i".
int64_t FirstArgmax(const float* row, int64_t length) {
  int64_t best = 0;
  for (int64_t i = 1; i < length; ++i) {
    if (row[i] > row[best]) best = i;
  }
  return best;
}

TEST(FloatRowSets, FirstArgmaxRowsWithTiesAndNaNs) {
  std::mt19937 random(2);
  std::uniform_int_distribution<int> small(-2, 2);
  for (const FloatRowPrimitives& set : RunnableSets()) {
    for (int64_t length : kLengths) {
      for (int variant = 0; variant < 3; ++variant) {
        constexpr int64_t kRows = 5;
        std::vector<float> rows(static_cast<size_t>(kRows * length));
        for (float& x : rows) x = static_cast<float>(small(random));  // many ties
        if (variant == 1) rows[static_cast<size_t>(length / 2)] = std::numeric_limits<float>::quiet_NaN();
        if (variant == 2) rows[0] = std::numeric_limits<float>::quiet_NaN();
        std::vector<int64_t> indices(kRows, -1);
        set.first_argmax_rows(rows.data(), kRows, length, indices.data());
        for (int64_t r = 0; r < kRows; ++r) {
          EXPECT_EQ(indices[r], FirstArgmax(rows.data() + r * length, length))
              << set.target << " length " << length << " variant " << variant << " row " << r;
        }
      }
    }
  }
}

TEST(FloatRowSets, ExpAndSumAndUnnormalisedSoftmax) {
  std::mt19937 random(3);
  for (const FloatRowPrimitives& set : RunnableSets()) {
    for (int64_t length : kLengths) {
      std::vector<float> row = RandomRow(random, length);
      const float multiplier = 0.5f, shift = set.max_of(row.data(), length) * multiplier;
      std::vector<double> expected(row.begin(), row.end());
      double expected_sum = 0;
      for (double& x : expected) {
        x = std::exp(x * multiplier - shift);
        expected_sum += x;
      }
      const float sum = set.exp_and_sum(row.data(), length, multiplier, shift);
      EXPECT_NEAR(sum, expected_sum, 1e-5 * expected_sum) << set.target << " length " << length;
      for (int64_t j = 0; j < length; ++j) {
        ASSERT_NEAR(row[j], expected[j], 1e-6 * std::max(1.0, expected[j])) << set.target << " length " << length;
      }
      // Two rows with a gap between them (stride > length): the gap is left alone.
      const int64_t stride = length + 3;
      std::vector<float> rows = RandomRow(random, 2 * stride);
      const std::vector<float> before = rows;
      float inverse_sums[2] = {0, 0};
      set.unnormalised_softmax_rows(rows.data(), 2, length, stride, inverse_sums);
      for (int r = 0; r < 2; ++r) {
        const float* original = before.data() + r * stride;
        const double maximum = *std::max_element(original, original + length);
        double row_sum = 0;
        for (int64_t j = 0; j < length; ++j) {
          const double exact = std::exp(original[j] - maximum);
          row_sum += exact;
          ASSERT_NEAR(rows[r * stride + j], exact, 1e-6) << set.target << " length " << length;
        }
        EXPECT_NEAR(inverse_sums[r], 1 / row_sum, 1e-6 / row_sum) << set.target << " length " << length;
        for (int64_t j = length; j < stride; ++j) EXPECT_EQ(rows[r * stride + j], before[r * stride + j]);
      }
    }
  }
}

TEST(FloatRowSets, ExpAndSumClampsTheFarTail) {
  for (const FloatRowPrimitives& set : RunnableSets()) {
    for (int64_t length : {3, 20}) {
      std::vector<float> row(static_cast<size_t>(length), -std::numeric_limits<float>::infinity());
      row[0] = 0;
      const float sum = set.exp_and_sum(row.data(), length, 1.0f, 0.0f);
      EXPECT_NEAR(sum, 1.0f, 1e-30f * length) << set.target;
      EXPECT_EQ(row[0], 1.0f) << set.target;
      EXPECT_FLOAT_EQ(row[1], FastExp(kFastExpMin)) << set.target;
    }
  }
}

TEST(FloatRowSets, AboveMask) {
  std::mt19937 random(4);
  for (const FloatRowPrimitives& set : RunnableSets()) {
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<float> values = RandomRow(random, kScanGroup, -1, 1);
      if (trial % 5 == 0) values[static_cast<size_t>(trial % kScanGroup)] = std::numeric_limits<float>::quiet_NaN();
      const float threshold = trial == 0 ? 0.0f : values[static_cast<size_t>(trial % kScanGroup)];
      uint64_t expected = 0;
      for (int64_t j = 0; j < kScanGroup; ++j) expected |= static_cast<uint64_t>(values[j] > threshold) << j;
      EXPECT_EQ(set.above_mask(values.data(), threshold), expected) << set.target << " trial " << trial;
    }
  }
}

// The rank-th highest: the value at position rank - 1 of a descending sort, on rows of distinct values, of many ties,
// of both zeros and of infinities.
TEST(FloatRowSets, KthHighest) {
  std::mt19937 random(6);
  std::uniform_int_distribution<int> small(-3, 3);
  for (const FloatRowPrimitives& set : RunnableSets()) {
    for (int64_t length : kLengths) {
      for (int kind = 0; kind < 3; ++kind) {
        std::vector<float> row = RandomRow(random, length, -1e3f, 1e3f);
        if (kind >= 1) {
          for (float& x : row) x = static_cast<float>(small(random));
        }
        if (kind == 2) {
          for (size_t j = 0; j < row.size(); ++j) {
            if (row[j] == 0) row[j] = j % 2 == 0 ? -0.0f : 0.0f;
            if (row[j] == 3) row[j] = std::numeric_limits<float>::infinity();
            if (row[j] == -3) row[j] = -std::numeric_limits<float>::infinity();
          }
        }
        std::vector<float> sorted = row;
        std::sort(sorted.begin(), sorted.end(), [](float a, float b) { return a > b; });
        for (int64_t rank = 1; rank <= length; ++rank) {
          EXPECT_EQ(set.kth_highest(row.data(), length, rank), sorted[rank - 1])
              << set.target << " length " << length << " kind " << kind << " rank " << rank;
        }
      }
    }
  }
}

// The double primitives (float64 inputs) agree with the float sets' definitions.
TEST(DoubleRows, MatchTheirDefinitions) {
  const std::vector<double> row = {1, 3, -2, 3, std::nan(""), 0};
  EXPECT_EQ(MaxOf(row.data(), 4), 3);
  int64_t index = -1;
  FirstArgmaxRows(row.data(), 1, 6, &index);
  EXPECT_EQ(index, 1);
  std::vector<double> logits = {0, -1, -2};
  EXPECT_NEAR(ExpAndSum(logits.data(), 3, 1.0, 0.0), 1 + std::exp(-1.0) + std::exp(-2.0), 1e-15);
  EXPECT_EQ(KthHighest(row.data(), 4, 2), 3);
  EXPECT_EQ(KthHighest(row.data(), 4, 3), 1);
}

// The CPU kernel's vectorisable float exp: within 2e-7 relative of the float64 exp on its whole range.
TEST(FastExp, MatchesStdExp) {
  double worst = 0;
  for (float x = kFastExpMin; x <= 88.0f; x += 1e-3f) {
    const double exact = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::abs(FastExp(x) - exact) / exact);
  }
  EXPECT_LT(worst, 2e-7);
  EXPECT_EQ(FastExp(0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(FastExp(std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace mita::kernels::internal
