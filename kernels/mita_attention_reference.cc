// Reference MiTA forward from plain ATen ops (matmul, stable sort, softmax, argmax, gather): slow and memory
// hungry ([H, N, k, d] gathered keys per item), obviously correct. It mirrors docs/design.md section 2 line by
// line and is what tests compare the production CPU kernel (mita_attention_cpu.cc) against.
#include <cmath>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/log.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include "kernels/mita_attention_internal.h"

namespace mita::kernels::internal {
namespace {

// Copies an integer tensor [rows, columns] into nested vectors.
std::vector<std::vector<int64_t>> ToNestedVectors(const at::Tensor& tensor) {
  const at::Tensor cpu = tensor.to(at::kCPU, at::kLong).contiguous();
  const int64_t rows = cpu.size(0), columns = cpu.size(1);
  const int64_t* data = cpu.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> result(rows);
  for (int64_t r = 0; r < rows; ++r) result[r].assign(data + r * columns, data + (r + 1) * columns);
  return result;
}

// Statistics of one item from its routing, with tensor ops. expert_of_query: [H, N]; expert_keys: [H, M, k].
MitaItemStatistics ReferenceStatistics(const at::Tensor& expert_of_query, const at::Tensor& expert_keys,
                                       int64_t expert_count, int64_t tokens) {
  const int64_t heads = expert_of_query.size(0);
  const auto options = expert_of_query.options().dtype(at::kDouble);
  // Queries per expert [H, M] and the number of experts that selected each key [H, N].
  const at::Tensor load = at::zeros({heads, expert_count}, options)
                              .scatter_add_(1, expert_of_query, at::ones(expert_of_query.sizes(), options));
  const at::Tensor flat_keys = expert_keys.reshape({heads, -1});
  const at::Tensor selections =
      at::zeros({heads, tokens}, options).scatter_add_(1, flat_keys, at::ones(flat_keys.sizes(), options));

  const double mean_load = static_cast<double>(tokens) / static_cast<double>(expert_count);
  const at::Tensor imbalance = std::get<0>(load.max(1)).div(mean_load);
  const at::Tensor share = load.div(static_cast<double>(tokens));
  const at::Tensor share_log_share = at::where(share.gt(0), share.mul(at::log(share)), at::zeros_like(share));
  const at::Tensor entropy = expert_count == 1 ? at::ones({heads}, options)
                                               : share_log_share.sum(1).div(-std::log(static_cast<double>(expert_count)));

  MitaItemStatistics statistics;
  const at::Tensor mean_load_per_expert = load.mean(0).cpu().contiguous();
  const double* data = mean_load_per_expert.data_ptr<double>();
  statistics.queries_per_expert.assign(data, data + expert_count);
  statistics.load_imbalance = imbalance.mean().item<double>();
  statistics.routing_entropy = entropy.mean().item<double>();
  statistics.pruned_key_fraction = selections.eq(0).to(at::kDouble).mean().item<double>();
  statistics.expert_overlap_fraction = selections.ge(2).to(at::kDouble).mean().item<double>();
  return statistics;
}

}  // namespace

at::Tensor MitaAttentionReference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  absl::Span<const MitaItem> items, std::vector<MitaItemStatistics>* statistics,
                                  const MitaForwardOptions& options) {
  const int64_t batch = q.size(0), heads = q.size(1), all_tokens = q.size(2), head_dim = q.size(3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  at::Tensor output = at::empty(q.sizes(), q.options());
  if (statistics != nullptr) statistics->assign(batch, MitaItemStatistics{});
  if (options.routing != nullptr) options.routing->assign(batch * heads, MitaHeadRouting{});

  for (int64_t b = 0; b < batch; ++b) {
    // The item's own tokens (MitaItem::token_count); padding rows of the output are 0.
    const int64_t tokens = ItemTokens(items[b], all_tokens);
    const at::Tensor queries = q[b].narrow(1, 0, tokens), keys = k[b].narrow(1, 0, tokens);  // [H, N_b, d]
    const at::Tensor values = v[b].narrow(1, 0, tokens);
    const at::Tensor landmarks = items[b].landmarks;  // [H, M, d]
    const int64_t expert_count = landmarks.size(1);
    const int64_t width = items[b].expert_width;

    // Routed experts: S = l k^T (no scale); expert i owns the `width` keys with the largest S[i, :]. The stable
    // descending sort keeps the lower key index first among equal scores: the documented tie rule.
    const at::Tensor scores = at::matmul(landmarks, keys.transpose(1, 2));  // [H, M, N]
    const at::Tensor ranked = std::get<1>(at::sort(scores, /*stable=*/true, /*dim=*/-1, /*descending=*/true));
    const at::Tensor expert_keys = ranked.narrow(-1, 0, width);  // [H, M, k]

    // Routing: G = l q^T (no scale); e(n) = argmax_i G[i, n], which returns the first maximum on ties.
    const at::Tensor gate = at::matmul(landmarks, queries.transpose(1, 2));  // [H, M, N]
    const at::Tensor expert_of_query = at::argmax(gate, 1);                 // [H, N]

    // Routed logits q_n . k_j * s over the keys of expert e(n): gather [H, N, k] key indices, then [H, N, k, d].
    const at::Tensor keys_of_query =
        expert_keys.gather(1, expert_of_query.unsqueeze(-1).expand({heads, tokens, width}));  // [H, N, k]
    const at::Tensor flat_index =
        keys_of_query.add(at::arange(heads, keys_of_query.options()).mul_(tokens).view({heads, 1, 1})).reshape(-1);
    const at::Tensor routed_keys =
        keys.reshape({heads * tokens, head_dim}).index_select(0, flat_index).view({heads, tokens, width, head_dim});
    const at::Tensor routed_values =
        values.reshape({heads * tokens, head_dim}).index_select(0, flat_index).view({heads, tokens, width, head_dim});
    const at::Tensor routed_logits = at::matmul(routed_keys, queries.unsqueeze(-1)).squeeze(-1).mul(scale);

    at::Tensor item_output;
    if (options.include_shared_expert) {
      // Shared expert A = softmax(S * s) v [H, M, d]; compressed logits q_n . l_i * s * s.
      const at::Tensor shared = at::matmul(at::softmax(scores.mul(scale), -1), values);
      const at::Tensor compressed_logits = at::matmul(queries, landmarks.transpose(1, 2)).mul(scale * scale);
      // One softmax over the M + k logits.
      const at::Tensor weights = at::softmax(at::cat({compressed_logits, routed_logits}, -1), -1);
      item_output = at::matmul(weights.narrow(-1, 0, expert_count), shared)
                        .add(at::matmul(weights.narrow(-1, expert_count, width).unsqueeze(-2), routed_values)
                                 .squeeze(-2));
    } else {
      const at::Tensor weights = at::softmax(routed_logits, -1);
      item_output = at::matmul(weights.unsqueeze(-2), routed_values).squeeze(-2);
    }
    output[b].narrow(1, 0, tokens).copy_(item_output);
    output[b].narrow(1, tokens, all_tokens - tokens).zero_();

    if (statistics != nullptr) {
      (*statistics)[b] = ReferenceStatistics(expert_of_query, expert_keys, expert_count, tokens);
    }
    if (options.routing != nullptr) {
      const at::Tensor query_experts = expert_of_query.to(at::kCPU).contiguous();
      const at::Tensor sorted_keys = std::get<0>(expert_keys.sort(-1));  // ascending key index
      for (int64_t h = 0; h < heads; ++h) {
        MitaHeadRouting& routing = (*options.routing)[b * heads + h];
        const int64_t* experts = query_experts[h].data_ptr<int64_t>();
        routing.expert_of_query.assign(experts, experts + tokens);
        routing.expert_keys = ToNestedVectors(sorted_keys[h]);
      }
    }
  }
  return output;
}

}  // namespace mita::kernels::internal
