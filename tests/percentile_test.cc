// base/percentile.h against values worked out by hand from the nearest-rank definition (the smallest value with at
// least p% of the values at or below it).
#include "base/percentile.h"

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"

namespace mita {
namespace {

TEST(PercentileTest, NearestRankOfTenValues) {
  const std::vector<double> values = {7, 1, 10, 3, 9, 2, 8, 4, 6, 5};  // 1..10, shuffled
  auto at = [&](double p) {
    std::vector<double> copy = values;
    return Percentile(copy, p);
  };
  EXPECT_EQ(at(50), 5);    // rank ceil(5) = 5
  EXPECT_EQ(at(51), 6);    // rank ceil(5.1) = 6
  EXPECT_EQ(at(95), 10);   // rank ceil(9.5) = 10
  EXPECT_EQ(at(90), 9);
  EXPECT_EQ(at(100), 10);
  EXPECT_EQ(at(0.1), 1);   // rank at least 1
  EXPECT_EQ(at(0), 1);     // p <= 0: the smallest
  EXPECT_EQ(at(250), 10);  // p > 100: the largest
}

TEST(PercentileTest, SmallAndEmptySets) {
  std::vector<double> none;
  EXPECT_EQ(Percentile(none, 99), 0);
  std::vector<double> one = {4.5};
  EXPECT_EQ(Percentile(one, 1), 4.5);
  EXPECT_EQ(Percentile(one, 99), 4.5);
  std::vector<double> two = {3, -1};
  EXPECT_EQ(Percentile(two, 50), -1);  // rank 1
  EXPECT_EQ(Percentile(two, 50.5), 3);  // rank 2
}

TEST(PercentileTest, KeepsTheValuesAndToleratesRepeats) {
  std::vector<double> values = {2, 2, 2, 1, 3};
  EXPECT_EQ(Percentile(values, 60), 2);  // sorted 1 2 2 2 3, rank 3
  EXPECT_EQ(Percentile(values, 80), 2);  // rank 4
  EXPECT_EQ(Percentile(values, 81), 3);  // rank 5
  std::sort(values.begin(), values.end());
  EXPECT_EQ(values, (std::vector<double>{1, 2, 2, 2, 3}));  // reordered, none lost
}

}  // namespace
}  // namespace mita
