// Validation, backend dispatch, landmarks and full attention (docs/design.md section 2; arXiv 2602.01219).
// The MiTA backends live in mita_attention_cpu.cc (production) and mita_attention_reference.cc (tests).
#include "kernels/mita_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <ATen/ops/adaptive_avg_pool1d.h>
#include <ATen/ops/adaptive_avg_pool2d.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scaled_dot_product_attention.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/aten_errors.h"
#include "kernels/forward_scopes.h"
#include "kernels/mita_attention_internal.h"
#ifdef MITA_HAVE_CUDA
#include "kernels/mita_attention_cuda.h"
#endif

namespace mita::kernels {
namespace {

// "[2, 4, 197, 32]".
std::string ShapeString(const at::Tensor& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.sizes(), ", "), "]");
}

std::string DtypeName(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    default:
      return c10::toString(type);
  }
}

// `tensor` is defined, 4-D [B, H, N, d], and float32, float64 or bfloat16.
absl::Status CheckAttentionInput(const at::Tensor& tensor, const char* name) {
  if (!tensor.defined()) return absl::InvalidArgumentError(absl::StrCat(name, " is undefined"));
  if (tensor.dim() != 4) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be a 4-D tensor [B, H, N, d], got ", tensor.dim(),
                                                   "-D shape ", ShapeString(tensor)));
  }
  const at::ScalarType type = tensor.scalar_type();
  if (type != at::kFloat && type != at::kDouble && type != at::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has dtype ", DtypeName(type),
                                                   "; supported dtypes are float32, float64 and bfloat16"));
  }
  return absl::OkStatus();
}

// `tensor` (k, v or landmarks, called `name` in errors) has q's dtype and device.
absl::Status CheckSameDtypeAndDeviceAsQuery(const at::Tensor& tensor, absl::string_view name, const at::Tensor& q) {
  if (tensor.scalar_type() != q.scalar_type()) {
    return absl::InvalidArgumentError(absl::StrCat(name, " dtype ", DtypeName(tensor.scalar_type()),
                                                   " differs from q dtype ", DtypeName(q.scalar_type())));
  }
  if (tensor.device() != q.device()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " is on device ", tensor.device().str(), " but q is on device ", q.device().str()));
  }
  return absl::OkStatus();
}

// k and v: same shape, dtype and device as q (self-attention).
absl::Status CheckQueryKeyValue(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const auto& [tensor, name] : {std::pair<const at::Tensor&, const char*>{q, "q"}, {k, "k"}, {v, "v"}}) {
    if (absl::Status status = CheckAttentionInput(tensor, name); !status.ok()) return status;
  }
  for (const auto& [tensor, name] : {std::pair<const at::Tensor&, const char*>{k, "k"}, {v, "v"}}) {
    if (tensor.sizes() != q.sizes()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " shape ", ShapeString(tensor), " differs from q shape ", ShapeString(q)));
    }
    if (absl::Status status = CheckSameDtypeAndDeviceAsQuery(tensor, name, q); !status.ok()) return status;
  }
  return absl::OkStatus();
}

// Runs `body` and turns the exceptions ATen may throw (out of memory, internal checks) into a Status
// (CurrentExceptionStatus, aten_errors.h).
template <typename Body>
absl::StatusOr<at::Tensor> RunWithoutThrowing(const char* operation, Body&& body) {
  try {
    return body();
  } catch (const std::exception&) {
    return CurrentExceptionStatus(operation);
  }
}

// Largest integer whose square is <= value (value >= 0), exact for all int64 values.
int64_t IntegerSquareRoot(int64_t value) {
  int64_t root = static_cast<int64_t>(std::sqrt(static_cast<double>(value)));
  while (root > 0 && root * root > value) --root;
  while ((root + 1) * (root + 1) <= value) ++root;
  return root;
}

// Landmarks on the CPU: the tokens 0 .. rows * columns - 1 of q laid row-major on a rows x columns grid, each of
// the pool_rows x pool_columns windows averaged straight from q's rows (in the models' strided views of the fused
// qkv output a row's d values are contiguous). Window (i, j) covers grid rows [floor(i rows / pool_rows),
// ceil((i + 1) rows / pool_rows)) and the columns likewise. Sums run in T over the window's rows, then its columns,
// and are divided by the window's token count: adaptive_avg_pool2d's order and precision (adaptive_avg_pool1d's
// with one row), so the landmarks are the ones LibTorch's pooling gives, bit for bit.
// LibTorch pools a permuted copy instead, several times slower (docs/kernels.md, "Phases and floors").
// Returns [B, H, pool_rows * pool_columns, d], landmark index = window row * pool_columns + window column.
template <typename T>
at::Tensor GridLandmarksOnCpu(const at::Tensor& q, int64_t rows, int64_t columns, int64_t pool_rows,
                              int64_t pool_columns) {
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(3);
  const int64_t windows = pool_rows * pool_columns;
  at::Tensor landmarks = at::empty({batch, heads, windows, head_dim}, q.options());
  const T* q_data = q.data_ptr<T>();
  T* out = landmarks.data_ptr<T>();
  const int64_t row_stride = q.stride(2), value_stride = q.stride(3);
  // Tasks of at least 2^15 values summed, so that a small input's landmarks stay on the calling thread.
  const int64_t values_per_window = ((rows * columns + windows - 1) / windows) * head_dim;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, values_per_window));
  at::parallel_for(0, batch * heads * windows, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> sums(head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head_task = task / windows, window = task % windows;
      const int64_t b = head_task / heads, h = head_task % heads;
      const int64_t window_row = window / pool_columns, window_column = window % pool_columns;
      const int64_t first_row = window_row * rows / pool_rows;
      const int64_t last_row = ((window_row + 1) * rows + pool_rows - 1) / pool_rows;  // exclusive
      const int64_t first_column = window_column * columns / pool_columns;
      const int64_t last_column = ((window_column + 1) * columns + pool_columns - 1) / pool_columns;  // exclusive
      const T* head = q_data + b * q.stride(0) + h * q.stride(1);
      std::fill(sums.begin(), sums.end(), T(0));
      T* __restrict__ window_sums = sums.data();
      for (int64_t row = first_row; row < last_row; ++row) {
        for (int64_t column = first_column; column < last_column; ++column) {
          const T* token = head + (row * columns + column) * row_stride;
          if (value_stride == 1) {
            // Contiguous channels (a fused qkv projection's rows): a loop the compiler vectorises, each channel's sum
            // still in token order.
            for (int64_t c = 0; c < head_dim; ++c) window_sums[c] += token[c];
          } else {
            for (int64_t c = 0; c < head_dim; ++c) window_sums[c] += token[c * value_stride];
          }
        }
      }
      const T count = static_cast<T>((last_row - first_row) * (last_column - first_column));
      T* landmark = out + task * head_dim;
      for (int64_t c = 0; c < head_dim; ++c) landmark[c] = sums[c] / count;
    }
  });
  return landmarks;
}

// True where GridLandmarksOnCpu serves q pooled into `windows` landmarks. LibTorch's pooling serves the rest: CUDA,
// bfloat16, and one window (a global mean, which LibTorch sums in another order).
bool LandmarksOnCpu(const at::Tensor& q, int64_t windows) {
  return windows > 1 && q.device().is_cpu() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble);
}

}  // namespace

namespace internal {

absl::Status ValidateMitaArguments(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   absl::Span<const MitaItem> items) {
  if (absl::Status status = CheckQueryKeyValue(q, k, v); !status.ok()) return status;
  const int64_t batch = q.size(0), heads = q.size(1), tokens = q.size(2), head_dim = q.size(3);
  if (heads < 1) return absl::InvalidArgumentError(absl::StrCat("q has H = ", heads, " heads; need H >= 1"));
  if (tokens < 1) return absl::InvalidArgumentError(absl::StrCat("q has N = ", tokens, " tokens; need N >= 1"));
  if (head_dim < 1) {
    return absl::InvalidArgumentError(absl::StrCat("q has head dimension d = ", head_dim, "; need d >= 1"));
  }
  if (static_cast<int64_t>(items.size()) != batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("items.size() ", items.size(), " differs from the batch size B = ", batch, " of q"));
  }
  for (size_t b = 0; b < items.size(); ++b) {
    const at::Tensor& landmarks = items[b].landmarks;
    const std::string name = absl::StrCat("items[", b, "].landmarks");
    if (!landmarks.defined()) return absl::InvalidArgumentError(absl::StrCat(name, " is undefined"));
    if (landmarks.dim() != 3 || landmarks.size(0) != heads || landmarks.size(1) < 1 ||
        landmarks.size(2) != head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must have shape [H, M, d] = [", heads, ", M >= 1, ",
                                                     head_dim, "], got ", ShapeString(landmarks)));
    }
    if (absl::Status status = CheckSameDtypeAndDeviceAsQuery(landmarks, name, q); !status.ok()) return status;
    const int64_t token_count = items[b].token_count;
    if (token_count < 0 || token_count > tokens) {
      return absl::InvalidArgumentError(absl::StrCat("items[", b, "].token_count ", token_count,
                                                     " is outside [0, ", tokens, "] (N = ", tokens,
                                                     "; 0 = all N)"));
    }
    const int64_t item_tokens = ItemTokens(items[b], tokens);
    const int64_t width = items[b].expert_width;
    if (width < 1 || width > item_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("items[", b, "].expert_width ", width, " is outside [1, ",
                                                     item_tokens, "] (the item's token count)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> MitaAttentionForwardWithOptions(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, absl::Span<const MitaItem> items,
                                                           std::vector<MitaItemStatistics>* statistics,
                                                           MitaBackend backend, const MitaForwardOptions& options) {
  RECORD_USER_SCOPE(kMitaAttentionScope);
  if (absl::Status status = ValidateMitaArguments(q, k, v, items); !status.ok()) return status;
  return RunWithoutThrowing("MiTA attention", [&]() -> at::Tensor {
    at::NoGradGuard no_grad;
    if (backend == MitaBackend::kReference) return MitaAttentionReference(q, k, v, items, statistics, options);
    if (q.device().is_cpu()) return MitaAttentionCpu(q, k, v, items, statistics, options);
#ifdef MITA_HAVE_CUDA
    // The CUDA kernel takes float32 and bfloat16 and has no test hooks (routing, no shared expert).
    const bool cuda_kernel_applies = q.is_cuda() && q.scalar_type() != at::kDouble &&
                                     q.size(3) <= cuda::kMaxCudaHeadDim && options.routing == nullptr &&
                                     options.include_shared_expert;
    if (cuda_kernel_applies) return MitaAttentionCuda(q, k, v, items, statistics);
#endif
    // Other devices and cases: the reference (device-agnostic ATen ops).
    return MitaAttentionReference(q, k, v, items, statistics, options);
  });
}

}  // namespace internal

absl::StatusOr<at::Tensor> MitaAttentionForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                absl::Span<const MitaItem> items,
                                                std::vector<MitaItemStatistics>* statistics,
                                                MitaBackend backend) {
  return internal::MitaAttentionForwardWithOptions(q, k, v, items, statistics, backend,
                                                   internal::MitaForwardOptions{});
}

// The most scores (items x heads x N^2) one fused CPU full-attention call may have: 2^24 (64 MiB of float32 were
// they materialised; tens of ms of work here, so a caller that leaves waits no longer).
constexpr int64_t kMaxFusedCpuScoreElements = int64_t{1} << 24;

absl::StatusOr<at::Tensor> FullAttentionForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const AttentionInterrupt& interrupt) {
  RECORD_USER_SCOPE(kFullAttentionScope);
  if (absl::Status status = CheckQueryKeyValue(q, k, v); !status.ok()) return status;
  return RunWithoutThrowing("full attention", [&]() -> at::Tensor {
    at::NoGradGuard no_grad;
    if (q.numel() > 0 && internal::UsesShortFullAttention(q)) {
      // Short inputs on the CPU: each (item, head, block of queries) on one thread, the output in the heads-merged
      // layout; `interrupt` asked once per item.
      std::vector<int64_t> skipped;
      for (int64_t b = 0; interrupt && b < q.size(0); ++b) {
        if (interrupt(b)) skipped.push_back(b);
      }
      return internal::ShortFullAttentionCpu(q, k, v, skipped);
    }
    // On a CUDA device, and on the CPU in bfloat16 when an item's scores are few (images: 4 heads x 50^2):
    // LibTorch's fused scaled-dot-product attention (FlashAttention or memory-efficient attention on CUDA, its
    // flash kernel on the CPU, O(N) memory, parallel over items and heads), on the CPU in groups of items of at
    // most 2^24 scores, on CUDA on the whole batch. `interrupt` is asked once per item before its group starts.
    // Per (item, head) ATen calls cost microseconds each, more than a small head's arithmetic, and run on one
    // thread.
    const int64_t item_scores = q.numel() == 0 ? 0 : q.size(1) * q.size(2) * q.size(2);
    if (q.numel() > 0 && (q.is_cuda() || item_scores <= kMaxFusedCpuScoreElements)) {
      const int64_t batch = q.size(0);
      const int64_t group = q.is_cuda() ? batch : std::max<int64_t>(1, kMaxFusedCpuScoreElements / item_scores);
      // Items [first, first + length): their attention, the rows of items whose caller left zeroed.
      auto attend = [&](int64_t first, int64_t length) {
        std::vector<int64_t> stopped;
        for (int64_t b = first; interrupt && b < first + length; ++b) {
          if (interrupt(b)) stopped.push_back(b - first);
        }
        // Contiguous inputs (strided views of a fused qkv otherwise): the fused kernels' layout checks then pass
        // at every head size, instead of a fall-back to the math path and its N x N scores.
        at::Tensor attended = at::scaled_dot_product_attention(q.narrow(0, first, length).contiguous(),
                                                               k.narrow(0, first, length).contiguous(),
                                                               v.narrow(0, first, length).contiguous())
                                  .contiguous();
        for (int64_t b : stopped) attended[b].zero_();
        return attended;
      };
      if (group >= batch) return attend(0, batch);
      at::Tensor output = at::empty(q.sizes(), q.options());
      for (int64_t first = 0; first < batch; first += group) {
        const int64_t length = std::min(group, batch - first);
        output.narrow(0, first, length).copy_(attend(first, length));
      }
      return output;
    }
    at::Tensor output = at::empty(q.sizes(), q.options());
    if (q.numel() == 0) return output;
    // Longer items (documents of thousands of tokens): the same fused kernel per item on chunks of its queries
    // against all its keys, each chunk of at most 2^24 scores, `interrupt` asked before every chunk.
    const int64_t batch = q.size(0), heads = q.size(1), tokens = q.size(2);
    const int64_t chunk = std::clamp<int64_t>(kMaxFusedCpuScoreElements / (heads * tokens), 1, tokens);
    for (int64_t b = 0; b < batch; ++b) {
      const at::Tensor queries = q.narrow(0, b, 1), keys = k.narrow(0, b, 1).contiguous();
      const at::Tensor values = v.narrow(0, b, 1).contiguous();
      const at::Tensor item_output = output.narrow(0, b, 1);
      for (int64_t start = 0; start < tokens; start += chunk) {
        if (interrupt && interrupt(b)) {
          item_output.narrow(2, start, tokens - start).zero_();
          break;
        }
        const int64_t length = std::min(chunk, tokens - start);
        item_output.narrow(2, start, length)
            .copy_(at::scaled_dot_product_attention(queries.narrow(2, start, length).contiguous(), keys, values));
      }
    }
    return output;
  });
}

absl::StatusOr<at::Tensor> ImageLandmarks(const at::Tensor& q, int64_t pool_side) {
  RECORD_USER_SCOPE(kLandmarksScope);
  if (absl::Status status = CheckAttentionInput(q, "q"); !status.ok()) return status;
  const int64_t batch = q.size(0), heads = q.size(1), tokens = q.size(2), head_dim = q.size(3);
  const int64_t side = tokens >= 2 ? IntegerSquareRoot(tokens - 1) : 0;
  if (tokens < 2 || side * side != tokens - 1) {
    return absl::InvalidArgumentError(absl::StrCat("q has N = ", tokens,
                                                   " tokens; image landmarks need N - 1 to be a positive perfect "
                                                   "square (a cls token plus an S x S patch grid)"));
  }
  if (pool_side < 1 || pool_side > side) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool_side ", pool_side, " is outside [1, ", side, "] (the patch grid side S)"));
  }
  return RunWithoutThrowing("image landmarks", [&]() -> at::Tensor {
    at::NoGradGuard no_grad;
    if (batch * heads * head_dim == 0) return at::empty({batch, heads, pool_side * pool_side, head_dim}, q.options());
    // Tokens 0 .. N-2 (cls first, last patch dropped: the official code's one-token shift) on the S x S grid.
    if (LandmarksOnCpu(q, pool_side * pool_side)) {
      return AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "ImageLandmarks", [&] {
        return GridLandmarksOnCpu<scalar_t>(q, side, side, pool_side, pool_side);
      });
    }
    const at::Tensor grid = q.narrow(2, 0, tokens - 1).reshape({batch * heads, side, side, head_dim});
    // adaptive_avg_pool2d's window i is [floor(i*S/P), ceil((i+1)*S/P)), as in the official code.
    const at::Tensor pooled = at::adaptive_avg_pool2d(grid.permute({0, 3, 1, 2}), {pool_side, pool_side});
    return pooled.permute({0, 2, 3, 1}).reshape({batch, heads, pool_side * pool_side, head_dim}).contiguous();
  });
}

absl::StatusOr<at::Tensor> SequenceLandmarks(const at::Tensor& q, int64_t expert_count) {
  RECORD_USER_SCOPE(kLandmarksScope);
  if (absl::Status status = CheckAttentionInput(q, "q"); !status.ok()) return status;
  const int64_t batch = q.size(0), heads = q.size(1), tokens = q.size(2), head_dim = q.size(3);
  if (expert_count < 1 || expert_count > tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert_count ", expert_count, " is outside [1, ", tokens, "] (N = ", tokens, ")"));
  }
  return RunWithoutThrowing("sequence landmarks", [&]() -> at::Tensor {
    at::NoGradGuard no_grad;
    if (batch * heads * head_dim == 0) return at::empty({batch, heads, expert_count, head_dim}, q.options());
    if (LandmarksOnCpu(q, expert_count)) {
      return AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "SequenceLandmarks", [&] {
        return GridLandmarksOnCpu<scalar_t>(q, /*rows=*/1, tokens, /*pool_rows=*/1, expert_count);
      });
    }
    // adaptive_avg_pool1d's window i is [floor(i*N/M), ceil((i+1)*N/M)).
    const at::Tensor sequence = q.reshape({batch * heads, tokens, head_dim}).transpose(1, 2);  // [B*H, d, N]
    const at::Tensor pooled = at::adaptive_avg_pool1d(sequence, {expert_count});           // [B*H, d, M]
    return pooled.transpose(1, 2).reshape({batch, heads, expert_count, head_dim}).contiguous();
  });
}

}  // namespace mita::kernels
