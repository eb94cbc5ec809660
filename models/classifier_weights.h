// Weight loading shared by the classifiers (vit_classifier.cc, document_classifier.cc): named float32 tensors
// (timm's naming) taken out of a package's weight map with their shapes checked, and the parameters of the
// pre-norm transformer block both classifiers use. Internal to models/.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "models/classifier.h"

namespace mita::models::internal {

// "[2, 3, 4]": a tensor shape for error messages.
std::string ShapeString(at::IntArrayRef shape);

// Takes the tensor `name` out of `weights` after checking it: shape `expected_shape`, float32, on the CPU;
// `target` receives it contiguous. Errors: INVALID_ARGUMENT "weights: missing tensor ..." (with the expected
// shape), "... has shape [..], expected [..]" or "... must be float32 on the CPU".
absl::Status TakeWeight(std::map<std::string, at::Tensor>& weights, const std::string& name,
                        std::vector<int64_t> expected_shape, at::Tensor& target);

// Runs a sequence of TakeWeight calls on one weight map, keeping the first error (later calls do nothing).
class WeightTaker {
 public:
  explicit WeightTaker(std::map<std::string, at::Tensor>& weights) : weights_(weights) {}

  void Take(const std::string& name, std::vector<int64_t> shape, at::Tensor& target);

  // The first error of the Take calls; else INVALID_ARGUMENT "weights: unexpected tensor(s) "a", "b""
  // followed by `unexpected_hint` when tensors are left in the map; else OK.
  absl::Status Finish(absl::string_view unexpected_hint = "") const;

 private:
  std::map<std::string, at::Tensor>& weights_;
  absl::Status status_;
};

// The parameters of one pre-norm transformer block: x + proj(attention(qkv(norm1(x)))), then
// x + fc2(gelu(fc1(norm2(x)))); C channels, `hidden` MLP channels.
struct TransformerBlockWeights {
  at::Tensor norm1_weight, norm1_bias;  // [C], [C]
  at::Tensor qkv_weight, qkv_bias;      // [3C, C], [3C]
  at::Tensor proj_weight, proj_bias;    // [C, C], [C]
  at::Tensor norm2_weight, norm2_bias;  // [C], [C]
  at::Tensor fc1_weight, fc1_bias;      // [hidden, C], [hidden]
  at::Tensor fc2_weight, fc2_bias;      // [C, hidden], [C]

  // The 12 tensors, for PlaceWeights.
  std::vector<at::Tensor*> All() {
    return {&norm1_weight, &norm1_bias, &qkv_weight,  &qkv_bias,  &proj_weight, &proj_bias,
            &norm2_weight, &norm2_bias, &fc1_weight, &fc1_bias, &fc2_weight,  &fc2_bias};
  }
};

// Moves each of `weights` (float32 CPU tensors, checked by TakeWeight) to `placement`'s device and dtype, in place
// (a classifier's Create; CheckPlacement(placement) has passed). Errors: RESOURCE_EXHAUSTED when the device's
// memory runs out; INTERNAL for another ATen failure.
absl::Status PlaceWeights(const std::vector<at::Tensor*>& weights, const Placement& placement);

// The description fields of `placement` (device and weights_dtype).
void DescribePlacement(const Placement& placement, ClassifierDescription& description);

// Options of the host tensor a batch's inputs are packed into before they go to `placement`'s device: pinned
// (page-locked) memory for a CUDA device, so that the copy runs without a staging copy and without making the
// host wait; ordinary memory on the CPU.
at::TensorOptions HostStagingOptions(const Placement& placement, at::ScalarType dtype);

// `input` (a CPU tensor) on `placement`'s device in `dtype`: `input` itself on the CPU when the dtype matches;
// copied without the host waiting when the device is CUDA and `input` is pinned (then converted there).
at::Tensor ToPlacement(const at::Tensor& input, const Placement& placement, at::ScalarType dtype);

// `logits` as float32 on the CPU, a normal (not inference-mode) tensor that callers may modify in place: a copy
// (from the device: the one wait for its work).
at::Tensor LogitsOnCpu(const at::Tensor& logits);

// Takes `prefix`norm1.{weight,bias}, attn.qkv.{weight,bias} and attn.proj.{weight,bias}.
void TakeAttentionWeights(WeightTaker& taker, const std::string& prefix, int64_t channels,
                          TransformerBlockWeights& block);
// Takes `prefix`norm2.{weight,bias}, mlp.fc1.{weight,bias} and mlp.fc2.{weight,bias}.
void TakeMlpWeights(WeightTaker& taker, const std::string& prefix, int64_t channels, int64_t hidden,
                    TransformerBlockWeights& block);

}  // namespace mita::models::internal
