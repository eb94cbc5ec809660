// ViT/DeiT image classifier with MiTA attention (timm parameter names), built on kernels/.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/mita_attention.h"
#include "models/classifier.h"
#include "models/image_decoder.h"
#include "models/model_config.h"

namespace mita::models {

// A timm-style VisionTransformer whose attention is MiTA (optionally with the DWC variant). Forward:
// patch_embed.proj (conv, stride = patch) -> prepend cls_token -> + pos_embed -> depth x [x + attn(norm1(x));
// x + mlp(norm2(x))] -> norm -> head on the cls token. attn: qkv = Linear(C, 3C) ([q|k|v], head h owns channels
// h*d .. h*d+d-1), MiTA per head with image landmarks (kernels::ImageLandmarks), merge heads, (+ DWC on the
// patch tokens), proj. Dense layers run on all B*N tokens at once; attention runs per item with its own budget.
// As a Classifier it takes encoded PNG/JPEG images (decoded and preprocessed by Prepare, models/image_decoder.h).
class VitClassifier final : public Classifier {
 public:
  // Builds the model from float32 weights named as timm's ViT: patch_embed.proj.{weight,bias}, cls_token,
  // pos_embed, blocks.{i}.norm1.{weight,bias}, blocks.{i}.attn.qkv.{weight,bias}, blocks.{i}.attn.proj.{weight,
  // bias}, blocks.{i}.attn.dwc.{weight,bias} (DWC only), blocks.{i}.norm2, blocks.{i}.mlp.fc1, blocks.{i}.mlp.fc2,
  // norm, head. Errors: INVALID_ARGUMENT naming a missing tensor or one whose shape disagrees with the config
  // (expected and found shapes in the message) or that is not float32 on the CPU; unexpected extra tensors are an
  // error too (e.g. DWC weights in a package whose config has depthwise_conv false). INVALID_ARGUMENT when
  // `labels` does not hold num_classes entries. `name` is the model's name in its description. The weights are
  // then moved to `placement` (its device and dtype); CheckPlacement's errors, and RESOURCE_EXHAUSTED when the
  // device's memory runs out.
  static absl::StatusOr<std::unique_ptr<VitClassifier>> Create(std::string name, const VitConfig& config,
                                                               std::vector<std::string> labels,
                                                               std::map<std::string, at::Tensor> weights,
                                                               const Placement& placement = {});

  // images: [B, in_channels, image_size, image_size] float32 on the CPU (PreprocessImage output, stacked; pinned
  // memory lets the copy to a CUDA device run without the host waiting). The forward runs on placement().device
  // in placement().weights_dtype; the logits come back float32 on the CPU.
  // budgets: B entries, each valid (CheckBudget against ImageKnobs, checked again here); items may differ. Item b runs MiTA
  // with P = sqrt(expert_count) landmarks per side and expert_width keys per expert, or full softmax attention.
  // The result for an item does not depend on the other items of the batch (up to float rounding).
  // Runs under c10::InferenceMode; the returned logits are ordinary tensors. Thread-safe (const, no state).
  // statistics: resized to B; statistics[b] holds one entry per layer when want_statistics and item b ran MiTA.
  // Errors: INVALID_ARGUMENT for a wrong image shape, dtype or device, a budget count != B or an invalid budget;
  // RESOURCE_EXHAUSTED when memory runs out; INTERNAL when ATen or a kernel fails otherwise on validated input.
  // `check` (optional): asked for every running image before each layer and at the end; an image whose caller
  // left is taken out of the batch (its logits row is 0, ClassifierOutput::stopped[b] says why).
  absl::StatusOr<ClassifierOutput> Forward(const at::Tensor& images, absl::Span<const AttentionBudget> budgets,
                                           bool want_statistics,
                                           kernels::MitaBackend backend = kernels::MitaBackend::kAuto,
                                           const ItemCheck& check = nullptr) const;

  const VitConfig& config() const { return config_; }
  const Placement& placement() const { return placement_; }
  const ClassifierDescription& description() const override { return description_; }

  // Stacks the items' images [B, C, H, W] (in pinned memory for a CUDA device) and runs Forward with their budgets.
  absl::StatusOr<ClassifierOutput> Run(absl::Span<const BatchItem* const> items, bool want_statistics,
                                       const ItemCheck& check = nullptr) const override;

  ~VitClassifier() override;

 protected:
  // Decodes the image (limits: the config's max_image_side, the server's max_encoded_image_bytes) and
  // preprocesses it to [C, image_size, image_size]; tokens = config().tokens().
  PreparedInput SyntheticInput(int64_t tokens) const override;
  absl::StatusOr<PreparedInput> PrepareInput(const ClassifierInput& input, const InputLimits& limits,
                                             const StopCheck& stop) const override;
  absl::StatusOr<int64_t> InputPreparationBytes(const ClassifierInput& input,
                                                const InputLimits& limits) const override;
  // The decoder's limits: the config's max_image_side, and its image_size as the resize target.
  ImageDecodeLimits DecodeLimits() const;

 private:
  struct Block;
  VitClassifier(std::string name, VitConfig config, std::vector<std::string> labels);

  VitConfig config_;
  Placement placement_;
  ClassifierDescription description_;
  std::vector<Block> blocks_;  // defined in the .cc
  at::Tensor patch_weight_, patch_bias_, cls_token_, pos_embed_, norm_weight_, norm_bias_, head_weight_, head_bias_;
};

}  // namespace mita::models
