#include "models/classifier_weights.h"

#include <utility>

#include <exception>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/aten_errors.h"
#include "kernels/device.h"

namespace mita::models::internal {

std::string ShapeString(at::IntArrayRef shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

absl::Status TakeWeight(std::map<std::string, at::Tensor>& weights, const std::string& name,
                        std::vector<int64_t> expected_shape, at::Tensor& target) {
  auto it = weights.find(name);
  if (it == weights.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights: missing tensor \"", name, "\" (expected shape ", ShapeString(expected_shape), ")"));
  }
  const at::Tensor& tensor = it->second;
  if (!tensor.defined() || tensor.sizes() != at::IntArrayRef(expected_shape)) {
    return absl::InvalidArgumentError(absl::StrCat("weights: tensor \"", name, "\" has shape ",
                                                   tensor.defined() ? ShapeString(tensor.sizes()) : "(undefined)",
                                                   ", expected ", ShapeString(expected_shape)));
  }
  if (tensor.scalar_type() != at::kFloat || !tensor.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat("weights: tensor \"", name, "\" must be float32 on the CPU"));
  }
  target = tensor.contiguous();
  weights.erase(it);
  return absl::OkStatus();
}

void WeightTaker::Take(const std::string& name, std::vector<int64_t> shape, at::Tensor& target) {
  if (status_.ok()) status_ = TakeWeight(weights_, name, std::move(shape), target);
}

absl::Status WeightTaker::Finish(absl::string_view unexpected_hint) const {
  if (!status_.ok()) return status_;
  if (weights_.empty()) return absl::OkStatus();
  std::vector<std::string> extra;
  for (const auto& [name, tensor] : weights_) extra.push_back(name);
  return absl::InvalidArgumentError(absl::StrCat("weights: unexpected tensor", extra.size() > 1 ? "s " : " ", "\"",
                                                 absl::StrJoin(extra, "\", \""), "\"", unexpected_hint));
}

void TakeAttentionWeights(WeightTaker& taker, const std::string& prefix, int64_t channels,
                          TransformerBlockWeights& block) {
  taker.Take(prefix + "norm1.weight", {channels}, block.norm1_weight);
  taker.Take(prefix + "norm1.bias", {channels}, block.norm1_bias);
  taker.Take(prefix + "attn.qkv.weight", {3 * channels, channels}, block.qkv_weight);
  taker.Take(prefix + "attn.qkv.bias", {3 * channels}, block.qkv_bias);
  taker.Take(prefix + "attn.proj.weight", {channels, channels}, block.proj_weight);
  taker.Take(prefix + "attn.proj.bias", {channels}, block.proj_bias);
}

void TakeMlpWeights(WeightTaker& taker, const std::string& prefix, int64_t channels, int64_t hidden,
                    TransformerBlockWeights& block) {
  taker.Take(prefix + "norm2.weight", {channels}, block.norm2_weight);
  taker.Take(prefix + "norm2.bias", {channels}, block.norm2_bias);
  taker.Take(prefix + "mlp.fc1.weight", {hidden, channels}, block.fc1_weight);
  taker.Take(prefix + "mlp.fc1.bias", {hidden}, block.fc1_bias);
  taker.Take(prefix + "mlp.fc2.weight", {channels, hidden}, block.fc2_weight);
  taker.Take(prefix + "mlp.fc2.bias", {channels}, block.fc2_bias);
}

absl::Status PlaceWeights(const std::vector<at::Tensor*>& weights, const Placement& placement) {
  if (placement.device.is_cpu() && placement.weights_dtype == at::kFloat) return absl::OkStatus();
  try {
    for (at::Tensor* weight : weights) {
      if (weight->defined()) *weight = weight->to(placement.device, placement.weights_dtype).contiguous();
    }
    return absl::OkStatus();
  } catch (const std::exception&) {
    return kernels::CurrentExceptionStatus(absl::StrCat("placing the weights on ", kernels::DeviceName(placement.device),
                                                        " in ", kernels::DtypeName(placement.weights_dtype)));
  }
}

void DescribePlacement(const Placement& placement, ClassifierDescription& description) {
  description.device = kernels::DeviceName(placement.device);
  description.weights_dtype = kernels::DtypeName(placement.weights_dtype);
}

at::TensorOptions HostStagingOptions(const Placement& placement, at::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).pinned_memory(placement.device.is_cuda());
}

at::Tensor ToPlacement(const at::Tensor& input, const Placement& placement, at::ScalarType dtype) {
  if (placement.device.is_cpu()) return input.to(dtype);
  // Copy in the source dtype first: a conversion on the host would make an unpinned temporary.
  const bool pinned = input.is_pinned();
  return input.to(placement.device, input.scalar_type(), /*non_blocking=*/pinned).to(dtype);
}

at::Tensor LogitsOnCpu(const at::Tensor& logits) {
  if (logits.device().is_cpu() && logits.scalar_type() == at::kFloat) return logits.clone();
  return logits.to(at::kCPU, at::kFloat);
}

}  // namespace mita::models::internal
