// MiTA long-document classifier forward (see document_classifier.h). The training twin is MitaDocument in
// tools/mita_reference.py; both follow docs/design.md section 2 and must agree to float32 rounding.
#include "models/document_classifier.h"

#include <algorithm>
#include <exception>
#include <utility>

#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/softmax.h>
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
#include "kernels/status_macros.h"
#include "models/classifier_errors.h"
#include "models/classifier_weights.h"
#include "models/request_error.h"

namespace mita::models {

struct DocumentClassifier::Block : internal::TransformerBlockWeights {};

DocumentClassifier::DocumentClassifier(std::string name, DocumentConfig config, std::vector<std::string> labels,
                                       std::unique_ptr<Tokenizer> tokenizer)
    : config_(std::move(config)), tokenizer_(std::move(tokenizer)) {
  description_.name = std::move(name);
  description_.architecture = config_.architecture;
  description_.input_kind = InputKind::kDocument;
  description_.document = DocumentInputDescription{
      config_.max_tokens, config_.vocab_size, tokenizer_ != nullptr ? tokenizer_->name() : config_.tokenizer};
  description_.labels = std::move(labels);
  description_.knobs = DocumentKnobs(config_);
  description_.layers = config_.depth;
  description_.heads = config_.num_heads;
  description_.embed_dim = config_.embed_dim;
  description_.tokens_per_input = 0;
  description_.max_input_tokens = config_.max_tokens;
  // A long document: what GetModel quotes the budgets' predicted compute for.
  constexpr int64_t kReferenceTokens = 16384;
  description_.reference_tokens = std::min(kReferenceTokens, config_.max_tokens);
}
DocumentClassifier::~DocumentClassifier() = default;

Classifier::PreparedInput DocumentClassifier::SyntheticInput(int64_t tokens) const {
  return PreparedInput{at::randint(config_.vocab_size, {tokens}, at::TensorOptions().dtype(at::kLong)), tokens, tokens};
}

absl::StatusOr<std::unique_ptr<DocumentClassifier>> DocumentClassifier::Create(
    std::string name, const DocumentConfig& config, std::vector<std::string> labels,
    std::map<std::string, at::Tensor> weights, std::unique_ptr<Tokenizer> tokenizer, const Placement& placement) {
  RETURN_IF_ERROR(CheckPlacement(placement));
  if (config.embed_dim <= 0 || config.num_heads <= 0 || config.embed_dim % config.num_heads != 0 ||
      config.depth <= 0 || config.vocab_size <= 0 || config.num_classes <= 0 || config.max_tokens <= 0 ||
      config.position_kernel_size <= 0 || config.position_kernel_size % 2 == 0 || config.mlp_hidden_dim <= 0) {
    return absl::InvalidArgumentError("config: inconsistent model dimensions (use ParseDocumentConfig)");
  }
  if (static_cast<int64_t>(labels.size()) != config.num_classes) {
    return absl::InvalidArgumentError(
        absl::StrCat("labels: ", labels.size(), " labels for ", config.num_classes, " classes"));
  }
  if (tokenizer != nullptr) {
    if (absl::Status fits = CheckTokenizerFits(*tokenizer, config); !fits.ok()) return fits;
  }
  const int64_t channels = config.embed_dim;
  const int64_t hidden = config.mlp_hidden_dim;
  std::unique_ptr<DocumentClassifier> model(
      new DocumentClassifier(std::move(name), config, std::move(labels), std::move(tokenizer)));
  internal::WeightTaker taker(weights);
  taker.Take("token_embedding.weight", {config.vocab_size, channels}, model->token_embedding_);
  taker.Take("position_conv.weight", {channels, 1, config.position_kernel_size}, model->position_weight_);
  taker.Take("position_conv.bias", {channels}, model->position_bias_);
  model->blocks_.resize(config.depth);
  for (int64_t i = 0; i < config.depth; ++i) {
    Block& block = model->blocks_[i];
    const std::string prefix = absl::StrCat("blocks.", i, ".");
    internal::TakeAttentionWeights(taker, prefix, channels, block);
    internal::TakeMlpWeights(taker, prefix, channels, hidden, block);
  }
  taker.Take("norm.weight", {channels}, model->norm_weight_);
  taker.Take("norm.bias", {channels}, model->norm_bias_);
  if (config.pooling == DocumentConfig::Pooling::kAttention) {
    taker.Take("pool.score.weight", {config.pooling_heads, channels}, model->pool_score_weight_);
    taker.Take("pool.score.bias", {config.pooling_heads}, model->pool_score_bias_);
    if (config.pooling_position_buckets > 0) {
      taker.Take("pool.position_bias", {config.pooling_heads, config.pooling_position_buckets},
                 model->pool_position_bias_);
    }
  }
  taker.Take("head.weight", {config.num_classes, channels}, model->head_weight_);
  taker.Take("head.bias", {config.num_classes}, model->head_bias_);
  if (absl::Status status = taker.Finish(); !status.ok()) return status;
  std::vector<at::Tensor*> tensors = {&model->token_embedding_, &model->position_weight_, &model->position_bias_,
                                      &model->norm_weight_,     &model->norm_bias_,       &model->head_weight_,
                                      &model->head_bias_};
  for (Block& block : model->blocks_) {
    for (at::Tensor* tensor : block.All()) tensors.push_back(tensor);
  }
  for (at::Tensor* tensor : {&model->pool_score_weight_, &model->pool_score_bias_, &model->pool_position_bias_}) {
    if (tensor->defined()) tensors.push_back(tensor);
  }
  RETURN_IF_ERROR(internal::PlaceWeights(tensors, placement));
  model->placement_ = placement;
  internal::DescribePlacement(placement, model->description_);
  return model;
}

absl::StatusOr<ClassifierOutput> DocumentClassifier::Forward(const at::Tensor& token_ids,
                                                             absl::Span<const int64_t> lengths,
                                                             absl::Span<const AttentionBudget> budgets,
                                                             bool want_statistics, kernels::MitaBackend backend,
                                                             const ItemCheck& check) const {
  if (!token_ids.defined() || token_ids.dim() != 1 || token_ids.scalar_type() != at::kLong ||
      !token_ids.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token_ids: must be a 1-D int64 tensor on the CPU, found ",
        token_ids.defined() ? absl::StrCat(internal::ShapeString(token_ids.sizes()), " ", c10::toString(token_ids.scalar_type()))
                            : "(undefined)"));
  }
  const int64_t batch = static_cast<int64_t>(lengths.size());
  if (batch == 0) return absl::InvalidArgumentError("lengths: the batch has no documents");
  if (static_cast<int64_t>(budgets.size()) != batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("budgets: ", budgets.size(), " entries for a batch of ", batch, " documents"));
  }
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (lengths[b] < 1 || lengths[b] > config_.max_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("lengths[", b, "]: ", lengths[b],
                                                     " tokens is out of range: allowed [1, ", config_.max_tokens, "]"));
    }
    total += lengths[b];
    const AttentionBudget& budget = budgets[b];
    if (absl::Status status = CheckBudget(description_.knobs, budget); !status.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("budgets[", b, "]: ", status.message()));
    }
    if (!budget.full_attention && (budget.expert_count > lengths[b] || budget.expert_width > lengths[b])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "budgets[", b, "]: expert_count ", budget.expert_count, " and expert_width ", budget.expert_width,
          " must not exceed the document's ", lengths[b], " tokens (apply ApplyBudget first)"));
    }
  }
  if (total != token_ids.size(0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("lengths: sum to ", total, " tokens, token_ids holds ", token_ids.size(0)));
  }

  const int64_t channels = config_.embed_dim;
  const int64_t heads = config_.num_heads;
  const int64_t head_dim = config_.head_dim();
  ClassifierOutput output;
  output.statistics.resize(batch);
  output.stopped.assign(batch, absl::OkStatus());
  at::Tensor logits;
  try {
    c10::InferenceMode inference_mode;
    const at::Tensor ids = token_ids.contiguous();
    {
      const int64_t* id = ids.data_ptr<int64_t>();
      for (int64_t t = 0; t < total; ++t) {
        if (id[t] < 0 || id[t] >= config_.vocab_size) {
          return absl::InvalidArgumentError(absl::StrCat("token_ids: id ", id[t], " at position ", t,
                                                         " is out of range: allowed [0, ", config_.vocab_size - 1,
                                                         "]"));
        }
      }
    }
    const bool on_cpu = placement_.device.is_cpu();
    // Row indices on the model's device (index_select and index_copy_ take them there).
    auto index_tensor = [&](const std::vector<int64_t>& values) {
      const at::Tensor indices = at::tensor(values, at::TensorOptions().dtype(at::kLong));
      return on_cpu ? indices : indices.to(placement_.device);
    };
    // The documents still running (indices into the batch), and where each one's rows start in x.
    std::vector<int64_t> active(batch);
    for (int64_t b = 0; b < batch; ++b) active[b] = b;
    std::vector<int64_t> offsets(batch);
    auto place = [&] {
      int64_t offset = 0;
      for (int64_t b : active) {
        offsets[b] = offset;
        offset += lengths[b];
      }
    };
    place();
    // Drops the documents whose caller left, taking their rows out of x (the packed batch shrinks).
    auto drop_gone = [&](at::Tensor& x) {
      if (!check) return;
      std::vector<int64_t> kept, rows;
      for (int64_t b : active) {
        absl::Status wanted = check(static_cast<size_t>(b));
        if (!wanted.ok()) {
          output.stopped[b] = std::move(wanted);
          continue;
        }
        kept.push_back(b);
        for (int64_t t = 0; t < lengths[b]; ++t) rows.push_back(offsets[b] + t);
      }
      if (kept.size() == active.size()) return;
      active = std::move(kept);
      if (!active.empty()) x = x.index_select(0, index_tensor(rows));
      place();
    };

    // Embedding [T, C], then the position convolution per document (zero padding at each document's ends, so
    // no information crosses between documents), added to a copy: x = embedded + conv(embedded).
    // The ids were checked on the host; on a CUDA device they are copied there (from pinned memory: without the
    // host waiting).
    at::Tensor x = [&] {
      RECORD_USER_SCOPE(kernels::kEmbeddingScope);
      const at::Tensor embedded = token_embedding_.index_select(0, internal::ToPlacement(ids, placement_, at::kLong));
      at::Tensor embedded_with_positions = embedded.clone();
      const at::Tensor position_weight = position_weight_.unsqueeze(2);  // [C, 1, 1, K]: a grid of one row
      for (int64_t b = 0; b < batch; ++b) {
        if (lengths[b] == 0) continue;
        kernels::AddDepthwiseConvolution(embedded.narrow(0, offsets[b], lengths[b]).unsqueeze(0), position_weight,
                                         position_bias_, /*rows=*/1, /*columns=*/lengths[b],
                                         embedded_with_positions.narrow(0, offsets[b], lengths[b]).unsqueeze(0));
      }
      return embedded_with_positions;
    }();

    for (size_t layer = 0; layer < blocks_.size(); ++layer) {
      drop_gone(x);
      if (active.empty()) break;
      RECORD_USER_SCOPE(kernels::kLayerScope);
      const Block& block = blocks_[layer];
      const int64_t rows = x.size(0);
      const at::Tensor normed =
          at::layer_norm(x, {channels}, block.norm1_weight, block.norm1_bias, config_.layer_norm_eps);
      const at::Tensor qkv = kernels::Linear(normed, block.qkv_weight, block.qkv_bias);  // [rows, 3C]
      at::Tensor merged = at::empty({rows, channels}, x.options());                 // heads merged
      for (int64_t b : active) {
        const int64_t tokens = lengths[b];
        // [N, 3C] -> [1, N, 3, H, d] -> [3, 1, H, N, d]: strided views the kernels read in place.
        const at::Tensor document_qkv =
            qkv.narrow(0, offsets[b], tokens).view({1, tokens, 3, heads, head_dim}).permute({2, 0, 3, 1, 4});
        const at::Tensor q = document_qkv[0], k = document_qkv[1], v = document_qkv[2];
        absl::StatusOr<at::Tensor> attention;  // [1, H, N, d]
        if (budgets[b].full_attention) {
          // Quadratic in N: asks, every query chunk, whether the document's caller is still there.
          kernels::AttentionInterrupt interrupt;
          if (check) interrupt = [&check, b](int64_t) { return !check(static_cast<size_t>(b)).ok(); };
          attention = kernels::FullAttentionForward(q, k, v, interrupt);
        } else {
          absl::StatusOr<at::Tensor> landmarks = kernels::SequenceLandmarks(q, budgets[b].expert_count);
          if (!landmarks.ok()) return internal::KernelFault(landmarks.status());
          const kernels::MitaItem item{(*landmarks)[0], budgets[b].expert_width};
          std::vector<kernels::MitaItemStatistics> statistics;
          attention = kernels::MitaAttentionForward(q, k, v, {item}, want_statistics ? &statistics : nullptr,
                                                    backend);
          if (attention.ok() && want_statistics && !statistics.empty()) {
            output.statistics[b].push_back(std::move(statistics[0]));
          }
        }
        if (!attention.ok()) return internal::KernelFault(attention.status());
        // [1, H, N, d] -> [N, H, d] -> [N, C]
        merged.narrow(0, offsets[b], tokens).view({tokens, heads, head_dim}).copy_((*attention)[0].transpose(0, 1));
      }
      x = kernels::Linear(merged, block.proj_weight, block.proj_bias, kernels::LinearEpilogue::AddResidual(x));
      const at::Tensor normed2 =
          at::layer_norm(x, {channels}, block.norm2_weight, block.norm2_bias, config_.layer_norm_eps);
      const at::Tensor hidden =
          kernels::Linear(normed2, block.fc1_weight, block.fc1_bias, kernels::LinearEpilogue::Gelu());
      x = kernels::Linear(hidden, block.fc2_weight, block.fc2_bias, kernels::LinearEpilogue::AddResidual(x));
    }
    drop_gone(x);
    logits = at::zeros({batch, config_.num_classes}, x.options());
    if (!active.empty()) {
      RECORD_USER_SCOPE(kernels::kPoolAndHeadScope);
      const at::Tensor normed = at::layer_norm(x, {channels}, norm_weight_, norm_bias_, config_.layer_norm_eps);
      std::vector<at::Tensor> pooled;
      for (int64_t b : active) pooled.push_back(Pool(normed.narrow(0, offsets[b], lengths[b])));
      logits.index_copy_(0, index_tensor(active), kernels::Linear(at::stack(pooled), head_weight_, head_bias_));
    }
    // A stopped document's statistics cover only the layers it ran: drop them with its answer.
    for (int64_t b = 0; b < batch; ++b) {
      if (!output.stopped[b].ok()) output.statistics[b].clear();
    }
  } catch (const std::exception&) {
    return kernels::CurrentExceptionStatus(absl::StrCat("document forward (", total, " tokens)"));
  }
  try {
    // Float32 on the CPU, a normal (not inference-mode) tensor: callers may modify it outside InferenceMode.
    output.logits = internal::LogitsOnCpu(logits);
  } catch (const std::exception&) {
    return kernels::CurrentExceptionStatus(absl::StrCat("document forward (", total, " tokens)"));
  }
  return output;
}

at::Tensor DocumentClassifier::Pool(const at::Tensor& normed) const {
  if (config_.pooling == DocumentConfig::Pooling::kMean) return normed.mean(0);
  const int64_t tokens = normed.size(0);
  const int64_t heads = config_.pooling_heads;
  at::Tensor scores = kernels::Linear(normed, pool_score_weight_, pool_score_bias_);  // [N, P]
  if (pool_position_bias_.defined()) {
    // Tokens share a bucket in runs ([2^b - 1, 2^(b+1) - 1)), so the bias is added run by run.
    const int64_t buckets = config_.pooling_position_buckets;
    for (int64_t bucket = 0, start = 0; start < tokens; ++bucket) {
      const int64_t end = bucket == buckets - 1 ? tokens : std::min(tokens, (int64_t{2} << bucket) - 1);
      scores.narrow(0, start, end - start).add_(pool_position_bias_.select(1, bucket));
      start = end;
    }
  }
  const at::Tensor weights = at::softmax(scores, 0);  // [N, P], over the tokens
  // [N, P, C/P] weighted by [N, P, 1], summed over the tokens -> [C].
  return normed.view({tokens, heads, config_.embed_dim / heads}).mul(weights.unsqueeze(2)).sum(0).view(
      {config_.embed_dim});
}

absl::StatusOr<int64_t> DocumentClassifier::InputPreparationBytes(const ClassifierInput& input,
                                                                  const InputLimits& limits) const {
  // Tokenization is bounded (EncodeBounded): one 8 KiB piece with its pieces and ids at a time, and at most
  // max_tokens + 1 ids kept, each held as int64 in the id list and in the input tensor.
  const int64_t max_tokens = std::min(config_.max_tokens, limits.max_tokens);
  const int64_t tokens = input.kind == ClassifierInput::Kind::kText
                             ? std::min<int64_t>(static_cast<int64_t>(input.bytes.size()), max_tokens + 1)
                             : std::min<int64_t>(static_cast<int64_t>(input.token_ids.size()), max_tokens + 1);
  constexpr int64_t kPieceWorkingBytes = int64_t{256} << 10;
  return 2 * static_cast<int64_t>(sizeof(int64_t)) * tokens + kPieceWorkingBytes;
}

absl::StatusOr<Classifier::PreparedInput> DocumentClassifier::PrepareInput(const ClassifierInput& input,
                                                                           const InputLimits& limits,
                                                                           const StopCheck& stop) const {
  constexpr char kEmpty[] = "the document is empty; a document needs at least 1 token";
  const int64_t max_tokens = std::min(config_.max_tokens, limits.max_tokens);
  std::vector<int64_t> ids;
  bool complete = true;  // whether `ids` are all of the document's tokens
  RequestField field = RequestField::kDocumentText;
  if (input.kind == ClassifierInput::Kind::kText) {
    const std::string_view text = input.bytes;
    if (text.empty()) return InvalidRequest(field, kEmpty);
    if (absl::Status status = ValidateUtf8(text); !status.ok()) {
      return InvalidRequest(field, std::string(status.message()));
    }
    // Only whitespace is no document, whichever whitespace and whichever tokenizer.
    if (IsOnlyWhitespace(text)) {
      return InvalidRequest(field, absl::StrCat("the ", text.size(),
                                                "-byte text is only whitespace; a document needs at least 1 token"));
    }
    if (tokenizer_ == nullptr) return InvalidRequest(field, "this model has no tokenizer: send token ids");
    // Only what the limit needs is tokenized: max_tokens + 1 ids tell a document over the limit.
    absl::StatusOr<BoundedEncoding> encoded = EncodeBounded(*tokenizer_, text, max_tokens, stop);
    if (!encoded.ok()) {
      const absl::StatusCode code = encoded.status().code();
      if (code == absl::StatusCode::kResourceExhausted || code == absl::StatusCode::kCancelled ||
          code == absl::StatusCode::kDeadlineExceeded) {
        return encoded.status();
      }
      return InvalidRequest(field, std::string(encoded.status().message()));
    }
    ids = std::move(encoded->ids);
    complete = encoded->complete;
    if (ids.empty()) {
      return InvalidRequest(field, absl::StrCat("the ", text.size(), "-byte text has no tokens (tokenizer ",
                                                tokenizer_->name(), "); a document needs at least 1 token"));
    }
  } else {
    field = RequestField::kDocumentTokenIds;
    const absl::Span<const int64_t> sent = input.token_ids;
    if (sent.empty()) return InvalidRequest(field, kEmpty);
    for (size_t i = 0; i < sent.size(); ++i) {
      if (sent[i] < 0 || sent[i] >= config_.vocab_size) {
        return InvalidRequest(
            field, absl::StrCat(sent[i], " is out of range: allowed [0, ", config_.vocab_size - 1, "]"),
            static_cast<int64_t>(i));
      }
    }
    ids.assign(sent.begin(), sent.end());
  }
  // Tokens before truncation; a lower bound (max_tokens + 1) when the text was not read to its end.
  const int64_t input_tokens = complete ? static_cast<int64_t>(ids.size()) : max_tokens + 1;
  if (static_cast<int64_t>(ids.size()) > max_tokens) {
    if (!input.truncate) {
      const std::string source =
          config_.max_tokens <= limits.max_tokens ? std::string("the model's max_tokens") : limits.max_tokens_source;
      const std::string count = complete ? absl::StrCat(ids.size()) : absl::StrCat("more than ", max_tokens);
      return InvalidRequest({{field, -1,
                              absl::StrCat("the document has ", count, " tokens, over the limit of ", max_tokens,
                                           " tokens (", source, ")")},
                             {RequestField::kTruncate, -1,
                              absl::StrCat("set it to classify the first ", max_tokens, " tokens")}});
    }
    ids.resize(static_cast<size_t>(max_tokens));
  }
  try {
    const int64_t tokens = static_cast<int64_t>(ids.size());
    at::Tensor tensor = at::empty({tokens}, at::TensorOptions().dtype(at::kLong));
    std::copy(ids.begin(), ids.end(), tensor.data_ptr<int64_t>());
    return PreparedInput{std::move(tensor), tokens, input_tokens};
  } catch (const std::exception&) {
    return kernels::CurrentExceptionStatus("document token ids");
  }
}

absl::StatusOr<ClassifierOutput> DocumentClassifier::Run(absl::Span<const BatchItem* const> items,
                                                         bool want_statistics, const ItemCheck& check) const {
  if (items.empty()) return absl::InvalidArgumentError("items: the batch is empty");
  // A packed batch without padding: the documents' token ids back to back, [T]; the dense layers run on all T
  // tokens at once, attention per document with its own N, m and k.
  int64_t total = 0;
  for (const BatchItem* item : items) total += item->tokens;
  std::vector<int64_t> lengths;
  std::vector<AttentionBudget> budgets;
  at::Tensor token_ids;
  try {
    // Packed in pinned memory for a CUDA device (Forward copies the ids there without the host waiting).
    token_ids = at::empty({total}, internal::HostStagingOptions(placement_, at::kLong));
    int64_t* packed = token_ids.data_ptr<int64_t>();
    for (const BatchItem* item : items) {
      const at::Tensor ids = item->input.contiguous();
      if (ids.dim() != 1 || ids.scalar_type() != at::kLong || ids.size(0) != item->tokens) {
        return absl::InvalidArgumentError("items: not prepared by this document classifier");
      }
      std::copy(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + item->tokens, packed);
      packed += item->tokens;
      lengths.push_back(item->tokens);
      budgets.push_back(item->budget.budget);
    }
  } catch (const std::exception&) {
    return kernels::CurrentExceptionStatus("packing the batch's documents");
  }
  return Forward(token_ids, lengths, budgets, want_statistics, kernels::MitaBackend::kAuto, check);
}

}  // namespace mita::models
