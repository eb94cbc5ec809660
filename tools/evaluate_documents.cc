// mita-eval-documents: held-out accuracy of a document model package at several budgets plus full attention,
// per length bucket, with the forward time per document.
//
//   mita-eval-documents --model=models/repository/texlive-doc-mita --corpus=build/texlive-doc-corpus \
//       --budgets=4x16,8x32,16x64,32x128 --first_tokens=512,4096@16x64 --threads=2
// Reads the corpus split written by tools/build_document_corpus.py, validates and tokenizes every document with
// the package's own tokenizer (as the server does), cuts it to the model's max_tokens, and classifies it with
// each budget (expert_count x expert_width, applied to each document's length with ApplyBudget) and with full
// attention, in packed batches of at most --batch_tokens tokens (0: one document per forward, so that the time
// per document is its own forward). Prints, per budget, the accuracy in each length bucket (under 4K, 4K-16K,
// 16K-32K, 32K-64K tokens, counted after the cut to max_tokens) and overall, and the mean forward time per
// document in each bucket; with --first_tokens=N[@budget],... also the same model on each document's first N tokens
// only (full attention unless a budget is named), the truncation baselines; then the majority-class baseline (the training split's most
// frequent class, predicted for every document). --full_attention_max_tokens leaves full attention out on
// longer documents (its time grows as N^2): their cells then count only the documents it ran on;
// --full_attention=false leaves it out altogether. --write_accuracy_order then rewrites the package's config.json
// with attention.accuracy_order: the budgets by their measured accuracy over every evaluated document, most
// accurate first; full attention only when it ran on every one of them.
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
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/runtime_environment.h"
#include "models/model_package.h"
#include "tools/accuracy_order.h"
#include "tools/document_corpus.h"

ABSL_FLAG(std::string, model, "models/repository/texlive-doc-mita", "document model package folder");
ABSL_FLAG(std::string, corpus, "build/texlive-doc-corpus", "corpus folder (tools/build_document_corpus.py)");
ABSL_FLAG(std::string, split, "heldout", "corpus split to evaluate");
ABSL_FLAG(std::string, budgets, "8x32,16x64,32x128",
          "comma-separated expert_count x expert_width budgets (full attention: --full_attention)");
ABSL_FLAG(int64_t, batch_tokens, 65536,
          "largest packed batch, tokens (a longer document runs alone; 0: one document per forward)");
ABSL_FLAG(std::string, first_tokens, "",
          "also classify each document's first N tokens only: comma-separated N or N@budget (budget MxK or full; "
          "full attention when left out), e.g. 512,4096@16x64 (empty: no)");
ABSL_FLAG(bool, full_attention, true, "also evaluate full attention on the same weights");
ABSL_FLAG(int64_t, full_attention_max_tokens, 0, "full attention only on documents of at most N tokens (0: all)");
ABSL_FLAG(bool, write_accuracy_order, false,
          "after the evaluation, write attention.accuracy_order into the package's config.json: every evaluated "
          "budget by its accuracy over all evaluated documents (4 decimals), most accurate first, the cheaper budget "
          "(compute at max_tokens) first at equal accuracy; the other keys are kept. Full attention is written only "
          "when it ran on every document (--full_attention_max_tokens 0 or above the longest): an accuracy over "
          "the shorter documents alone does not compare with the others', so it is left out (and said so)");
ABSL_FLAG(int64_t, limit, 0, "evaluate only the first N documents (0 = all)");
ABSL_FLAG(int, threads, 2, "LibTorch intra-op threads");
ABSL_FLAG(std::string, weights_dtype, "float32",
          "float32, or bfloat16 (a CUDA device, or a CPU with AVX512-BF16 or AMX-BF16)");

namespace {

using Clock = std::chrono::steady_clock;

struct Tokenized {
  std::vector<int64_t> ids;
  int64_t label = 0;
};

}  // namespace

int main(int argc, char** argv) {
  mita::kernels::ReexecWithOpenMpWaitSettingsIfUnset(argv);
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "/evaluate_documents.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage("Held-out accuracy of a document model per budget. Flags below.");
  absl::ParseCommandLine(argc, argv);
  mita::kernels::SetIntraOpThreads(absl::GetFlag(FLAGS_threads));

  absl::StatusOr<mita::models::Placement> placement =
      mita::models::ParsePlacement("cpu", absl::GetFlag(FLAGS_weights_dtype));
  if (!placement.ok()) {
    std::fprintf(stderr, "--weights_dtype: %s\n", placement.status().ToString().c_str());
    return 2;
  }
  auto loaded = mita::models::LoadDocumentClassifier(absl::GetFlag(FLAGS_model), *placement);
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
      std::fprintf(stderr, "--budgets: '%s' is not expert_count x expert_width (full attention: --full_attention)\n",
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
  if (absl::GetFlag(FLAGS_full_attention)) {
    budgets.push_back({true, 0, 0});
    names.push_back(mita::models::BudgetName(budgets.back()));
  }

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

  // A run: a budget on every document (or its first `first_tokens` tokens), skipping documents over `max_tokens`.
  struct Run {
    std::string name;
    mita::models::AttentionBudget budget;
    int64_t first_tokens = 0;  // 0: the whole document
    int64_t max_tokens = 0;    // 0: every document
  };
  std::vector<Run> runs;
  for (size_t i = 0; i < budgets.size(); ++i) {
    runs.push_back({names[i], budgets[i], 0, budgets[i].full_attention ? absl::GetFlag(FLAGS_full_attention_max_tokens) : 0});
  }
  for (absl::string_view entry : absl::StrSplit(absl::GetFlag(FLAGS_first_tokens), ',', absl::SkipEmpty())) {
    const std::vector<absl::string_view> parts = absl::StrSplit(entry, absl::MaxSplits('@', 1));
    int64_t first_tokens = 0;
    absl::StatusOr<mita::models::AttentionBudget> budget = mita::models::ParseBudget(parts.size() > 1 ? parts[1] : "full");
    if (!absl::SimpleAtoi(parts[0], &first_tokens) || first_tokens < 1 || !budget.ok() ||
        !mita::models::CheckBudget(model.description().knobs, *budget).ok()) {
      std::fprintf(stderr, "--first_tokens: '%s' is not N or N@budget (N >= 1; budget MxK within the model's knobs, "
                   "or full)\n", std::string(entry).c_str());
      return 1;
    }
    runs.push_back({absl::StrCat("first ", first_tokens, " tokens only, ", mita::models::BudgetName(*budget)),
                    *budget, first_tokens, 0});
  }
  // Length buckets of the classified tokens (after the cut to max_tokens).
  const std::vector<std::pair<int64_t, std::string>> buckets = {
      {4096, "under 4K"}, {16384, "4K-16K"}, {32768, "16K-32K"}, {int64_t{1} << 62, "32K-64K"}};
  auto bucket_of = [&](int64_t tokens) {
    size_t b = 0;
    while (tokens >= buckets[b].first) ++b;
    return b;
  };
  std::vector<int64_t> bucket_counts(buckets.size());
  for (const auto& input : inputs) ++bucket_counts[bucket_of(static_cast<int64_t>(input.ids.size()))];
  std::printf("documents per bucket:");
  for (size_t b = 0; b < buckets.size(); ++b) {
    std::printf(" %s %lld%s", buckets[b].second.c_str(), static_cast<long long>(bucket_counts[b]),
                b + 1 < buckets.size() ? "," : "\n");
  }
  std::printf("| budget |");
  for (const auto& bucket : buckets) std::printf(" %s |", bucket.second.c_str());
  std::printf(" all | forward time per document (ms), per bucket |\n|---|");
  for (size_t b = 0; b <= buckets.size() + 1; ++b) std::printf("---|");
  std::printf("\n");
  const int64_t batch_tokens = absl::GetFlag(FLAGS_batch_tokens);
  std::vector<mita::tools::MeasuredAccuracy> measured;  // whole documents, every one classified
  std::vector<std::string> left_out;                    // why a budget is not in `measured`
  for (const Run& run : runs) {
    std::vector<int64_t> correct(buckets.size()), seen(buckets.size());
    std::vector<double> seconds(buckets.size());
    std::vector<int64_t> order;  // the documents this run classifies
    for (int64_t i = 0; i < count; ++i) {
      if (run.max_tokens == 0 || static_cast<int64_t>(inputs[i].ids.size()) <= run.max_tokens) order.push_back(i);
    }
    for (size_t first = 0; first < order.size();) {
      // A packed batch: documents while the token total stays within --batch_tokens (at least one document).
      std::vector<int64_t> ids, lengths;
      std::vector<mita::models::AttentionBudget> applied;
      size_t last = first;
      auto tokens_of = [&](size_t position) {
        const int64_t tokens = static_cast<int64_t>(inputs[order[position]].ids.size());
        return run.first_tokens > 0 ? std::min(tokens, run.first_tokens) : tokens;
      };
      while (last < order.size() &&
             (last == first || static_cast<int64_t>(ids.size()) + tokens_of(last) <= batch_tokens)) {
        const auto& document = inputs[order[last]].ids;
        ids.insert(ids.end(), document.begin(), document.begin() + tokens_of(last));
        lengths.push_back(tokens_of(last));
        applied.push_back(mita::models::ApplyBudget(run.budget, lengths.back()));
        ++last;
      }
      const auto start = Clock::now();
      auto output = model.Forward(at::tensor(ids, at::TensorOptions().dtype(at::kLong)), lengths, applied, false);
      const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      if (!output.ok()) {
        std::fprintf(stderr, "%s\n", output.status().ToString().c_str());
        return 1;
      }
      const at::Tensor predicted = output->logits.argmax(1);
      for (size_t i = first; i < last; ++i) {
        const Tokenized& input = inputs[order[i]];
        const size_t b = bucket_of(static_cast<int64_t>(input.ids.size()));
        correct[b] += predicted[static_cast<int64_t>(i - first)].item<int64_t>() == input.label;
        ++seen[b];
        // A packed batch's time is shared by its documents in proportion to their tokens.
        seconds[b] += elapsed * static_cast<double>(lengths[i - first]) / static_cast<double>(ids.size());
      }
      first = last;
    }
    int64_t all_correct = 0, all_seen = 0;
    std::printf("| %s |", run.name.c_str());
    std::string times;
    for (size_t b = 0; b < buckets.size(); ++b) {
      all_correct += correct[b];
      all_seen += seen[b];
      if (seen[b] == 0) {
        std::printf(" - |");
        absl::StrAppend(&times, b == 0 ? "" : " / ", "-");
        continue;
      }
      std::printf(" %.3f (%lld/%lld) |", static_cast<double>(correct[b]) / static_cast<double>(seen[b]),
                  static_cast<long long>(correct[b]), static_cast<long long>(seen[b]));
      absl::StrAppend(&times, b == 0 ? "" : " / ", absl::StrFormat("%.0f", 1000 * seconds[b] / static_cast<double>(seen[b])));
    }
    std::printf(" %.3f (%lld/%lld) | %s |\n",
                all_seen == 0 ? 0.0 : static_cast<double>(all_correct) / static_cast<double>(all_seen),
                static_cast<long long>(all_correct), static_cast<long long>(all_seen), times.c_str());
    std::fflush(stdout);
    if (run.first_tokens > 0 || count == 0) continue;
    if (all_seen == count) {
      measured.push_back({run.budget, static_cast<double>(all_correct) / static_cast<double>(all_seen)});
    } else {
      left_out.push_back(absl::StrFormat("%s: it ran on %lld of the %lld documents (--full_attention_max_tokens=%lld)",
                                         run.name, static_cast<long long>(all_seen), static_cast<long long>(count),
                                         static_cast<long long>(run.max_tokens)));
    }
  }
  if (training->empty()) {
    std::printf("(no majority-class row: the corpus has no training documents)\n");
  } else {
    std::printf("| majority class (%s, from the training split) |", model.description().labels[majority].c_str());
    std::vector<int64_t> majority_bucket(buckets.size());
    for (const auto& input : inputs) {
      majority_bucket[bucket_of(static_cast<int64_t>(input.ids.size()))] += input.label == majority;
    }
    for (size_t b = 0; b < buckets.size(); ++b) {
      if (bucket_counts[b] == 0) {
        std::printf(" - |");
      } else {
        std::printf(" %.3f (%lld/%lld) |",
                    static_cast<double>(majority_bucket[b]) / static_cast<double>(bucket_counts[b]),
                    static_cast<long long>(majority_bucket[b]), static_cast<long long>(bucket_counts[b]));
      }
    }
    std::printf(" %.3f (%lld/%lld) | - |\n", static_cast<double>(majority_correct) / static_cast<double>(count),
                static_cast<long long>(majority_correct), static_cast<long long>(count));
  }
  if (absl::GetFlag(FLAGS_write_accuracy_order)) {
    auto written = mita::tools::WriteAccuracyOrder(absl::GetFlag(FLAGS_model),
                                                   mita::tools::SortByAccuracy(measured, config.max_tokens));
    if (!written.ok()) {
      std::fprintf(stderr, "--write_accuracy_order: %s\n", written.status().ToString().c_str());
      return 1;
    }
    std::printf("wrote attention.accuracy_order to %s/config.json (accuracy over the %lld %s documents), most "
                "accurate first:\n", absl::GetFlag(FLAGS_model).c_str(), static_cast<long long>(count),
                absl::GetFlag(FLAGS_split).c_str());
    for (const mita::models::DeclaredBudget& declared : *written) {
      const std::string text = mita::models::BudgetText(declared.budget);
      std::printf("  %s%s: %.4f\n", declared.name.c_str(),
                  declared.name == text ? "" : absl::StrCat(" (", text, ")").c_str(), declared.accuracy);
    }
    for (const std::string& reason : left_out) {
      std::printf("  left out %s; an accuracy over a subset does not compare with the others'\n", reason.c_str());
    }
  }
  return 0;
}
