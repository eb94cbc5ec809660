// The parts of the Classifier interface every model shares (see classifier.h).
#include "models/classifier.h"

#include <algorithm>
#include <exception>

#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>

#include "absl/strings/str_cat.h"
#include "kernels/aten_errors.h"
#include "kernels/device.h"
#include "kernels/status_macros.h"
#include "models/request_error.h"

namespace mita::models {
namespace {

// The input kind `input` is, or kNone.
std::optional<InputKind> KindOf(const ClassifierInput& input) {
  switch (input.kind) {
    case ClassifierInput::Kind::kImage:
      return InputKind::kImage;
    case ClassifierInput::Kind::kText:
    case ClassifierInput::Kind::kTokenIds:
      return InputKind::kDocument;
    case ClassifierInput::Kind::kNone:
      break;
  }
  return std::nullopt;
}

const char* KindName(InputKind kind) {
  switch (kind) {
    case InputKind::kImage:
      return "an image";
    case InputKind::kDocument:
      return "a document (text or token ids)";
    case InputKind::kOther:
      break;
  }
  return "another kind of input";
}

}  // namespace

Classifier::~Classifier() = default;

std::string ClassifierDescription::Summary() const {
  std::string input;
  if (image.has_value()) {
    input = absl::StrCat("image ", image->width, "x", image->height, "x", image->channels, ", ", tokens_per_input,
                         " tokens");
  } else if (document.has_value()) {
    input = absl::StrCat("documents up to ", document->max_tokens, " tokens, tokenizer ", document->tokenizer);
  }
  return absl::StrCat(name, " (", architecture, ", ", input, ", ", layers, " layers, ", labels.size(),
                      " classes, default budget ", BudgetName(knobs.default_budget), ", on ", device, " in ",
                      weights_dtype, ")");
}

absl::Status CheckPlacement(const Placement& placement) {
  RETURN_IF_ERROR(kernels::CheckWeightsDtypeOnDevice(placement.weights_dtype, placement.device));
  return kernels::CheckDeviceUsable(placement.device);
}

absl::StatusOr<Placement> ParsePlacement(absl::string_view device, absl::string_view weights_dtype) {
  Placement placement;
  ASSIGN_OR_RETURN(placement.device, kernels::ParseDevice(device));
  ASSIGN_OR_RETURN(placement.weights_dtype, kernels::ParseWeightsDtype(weights_dtype));
  RETURN_IF_ERROR(CheckPlacement(placement));
  return placement;
}

absl::Status Classifier::CheckInputKind(const ClassifierInput& input) const {
  const ClassifierDescription& model = description();
  const std::optional<InputKind> kind = KindOf(input);
  if (kind == model.input_kind) return absl::OkStatus();
  return InvalidRequest(RequestField::kInput,
                        absl::StrCat("model '", model.name, "' takes ", KindName(model.input_kind),
                                     kind.has_value()
                                         ? absl::StrCat(", not ", kind == InputKind::kImage ? "an image" : "a document")
                                         : std::string(" and none was set")));
}

CostFeatures Classifier::BatchCostFeatures(absl::Span<const CostItem> items) const {
  return TransformerCostFeatures(description().layers, description().embed_dim, items);
}

CostFeatures Classifier::PriorCostCoefficients() const { return TransformerPriorCoefficients(); }

BatchItem BatchItem::WithBudget(size_t choice) const {
  BatchItem item = *this;
  if (choice < allowed_budgets.size()) {
    item.budget = allowed_budgets[choice];
    item.compute_units = ComputeUnits(tokens, item.budget.budget);
  }
  return item;
}

absl::StatusOr<BatchItem> Classifier::SyntheticItem(int64_t tokens, const AttentionBudget& budget) const {
  const ClassifierDescription& model = description();
  if (tokens < 1 || tokens > model.max_input_tokens ||
      (model.tokens_per_input > 0 && tokens != model.tokens_per_input)) {
    return absl::InvalidArgumentError(absl::StrCat("model '", model.name, "' takes no input of ", tokens, " tokens"));
  }
  PreparedInput prepared = SyntheticInput(tokens);
  BatchItem item;
  item.input = std::move(prepared.input);
  item.tokens = prepared.tokens;
  item.input_tokens = prepared.input_tokens;
  item.requested_budget = budget;
  item.budget = ResolvedBudget{ApplyBudget(budget, item.tokens), ""};
  item.compute_units = ComputeUnits(item.tokens, item.budget.budget);
  return item;
}

absl::StatusOr<BatchItem> Classifier::Prepare(const ClassifierInput& input, const BudgetRequest& budget,
                                              const InputLimits& limits, const StopCheck& stop) const {
  const ClassifierDescription& model = description();
  RETURN_IF_ERROR(CheckInputKind(input));
  ASSIGN_OR_RETURN(std::vector<ResolvedBudget> allowed, AllowedBudgets(model.knobs, budget));
  ASSIGN_OR_RETURN(PreparedInput prepared, PrepareInput(input, limits, stop));
  BatchItem item;
  item.input = std::move(prepared.input);
  item.tokens = prepared.tokens;
  item.input_tokens = prepared.input_tokens;
  item.requested_budget = allowed.front().budget;
  item.budget = ResolvedBudget{ApplyBudget(allowed.front().budget, item.tokens), allowed.front().preset};
  item.latency_target = budget.choice == BudgetRequest::Choice::kLatencyTarget;
  if (item.latency_target) {
    for (const ResolvedBudget& choice : allowed) {
      item.allowed_budgets.push_back(ResolvedBudget{ApplyBudget(choice.budget, item.tokens), choice.preset});
    }
  }
  item.compute_units = ComputeUnits(item.tokens, item.budget.budget);
  return item;
}

absl::StatusOr<int64_t> Classifier::PreparationBytes(const ClassifierInput& input, const InputLimits& limits) const {
  if (!CheckInputKind(input).ok()) return 0;
  return InputPreparationBytes(input, limits);
}

absl::StatusOr<std::vector<std::vector<ClassScore>>> TopClasses(const at::Tensor& logits,
                                                                absl::Span<const int64_t> top_n) {
  if (!logits.defined() || logits.dim() != 2 || logits.size(0) != static_cast<int64_t>(top_n.size())) {
    return absl::InvalidArgumentError(absl::StrCat("logits must be [B, C] with B = ", top_n.size(), " rows"));
  }
  try {
    int64_t columns = 1;
    for (int64_t n : top_n) columns = std::max(columns, n);
    columns = std::min(columns, logits.size(1));
    const at::Tensor probabilities = at::softmax(logits.to(at::kFloat), 1);
    const auto [values, indices] = at::topk(probabilities, columns, 1);
    const at::Tensor top_values = values.contiguous();
    const at::Tensor top_indices = indices.contiguous();
    const float* value = top_values.data_ptr<float>();
    const int64_t* index = top_indices.data_ptr<int64_t>();
    std::vector<std::vector<ClassScore>> result(top_n.size());
    for (size_t b = 0; b < top_n.size(); ++b) {
      const int64_t n = std::min(top_n[b], columns);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = static_cast<int64_t>(b) * columns + j;
        result[b].push_back({index[at], value[at]});
      }
    }
    return result;
  } catch (const std::exception&) {
    return kernels::CurrentExceptionStatus("top classes");
  }
}

}  // namespace mita::models
