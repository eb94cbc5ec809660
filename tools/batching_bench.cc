// mita-batching-bench: how much batching can gain inside the image model itself, on this machine
// (docs/serving.md, "How far batching can go here"). Google Benchmark, one intra-op thread (LibTorch and OpenBLAS),
// as mita-server runs with --torch_threads=1:
//
//   build/tools/mita-batching-bench                          # batch sizes 1 and 16, budget 9x16, 5 repetitions
//   build/tools/mita-batching-bench --batch_sizes=1,4,8,16,32 --budget=16x32 --benchmark_repetitions=9
//
// Benchmarks, each over --batch_sizes (B):
//   forward/B        VitClassifier::Forward on B real Fashion-MNIST test images (the t10k split, preprocessed as
//                    the server does) at --budget for every item, with the attention statistics the server asks
//                    for. Inputs are stacked before the clock starts.
//   dense_layers/B   only the model's dense layers: per block, at::linear for qkv [C -> 3C], proj [C -> C], fc1
//                    [C -> hidden] and fc2 [hidden -> C] on [B, N, C] / [B, N, hidden] inputs, weights and
//                    inputs ~ N(0, 1) of the package's shapes (the GEMMs' speed does not depend on the values).
// --device=cuda:N (with --weights_dtype=bfloat16 if wanted) runs both on a CUDA device: the images are copied
// there from pinned memory in every forward, and the dense layers wait for the device in every iteration.
// Each benchmark reports its time per image (real time / B, "per_image_us"). Google Benchmark's own flags
// (--benchmark_filter, --benchmark_repetitions, --benchmark_min_time, ...) are accepted beside the flags below;
// by default 5 repetitions, interleaved at random so that the machine's drift hits every batch size alike.
// (Debian's libbenchmark prints "Library was built as DEBUG": that is the benchmark library's own build, not the
// code it times.)
//
// After the runs it prints, from the medians over repetitions, for the smallest batch size b and the largest B:
//   T_b, T_B    forward time per image;        D_b, D_B  dense-layer time per image;
//   ratio       T_b / T_B: what batching gains in the model (a server adds per-request work it cannot share);
//   saving      T_b - T_B: the time per image that batching removes (per-call costs shared by B images, and
//               GEMMs running faster on B N rows than on N);
//   bound       1 + (T_b - T_B) / D_B. Removing a per-image cost (attention, norms, copies) lowers T_b and T_B
//               alike and leaves the saving as it is; the most any such change can reach is T_B = D_B, where
//               the ratio is (D_B + saving) / D_B. So the model's batching ratio stays under this bound unless
//               the dense layers themselves get faster at batch B (another BLAS, another machine) or the
//               per-call costs grow.
//   for 2x      T_B <= saving: what is left per image for everything but the dense layers (saving - D_B),
//               against what it takes now (T_B - D_B); "out of reach" when the dense layers alone take more than
//               the saving. No bound when T_B >= T_b (batching saves nothing).
// Exit status: 0 done (also when a --benchmark_filter leaves out what the summary needs: it says so), 1 a forward
// failed or no benchmark matched, 2 a bad flag (including --model).
#include <ATen/core/Tensor.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/stack.h>
#include <benchmark/benchmark.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/device.h"
#include "kernels/runtime_environment.h"
#include "models/model_package.h"
#include "tools/fashion_mnist.h"
#include "tools/fashion_mnist_inputs.h"

ABSL_FLAG(std::string, model, "models/repository/fashion-mnist-vit", "image model package folder");
ABSL_FLAG(std::string, budget, "9x16",
          "expert_count x expert_width of every item (explicit values, as in a preset), or 'full' for full attention");
ABSL_FLAG(std::string, batch_sizes, "1,16",
          "comma-separated batch sizes (images per forward), each in [1, 4096] and given once");
ABSL_FLAG(std::string, device, "cpu", "where the model runs: cpu or cuda:N (the dense layers' benchmark too)");
ABSL_FLAG(std::string, weights_dtype, "float32",
          "float32, or bfloat16 (a CUDA device, or a CPU with AVX512-BF16 or AMX-BF16)");

namespace {

// The benchmarks' shared inputs, set up once in main before any benchmark runs.
struct Setup {
  std::unique_ptr<mita::models::VitClassifier> model;
  mita::models::AttentionBudget budget;
  std::vector<at::Tensor> images;  // preprocessed test images, [in_channels, side, side] each
};
Setup* setup = nullptr;

// Adds the counter "per_image_us": real time per iteration / images per iteration (Google Benchmark shows it in
// seconds with a unit prefix; CollectingReporter reads it back).
void ReportTimePerImage(benchmark::State& state, int64_t images_per_iteration) {
  state.counters["per_image_us"] =
      benchmark::Counter(static_cast<double>(images_per_iteration),
                         benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void Forward(benchmark::State& state) {
  const int64_t batch = state.range(0);
  c10::InferenceMode inference_mode;
  std::vector<at::Tensor> chosen;
  for (int64_t i = 0; i < batch; ++i) chosen.push_back(setup->images[i % setup->images.size()]);
  at::Tensor input = at::stack(chosen);
  // On a CUDA device from pinned memory, as mita-server's batches are (Forward copies it there each time).
  if (setup->model->placement().device.is_cuda()) input = input.pin_memory();
  const std::vector<mita::models::AttentionBudget> budgets(batch, setup->budget);
  for (auto _ : state) {
    auto output = setup->model->Forward(input, budgets, /*want_statistics=*/true);
    if (!output.ok()) {
      state.SkipWithError(output.status().ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(output->logits.data_ptr<float>());
  }
  ReportTimePerImage(state, batch);
}

void DenseLayers(benchmark::State& state) {
  const int64_t batch = state.range(0);
  const mita::models::VitConfig& config = setup->model->config();
  const int64_t tokens = config.tokens(), channels = config.embed_dim, hidden = config.mlp_hidden_dim;
  c10::InferenceMode inference_mode;
  const mita::models::Placement& placement = setup->model->placement();
  const at::TensorOptions options = at::TensorOptions().device(placement.device).dtype(placement.weights_dtype);
  const at::Tensor x = at::randn({batch, tokens, channels}, options);  // a block's input, [B, N, C]
  const at::Tensor h = at::randn({batch, tokens, hidden}, options);    // the MLP's hidden activations, [B, N, hidden]
  struct Layer {
    const at::Tensor* input;
    at::Tensor weight, bias;
  };
  auto layer = [&options](const at::Tensor& input, int64_t out) {
    return Layer{&input, at::randn({out, input.size(-1)}, options), at::randn({out}, options)};
  };
  std::vector<Layer> layers;
  for (int64_t block = 0; block < config.depth; ++block) {
    layers.push_back(layer(x, 3 * channels));  // qkv
    layers.push_back(layer(x, channels));      // proj
    layers.push_back(layer(x, hidden));        // fc1
    layers.push_back(layer(h, channels));      // fc2
  }
  for (auto _ : state) {
    for (const Layer& dense : layers) {
      const at::Tensor out = at::linear(*dense.input, dense.weight, dense.bias);
      benchmark::DoNotOptimize(out.data_ptr());
    }
    // A CUDA device runs the products after their launch: wait for them inside the timed iteration.
    if (absl::Status done = mita::kernels::SynchronizeDevice(placement.device); !done.ok()) {
      state.SkipWithError(done.ToString().c_str());
      return;
    }
  }
  ReportTimePerImage(state, batch);
}

// Collects per_image_us of every (non-aggregate) run by benchmark name ("forward/16/real_time"), beside the
// console output.
class CollectingReporter : public benchmark::ConsoleReporter {
 public:
  explicit CollectingReporter(OutputOptions options) : ConsoleReporter(options) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      any_failed_ |= run.error_occurred;
      if (run.run_type != Run::RT_Iteration || run.error_occurred) continue;
      const auto counter = run.counters.find("per_image_us");
      if (counter != run.counters.end()) per_image_us_[run.benchmark_name()].push_back(counter->second.value * 1e6);
    }
    ConsoleReporter::ReportRuns(runs);
  }
  // Median per-image time of `name` in microseconds, or a negative value when it did not run.
  double MedianUs(const std::string& name) const {
    const auto found = per_image_us_.find(name);
    if (found == per_image_us_.end() || found->second.empty()) return -1;
    std::vector<double> values = found->second;
    std::sort(values.begin(), values.end());
    const size_t middle = values.size() / 2;
    return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
  }
  // Whether a run reported an error (state.SkipWithError: the forward failed).
  bool AnyFailed() const { return any_failed_; }
  size_t Repetitions(const std::string& name) const {
    const auto found = per_image_us_.find(name);
    return found == per_image_us_.end() ? 0 : found->second.size();
  }

 private:
  std::map<std::string, std::vector<double>> per_image_us_;
  bool any_failed_ = false;
};

// Whether argv asks for help: then Abseil prints the flags (Google Benchmark would print only its own).
bool AsksForHelp(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-help" || arg == "--helpfull" || arg == "--helpshort" ||
        absl::StartsWith(arg, "--helpon") || absl::StartsWith(arg, "--helpmatch")) {
      return true;
    }
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  mita::kernels::ReexecWithOpenMpWaitSettingsIfUnset(argv);
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) { return absl::EndsWith(file, "/batching_bench.cc"); };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "How much batching gains inside the image model, and the most it could gain on this machine "
      "(tools/batching_bench.cc says how; run it on an otherwise idle machine). Run from the repository root, or "
      "pass --model. Google Benchmark's flags work too; this tool's defaults for them: "
      "--benchmark_repetitions=5 --benchmark_min_time=0.5 (seconds per repetition) "
      "--benchmark_enable_random_interleaving=true; also --benchmark_filter=REGEX and "
      "--benchmark_out=FILE --benchmark_out_format=json|csv|console (the screen shows the console format only). "
      "Exit status: 0 done, 1 a run failed or nothing ran, 2 a bad flag. Flags below.");
  // Google Benchmark's defaults for this tool, before its own parsing (flags given on the command line win).
  std::vector<char*> arguments(argv, argv + argc);
  std::string repetitions = "--benchmark_repetitions=5", interleave = "--benchmark_enable_random_interleaving=true";
  std::string min_time = "--benchmark_min_time=0.5";
  const bool help = AsksForHelp(argc, argv);
  if (!help) arguments.insert(arguments.begin() + 1, {repetitions.data(), interleave.data(), min_time.data()});
  int count = static_cast<int>(arguments.size());
  if (!help) benchmark::Initialize(&count, arguments.data());
  // Google Benchmark leaves a --benchmark_* flag it could not read (a bad value) in place.
  for (int i = 1; i < count; ++i) {
    if (absl::StartsWith(arguments[i], "--benchmark_")) {
      std::fprintf(stderr, "%s: not a valid value for this Google Benchmark flag (see --help)\n", arguments[i]);
      return 2;
    }
  }
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (absl::StartsWith(arg, "--benchmark_format=") && arg != "--benchmark_format=console") {
      std::fprintf(stderr, "%s: the screen shows the console format only; use --benchmark_out=FILE "
                           "--benchmark_out_format=json (or csv) for another format\n", argv[i]);
      return 2;
    }
  }
  const std::vector<char*> positional = absl::ParseCommandLine(count, arguments.data());
  if (positional.size() > 1) {
    std::fprintf(stderr, "'%s': unexpected argument (every input is a --flag; see --help)\n", positional[1]);
    return 2;
  }

  std::vector<int64_t> batch_sizes;
  for (absl::string_view item : absl::StrSplit(absl::GetFlag(FLAGS_batch_sizes), ',', absl::SkipEmpty())) {
    int64_t size = 0;
    if (!absl::SimpleAtoi(item, &size) || size < 1 || size > 4096) {
      std::fprintf(stderr, "--batch_sizes: '%s' is not a batch size in [1, 4096]\n", std::string(item).c_str());
      return 2;
    }
    if (std::find(batch_sizes.begin(), batch_sizes.end(), size) != batch_sizes.end()) {
      std::fprintf(stderr, "--batch_sizes: %lld is given twice; give each batch size once\n",
                   static_cast<long long>(size));
      return 2;
    }
    batch_sizes.push_back(size);
  }
  if (batch_sizes.size() < 2) {
    std::fprintf(stderr, "--batch_sizes: give at least two batch sizes (e.g. 1,16)\n");
    return 2;
  }
  std::sort(batch_sizes.begin(), batch_sizes.end());

  Setup shared;
  const std::string budget_text = absl::GetFlag(FLAGS_budget);
  absl::StatusOr<mita::models::AttentionBudget> budget = mita::models::ParseBudget(budget_text);
  if (!budget.ok()) {
    std::fprintf(stderr, "--budget: %s\n", budget.status().ToString().c_str());
    return 2;
  }
  shared.budget = *budget;
  mita::kernels::SetIntraOpThreads(1);
  absl::StatusOr<mita::models::Placement> placement =
      mita::models::ParsePlacement(absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_weights_dtype));
  if (!placement.ok()) {
    std::fprintf(stderr, "--device/--weights_dtype: %s\n", placement.status().ToString().c_str());
    return 2;
  }
  auto model = mita::models::LoadVitClassifier(absl::GetFlag(FLAGS_model), *placement);
  if (!model.ok()) {
    std::fprintf(stderr, "--model: %s\n", model.status().ToString().c_str());
    return 2;
  }
  shared.model = *std::move(model);
  if (!shared.budget.full_attention) {
    if (absl::Status valid = mita::models::CheckBudget(shared.model->description().knobs, shared.budget); !valid.ok()) {
      std::fprintf(stderr, "--budget: %s\n", valid.ToString().c_str());
      return 2;
    }
  }
  auto data = mita::datasets::ReadFashionMnist("t10k");
  if (!data.ok()) {
    std::fprintf(stderr, "%s\n", data.status().ToString().c_str());
    return 1;
  }
  auto images = mita::datasets::PreprocessedImages(*data, shared.model->config(), batch_sizes.back());
  if (!images.ok()) {
    std::fprintf(stderr, "%s\n", images.status().ToString().c_str());
    return 1;
  }
  shared.images = *std::move(images);
  setup = &shared;

  benchmark::internal::Benchmark* forward = benchmark::RegisterBenchmark("forward", Forward);
  benchmark::internal::Benchmark* dense_layers = benchmark::RegisterBenchmark("dense_layers", DenseLayers);
  for (benchmark::internal::Benchmark* registered : {forward, dense_layers}) {
    for (int64_t size : batch_sizes) registered->Arg(size);
    registered->Unit(benchmark::kMicrosecond)->UseRealTime();
  }
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  std::printf("model %s on %s in %s, budget %s, N = %lld tokens, 1 intra-op thread, OPENBLAS_CORETYPE=%s\n",
              absl::GetFlag(FLAGS_model).c_str(), shared.model->description().device.c_str(),
              shared.model->description().weights_dtype.c_str(), budget_text.c_str(),
              static_cast<long long>(shared.model->config().tokens()), coretype != nullptr ? coretype : "(unset)");
  std::fflush(stdout);
  // Colours only on a terminal (a custom reporter does not follow --benchmark_color).
  CollectingReporter reporter(isatty(fileno(stdout)) != 0 ? benchmark::ConsoleReporter::OO_ColorTabular
                                                          : benchmark::ConsoleReporter::OO_Tabular);
  const size_t benchmarks_run = benchmark::RunSpecifiedBenchmarks(&reporter);
  bool listing_only = false;  // --benchmark_list_tests: names printed, nothing run
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    listing_only |= arg == "--benchmark_list_tests" || arg == "--benchmark_list_tests=true";
  }
  if (listing_only) return 0;
  if (benchmarks_run == 0) {
    std::fprintf(stderr, "no benchmark ran (--benchmark_filter matched none)\n");
    return 1;
  }

  const int64_t small = batch_sizes.front(), large = batch_sizes.back();
  auto name = [](const char* kind, int64_t size) { return absl::StrCat(kind, "/", size, "/real_time"); };
  const double forward_small = reporter.MedianUs(name("forward", small));
  const double forward_large = reporter.MedianUs(name("forward", large));
  const double dense_small = reporter.MedianUs(name("dense_layers", small));
  const double dense_large = reporter.MedianUs(name("dense_layers", large));
  if (forward_small <= 0 || forward_large <= 0 || dense_small <= 0 || dense_large <= 0) {
    std::printf("no summary: it needs forward/%lld, forward/%lld, dense_layers/%lld and dense_layers/%lld, and "
                "--benchmark_filter left one out or one failed\n",
                static_cast<long long>(small), static_cast<long long>(large), static_cast<long long>(small),
                static_cast<long long>(large));
    return reporter.AnyFailed() ? 1 : 0;
  }
  const double saving = forward_small - forward_large;
  std::printf("\nper image, median of %zu repetitions: forward %.1f us at batch size %lld, %.1f us at %lld; "
              "dense layers %.1f us and %.1f us\n",
              reporter.Repetitions(name("forward", large)), forward_small, static_cast<long long>(small),
              forward_large, static_cast<long long>(large), dense_small, dense_large);
  std::printf("batching ratio of the model (batch size %lld against %lld): %.2fx; batching saves %.1f us per image\n",
              static_cast<long long>(large), static_cast<long long>(small), forward_small / forward_large, saving);
  if (saving <= 0) {
    std::printf("no bound: batch size %lld is not faster per image than %lld here, so batching saves nothing to "
                "build on\n",
                static_cast<long long>(large), static_cast<long long>(small));
    return 0;
  }
  std::printf("upper bound on that ratio (only the dense layers left at batch size %lld, the saving as it is): "
              "1 + %.1f / %.1f = %.2fx\n",
              static_cast<long long>(large), saving, dense_large, 1 + saving / dense_large);
  if (saving <= dense_large) {
    std::printf("for 2x: out of reach here; it needs at most %.1f us per image at batch size %lld (the saving), "
                "and the dense layers alone take %.1f us\n",
                saving, static_cast<long long>(large), dense_large);
  } else {
    std::printf("for 2x: at most %.1f us per image at batch size %lld (the saving); the dense layers take %.1f us "
                "of it, which leaves %.1f us per image for everything else (now %.1f us)\n",
                saving, static_cast<long long>(large), dense_large, saving - dense_large,
                forward_large - dense_large);
  }
  return 0;
}
