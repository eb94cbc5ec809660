// mita-eval: test-set accuracy and latency of an image model package at several budgets plus full attention.
//
//   mita-eval --model=models/repository/fashion-mnist-vit --budgets=1x50,4x8,9x16,16x32,49x50 --threads=2
// For each budget (expert_count x expert_width) and for full attention it prints: top-1 accuracy on the
// whole Fashion-MNIST test split (10,000 images, forward in batches of --batch_size), the per-image latency of
// a batch-1 forward (median and p95 over --latency_images images, ms) and the batched throughput.
// Images go through the same PreprocessImage as the server (decoding is skipped: pixels come from the IDX).
// --statistics also computes the per-layer attention statistics, as mita-server does for every request (to
// compare with the server's compute time; without it the forward skips them). --full_attention=false skips the
// full-attention row (for profiling one budget). --write_accuracy_order then rewrites the package's config.json
// with attention.accuracy_order: every evaluated budget by its measured test accuracy, most accurate first.
#include <ATen/Parallel.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "base/percentile.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/flags/usage_config.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "base/percentile.h"
#include "kernels/runtime_environment.h"
#include "models/model_package.h"
#include "tools/accuracy_order.h"
#include "tools/fashion_mnist.h"
#include "tools/fashion_mnist_inputs.h"

ABSL_FLAG(std::string, model, "models/repository/fashion-mnist-vit", "model package folder");
ABSL_FLAG(std::string, budgets, "1x50,4x8,9x16,16x32,25x50",
          "comma-separated expert_count x expert_width budgets; full attention is always added");
ABSL_FLAG(int64_t, images, 10000, "test images to evaluate (from the start of the t10k split)");
ABSL_FLAG(int64_t, batch_size, 250, "batch size for the accuracy pass");
ABSL_FLAG(int64_t, latency_images, 200, "images timed one by one (batch size 1)");
ABSL_FLAG(bool, statistics, false,
          "also compute the per-layer attention statistics (routing, pruning), as mita-server does for every request");
ABSL_FLAG(int, threads, 2, "LibTorch intra-op threads");
ABSL_FLAG(std::string, weights_dtype, "float32",
          "float32, or bfloat16 (a CUDA device, or a CPU with AVX512-BF16 or AMX-BF16)");
ABSL_FLAG(bool, full_attention, true, "also evaluate full attention on the same weights");
ABSL_FLAG(bool, write_accuracy_order, false,
          "after the evaluation, write attention.accuracy_order into the package's config.json: every evaluated "
          "budget (full attention too unless --full_attention=false) by its measured test accuracy (4 decimals), "
          "most accurate first, the cheaper budget first at equal accuracy; the other keys are kept");

namespace {

using Clock = std::chrono::steady_clock;

double Milliseconds(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

}  // namespace

int main(int argc, char** argv) {
  mita::kernels::ReexecWithOpenMpWaitSettingsIfUnset(argv);
  // --help lists the flags of this file (Abseil would look for a file named after the binary).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) { return absl::EndsWith(file, "/evaluate.cc"); };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage("Fashion-MNIST test accuracy and latency of a model package per budget. Flags below.");
  absl::ParseCommandLine(argc, argv);
  mita::kernels::SetIntraOpThreads(absl::GetFlag(FLAGS_threads));
  absl::StatusOr<mita::models::Placement> placement =
      mita::models::ParsePlacement("cpu", absl::GetFlag(FLAGS_weights_dtype));
  if (!placement.ok()) {
    std::fprintf(stderr, "--weights_dtype: %s\n", placement.status().ToString().c_str());
    return 2;
  }
  auto model = mita::models::LoadVitClassifier(absl::GetFlag(FLAGS_model), *placement);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  auto data = mita::datasets::ReadFashionMnist("t10k");
  if (!data.ok()) {
    std::fprintf(stderr, "%s\n", data.status().ToString().c_str());
    return 1;
  }
  const int64_t count = std::min<int64_t>(absl::GetFlag(FLAGS_images), data->count);
  auto preprocessed = mita::datasets::PreprocessedImages(*data, (*model)->config(), count);
  if (!preprocessed.ok()) {
    std::fprintf(stderr, "%s\n", preprocessed.status().ToString().c_str());
    return 1;
  }
  const std::vector<at::Tensor> inputs = *std::move(preprocessed);

  std::vector<std::pair<std::string, mita::models::AttentionBudget>> budgets;
  for (absl::string_view item : absl::StrSplit(absl::GetFlag(FLAGS_budgets), ',', absl::SkipEmpty())) {
    absl::StatusOr<mita::models::AttentionBudget> budget = mita::models::ParseBudget(item);
    if (!budget.ok() || budget->full_attention) {
      std::fprintf(stderr, "--budgets: '%s' is not expert_count x expert_width (e.g. 9x16; full attention is "
                           "--full_attention)\n", std::string(item).c_str());
      return 2;
    }
    if (absl::Status valid = mita::models::CheckBudget((*model)->description().knobs, *budget); !valid.ok()) {
      std::fprintf(stderr, "--budgets: %s\n", valid.ToString().c_str());
      return 2;
    }
    budgets.emplace_back(mita::models::BudgetName(*budget), *budget);
  }
  if (absl::GetFlag(FLAGS_full_attention)) {
    mita::models::AttentionBudget full;
    full.full_attention = true;
    budgets.emplace_back(mita::models::BudgetName(full), full);
  }

  std::printf("model %s, %lld test images, tokens N=%lld, %d threads\n", absl::GetFlag(FLAGS_model).c_str(),
              static_cast<long long>(count), static_cast<long long>((*model)->config().tokens()),
              absl::GetFlag(FLAGS_threads));
  std::printf("| budget | top-1 accuracy | batch-1 latency p50 (ms) | p95 (ms) | batched throughput (images/s) |\n");
  std::printf("|---|---|---|---|---|\n");
  const int64_t batch_size = absl::GetFlag(FLAGS_batch_size);
  const bool want_statistics = absl::GetFlag(FLAGS_statistics);
  std::vector<mita::tools::MeasuredAccuracy> measured;
  for (const auto& [name, budget] : budgets) {
    int64_t correct = 0;
    const auto start = Clock::now();
    for (int64_t begin = 0; begin < count; begin += batch_size) {
      const int64_t end = std::min(count, begin + batch_size);
      at::Tensor batch = at::stack(std::vector<at::Tensor>(inputs.begin() + begin, inputs.begin() + end));
      std::vector<mita::models::AttentionBudget> per_item(end - begin, budget);
      auto output = (*model)->Forward(batch, per_item, want_statistics);
      if (!output.ok()) {
        std::fprintf(stderr, "%s\n", output.status().ToString().c_str());
        return 1;
      }
      at::Tensor predicted = output->logits.argmax(1);
      const int64_t* predicted_data = predicted.data_ptr<int64_t>();
      for (int64_t i = begin; i < end; ++i) correct += predicted_data[i - begin] == data->labels[i];
    }
    const double batched_seconds = Milliseconds(Clock::now() - start) / 1000.0;
    std::vector<double> latencies;
    const int64_t timed = std::min(count, absl::GetFlag(FLAGS_latency_images));
    for (int64_t i = 0; i < timed; ++i) {
      const auto t0 = Clock::now();
      auto output = (*model)->Forward(inputs[i].unsqueeze(0), {budget}, want_statistics);
      latencies.push_back(Milliseconds(Clock::now() - t0));
      if (!output.ok()) return 1;
    }
    std::printf("| %s | %.4f | %.3f | %.3f | %.0f |\n", name.c_str(), static_cast<double>(correct) / count,
                mita::Percentile(latencies, 50), mita::Percentile(latencies, 95), count / batched_seconds);
    std::fflush(stdout);
    measured.push_back({budget, static_cast<double>(correct) / static_cast<double>(count)});
  }
  if (absl::GetFlag(FLAGS_write_accuracy_order)) {
    auto written = mita::tools::WriteAccuracyOrder(
        absl::GetFlag(FLAGS_model), mita::tools::SortByAccuracy(measured, (*model)->config().tokens()));
    if (!written.ok()) {
      std::fprintf(stderr, "--write_accuracy_order: %s\n", written.status().ToString().c_str());
      return 1;
    }
    std::printf("wrote attention.accuracy_order to %s/config.json (test accuracy on %lld images), most accurate "
                "first:\n", absl::GetFlag(FLAGS_model).c_str(), static_cast<long long>(count));
    for (const mita::models::DeclaredBudget& declared : *written) {
      const std::string text = mita::models::BudgetText(declared.budget);
      std::printf("  %s%s: %.4f\n", declared.name.c_str(),
                  declared.name == text ? "" : absl::StrCat(" (", text, ")").c_str(), declared.accuracy);
    }
  }
  return 0;
}
