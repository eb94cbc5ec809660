// libFuzzer target: config.json parsing and budget checks (models::ParseVitConfig, ImageKnobs, CheckBudget). Any input must give a config or an INVALID_ARGUMENT, never a crash or a sanitizer
// report; an accepted config must satisfy the invariants the model code relies on.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "models/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<mita::models::VitConfig> config = mita::models::ParseVitConfig(text);
  if (!config.ok()) {
    if (config.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  // Invariants the model code relies on.
  if (config->patch_size < 1 || config->image_size % config->patch_size != 0 || config->num_heads < 1 ||
      config->embed_dim % config->num_heads != 0 || (config->in_channels != 1 && config->in_channels != 3) ||
      static_cast<int64_t>(config->mean.size()) != config->in_channels ||
      static_cast<int64_t>(config->std.size()) != config->in_channels) {
    std::abort();
  }
  for (float deviation : config->std) {
    if (!(deviation > 0)) std::abort();
  }
  const mita::models::BudgetKnobs knobs = mita::models::ImageKnobs(*config);
  if (!mita::models::CheckBudget(knobs, config->default_budget).ok()) std::abort();
  for (const auto& [name, preset] : config->presets) {
    if (name.empty() || !mita::models::CheckBudget(knobs, preset).ok()) std::abort();
  }
  // Budgets around the edges of the allowed ranges must be classified without crashing.
  for (int64_t count : {int64_t{0}, int64_t{1}, config->grid_side() * config->grid_side(), int64_t{-1}}) {
    for (int64_t width : {int64_t{0}, int64_t{1}, config->tokens(), config->tokens() + 1}) {
      (void)mita::models::CheckBudget(knobs, {false, count, width});
    }
  }
  return 0;
}
