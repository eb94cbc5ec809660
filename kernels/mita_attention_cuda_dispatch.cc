// Dispatch of MitaAttentionForward to the CUDA kernel (mita_attention_cuda.cu) for tensors on a CUDA device.
// Compiled by the host compiler against whatever LibTorch the build uses, CPU-only included: it touches CUDA
// tensors only through data_ptr(), strides and sizes, and the raw-pointer API (no c10/cuda headers), so it
// builds everywhere nvcc exists and runs where LibTorch has CUDA.
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "kernels/mita_attention_cuda.h"
#include "kernels/mita_attention_internal.h"

namespace mita::kernels::internal {

at::Tensor MitaAttentionCuda(const at::Tensor& q_input, const at::Tensor& k_input, const at::Tensor& v_input,
                             absl::Span<const MitaItem> items, std::vector<MitaItemStatistics>* statistics) {
  const at::Tensor q = WithContiguousRows(q_input), k = WithContiguousRows(k_input), v = WithContiguousRows(v_input);
  const int64_t batch = q.size(0), heads = q.size(1), tokens = q.size(2), head_dim = q.size(3);
  at::Tensor output = at::empty(q.sizes(), q.options());  // contiguous, q's device and dtype
  if (statistics != nullptr) statistics->assign(batch, MitaItemStatistics{});
  if (batch == 0) return output;

  std::vector<at::Tensor> landmarks(batch);
  std::vector<cuda::CudaMitaItem> cuda_items(batch);
  for (int64_t b = 0; b < batch; ++b) {
    landmarks[b] = items[b].landmarks.contiguous();
    cuda_items[b].landmarks = landmarks[b].data_ptr();
    cuda_items[b].expert_count = landmarks[b].size(1);
    cuda_items[b].expert_width = items[b].expert_width;
    cuda_items[b].token_count = items[b].token_count;
  }
  std::vector<HeadCounts> counts;
  std::vector<cuda::CudaHeadCounts> cuda_counts;
  if (statistics != nullptr) {
    counts.resize(batch * heads);
    cuda_counts.resize(batch * heads);
    for (int64_t task = 0; task < batch * heads; ++task) {
      counts[task].queries_per_expert.assign(cuda_items[task / heads].expert_count, 0);
      cuda_counts[task].queries_per_expert = counts[task].queries_per_expert.data();
    }
  }

  cuda::CudaMitaProblem problem;
  problem.type = q.scalar_type() == at::kBFloat16 ? cuda::ElementType::kBFloat16 : cuda::ElementType::kFloat32;
  problem.device = q.get_device();
  problem.batch = batch;
  problem.heads = heads;
  problem.tokens = tokens;
  problem.head_dim = head_dim;
  problem.q = q.data_ptr();
  problem.k = k.data_ptr();
  problem.v = v.data_ptr();
  for (int dimension = 0; dimension < 3; ++dimension) {
    // A single token's row stride is free in ATen; the kernel only multiplies it by token index 0.
    problem.q_strides[dimension] = q.stride(dimension);
    problem.k_strides[dimension] = k.stride(dimension);
    problem.v_strides[dimension] = v.stride(dimension);
  }
  problem.output = output.data_ptr();
  problem.items = cuda_items.data();
  problem.head_counts = statistics != nullptr ? cuda_counts.data() : nullptr;
  problem.stream = nullptr;  // the legacy default stream (LibTorch's current stream unless a caller changed it)
  // Scratch memory from LibTorch's caching allocator: reused between calls, counted in its statistics, and out of
  // memory is its c10::OutOfMemoryError (RESOURCE_EXHAUSTED). Freed when this call returns: the allocator hands
  // it out again only to work queued after this call's on the same stream.
  const size_t workspace_bytes = cuda::MitaCudaWorkspaceBytes(problem);
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(workspace_bytes)}, q.options().dtype(at::kByte));
  problem.workspace = workspace.data_ptr();
  problem.workspace_bytes = workspace_bytes;
  if (const std::string error = cuda::MitaAttentionForwardCuda(problem); !error.empty()) {
    throw std::runtime_error("CUDA MiTA kernel: " + error);
  }
  if (statistics != nullptr) {
    for (int64_t task = 0; task < batch * heads; ++task) {
      counts[task].pruned_keys = cuda_counts[task].pruned_keys;
      counts[task].overlapping_keys = cuda_counts[task].overlapping_keys;
    }
    for (int64_t b = 0; b < batch; ++b) {
      (*statistics)[b] =
          AverageOverHeads(absl::MakeConstSpan(counts).subspan(b * heads, heads), ItemTokens(items[b], tokens));
    }
  }
  return output;
}

}  // namespace mita::kernels::internal
