// MiTA-ViT forward (see vit_classifier.h). The training twin is tools/mita_reference.py (MitaVit); both follow
// docs/design.md section 2 and must agree to float32 rounding.
#include "models/vit_classifier.h"

#include <cmath>
#include <exception>
#include <utility>

#include <ATen/ops/cat.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/aten_errors.h"
#include "kernels/depthwise_convolution.h"
#include "kernels/forward_scopes.h"
#include "kernels/linear.h"
#include "models/classifier_errors.h"
#include "models/classifier_weights.h"
#include "kernels/status_macros.h"
#include "models/image_decoder.h"
#include "models/request_error.h"

namespace mita::models {

struct VitClassifier::Block : internal::TransformerBlockWeights {
  at::Tensor dwc_weight, dwc_bias;  // [C, 1, 3, 3], [C]; undefined without DWC
};

VitClassifier::VitClassifier(std::string name, VitConfig config, std::vector<std::string> labels)
    : config_(std::move(config)) {
  description_.name = std::move(name);
  description_.architecture = config_.architecture;
  description_.input_kind = InputKind::kImage;
  description_.image = ImageInputDescription{config_.image_size, config_.image_size, config_.in_channels,
                                             config_.max_image_side, config_.max_image_side};
  description_.labels = std::move(labels);
  description_.knobs = ImageKnobs(config_);
  description_.layers = config_.depth;
  description_.heads = config_.num_heads;
  description_.embed_dim = config_.embed_dim;
  description_.tokens_per_input = config_.tokens();
  description_.max_input_tokens = config_.tokens();
  description_.reference_tokens = config_.tokens();
}
VitClassifier::~VitClassifier() = default;

Classifier::PreparedInput VitClassifier::SyntheticInput(int64_t tokens) const {
  // A random image of the size the model classifies at (SyntheticItem checked `tokens` = tokens_per_input).
  return PreparedInput{at::rand({config_.in_channels, config_.image_size, config_.image_size}), tokens, tokens};
}

absl::StatusOr<std::unique_ptr<VitClassifier>> VitClassifier::Create(std::string name, const VitConfig& config,
                                                                     std::vector<std::string> labels,
                                                                     std::map<std::string, at::Tensor> weights,
                                                                     const Placement& placement) {
  RETURN_IF_ERROR(CheckPlacement(placement));
  if (config.embed_dim <= 0 || config.num_heads <= 0 || config.embed_dim % config.num_heads != 0 ||
      config.patch_size <= 0 || config.image_size % config.patch_size != 0 || config.depth <= 0) {
    return absl::InvalidArgumentError("config: inconsistent model dimensions (use ParseVitConfig)");
  }
  if (static_cast<int64_t>(labels.size()) != config.num_classes) {
    return absl::InvalidArgumentError(
        absl::StrCat("labels: ", labels.size(), " labels for ", config.num_classes, " classes"));
  }
  const int64_t channels = config.embed_dim;
  const int64_t hidden = config.mlp_hidden_dim;
  std::unique_ptr<VitClassifier> model(new VitClassifier(std::move(name), config, std::move(labels)));
  internal::WeightTaker taker(weights);
  taker.Take("patch_embed.proj.weight", {channels, config.in_channels, config.patch_size, config.patch_size},
             model->patch_weight_);
  taker.Take("patch_embed.proj.bias", {channels}, model->patch_bias_);
  taker.Take("cls_token", {1, 1, channels}, model->cls_token_);
  taker.Take("pos_embed", {1, config.tokens(), channels}, model->pos_embed_);
  model->blocks_.resize(config.depth);
  for (int64_t i = 0; i < config.depth; ++i) {
    Block& block = model->blocks_[i];
    const std::string prefix = absl::StrCat("blocks.", i, ".");
    internal::TakeAttentionWeights(taker, prefix, channels, block);
    if (config.depthwise_conv) {
      taker.Take(prefix + "attn.dwc.weight", {channels, 1, 3, 3}, block.dwc_weight);
      taker.Take(prefix + "attn.dwc.bias", {channels}, block.dwc_bias);
    }
    internal::TakeMlpWeights(taker, prefix, channels, hidden, block);
  }
  taker.Take("norm.weight", {channels}, model->norm_weight_);
  taker.Take("norm.bias", {channels}, model->norm_bias_);
  taker.Take("head.weight", {config.num_classes, channels}, model->head_weight_);
  taker.Take("head.bias", {config.num_classes}, model->head_bias_);
  if (absl::Status status = taker.Finish(config.depthwise_conv
                                             ? ""
                                             : " (attention.depthwise_conv is false: DWC weights are not expected)");
      !status.ok()) {
    return status;
  }
  std::vector<at::Tensor*> tensors = {&model->patch_weight_, &model->patch_bias_, &model->cls_token_,
                                      &model->pos_embed_,    &model->norm_weight_, &model->norm_bias_,
                                      &model->head_weight_,  &model->head_bias_};
  for (Block& block : model->blocks_) {
    for (at::Tensor* tensor : block.All()) tensors.push_back(tensor);
    tensors.push_back(&block.dwc_weight);
    tensors.push_back(&block.dwc_bias);
  }
  RETURN_IF_ERROR(internal::PlaceWeights(tensors, placement));
  model->placement_ = placement;
  internal::DescribePlacement(placement, model->description_);
  return model;
}

absl::StatusOr<ClassifierOutput> VitClassifier::Forward(const at::Tensor& images,
                                                        absl::Span<const AttentionBudget> budgets,
                                                        bool want_statistics, kernels::MitaBackend backend,
                                                        const ItemCheck& check) const {
  const int64_t side = config_.image_size;
  if (!images.defined() || images.dim() != 4 || images.size(0) < 1 || images.size(1) != config_.in_channels ||
      images.size(2) != side || images.size(3) != side) {
    return absl::InvalidArgumentError(absl::StrCat(
        "images: shape ", images.defined() ? internal::ShapeString(images.sizes()) : "(undefined)", ", expected [B >= 1, ",
        config_.in_channels, ", ", side, ", ", side, "]"));
  }
  if (images.scalar_type() != at::kFloat || !images.device().is_cpu()) {
    return absl::InvalidArgumentError("images: must be float32 on the CPU");
  }
  const int64_t batch = images.size(0);
  if (static_cast<int64_t>(budgets.size()) != batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("budgets: ", budgets.size(), " entries for a batch of ", batch, " images"));
  }
  for (const AttentionBudget& budget : budgets) RETURN_IF_ERROR(CheckBudget(description_.knobs, budget));

  const int64_t tokens = config_.tokens();
  const int64_t channels = config_.embed_dim;
  const int64_t heads = config_.num_heads;
  const int64_t head_dim = config_.head_dim();
  const int64_t grid = config_.grid_side();
  ClassifierOutput output;
  output.statistics.resize(batch);
  output.stopped.assign(batch, absl::OkStatus());
  at::Tensor logits;

  try {
    c10::InferenceMode inference_mode;
    const bool on_cpu = placement_.device.is_cpu();
    // Row indices on the model's device (index_select and index_copy_ take them there).
    auto index_tensor = [&](const std::vector<int64_t>& values) {
      const at::Tensor indices = at::tensor(values, at::TensorOptions().dtype(at::kLong));
      return on_cpu ? indices : indices.to(placement_.device);
    };
    // The images still running (indices into the batch; row i of x is image active[i]), grouped by attention
    // kind and pool side P (landmarks are computed per group, one ImageLandmarks call). Positions are rows of x.
    std::vector<int64_t> active(batch);
    for (int64_t b = 0; b < batch; ++b) active[b] = b;
    struct Groups {
      std::vector<int64_t> full_items, mita_items;
      std::map<int64_t, std::vector<int64_t>> mita_items_by_side;  // P -> positions in mita_items
      at::Tensor full_index, mita_index;
    } groups;
    auto group = [&] {
      groups = Groups{};
      for (int64_t row = 0; row < static_cast<int64_t>(active.size()); ++row) {
        const AttentionBudget& budget = budgets[active[row]];
        if (budget.full_attention) {
          groups.full_items.push_back(row);
        } else {
          const auto pool_side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(budget.expert_count))));
          groups.mita_items_by_side[pool_side].push_back(static_cast<int64_t>(groups.mita_items.size()));
          groups.mita_items.push_back(row);
        }
      }
      groups.full_index = index_tensor(groups.full_items);
      groups.mita_index = index_tensor(groups.mita_items);
    };
    group();
    // Drops the images whose caller left, taking their rows out of x.
    auto drop_gone = [&](at::Tensor& x) {
      if (!check) return;
      std::vector<int64_t> kept, rows;
      for (int64_t row = 0; row < static_cast<int64_t>(active.size()); ++row) {
        absl::Status wanted = check(static_cast<size_t>(active[row]));
        if (!wanted.ok()) {
          output.stopped[active[row]] = std::move(wanted);
          continue;
        }
        kept.push_back(active[row]);
        rows.push_back(row);
      }
      if (kept.size() == active.size()) return;
      active = std::move(kept);
      if (!active.empty()) x = x.index_select(0, index_tensor(rows));
      group();
    };

    // Patch embedding: [B, C_in, side, side] -> [B, S*S, C]; prepend cls; add positions -> [B, N, C].
    const at::Tensor placed = internal::ToPlacement(images, placement_, placement_.weights_dtype);
    at::Tensor x = [&] {
      RECORD_USER_SCOPE(kernels::kEmbeddingScope);
      const at::Tensor patches =
          at::conv2d(placed, patch_weight_, patch_bias_, /*stride=*/{config_.patch_size, config_.patch_size})
              .flatten(2)
              .transpose(1, 2);
      return at::cat({cls_token_.expand({batch, 1, channels}), patches}, 1).add(pos_embed_);
    }();

    for (size_t layer = 0; layer < blocks_.size(); ++layer) {
      drop_gone(x);
      if (active.empty()) break;
      RECORD_USER_SCOPE(kernels::kLayerScope);
      const int64_t rows = static_cast<int64_t>(active.size());
      const bool all_mita = groups.full_items.empty();
      const bool all_full = groups.mita_items.empty();
      const Block& block = blocks_[layer];
      const at::Tensor normed = at::layer_norm(x, {channels}, block.norm1_weight, block.norm1_bias,
                                               config_.layer_norm_eps);
      // [B, N, 3C] -> [B, N, 3, H, d] -> [3, B, H, N, d]: channels ordered [q | k | v], head h owns h*d .. h*d+d-1.
      const at::Tensor qkv = kernels::Linear(normed, block.qkv_weight, block.qkv_bias)
                                 .reshape({rows, tokens, 3, heads, head_dim})
                                 .permute({2, 0, 3, 1, 4});
      // Strided views into the fused qkv output: the kernels read them in place (no per-layer copies).
      const at::Tensor q = qkv[0];
      const at::Tensor k = qkv[1];
      const at::Tensor v = qkv[2];

      // Attention per item: MiTA items in one kernel call (each with its own landmarks and width), full-attention
      // items in another. attention: [B, H, N, d].
      at::Tensor attention;
      at::Tensor mita_output, full_output;
      if (!all_full) {
        const at::Tensor q_mita = all_mita ? q : q.index_select(0, groups.mita_index);
        const at::Tensor k_mita = all_mita ? k : k.index_select(0, groups.mita_index);
        const at::Tensor v_mita = all_mita ? v : v.index_select(0, groups.mita_index);
        std::vector<kernels::MitaItem> items(groups.mita_items.size());
        for (const auto& [pool_side, positions] : groups.mita_items_by_side) {
          const bool whole = positions.size() == groups.mita_items.size();
          const at::Tensor q_group = whole ? q_mita : q_mita.index_select(0, index_tensor(positions));
          absl::StatusOr<at::Tensor> landmarks = kernels::ImageLandmarks(q_group, pool_side);  // [b, H, P*P, d]
          if (!landmarks.ok()) return internal::KernelFault(landmarks.status());
          for (size_t j = 0; j < positions.size(); ++j) {
            kernels::MitaItem& item = items[positions[j]];
            item.landmarks = (*landmarks)[static_cast<int64_t>(j)];
            item.expert_width = budgets[active[groups.mita_items[positions[j]]]].expert_width;
          }
        }
        std::vector<kernels::MitaItemStatistics> statistics;
        absl::StatusOr<at::Tensor> result = kernels::MitaAttentionForward(
            q_mita, k_mita, v_mita, items, want_statistics ? &statistics : nullptr, backend);
        if (!result.ok()) return internal::KernelFault(result.status());
        mita_output = *std::move(result);
        if (want_statistics) {
          for (size_t j = 0; j < groups.mita_items.size() && j < statistics.size(); ++j) {
            output.statistics[active[groups.mita_items[j]]].push_back(std::move(statistics[j]));
          }
        }
      }
      if (!all_mita) {
        absl::StatusOr<at::Tensor> result =
            kernels::FullAttentionForward(all_full ? q : q.index_select(0, groups.full_index),
                                          all_full ? k : k.index_select(0, groups.full_index),
                                          all_full ? v : v.index_select(0, groups.full_index));
        if (!result.ok()) return internal::KernelFault(result.status());
        full_output = *std::move(result);
      }
      if (all_full) {
        attention = full_output;
      } else if (all_mita) {
        attention = mita_output;
      } else {
        // Heads-merged memory, as each kernel's own output on the CPU: the head merge below stays a view.
        attention = at::empty({rows, tokens, heads, head_dim}, q.options()).transpose(1, 2);
        attention.index_copy_(0, groups.mita_index, mita_output);
        attention.index_copy_(0, groups.full_index, full_output);
      }

      // Merge heads: [B, H, N, d] -> [B, N, C]. The attention output is this layer's own tensor, so the DWC term may
      // be added in place even where the merge is a view of it.
      const at::Tensor merged = attention.transpose(1, 2).reshape({rows, tokens, channels});
      if (config_.depthwise_conv) {
        // DWC: v of the patch tokens 1 .. N-1, heads merged ([B, N-1, C], a view of the fused qkv output), on the
        // S x S grid (token t = 1 + r*S + c); depthwise 3x3 conv, zero padding 1; added to the attention output of
        // the same tokens before proj.
        const at::Tensor patch_values =
            v.narrow(2, 1, tokens - 1).transpose(1, 2).reshape({rows, tokens - 1, channels});
        kernels::AddDepthwiseConvolution(patch_values, block.dwc_weight, block.dwc_bias, grid, grid,
                                         merged.narrow(1, 1, tokens - 1));
      }
      x = kernels::Linear(merged, block.proj_weight, block.proj_bias, kernels::LinearEpilogue::AddResidual(x));
      const at::Tensor normed2 = at::layer_norm(x, {channels}, block.norm2_weight, block.norm2_bias,
                                                config_.layer_norm_eps);
      const at::Tensor hidden =
          kernels::Linear(normed2, block.fc1_weight, block.fc1_bias, kernels::LinearEpilogue::Gelu());
      x = kernels::Linear(hidden, block.fc2_weight, block.fc2_bias, kernels::LinearEpilogue::AddResidual(x));
    }
    drop_gone(x);
    logits = at::zeros({batch, config_.num_classes}, x.options());
    if (!active.empty()) {
      RECORD_USER_SCOPE(kernels::kPoolAndHeadScope);
      // LayerNorm is per token, so normalising only the cls token equals norm(x)[:, 0].
      const at::Tensor cls =
          at::layer_norm(x.select(1, 0), {channels}, norm_weight_, norm_bias_, config_.layer_norm_eps);
      logits.index_copy_(0, index_tensor(active), kernels::Linear(cls, head_weight_, head_bias_));
    }
    for (int64_t b = 0; b < batch; ++b) {
      if (!output.stopped[b].ok()) output.statistics[b].clear();
    }
  } catch (const std::exception&) {
    return kernels::CurrentExceptionStatus("classifier forward");
  }
  try {
    // Float32 on the CPU, a normal (not inference-mode) tensor: callers may modify it outside InferenceMode.
    output.logits = internal::LogitsOnCpu(logits);
  } catch (const std::exception&) {
    return kernels::CurrentExceptionStatus("classifier forward");
  }
  return output;
}

ImageDecodeLimits VitClassifier::DecodeLimits() const {
  ImageDecodeLimits limits;
  limits.max_width = config_.max_image_side;
  limits.max_height = config_.max_image_side;
  limits.target_width = config_.image_size;
  limits.target_height = config_.image_size;
  return limits;
}

absl::StatusOr<int64_t> VitClassifier::InputPreparationBytes(const ClassifierInput& input,
                                                             const InputLimits& limits) const {
  // Size first: an image over the byte limit is refused by Prepare before its header matters.
  if (input.bytes.empty() || static_cast<int64_t>(input.bytes.size()) > limits.max_encoded_image_bytes) return 0;
  ASSIGN_OR_RETURN(const ImageDecodePlan plan, PlanImageDecode(input.bytes, config_.in_channels, DecodeLimits()));
  return plan.working_bytes;
}

absl::StatusOr<Classifier::PreparedInput> VitClassifier::PrepareInput(const ClassifierInput& input,
                                                                      const InputLimits& limits,
                                                                      const StopCheck& /*stop*/) const {
  const std::string_view bytes = input.bytes;
  if (bytes.empty()) return InvalidRequest(RequestField::kImage, "empty");
  if (static_cast<int64_t>(bytes.size()) > limits.max_encoded_image_bytes) {
    return InvalidRequest(RequestField::kImage, absl::StrCat(bytes.size(), " bytes is over the limit of ",
                                                             limits.max_encoded_image_bytes, " bytes"));
  }
  const ImageDecodeLimits decode_limits = DecodeLimits();
  try {
    ASSIGN_OR_RETURN(const DecodedImage decoded, DecodeImage(bytes, config_.in_channels, decode_limits));
    ASSIGN_OR_RETURN(at::Tensor image, PreprocessImage(decoded, config_));
    return PreparedInput{std::move(image), config_.tokens(), config_.tokens()};
  } catch (const std::exception& e) {
    // The bytes are user input: anything the decoder throws is a problem of the image.
    return InvalidRequest(RequestField::kImage, absl::StrCat("cannot decode: ", e.what()));
  }
}

absl::StatusOr<ClassifierOutput> VitClassifier::Run(absl::Span<const BatchItem* const> items,
                                                    bool want_statistics, const ItemCheck& check) const {
  if (items.empty()) return absl::InvalidArgumentError("items: the batch is empty");
  std::vector<at::Tensor> images;
  std::vector<AttentionBudget> budgets;
  images.reserve(items.size());
  budgets.reserve(items.size());
  for (const BatchItem* item : items) {
    const at::Tensor& image = item->input;
    if (!image.defined() || image.dim() != 3 || image.scalar_type() != at::kFloat || !image.device().is_cpu() ||
        image.size(0) != config_.in_channels || image.size(1) != config_.image_size ||
        image.size(2) != config_.image_size) {
      return absl::InvalidArgumentError("items: not prepared by this image classifier");
    }
    images.push_back(image);
    budgets.push_back(item->budget.budget);
  }
  at::Tensor stacked;
  try {
    // Stacked in pinned memory for a CUDA device (Forward copies it there without the host waiting).
    const at::Tensor& first = images.front();
    stacked = at::empty({static_cast<int64_t>(images.size()), first.size(0), first.size(1), first.size(2)},
                        internal::HostStagingOptions(placement_, at::kFloat));
    at::stack_out(stacked, images, 0);
  } catch (const std::exception&) {
    return kernels::CurrentExceptionStatus("stacking the batch's images");
  }
  return Forward(stacked, budgets, want_statistics, kernels::MitaBackend::kAuto, check);
}

}  // namespace mita::models
