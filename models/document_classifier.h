// Long-document classifier with MiTA attention (sequence landmarks), built on kernels/.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/mita_attention.h"
#include "models/model_config.h"
#include "models/classifier.h"
#include "models/tokenizer.h"

namespace mita::models {

// A pre-norm Transformer encoder over token ids with a convolutional position encoding and a pooled
// classification head. Forward for one document of N tokens (C = embed_dim, K = position kernel size):
//   x = token_embedding.weight[ids]                                    [N, C]
//   x = x + position_conv(x)     depthwise 1-D convolution over the N tokens of this document only (kernel K,
//                                zero padding K / 2, bias): relative, local position information defined at any
//                                N (conditional position encoding, Chu et al., "Conditional Positional Encodings
//                                for Vision Transformers", 2021); no table tied to a trained length
//   depth x [x + attn(norm1(x)); x + mlp(norm2(x))]
//       attn: qkv = Linear(C, 3C) ([q|k|v], head h owns channels h*d .. h*d+d-1), per head MiTA with sequence
//             landmarks (kernels::SequenceLandmarks: adaptive 1-D average pooling of q into m windows) and expert
//             width k, or full softmax attention; merge heads; proj = Linear(C, C). mlp: fc1, GELU (erf), fc2.
//   logits = head(pool(norm(x)))                                         [num_classes]
//       pool: the mean over the N tokens, or attention pooling (DocumentConfig::pooling)
// Weight names (float32): token_embedding.weight [V, C], position_conv.weight [C, 1, K], position_conv.bias [C],
// blocks.{i}.norm1.{weight,bias}, blocks.{i}.attn.qkv.{weight,bias}, blocks.{i}.attn.proj.{weight,bias},
// blocks.{i}.norm2.{weight,bias}, blocks.{i}.mlp.fc1.{weight,bias}, blocks.{i}.mlp.fc2.{weight,bias},
// norm.{weight,bias}, head.{weight,bias}; with attention pooling also pool.score.{weight [P, C], bias [P]} and
// pool.position_bias [P, B] (when B > 0). The PyTorch twin is MitaDocument in tools/mita_reference.py.
// As a Classifier it takes UTF-8 text (tokenized by its tokenizer) or token ids (Prepare).
class DocumentClassifier final : public Classifier {
 public:
  // `name`: the model's name in its description; `labels`: num_classes entries; `tokenizer`: turns text into
  // ids (null: the model takes token ids only). Errors: INVALID_ARGUMENT naming a missing tensor, one of the
  // wrong shape (expected and found in the message), dtype or device, or an unexpected extra tensor;
  // INVALID_ARGUMENT for an inconsistent config, a label count other than num_classes, or a tokenizer whose
  // vocabulary is larger than vocab_size. The weights are then moved to `placement` (its device and dtype);
  // CheckPlacement's errors, and RESOURCE_EXHAUSTED when the device's memory runs out.
  static absl::StatusOr<std::unique_ptr<DocumentClassifier>> Create(std::string name, const DocumentConfig& config,
                                                                    std::vector<std::string> labels,
                                                                    std::map<std::string, at::Tensor> weights,
                                                                    std::unique_ptr<Tokenizer> tokenizer,
                                                                    const Placement& placement = {});

  // Packed (ragged) batch without padding. token_ids: [T] int64 on the CPU (pinned memory lets the copy to a CUDA
  // device run without the host waiting) holding B documents back to back;
  // lengths: B entries, each in [1, max_tokens], summing to T; budgets: B entries, each valid
  // (CheckBudget against DocumentKnobs) and already applied to its length (ApplyBudget: expert_count and
  // expert_width <= the document's length). Dense layers (embedding, LayerNorms, qkv, proj, MLP) run on all T
  // tokens at once; the position convolution, attention and pooling run per document with its own N, m and k,
  // so a document's logits do not depend on the other documents of the batch (up to float rounding).
  // Runs on placement().device in placement().weights_dtype. Returns logits [B, num_classes] float32 on the CPU
  // and, when want_statistics, statistics[b] with one entry per layer
  // for documents that ran MiTA (empty for full attention). Runs under c10::InferenceMode; thread-safe.
  // Errors: INVALID_ARGUMENT for token_ids not 1-D int64 on the CPU, an id outside [0, vocab_size), a
  // lengths/budgets count mismatch or B = 0, a length outside [1, max_tokens], lengths not summing to T, or an
  // invalid or unapplied budget (messages name the document index and the allowed range); RESOURCE_EXHAUSTED
  // when memory runs out; INTERNAL when ATen or a kernel fails on validated input.
  // `check` (optional): asked for every running document before each layer and at the end, and inside full
  // attention every query chunk; a document whose caller left is taken out of the packed batch (its logits row
  // is 0, ClassifierOutput::stopped[b] says why) and the others go on.
  absl::StatusOr<ClassifierOutput> Forward(const at::Tensor& token_ids, absl::Span<const int64_t> lengths,
                                           absl::Span<const AttentionBudget> budgets, bool want_statistics,
                                           kernels::MitaBackend backend = kernels::MitaBackend::kAuto,
                                           const ItemCheck& check = nullptr) const;

  const DocumentConfig& config() const { return config_; }
  const Placement& placement() const { return placement_; }
  const ClassifierDescription& description() const override { return description_; }
  // The tokenizer of text inputs; null when the model takes token ids only.
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }

  // Packs the items' token ids back to back [T] and runs Forward with their lengths and budgets.
  absl::StatusOr<ClassifierOutput> Run(absl::Span<const BatchItem* const> items, bool want_statistics,
                                       const ItemCheck& check = nullptr) const override;

  ~DocumentClassifier() override;

 protected:
  // Text: checked as UTF-8 and tokenized; token ids: range-checked against vocab_size. A document longer than
  // min(max_tokens, limits.max_tokens) is cut to that many tokens when input.truncate is set, refused otherwise.
  // Errors: INVALID_ARGUMENT carrying kDocumentText / kDocumentTokenIds problems (empty, invalid UTF-8 with
  // its byte offset, an id out of range with its index, too long: the limit, who sets it, and a kTruncate
  // hint); RESOURCE_EXHAUSTED when the ids cannot be allocated.
  PreparedInput SyntheticInput(int64_t tokens) const override;
  absl::StatusOr<PreparedInput> PrepareInput(const ClassifierInput& input, const InputLimits& limits,
                                             const StopCheck& stop) const override;
  absl::StatusOr<int64_t> InputPreparationBytes(const ClassifierInput& input,
                                                const InputLimits& limits) const override;

 private:
  struct Block;
  DocumentClassifier(std::string name, DocumentConfig config, std::vector<std::string> labels,
                     std::unique_ptr<Tokenizer> tokenizer);

  DocumentConfig config_;
  Placement placement_;
  ClassifierDescription description_;
  std::unique_ptr<Tokenizer> tokenizer_;
  // The head's view of one document's normed tokens [N, C] -> [C] (DocumentConfig::pooling).
  at::Tensor Pool(const at::Tensor& normed) const;

  std::vector<Block> blocks_;  // defined in the .cc
  at::Tensor token_embedding_, position_weight_, position_bias_, norm_weight_, norm_bias_, head_weight_, head_bias_;
  // Attention pooling only (undefined for the mean; the position bias also when it has no buckets).
  at::Tensor pool_score_weight_, pool_score_bias_, pool_position_bias_;
};

}  // namespace mita::models
