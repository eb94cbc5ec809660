// Attention budgets: what a request asks for (BudgetRequest), what a model accepts (BudgetKnobs), and the budget
// that runs (AttentionBudget). One resolution for every model kind; the kind only decides the knobs.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "models/request_error.h"

namespace mita::models {

// A MiTA budget: expert count m (number of landmarks = routed experts) and expert width k (keys per routed
// expert), or full softmax attention with the same weights.
struct AttentionBudget {
  bool full_attention = false;
  int64_t expert_count = 0;
  int64_t expert_width = 0;

  bool operator==(const AttentionBudget& other) const {
    return full_attention == other.full_attention &&
           (full_attention || (expert_count == other.expert_count && expert_width == other.expert_width));
  }
};

// The budget a request asks for, in neutral terms (each front end translates its own form into this).
struct BudgetRequest {
  enum class Choice {
    kDefault,        // the model's default budget
    kPreset,         // a named preset of the model ("" and "default" name the default budget)
    kExperts,        // an expert budget; a knob left at 0 takes the model's default
    kFullAttention,  // ordinary softmax attention with the same weights
    kLatencyTarget,  // the server picks from the model's accuracy order (BudgetKnobs::accuracy_order)
  };
  Choice choice = Choice::kDefault;
  std::string preset;        // kPreset
  int64_t expert_count = 0;  // kExperts
  int64_t expert_width = 0;  // kExperts
  // kLatencyTarget: receipt to answer the server plans for; zero: the call's deadline (server/planning/latency_planner.h).
  absl::Duration latency_target = absl::ZeroDuration();
  // kLatencyTarget: the least accurate budget the server may apply: a DeclaredBudget name, or a preset name,
  // "default" or budget text ("9x16", "full") naming a budget of the order; "": the order's last one.
  std::string floor;
};

// One budget a model declares in its accuracy order, with its held-out accuracy.
struct DeclaredBudget {
  // The preset's name when a preset (or the default) is this budget, else the budget's text ("9x16", "full").
  std::string name;
  AttentionBudget budget;
  // Held-out accuracy in [0, 1] written by the evaluation tool (config.json attention.accuracy_order); -1 when
  // the package declares no order and the budgets are ranked by their compute instead.
  double accuracy = -1;
};

// What a model accepts: the knob ranges, its default budget and its named presets.
struct BudgetKnobs {
  // Expert counts allowed; empty: every count in [min_expert_count, max_expert_count].
  std::vector<int64_t> allowed_expert_counts;
  int64_t min_expert_count = 1;
  int64_t max_expert_count = 1;
  int64_t min_expert_width = 1;
  int64_t max_expert_width = 1;
  AttentionBudget default_budget;
  std::map<std::string, AttentionBudget> presets;
  // Every model runs full attention with its own weights (docs/design.md section 2.7).
  bool full_attention_supported = true;
  // The budgets a latency target chooses from, most accurate first (never empty for a loaded model):
  // config.json attention.accuracy_order when present, else the default, the presets and full attention ranked
  // by their compute at the model's longest input (DefaultAccuracyOrder).
  std::vector<DeclaredBudget> accuracy_order;
};

// A resolved budget and the preset name to echo: "default" for the default budget, the preset's name for a
// preset, "" for an explicit expert budget or full attention.
struct ResolvedBudget {
  AttentionBudget budget;
  std::string preset;
};

// The budgets a request allows, most accurate first: one for a fixed budget (ResolveBudget's), the accuracy
// order down to the floor for a latency target. Errors: ResolveBudget's; for kLatencyTarget INVALID_ARGUMENT
// carrying a kBudgetFloor problem for an unknown floor (listing the names), a kLatencyTarget problem for a
// negative target.
absl::StatusOr<std::vector<ResolvedBudget>> AllowedBudgets(const BudgetKnobs& knobs, const BudgetRequest& request);

// The accuracy order of a package that declares none: the default budget, the presets and (when supported) full
// attention, ranked by ComputeUnits at `tokens` tokens, most first (more compute taken as more accurate), equal
// budgets once, accuracy -1, each named by DeclaredBudgetName.
std::vector<DeclaredBudget> DefaultAccuracyOrder(const BudgetKnobs& knobs, int64_t tokens);

// The problem with `value` for the knob `field` (kExpertCount or kExpertWidth) of a model with `knobs`, worded
// with what is allowed ("10 is not allowed: use one of 1, 4, 9", "51 is out of range: allowed [1, 50]"); none
// when it is allowed. The one wording of a knob's range, for every front end.
std::optional<FieldProblem> KnobProblem(const BudgetKnobs& knobs, RequestField field, int64_t value);

// The problems of `budget` against `knobs` (none for full attention): expert_count not allowed ("10 is not
// allowed: use one of 1, 4, 9") or out of range ("0 is out of range: allowed [1, 256]"), expert_width out of
// range. Each problem names its knob (RequestField::kExpertCount / kExpertWidth, models/request_error.h).
// Returns OK, or INVALID_ARGUMENT carrying one problem per bad knob.
absl::Status CheckBudget(const BudgetKnobs& knobs, const AttentionBudget& budget);

// Resolves `request` against `knobs`: kDefault -> the default budget; kPreset -> that preset; kExperts -> the
// budget with unset knobs defaulted, checked by CheckBudget; kFullAttention -> full attention.
// Errors: INVALID_ARGUMENT carrying field problems: an unknown preset (kPreset, listing the available ones), a
// bad knob (kExpertCount, kExpertWidth), an expert budget with a knob left unset when the model's default is
// full attention (kExperts), full attention on a model without it (kBudget).
absl::StatusOr<ResolvedBudget> ResolveBudget(const BudgetKnobs& knobs, const BudgetRequest& request);

// The budget applied to an input of `tokens` (>= 1) tokens: expert_count = min(m, tokens) and expert_width =
// min(k, tokens); full attention unchanged. An input shorter than the budget runs with every token as a
// landmark and/or every key in each routed expert.
AttentionBudget ApplyBudget(const AttentionBudget& budget, int64_t tokens);

// Compute units of one input (server/planning/batcher.h): tokens x attention width, where the width is M + k under MiTA
// (the M shared-expert outputs and the k keys of the query's routed expert: cost O(N (M + k) d) per head,
// docs/design.md) and N under full attention. `budget` is the budget applied to the input.
int64_t ComputeUnits(int64_t tokens, const AttentionBudget& budget);

// Parses the budget text the tools take on the command line: "MxK" (expert_count x expert_width, e.g. "9x16")
// or "full" (full attention). Only the form is checked; CheckBudget checks the values against a model.
// Errors: INVALID_ARGUMENT quoting the text and the expected form.
absl::StatusOr<AttentionBudget> ParseBudget(absl::string_view text);

// A budget's name in tables and logs: "MiTA m=9 k=16" or "full attention".
std::string BudgetName(const AttentionBudget& budget);

// A budget as ParseBudget reads it: "9x16" (expert_count x expert_width) or "full".
std::string BudgetText(const AttentionBudget& budget);

// The DeclaredBudget::name of `budget` in `knobs`: "default" when it is the default budget, else the name of
// the first preset (in map order) equal to it, else BudgetText ("9x16", "full").
std::string DeclaredBudgetName(const BudgetKnobs& knobs, const AttentionBudget& budget);

}  // namespace mita::models
