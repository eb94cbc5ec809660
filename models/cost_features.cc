// A transformer's cost features (see cost_features.h).
#include "models/cost_features.h"

namespace mita::models {

CostFeatures TransformerCostFeatures(int64_t layers, int64_t embed_dim, absl::Span<const CostItem> items) {
  CostFeatures features{};
  if (items.empty()) return features;
  const double d = static_cast<double>(embed_dim);
  const double l = static_cast<double>(layers);
  features[0] = 1.0;
  for (const CostItem& item : items) {
    const double n = static_cast<double>(item.tokens);
    features[1] += l;
    features[2] += l * n * d * d;
    if (item.budget.full_attention) {
      features[5] += l * n * n * d;
    } else {
      const double m = static_cast<double>(item.budget.expert_count);
      const double k = static_cast<double>(item.budget.expert_width);
      features[3] += l * n * (m + k) * d;
      features[4] += l * n * m * d;
    }
  }
  return features;
}

CostFeatures TransformerPriorCoefficients() { return CostFeatures{5e-4, 2e-5, 1e-9, 2e-9, 2e-9, 1e-9}; }

}  // namespace mita::models
