// Percentiles of measured values, for every part that reports or plans with them (the server's planning slack,
// mita-client, mita-bench, the tools and tests): one rule, the nearest rank.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace mita {

// The nearest-rank `p`-th percentile of `values`: the smallest value with at least p% of the values at or below
// it (p in (0, 100]; p <= 0 gives the smallest, p > 100 the largest); 0 when there are none. Reorders `values`
// (partial selection, O(n)).
inline double Percentile(std::vector<double>& values, double p) {
  if (values.empty()) return 0;
  const double rank = std::ceil(p / 100.0 * static_cast<double>(values.size()));
  const size_t index = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(values.size()))) - 1;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(index), values.end());
  return values[index];
}

}  // namespace mita
