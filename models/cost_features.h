// What a batch's compute time is linear in, as a model describes it (Classifier::BatchCostFeatures): the server's
// cost model (server/planning/cost_model.h) fits one coefficient per feature and knows nothing else of how a model
// computes. Every model so far is a transformer with MiTA attention, whose features are TransformerCostFeatures.
#pragma once

#include <array>
#include <cstdint>

#include "absl/types/span.h"
#include "models/budget.h"

namespace mita::models {

// One item of a batch as its cost sees it: its tokens and its applied budget (ApplyBudget).
struct CostItem {
  int64_t tokens = 0;
  AttentionBudget budget;
};

// The features of a batch, summed over its items. Feature 0 is 1 for a non-empty batch (the forward's fixed cost);
// the others are a model's own (TransformerCostFeatures).
inline constexpr int kNumCostFeatures = 6;
using CostFeatures = std::array<double, kNumCostFeatures>;

// A transformer's features for `layers` (L) attention layers of hidden size `embed_dim` (d), summed over `items`
// (N: an item's tokens; m, k: its expert count and width; docs/design.md section 2.7 for the costs):
//   0 batch            1 per batch
//   1 items            L per item (attention runs per item)
//   2 projections      L N d^2 per item (q/k/v/output projections and the MLP)
//   3 mita attention   L N (m + k) d per MiTA item (m shared-expert outputs + the k keys of the routed expert)
//   4 landmarks        L N m d per MiTA item (landmark pooling, the routing gate and the top-k selection)
//   5 full attention   L N^2 d per full-attention item
// Empty `items`: all zero.
CostFeatures TransformerCostFeatures(int64_t layers, int64_t embed_dim, absl::Span<const CostItem> items);

// Seconds per unit of each TransformerCostFeatures feature before any calibration, from a CPU core's rough rates:
// 0.5 ms per batch, 20 us per item and layer, about 16 GFLOP/s on the projections (16 flops per N d^2), 2 GFLOP/s
// on the gathered MiTA attention, 4 GFLOP/s on full attention.
CostFeatures TransformerPriorCoefficients();

}  // namespace mita::models
