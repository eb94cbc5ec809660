// The one interface the server sees of a model: a Classifier turns one request input and its budget into a batch
// item (Prepare), runs packed batches of items with per-item budgets (Run), and describes itself. The image
// classifier (vit_classifier.h) and the document classifier (document_classifier.h) implement it; a model package
// holds one (model_package.h). Nothing here knows an API: errors about a request carry structured field problems
// (request_error.h) that each front end words in its own vocabulary.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/mita_attention.h"
#include "models/budget.h"
#include "models/cost_features.h"

namespace mita::models {

// What a classifier takes as input. kOther: an input neither front end has a form for (a classifier made in code,
// e.g. a test's scripted kind); it says which inputs it takes (Classifier::CheckInputKind).
enum class InputKind { kImage, kDocument, kOther };

// Where a classifier's weights live and its forward runs, and the dtype of its weights and activations
// (mita-server's --device and --weights_dtype, server/process/placement.h). Inputs arrive on the CPU; logits leave on it.
struct Placement {
  c10::Device device = c10::Device(c10::kCPU);
  // float32; or bfloat16 (weights and activations) on a CUDA device, where the CUDA MiTA kernel accumulates in
  // float32, or on a CPU with bfloat16 dot products, where the attention kernels run in float32.
  at::ScalarType weights_dtype = at::kFloat;
};

// OK when a classifier can run with `placement` in this process. Errors: kernels::CheckWeightsDtypeOnDevice's
// (INVALID_ARGUMENT for a dtype other than float32 or bfloat16; FAILED_PRECONDITION for bfloat16 on a CPU without
// bfloat16 dot products); FAILED_PRECONDITION when the device cannot be used (kernels::CheckDeviceUsable: no CUDA
// in LibTorch, no CUDA device visible, an index beyond the visible devices).
absl::Status CheckPlacement(const Placement& placement);

// The placement a device name ("cpu", "cuda:N") and a weights dtype name ("float32", "bfloat16") give, checked by
// CheckPlacement (the tools' --device and --weights_dtype). Errors: kernels::ParseDevice's,
// kernels::ParseWeightsDtype's (INVALID_ARGUMENT naming the value and the allowed ones), CheckPlacement's.
absl::StatusOr<Placement> ParsePlacement(absl::string_view device, absl::string_view weights_dtype);

// One request input, in neutral terms. It views the caller's request: valid while Prepare runs.
struct ClassifierInput {
  enum class Kind {
    kNone,      // the request carried no input
    kImage,     // `bytes`: an encoded PNG or JPEG
    kText,      // `bytes`: UTF-8 text (checked by Prepare)
    kTokenIds,  // `token_ids`
  };
  Kind kind = Kind::kNone;
  std::string_view bytes;
  absl::Span<const int64_t> token_ids;
  // Documents: classify the first max_tokens tokens of a longer document instead of refusing it.
  bool truncate = false;
};

// Limits the server applies to inputs, on top of the model's own (the tighter one wins).
struct InputLimits {
  // Largest encoded image, bytes.
  int64_t max_encoded_image_bytes = int64_t{4} << 20;
  // Longest document, tokens, and who sets that limit (named in errors, e.g. "flag --max_batch_tokens").
  int64_t max_tokens = std::numeric_limits<int64_t>::max();
  std::string max_tokens_source = "the server's limit";
};

// An image model's input: the size it classifies at and the largest image it decodes.
struct ImageInputDescription {
  int64_t width = 0;   // pixels; other sizes are resized
  int64_t height = 0;  // pixels
  int64_t channels = 0;
  int64_t max_width = 0;   // largest declared width accepted, pixels
  int64_t max_height = 0;  // largest declared height accepted, pixels
};

// A document model's input.
struct DocumentInputDescription {
  int64_t max_tokens = 0;       // longest document the model takes, tokens
  int64_t vocabulary_size = 0;  // token ids are in [0, vocabulary_size)
  std::string tokenizer;        // "bytes" or "sentencepiece"
};

// What a classifier is: its input, labels and budget knobs. `image` or `document` is set when `input_kind` names
// it (neither for kOther).
struct ClassifierDescription {
  std::string name;          // the model's name (its package folder)
  std::string architecture;  // config.json "architecture"
  InputKind input_kind = InputKind::kImage;
  std::optional<ImageInputDescription> image;
  std::optional<DocumentInputDescription> document;
  std::vector<std::string> labels;  // one per class, by class index
  BudgetKnobs knobs;
  int64_t layers = 0;  // transformer blocks (attention layers)
  int64_t heads = 0;
  int64_t embed_dim = 0;
  // Tokens one input occupies in attention when fixed (images: patches + cls); 0 when it varies (documents).
  int64_t tokens_per_input = 0;
  // The most tokens one input may occupy (tokens_per_input when fixed; documents: their max_tokens).
  int64_t max_input_tokens = 0;
  // The token count of a representative input, for which GetModel quotes each budget's predicted compute
  // (tokens_per_input when fixed; documents: 16,384, or max_tokens when smaller).
  int64_t reference_tokens = 0;
  // Where it runs (kernels::DeviceName: "cpu", "cuda:0") and its weights' dtype ("float32", "bfloat16").
  std::string device = "cpu";
  std::string weights_dtype = "float32";

  // One line for logs, e.g. "fashion-mnist-vit (mita_vit, image 28x28x1, 50 tokens, 4 layers, 10 classes,
  // default budget MiTA m=9 k=16, on cpu in float32)".
  std::string Summary() const;
};

// One prepared input, ready to join a packed batch.
struct BatchItem {
  // The model input: images [C, H, W] float32; documents [N] int64 token ids.
  at::Tensor input;
  // Tokens this item adds to a packed batch (images: patches + cls; documents: after truncation).
  int64_t tokens = 0;
  // Tokens of the input before truncation (>= tokens).
  int64_t input_tokens = 0;
  // The budget applied to this input (ApplyBudget) and the preset name to echo.
  ResolvedBudget budget;
  // The budget the request asked for, resolved against the knobs (before ApplyBudget); for a latency target
  // its most accurate allowed budget.
  AttentionBudget requested_budget;
  // Whether the request set a latency target; then the budgets it allows (AllowedBudgets), applied to `tokens`,
  // most accurate first: the server picks one into `budget` (server/planning/latency_planner.h). Empty otherwise.
  bool latency_target = false;
  std::vector<ResolvedBudget> allowed_budgets;
  // ComputeUnits(tokens, budget.budget): the admission cost (server/planning/batcher.h).
  int64_t compute_units = 0;

  // This item with allowed_budgets[choice] applied (budget and compute_units follow it); a copy of it when it
  // allows one budget (`choice` is then ignored). The input tensor is shared, not copied.
  BatchItem WithBudget(size_t choice) const;
};

// Whether long work should go on: OK, or the status to stop with (CANCELLED, DEADLINE_EXCEEDED).
using StopCheck = std::function<absl::Status()>;
// Whether the caller of batch item `item` still waits for it: OK, or why not (CANCELLED, DEADLINE_EXCEEDED).
using ItemCheck = std::function<absl::Status(size_t item)>;

// Output of one batched forward.
struct ClassifierOutput {
  // Class logits [B, num_classes], float32 on the CPU whatever the placement (the rows of stopped items are 0).
  at::Tensor logits;
  // B entries: statistics[b][layer] for item b when requested and item b ran MiTA; statistics[b] empty otherwise.
  std::vector<std::vector<kernels::MitaItemStatistics>> statistics;
  // B entries: OK for an item that ran to the end; else the status its ItemCheck stopped it with.
  std::vector<absl::Status> stopped;
};

// A model the server can host. Implementations are immutable after creation and thread-safe.
class Classifier {
 public:
  virtual ~Classifier();

  virtual const ClassifierDescription& description() const = 0;

  // OK when this model takes inputs of `input`'s kind. Errors: INVALID_ARGUMENT carrying a kInput problem ("model
  // 'X' takes an image, not a document"). The default compares with description().input_kind.
  virtual absl::Status CheckInputKind(const ClassifierInput& input) const;

  // What the compute time of a batch of `items` is linear in (models/cost_features.h; feature 0 is 1 per batch).
  // The default is a transformer's: TransformerCostFeatures of description()'s layers and embed_dim.
  virtual CostFeatures BatchCostFeatures(absl::Span<const CostItem> items) const;
  // Seconds per unit of each feature before any calibration. The default: TransformerPriorCoefficients().
  virtual CostFeatures PriorCostCoefficients() const;

  // A synthetic input of `tokens` tokens at `budget` (applied to the tokens), for timing batches (the server's cost
  // calibration): random content of this model's kind. Errors: INVALID_ARGUMENT when no input of this model has
  // `tokens` tokens (< 1, over max_input_tokens, or not tokens_per_input).
  absl::StatusOr<BatchItem> SyntheticItem(int64_t tokens, const AttentionBudget& budget) const;

  // Turns one input and its budget into a batch item: checks the input kind, resolves the budget against the
  // knobs (AllowedBudgets: one budget, or a latency target's choices), then decodes or tokenizes the input
  // (PrepareInput) and applies the budget(s) to its token count (ApplyBudget). Cheap checks come first, so a bad
  // request costs no decoding.
  // Errors: INVALID_ARGUMENT carrying field problems (request_error.h): the wrong or no input (kInput), a bad
  // budget (kPreset, kExperts, kExpertCount, kExpertWidth, kLatencyTarget, kBudgetFloor), a bad input (kImage, kDocument, kDocumentText,
  // kDocumentTokenIds); RESOURCE_EXHAUSTED when memory runs out.
  // `stop` (optional) is asked between pieces of long preparation work (e.g. every piece of a long text); a
  // non-OK answer ends Prepare with that status.
  absl::StatusOr<BatchItem> Prepare(const ClassifierInput& input, const BudgetRequest& budget,
                                    const InputLimits& limits, const StopCheck& stop = nullptr) const;

  // The working memory Prepare will need for `input`, bytes, found from cheap checks and headers only (an
  // image's declared size and decode scale, a text's length); the server admits preparation by it. An input of
  // the wrong kind costs 0 (Prepare refuses it). Errors: INVALID_ARGUMENT as Prepare for an input refused from
  // its header alone (a kImage problem: unknown format, declared size over the limits, a bad JPEG header).
  absl::StatusOr<int64_t> PreparationBytes(const ClassifierInput& input, const InputLimits& limits) const;

  // Runs a packed batch: items from Prepare of this classifier, each with its own budget; the dense layers run
  // on all items' tokens at once, attention per item, on the classifier's device (a CUDA device: the packed
  // inputs are copied there through pinned host memory). An item's logits do not depend on the other items (up
  // to float rounding). `want_statistics`: fill ClassifierOutput::statistics. `check` (optional) is asked for every
  // running item between layers (and inside long attention): an item whose caller left is dropped from the
  // packed batch, and the others go on (ClassifierOutput::stopped says which stopped). Runs under
  // c10::InferenceMode.
  // Errors: INVALID_ARGUMENT for an empty batch or items this classifier did not prepare; RESOURCE_EXHAUSTED
  // when memory runs out (host or device: c10::OutOfMemoryError); INTERNAL when ATen or a kernel fails on
  // validated input.
  virtual absl::StatusOr<ClassifierOutput> Run(absl::Span<const BatchItem* const> items, bool want_statistics,
                                               const ItemCheck& check = nullptr) const = 0;

 protected:
  // The input as the model takes it: the tensor of BatchItem::input and its token counts.
  struct PreparedInput {
    at::Tensor input;
    int64_t tokens = 0;
    int64_t input_tokens = 0;
  };
  // Decodes or tokenizes an input of this classifier's kind (Prepare has checked the kind).
  // Errors: INVALID_ARGUMENT carrying field problems; RESOURCE_EXHAUSTED when memory runs out.
  virtual absl::StatusOr<PreparedInput> PrepareInput(const ClassifierInput& input, const InputLimits& limits,
                                                     const StopCheck& stop) const = 0;
  // PreparationBytes of an input of this classifier's kind.
  virtual absl::StatusOr<int64_t> InputPreparationBytes(const ClassifierInput& input,
                                                        const InputLimits& limits) const = 0;
  // Random content of `tokens` tokens (SyntheticItem has checked the count against the description).
  virtual PreparedInput SyntheticInput(int64_t tokens) const = 0;
};

// One class of a classification: index, softmax probability.
struct ClassScore {
  int64_t index = 0;
  float probability = 0;
};

// The `top_n[b]` most probable classes of each row b of `logits` [B, C] (softmax over C), best first.
// Errors: INVALID_ARGUMENT when logits is not 2-D or top_n has not B entries; INTERNAL if ATen fails.
absl::StatusOr<std::vector<std::vector<ClassScore>>> TopClasses(const at::Tensor& logits,
                                                                absl::Span<const int64_t> top_n);

}  // namespace mita::models
