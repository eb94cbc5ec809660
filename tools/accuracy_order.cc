// See accuracy_order.h.
#include "tools/accuracy_order.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "models/model_config.h"
#include "nlohmann/json.hpp"

namespace mita::tools {

std::vector<MeasuredAccuracy> SortByAccuracy(const std::vector<MeasuredAccuracy>& given, int64_t tokens) {
  std::vector<MeasuredAccuracy> measured;
  for (const MeasuredAccuracy& entry : given) {
    const bool listed = std::any_of(measured.begin(), measured.end(),
                                    [&entry](const MeasuredAccuracy& kept) { return kept.budget == entry.budget; });
    if (!listed) measured.push_back({entry.budget, std::round(entry.accuracy * 10000) / 10000});
  }
  std::stable_sort(measured.begin(), measured.end(), [tokens](const MeasuredAccuracy& a, const MeasuredAccuracy& b) {
    if (a.accuracy != b.accuracy) return a.accuracy > b.accuracy;
    return models::ComputeUnits(tokens, models::ApplyBudget(a.budget, tokens)) <
           models::ComputeUnits(tokens, models::ApplyBudget(b.budget, tokens));
  });
  return measured;
}

absl::StatusOr<std::vector<models::DeclaredBudget>> WriteAccuracyOrder(const std::string& package_directory,
                                                                      const std::vector<MeasuredAccuracy>& order) {
  const std::filesystem::path path = std::filesystem::path(package_directory) / "config.json";
  std::ifstream input(path, std::ios::binary);
  if (!input) return absl::NotFoundError(absl::StrCat("cannot open ", path.string()));
  const std::string old_text((std::istreambuf_iterator<char>(input)), std::istreambuf_iterator<char>());
  // ordered_json keeps the file's key order.
  nlohmann::ordered_json root;
  try {
    root = nlohmann::ordered_json::parse(old_text);
  } catch (const nlohmann::ordered_json::exception& error) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": invalid JSON: ", error.what()));
  }
  if (!root.is_object() || !root.contains("attention") || !root["attention"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": no attention object"));
  }
  nlohmann::ordered_json entries = nlohmann::ordered_json::array();
  for (const MeasuredAccuracy& entry : order) {
    entries.push_back({{"budget", models::BudgetText(entry.budget)}, {"accuracy", entry.accuracy}});
  }
  root["attention"]["accuracy_order"] = std::move(entries);
  const std::string new_text = root.dump(2) + "\n";

  // The server's own parser must accept what is written.
  ASSIGN_OR_RETURN(const std::string architecture, models::ParseArchitecture(new_text));
  std::vector<models::DeclaredBudget> parsed;
  if (architecture == "mita_vit") {
    ASSIGN_OR_RETURN(const models::VitConfig config, models::ParseVitConfig(new_text));
    parsed = config.accuracy_order;
  } else {
    ASSIGN_OR_RETURN(const models::DocumentConfig config, models::ParseDocumentConfig(new_text));
    parsed = config.accuracy_order;
  }

  const std::filesystem::path temporary = path.string() + ".tmp";
  {
    std::ofstream output(temporary, std::ios::binary | std::ios::trunc);
    output << new_text;
    if (!output.flush()) return absl::InternalError(absl::StrCat("cannot write ", temporary.string()));
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) return absl::InternalError(absl::StrCat("cannot replace ", path.string(), ": ", error.message()));
  return parsed;
}

}  // namespace mita::tools
