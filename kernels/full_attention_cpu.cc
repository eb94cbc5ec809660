// Full softmax attention on the CPU for short inputs (FullAttentionForward's path for images and short documents,
// mita_attention_internal.h): per (item, head, block of queries) on one thread, the block's scores against every
// key (one GEMM on q's and k's rows where they lie, scaled by 1/sqrt(d)), the max-subtracted softmax (the MiTA
// kernel's vector row primitives), and the block's output (one GEMM with v's rows, each row then scaled by its
// inverse sum), written straight into the heads-merged layout [B, N, H, d].
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "kernels/cpu_blas.h"
#include "kernels/cpu_row_primitives.h"
#include "kernels/mita_attention_internal.h"

namespace mita::kernels::internal {

namespace {

// Queries per block: at least kMinBlockRows, at most kMaxBlockRows (their scores stay in a core's L2).
constexpr int64_t kMinBlockRows = 16, kMaxBlockRows = 128;

// Queries [begin, end) of one (item, head): output rows at `out` (row stride out_stride), `scores` and
// `inverse_sums` the thread's scratch of at least (end - begin) * N and (end - begin) values.
template <typename T>
void AttendBlock(HeadRows<T> q, HeadRows<T> k, HeadRows<T> v, int64_t tokens, int64_t head_dim, int64_t begin,
                 int64_t end, T* out, int64_t out_stride, T* scores, T* inverse_sums) {
  const int64_t rows = end - begin;
  const T scale = T(1) / std::sqrt(static_cast<T>(head_dim));
  // scores[rows, N] = scale q[begin, end) k^T (column-major: scores^T = scale k q^T).
  Gemm('T', 'N', tokens, rows, head_dim, scale, k.data, k.stride, q.data + begin * q.stride, q.stride, T(0), scores,
       tokens);
  UnnormalisedSoftmaxRows(scores, rows, tokens, tokens, inverse_sums);
  MatmulAccumulate(scores, tokens, v.data, v.stride, out, out_stride, rows, head_dim, tokens,
                   /*accumulate=*/false);
  for (int64_t row = 0; row < rows; ++row) {
    T* out_row = out + row * out_stride;
    for (int64_t channel = 0; channel < head_dim; ++channel) out_row[channel] *= inverse_sums[row];
  }
}

template <typename T>
void ShortFullAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& merged,
                        absl::Span<const int64_t> skipped_items) {
  const int64_t batch = q.size(0), heads = q.size(1), tokens = q.size(2), head_dim = q.size(3);
  // Blocks of queries: enough tasks for every thread twice over, within the bounds above.
  const int64_t wanted_blocks = (2 * at::get_num_threads() + batch * heads - 1) / (batch * heads);
  const int64_t block_rows =
      std::clamp<int64_t>((tokens + wanted_blocks - 1) / wanted_blocks, kMinBlockRows, kMaxBlockRows);
  const int64_t blocks = (tokens + block_rows - 1) / block_rows;
  T* merged_data = merged.data_ptr<T>();  // [B, N, H, d]
  at::parallel_for(0, batch * heads * blocks, /*grain_size=*/1, [&](int64_t first, int64_t last) {
    const OneThreadBlas one_thread_blas;
    std::vector<T> scores(block_rows * tokens), inverse_sums(block_rows);
    for (int64_t task = first; task < last; ++task) {
      const int64_t item = task / (heads * blocks), head = task / blocks % heads, block = task % blocks;
      const int64_t begin = block * block_rows, end = std::min(tokens, begin + block_rows);
      T* out = merged_data + ((item * tokens + begin) * heads + head) * head_dim;
      if (std::find(skipped_items.begin(), skipped_items.end(), item) != skipped_items.end()) {
        for (int64_t row = begin; row < end; ++row) std::fill_n(out + (row - begin) * heads * head_dim, head_dim, T(0));
        continue;
      }
      AttendBlock(RowsOf<T>(q, item, head), RowsOf<T>(k, item, head), RowsOf<T>(v, item, head), tokens, head_dim,
                  begin, end, out, heads * head_dim, scores.data(), inverse_sums.data());
    }
  });
}

}  // namespace

bool UsesShortFullAttention(const at::Tensor& q) {
  return q.device().is_cpu() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble) &&
         q.size(2) <= kMaxShortFullAttentionTokens && BlasLibrary::Get().has_thread_local_threads();
}

at::Tensor ShortFullAttentionCpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 absl::Span<const int64_t> skipped_items) {
  const at::Tensor q_rows = WithContiguousRows(q), k_rows = WithContiguousRows(k), v_rows = WithContiguousRows(v);
  at::Tensor merged = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  if (merged.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "ShortFullAttentionCpu", [&] {
      ShortFullAttention<scalar_t>(q_rows, k_rows, v_rows, merged, skipped_items);
    });
  }
  return merged.transpose(1, 2);
}

}  // namespace mita::kernels::internal
