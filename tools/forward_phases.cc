// mita-forward-phases: where one forward's time goes, phase by phase, beside its floor (docs/kernels.md,
// "Phases and floors").
//
//   mita-forward-phases --model=DIR --budgets=8x32,16x64,full [--tokens=1024,16384,65536] [--batch_sizes=1,8]
//                       [--repeats=5] [--threads=2] [--packing_operations]
//
// For each (tokens, batch size, budget) a packed batch of synthetic inputs (Classifier::SyntheticItem: random content
// of the model's kind; an image model takes its fixed token count and ignores --tokens) runs through Classifier::Run:
// --repeats times as it serves ("forward ms", the median), then --repeats times with a RecordFunction callback on the
// calling thread. The callback puts every outermost operation into a phase by the scopes the models and kernels open
// (kernels/forward_scopes.h): embedding and position encoding; dense GEMMs (kernels::Linear, with their FLOPs);
// landmarks; the attention kernel; norms, activations and residual adds (layer_norm, gelu, add) and the DWC term's
// depthwise convolution; packing and copies (every other operation in a layer, and those outside any scope: packing the
// batch, the logits' copy); pooling and the head; and "between operations", the C++ of the forward itself (the profiled
// run's wall time less its operations). The breakdown printed is the profiled run of median wall time.
// --packing_operations lists that run's "packing, copies" by operation.
//
// floor = dense FLOPs / the limit + the attention kernel's own time, the limit being the rate of the process's
// BLAS (kernels/blas_library.h) on a 2048 cube measured at start (best of 3; with --weights_dtype=bfloat16 the rate
// of at::linear on a bfloat16 2048 cube, LibTorch's oneDNN): what the forward would take if
// everything but the kernel were its dense GEMMs at the machine's rate. Exit status: 0; 1 when a forward failed;
// 2 for a bad flag.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linear.h>
#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/blas_library.h"
#include "kernels/forward_scopes.h"
#include "kernels/runtime_environment.h"
#include "models/budget.h"
#include "models/classifier.h"
#include "models/model_package.h"

ABSL_FLAG(std::string, model, "models/repository/linux-doc-mita", "model package folder");
ABSL_FLAG(std::string, budgets, "full", "comma-separated budgets: MxK (expert count x width) or full");
ABSL_FLAG(std::string, tokens, "1024,16384,65536", "comma-separated input lengths, tokens (document models)");
ABSL_FLAG(std::string, batch_sizes, "1", "comma-separated inputs per packed batch");
ABSL_FLAG(int32_t, repeats, 5, "forwards per case, unprofiled and profiled each (medians reported)");
ABSL_FLAG(int32_t, threads, 2, "intra-op threads of LibTorch and its BLAS");
ABSL_FLAG(bool, packing_operations, false,
          "after each case's row, the operations of its \"packing, copies\" phase by name: calls and ms");
ABSL_FLAG(std::string, weights_dtype, "float32",
          "float32, or bfloat16 on a CPU with AVX512-BF16 or AMX-BF16 (the limit is then bfloat16's)");

namespace {

using mita::kernels::BlasLibrary;
using Clock = std::chrono::steady_clock;

enum Phase {
  kEmbedding,
  kDense,
  kLandmarks,
  kAttention,
  kNorms,
  kPacking,
  kPoolAndHead,
  kBetween,
  kPhaseCount,
};
const char* const kPhaseNames[kPhaseCount] = {
    "embedding",       "dense GEMMs",   "landmarks",  "attention kernel", "norms, act., residuals, DWC",
    "packing, copies", "pooling, head", "between ops"};

struct Breakdown {
  std::array<double, kPhaseCount> seconds{};
  std::map<std::string, std::pair<int, double>> packing_operations;  // name -> calls, seconds
  double dense_flops = 0;
  double wall_seconds = 0;
};

bool Is(const char* name, const char* scope) { return std::strcmp(name, scope) == 0; }

// The profiled thread's open operations and scopes, outermost first.
struct Frame {
  const char* name;
  bool counted;  // the outermost operation of its chain (its time is attributed)
  double flops;
  Clock::time_point start;
};
Breakdown* current_breakdown = nullptr;
std::thread::id profiled_thread;
thread_local std::vector<Frame> open_frames;

bool IsContainer(const char* name) {
  return Is(name, mita::kernels::kEmbeddingScope) || Is(name, mita::kernels::kLayerScope) ||
         Is(name, mita::kernels::kPoolAndHeadScope);
}

Phase PhaseOf(const char* name) {
  const char* container = nullptr;
  for (auto frame = open_frames.rbegin(); frame != open_frames.rend(); ++frame) {
    if (IsContainer(frame->name)) {
      container = frame->name;
      break;
    }
  }
  if (container != nullptr && Is(container, mita::kernels::kEmbeddingScope)) return kEmbedding;
  if (container != nullptr && Is(container, mita::kernels::kPoolAndHeadScope)) return kPoolAndHead;
  if (Is(name, mita::kernels::kLinearScope)) return kDense;
  if (Is(name, mita::kernels::kLandmarksScope)) return kLandmarks;
  if (Is(name, mita::kernels::kMitaAttentionScope) || Is(name, mita::kernels::kFullAttentionScope)) return kAttention;
  if (container != nullptr && (Is(name, "aten::layer_norm") || Is(name, "aten::gelu") || Is(name, "aten::add") ||
                               Is(name, "aten::add_") || Is(name, mita::kernels::kDepthwiseConvolutionScope))) {
    return kNorms;
  }
  return kPacking;
}

std::unique_ptr<at::ObserverContext> OnStart(const at::RecordFunction& function) {
  if (std::this_thread::get_id() != profiled_thread) return nullptr;
  const char* name = function.name();
  bool inside_counted = false;
  for (const Frame& frame : open_frames) inside_counted = inside_counted || frame.counted;
  Frame frame{name, !IsContainer(name) && !inside_counted, 0.0, {}};
  if (frame.counted && Is(name, mita::kernels::kLinearScope) && function.inputs().size() >= 2) {
    const at::Tensor& input = function.inputs()[0].toTensor();
    const at::Tensor& weight = function.inputs()[1].toTensor();
    frame.flops = 2.0 * static_cast<double>(input.numel()) * static_cast<double>(weight.size(0));
  }
  frame.start = Clock::now();
  open_frames.push_back(frame);
  return nullptr;
}

void OnEnd(const at::RecordFunction& /*function*/, at::ObserverContext* /*context*/) {
  if (std::this_thread::get_id() != profiled_thread || open_frames.empty()) return;
  const Frame frame = open_frames.back();
  open_frames.pop_back();
  if (!frame.counted || current_breakdown == nullptr) return;
  const double seconds = std::chrono::duration<double>(Clock::now() - frame.start).count();
  const Phase phase = PhaseOf(frame.name);
  current_breakdown->seconds[phase] += seconds;
  if (phase == kPacking) {
    auto& [calls, total] = current_breakdown->packing_operations[frame.name];
    ++calls;
    total += seconds;
  }
  current_breakdown->dense_flops += frame.flops;
}

// The rate of the dense layers' products on a 2048 cube, FLOP/s (best of 3 after one untimed call): the process
// BLAS's in float32, at::linear's (oneDNN) in bfloat16.
double GemmLimit(at::ScalarType dtype) {
  constexpr int64_t n = 2048;
  if (dtype == at::kBFloat16) {
    const at::Tensor x = at::full({n, n}, 0.5, at::kBFloat16), w = at::full({n, n}, 0.25, at::kBFloat16);
    double best = 1e30;
    for (int call = 0; call < 4; ++call) {
      const auto start = Clock::now();
      const at::Tensor y = at::linear(x, w);
      if (call > 0) best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
    }
    return 2.0 * n * n * n / best;
  }
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  double best = 1e30;
  for (int call = 0; call < 4; ++call) {
    const auto start = Clock::now();
    BlasLibrary::Get().Gemm('N', 'N', n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    if (call > 0) best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return 2.0 * n * n * n / best;
}

std::vector<int64_t> ParseList(const std::string& text, const char* flag) {
  std::vector<int64_t> values;
  for (absl::string_view piece : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t value = 0;
    if (!absl::SimpleAtoi(piece, &value) || value < 1) {
      std::fprintf(stderr, "flag --%s: '%s' is not a positive integer\n", flag, std::string(piece).c_str());
      std::exit(2);
    }
    values.push_back(value);
  }
  return values;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  mita::kernels::ReexecWithOpenMpWaitSettingsIfUnset(argv);  // libgomp as mita-server starts it
  absl::SetProgramUsageMessage("Where one forward's time goes, phase by phase, beside its floor. Flags below.");
  absl::ParseCommandLine(argc, argv);
  mita::kernels::SetIntraOpThreads(absl::GetFlag(FLAGS_threads));
  mita::kernels::KeepFreedMemoryForReuse();  // as mita-server does by default (--keep_freed_memory)
  c10::InferenceMode inference;
  absl::StatusOr<mita::models::Placement> placement =
      mita::models::ParsePlacement("cpu", absl::GetFlag(FLAGS_weights_dtype));
  if (!placement.ok()) {
    std::fprintf(stderr, "--weights_dtype: %s\n", placement.status().ToString().c_str());
    return 2;
  }
  auto package = mita::models::LoadModelPackage(absl::GetFlag(FLAGS_model), *placement);
  if (!package.ok()) {
    std::fprintf(stderr, "%s\n", package.status().ToString().c_str());
    return 1;
  }
  const mita::models::Classifier& model = *package->classifier;
  std::vector<mita::models::AttentionBudget> budgets;
  for (absl::string_view text : absl::StrSplit(absl::GetFlag(FLAGS_budgets), ',', absl::SkipEmpty())) {
    auto budget = mita::models::ParseBudget(text);
    if (!budget.ok()) {
      std::fprintf(stderr, "flag --budgets: %s\n", budget.status().ToString().c_str());
      return 2;
    }
    budgets.push_back(*budget);
  }
  std::vector<int64_t> token_counts = ParseList(absl::GetFlag(FLAGS_tokens), "tokens");
  if (model.description().tokens_per_input > 0) token_counts = {model.description().tokens_per_input};
  const std::vector<int64_t> batch_sizes = ParseList(absl::GetFlag(FLAGS_batch_sizes), "batch_sizes");
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));

  const double limit = GemmLimit(placement->weights_dtype);
  std::printf("%s; %d threads; BLAS %s (%s); limit (2048 cube) %.0f GFLOP/s\n", model.description().Summary().c_str(),
              at::get_num_threads(), BlasLibrary::Get().description().c_str(), BlasLibrary::choice_reason().c_str(),
              limit / 1e9);
  std::printf("| tokens | batch | budget | forward ms | profiled ms |");
  for (const char* name : kPhaseNames) std::printf(" %s |", name);
  std::printf(" dense GFLOP/s | floor ms | forward / floor |\n|");
  for (int column = 0; column < 5 + kPhaseCount + 3; ++column) std::printf("---|");
  std::printf("\n");

  profiled_thread = std::this_thread::get_id();
  for (const int64_t tokens : token_counts) {
    for (const int64_t batch : batch_sizes) {
      for (const mita::models::AttentionBudget& budget : budgets) {
        std::vector<mita::models::BatchItem> items;
        for (int64_t i = 0; i < batch; ++i) {
          auto item = model.SyntheticItem(tokens, budget);
          if (!item.ok()) {
            std::fprintf(stderr, "%lld tokens: %s\n", static_cast<long long>(tokens), item.status().ToString().c_str());
            return 1;
          }
          items.push_back(std::move(*item));
        }
        std::vector<const mita::models::BatchItem*> batch_items;
        for (const auto& item : items) batch_items.push_back(&item);
        auto run = [&]() -> double {
          const auto start = Clock::now();
          auto output = model.Run(batch_items, /*want_statistics=*/false);
          if (!output.ok()) {
            std::fprintf(stderr, "forward: %s\n", output.status().ToString().c_str());
            std::exit(1);
          }
          return std::chrono::duration<double>(Clock::now() - start).count();
        };
        run();  // warm-up: the heap, the thread pools
        std::vector<double> plain;
        for (int r = 0; r < repeats; ++r) plain.push_back(run());
        std::vector<Breakdown> profiled(repeats);
        const at::CallbackHandle handle =
            at::addThreadLocalCallback(at::RecordFunctionCallback(&OnStart, &OnEnd).needsInputs(true));
        for (Breakdown& breakdown : profiled) {
          current_breakdown = &breakdown;
          breakdown.wall_seconds = run();
          double in_operations = 0;
          for (double seconds : breakdown.seconds) in_operations += seconds;
          breakdown.seconds[kBetween] = std::max(0.0, breakdown.wall_seconds - in_operations);
        }
        current_breakdown = nullptr;
        at::removeCallback(handle);
        std::sort(profiled.begin(), profiled.end(),
                  [](const Breakdown& a, const Breakdown& b) { return a.wall_seconds < b.wall_seconds; });
        const Breakdown& median = profiled[profiled.size() / 2];
        const double forward = Median(plain);
        const double floor = median.dense_flops / limit + median.seconds[kAttention];
        std::printf("| %lld | %lld | %s | %.2f | %.2f |", static_cast<long long>(tokens), static_cast<long long>(batch),
                    mita::models::BudgetName(budget).c_str(), forward * 1e3, median.wall_seconds * 1e3);
        for (double seconds : median.seconds) std::printf(" %.2f |", seconds * 1e3);
        std::printf(" %.0f | %.2f | %.2fx |\n",
                    median.seconds[kDense] > 0 ? median.dense_flops / median.seconds[kDense] / 1e9 : 0.0, floor * 1e3,
                    forward / floor);
        if (absl::GetFlag(FLAGS_packing_operations)) {
          for (const auto& [name, calls_and_seconds] : median.packing_operations) {
            std::printf("    packing, copies: %s: %d calls, %.3f ms\n", name.c_str(), calls_and_seconds.first,
                        calls_and_seconds.second * 1e3);
          }
        }
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
