// Model package configuration (the package's config.json).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "models/budget.h"

namespace mita::models {

// The fields both architectures share: a pre-norm Transformer encoder whose attention is MiTA.
struct EncoderConfig {
  std::string architecture;  // "mita_vit" or "mita_document"
  int64_t embed_dim = 0;     // C; C % num_heads == 0
  int64_t depth = 0;         // transformer blocks
  int64_t num_heads = 0;     // H
  int64_t mlp_hidden_dim = 0;
  double layer_norm_eps = 1e-6;
  int64_t num_classes = 0;
  AttentionBudget default_budget;
  std::map<std::string, AttentionBudget> presets;
  // attention.accuracy_order (optional): declared budgets, most accurate first; empty when absent. In config.json
  // an array of {"budget": "9x16" | "full", "accuracy": held-out accuracy in [0, 1]}, written by
  // `mita-eval --write_accuracy_order` / `mita-eval-documents --write_accuracy_order`, e.g.
  //   "accuracy_order": [{"budget": "16x32", "accuracy": 0.8828}, {"budget": "9x16", "accuracy": 0.8823}]
  // Each budget is named as DeclaredBudgetName names it ("default", a preset's name, else the text).
  std::vector<DeclaredBudget> accuracy_order;

  int64_t head_dim() const { return embed_dim / num_heads; }
};

// config.json of a "mita_vit" package. Example (models/repository/fashion-mnist-vit/config.json):
//   {"architecture": "mita_vit", "image_size": 28, "patch_size": 4, "in_channels": 1, "embed_dim": 96,
//    "depth": 4, "num_heads": 4, "mlp_hidden_dim": 192, "layer_norm_eps": 1e-6, "num_classes": 10,
//    "normalization": {"mean": [0.286], "std": [0.353]},
//    "attention": {"type": "mita", "depthwise_conv": true,
//                  "default_budget": {"expert_count": 9, "expert_width": 16},
//                  "presets": {"fast": {"expert_count": 4, "expert_width": 8}}},
//    "max_image_side": 4096}
struct VitConfig : EncoderConfig {
  int64_t image_size = 0;    // input side, pixels (square inputs)
  int64_t patch_size = 0;    // patch side, pixels; image_size % patch_size == 0
  int64_t in_channels = 0;   // 1 (grayscale) or 3 (RGB)
  std::vector<float> mean;  // per channel, on [0, 1] pixel values
  std::vector<float> std;   // per channel
  bool depthwise_conv = false;  // MiTA "DWC" variant: depthwise 3x3 conv on v of the patch tokens
  int64_t max_image_side = 4096;  // largest accepted declared width or height, pixels

  // Patches per side S = image_size / patch_size.
  int64_t grid_side() const { return image_size / patch_size; }
  // Tokens N = S * S + 1 (patches + cls).
  int64_t tokens() const { return grid_side() * grid_side() + 1; }
};

// Parses and validates config.json text. Required: architecture ("mita_vit"), image_size, patch_size (divides
// image_size), in_channels (1 or 3), embed_dim, depth, num_heads (divides embed_dim), mlp_hidden_dim,
// num_classes, normalization.mean and .std (in_channels numbers each, std > 0), attention.type ("mita"),
// attention.default_budget. Optional: task ("image_classification"), layer_norm_eps (> 0, default 1e-6),
// attention.depthwise_conv (default false), attention.presets (name -> budget), attention.accuracy_order
// (EncoderConfig::accuracy_order), max_image_side (default 4096).
// Integers must be JSON integers (28.0 is rejected). A budget object is {"expert_count": m, "expert_width": k}
// or {"full_attention": true}. Unknown fields are ignored (forward compatibility).
// Errors: INVALID_ARGUMENT, prefixed "config.json: ", naming the field that is missing, of the wrong type or out
// of range (e.g. "config.json: patch_size 5 does not divide image_size 28"); the default budget and the presets
// are checked against the allowed ranges (expert count a perfect square P*P with 1 <= P <= grid side, expert
// width in [1, tokens]), e.g. "config.json: attention.presets.fast.expert_count 10 is not allowed: use one of
// 1, 4, 9, 16, 25, 36, 49". attention.accuracy_order must be non-empty, with accuracies in [0, 1] that never
// rise down the list, no budget twice, each budget within the ranges (e.g. "config.json:
// attention.accuracy_order[2].budget \"10x16\": expert_count 10 is not allowed: use one of ...").
absl::StatusOr<VitConfig> ParseVitConfig(std::string_view json_text);

// The budget knobs of an image model: expert counts P*P for P in 1 .. grid side (a P x P landmark grid), expert
// width in [1, tokens], its default budget and presets.
BudgetKnobs ImageKnobs(const VitConfig& config);

// config.json of a "mita_document" package (a long-document classifier, models/document_classifier.h).
// Example (tools/mita_reference.py document_config):
//   {"architecture": "mita_document", "task": "document_classification", "vocab_size": 4096, "embed_dim": 128,
//    "depth": 2, "num_heads": 4, "mlp_hidden_dim": 256, "layer_norm_eps": 1e-6, "num_classes": 18,
//    "max_tokens": 65536, "tokenizer": "sentencepiece",
//    "position_encoding": {"type": "convolution", "kernel_size": 9},
//    "attention": {"type": "mita", "default_budget": {"expert_count": 16, "expert_width": 64},
//                  "presets": {"fast": {"expert_count": 8, "expert_width": 32}, "exact": {"full_attention": true}},
//                  "max_expert_count": 256, "max_expert_width": 1024}}
struct DocumentConfig : EncoderConfig {
  // How the classification head sees a document's tokens (config.json "pooling", optional):
  //   {"type": "mean"} (the default when absent): the mean of norm(x) over the N tokens;
  //   {"type": "attention", "heads": P, "position_buckets": B}: P pooling heads (P divides embed_dim), head p
  //   scores token n as norm(x)_n . pool.score.weight[p] + pool.score.bias[p] + pool.position_bias[p, bucket(n)]
  //   (bucket(n) = min(floor(log2(n + 1)), B - 1), n counted from the document's first token; no position term
  //   when B is 0, the default), takes a softmax over the tokens and averages its channel group (channels
  //   p C/P .. (p + 1) C/P - 1) with those weights (AttentionPooling in tools/mita_reference.py).
  enum class Pooling { kMean, kAttention };
  Pooling pooling = Pooling::kMean;
  int64_t pooling_heads = 0;             // P, attention pooling only
  int64_t pooling_position_buckets = 0;  // B, attention pooling only
  int64_t vocab_size = 0;    // token ids are in [0, vocab_size)
  int64_t max_tokens = 0;     // longest accepted document, tokens
  std::string tokenizer;      // "bytes" (UTF-8 bytes, vocab_size >= 256) or "sentencepiece" (tokenizer.model)
  int64_t position_kernel_size = 0;  // odd width of the depthwise 1-D position convolution, tokens
  int64_t max_expert_count = 0;  // requests may use expert_count in [1, max_expert_count]
  int64_t max_expert_width = 0;  // requests may use expert_width in [1, max_expert_width]
};

// Parses and validates the config.json text of a document package. Required: architecture ("mita_document"),
// vocab_size, embed_dim, depth, num_heads (divides embed_dim), mlp_hidden_dim, num_classes, max_tokens (in
// [1, 2^24]), tokenizer ("bytes", which needs vocab_size >= 256, or "sentencepiece"),
// position_encoding.type ("convolution") and .kernel_size (odd, in [1, 255]), attention.type ("mita"),
// attention.default_budget, attention.max_expert_count and attention.max_expert_width (each in [1, max_tokens]).
// Optional: task ("document_classification"), layer_norm_eps (> 0, default 1e-6), pooling (type "mean" or
// "attention"; for "attention" heads dividing embed_dim, position_buckets in [0, 64]), attention.presets,
// attention.accuracy_order (as for ParseVitConfig). The default budget, presets and accuracy order must lie within
// the max_expert_* ranges. Integers must be JSON integers; unknown fields are ignored. Errors: INVALID_ARGUMENT
// prefixed "config.json: " naming the field, e.g.
// "config.json: attention.presets.fast.expert_width 5000 is out of range: allowed [1, 1024]".
absl::StatusOr<DocumentConfig> ParseDocumentConfig(std::string_view json_text);

// The budget knobs of a document model: expert count in [1, max_expert_count], expert width in
// [1, max_expert_width], its default budget and presets. A document shorter than m or k runs with
// ApplyBudget's min(m, N) and min(k, N).
BudgetKnobs DocumentKnobs(const DocumentConfig& config);

// The "architecture" field of config.json text (e.g. "mita_vit", "mita_document"), for choosing the loader.
// Errors: INVALID_ARGUMENT "config.json: ..." for invalid JSON or a missing or non-string architecture.
absl::StatusOr<std::string> ParseArchitecture(std::string_view json_text);

}  // namespace mita::models
