// mita-eval-documents: held-out accuracy of a document model package at several budgets plus full attention.
//
//   mita-eval-documents --model=models/repository/linux-doc-mita --corpus=build/linux-doc-corpus \
//       --budgets=8x32,16x64,32x128 --threads=2
// Reads the corpus split written by tools/build_document_corpus.py, validates and tokenizes every document with
// the package's own tokenizer (as the server does), cuts it to the model's max_tokens, and classifies it with
// each budget (expert_count x expert_width, applied to each document's length with ApplyDocumentBudget) and
// with full attention, in packed batches of at most --batch_tokens tokens. Prints the accuracy per budget, the
// majority-class baseline (the most frequent class of the training split, predicted for every document) and
// the token-count statistics.
#include <ATen/Parallel.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "kernels/runtime_environment.h"
#include "models/model_package.h"
#include "tools/document_corpus.h"

ABSL_FLAG(std::string, model, "models/repository/linux-doc-mita", "document model package folder");
ABSL_FLAG(std::string, corpus, "build/linux-doc-corpus", "corpus folder (tools/build_document_corpus.py)");
ABSL_FLAG(std::string, split, "heldout", "corpus split to evaluate");
ABSL_FLAG(std::string, budgets, "8x32,16x64,32x128",
          "comma-separated expert_count x expert_width budgets; full attention is always added");
ABSL_FLAG(int64_t, batch_tokens, 65536, "largest packed batch, tokens (a longer document runs alone)");
ABSL_FLAG(int64_t, limit, 0, "evaluate only the first N documents (0 = all)");
ABSL_FLAG(int, threads, 2, "LibTorch intra-op threads");

namespace {

using Clock = std::chrono::steady_clock;

struct Tokenized {
  std::vector<int64_t> ids;
  int64_t label = 0;
};

}  // namespace

int main(int argc, char** argv) {
  mita::kernels::ReexecWithPassiveOpenMpWaitIfUnset(argv);
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "/evaluate_documents.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage("Held-out accuracy of a document model per budget. Flags below.");
  absl::ParseCommandLine(argc, argv);
  mita::kernels::SetIntraOpThreads(absl::GetFlag(FLAGS_threads));

  auto loaded = mita::models::LoadDocumentClassifier(absl::GetFlag(FLAGS_model));
  if (!loaded.ok()) {
    std::fprintf(stderr, "%s\n", loaded.status().ToString().c_str());
    return 1;
  }
  const mita::models::DocumentClassifier& model = **loaded;
  const mita::models::DocumentConfig& config = model.config();
  if (model.tokenizer() == nullptr) {
    std::fprintf(stderr, "%s has no tokenizer\n", absl::GetFlag(FLAGS_model).c_str());
    return 1;
  }
  auto documents = mita::datasets::ReadCorpusSplit(absl::GetFlag(FLAGS_corpus), absl::GetFlag(FLAGS_split));
  auto training = mita::datasets::ReadCorpusSplit(absl::GetFlag(FLAGS_corpus), "train");
  if (!documents.ok() || !training.ok()) {
    std::fprintf(stderr, "%s\n", (!documents.ok() ? documents.status() : training.status()).ToString().c_str());
    return 1;
  }
  if (absl::GetFlag(FLAGS_limit) > 0 && static_cast<int64_t>(documents->size()) > absl::GetFlag(FLAGS_limit)) {
    documents->resize(absl::GetFlag(FLAGS_limit));
  }

  // Budgets: "m x k" entries, then full attention.
  std::vector<mita::models::AttentionBudget> budgets;
  std::vector<std::string> names;
  for (absl::string_view entry : absl::StrSplit(absl::GetFlag(FLAGS_budgets), ',', absl::SkipEmpty())) {
    absl::StatusOr<mita::models::AttentionBudget> budget = mita::models::ParseBudget(entry);
    if (!budget.ok() || budget->full_attention) {
      std::fprintf(stderr, "--budgets: '%s' is not expert_count x expert_width (full attention is always added)\n",
                   std::string(entry).c_str());
      return 1;
    }
    if (auto status = mita::models::CheckBudget(model.description().knobs, *budget); !status.ok()) {
      std::fprintf(stderr, "--budgets: %s\n", status.ToString().c_str());
      return 1;
    }
    budgets.push_back(*budget);
    names.push_back(mita::models::BudgetName(*budget));
  }
  budgets.push_back({true, 0, 0});
  names.push_back(mita::models::BudgetName(budgets.back()));

  // Tokenize (validate UTF-8 first, as the server does) and cut to max_tokens.
  std::vector<Tokenized> inputs;
  int64_t truncated = 0, total_tokens = 0, longest = 0;
  std::vector<int64_t> token_counts;
  for (const auto& document : *documents) {
    if (auto status = mita::models::ValidateUtf8(document.text); !status.ok()) {
      std::fprintf(stderr, "%s: %s\n", document.source.c_str(), status.ToString().c_str());
      return 1;
    }
    auto ids = model.tokenizer()->Encode(document.text);
    if (!ids.ok()) {
      std::fprintf(stderr, "%s: %s\n", document.source.c_str(), ids.status().ToString().c_str());
      return 1;
    }
    if (ids->empty()) continue;
    token_counts.push_back(static_cast<int64_t>(ids->size()));
    if (static_cast<int64_t>(ids->size()) > config.max_tokens) {
      ids->resize(config.max_tokens);
      ++truncated;
    }
    total_tokens += static_cast<int64_t>(ids->size());
    longest = std::max<int64_t>(longest, static_cast<int64_t>(ids->size()));
    inputs.push_back({*std::move(ids), document.label});
  }
  std::sort(token_counts.begin(), token_counts.end());
  const auto count = static_cast<int64_t>(inputs.size());
  std::printf("model %s (%s tokenizer), split %s: %lld documents, %lld tokens (median %lld, max %lld; %lld cut to "
              "max_tokens %lld)\n",
              absl::GetFlag(FLAGS_model).c_str(), model.tokenizer()->name().c_str(),
              absl::GetFlag(FLAGS_split).c_str(), static_cast<long long>(count), static_cast<long long>(total_tokens),
              static_cast<long long>(token_counts.empty() ? 0 : token_counts[token_counts.size() / 2]),
              static_cast<long long>(token_counts.empty() ? 0 : token_counts.back()), static_cast<long long>(truncated),
              static_cast<long long>(config.max_tokens));

  // Majority-class baseline: the training split's most frequent class.
  std::map<int64_t, int64_t> training_counts;
  for (const auto& document : *training) ++training_counts[document.label];
  int64_t majority = 0;
  for (const auto& [label, n] : training_counts) {
    if (n > training_counts[majority]) majority = label;
  }
  int64_t majority_correct = 0;
  for (const auto& input : inputs) majority_correct += input.label == majority;

  std::printf("| budget | held-out accuracy | correct | forward time (s) |\n|---|---|---|---|\n");
  for (size_t budget_index = 0; budget_index < budgets.size(); ++budget_index) {
    int64_t correct = 0;
    const auto start = Clock::now();
    for (int64_t first = 0; first < count;) {
      // A packed batch: documents while the token total stays within --batch_tokens (at least one document).
      std::vector<int64_t> ids, lengths;
      std::vector<mita::models::AttentionBudget> applied;
      int64_t last = first;
      while (last < count && (last == first || static_cast<int64_t>(ids.size() + inputs[last].ids.size()) <=
                                                   absl::GetFlag(FLAGS_batch_tokens))) {
        ids.insert(ids.end(), inputs[last].ids.begin(), inputs[last].ids.end());
        lengths.push_back(static_cast<int64_t>(inputs[last].ids.size()));
        applied.push_back(mita::models::ApplyBudget(budgets[budget_index], lengths.back()));
        ++last;
      }
      auto output = model.Forward(at::tensor(ids, at::TensorOptions().dtype(at::kLong)), lengths, applied, false);
      if (!output.ok()) {
        std::fprintf(stderr, "%s\n", output.status().ToString().c_str());
        return 1;
      }
      const at::Tensor predicted = output->logits.argmax(1);
      for (int64_t i = first; i < last; ++i) correct += predicted[i - first].item<int64_t>() == inputs[i].label;
      first = last;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf("| %s | %.4f | %lld / %lld | %.1f |\n", names[budget_index].c_str(),
                static_cast<double>(correct) / static_cast<double>(count), static_cast<long long>(correct),
                static_cast<long long>(count), seconds);
    std::fflush(stdout);
  }
  std::printf("| majority class (%s, from the training split) | %.4f | %lld / %lld | - |\n",
              model.description().labels[majority].c_str(), static_cast<double>(majority_correct) / static_cast<double>(count),
              static_cast<long long>(majority_correct), static_cast<long long>(count));
  return 0;
}
