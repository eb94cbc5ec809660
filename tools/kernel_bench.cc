// mita-kernel-bench: speed of the MiTA CPU kernel against this machine's fp32 GEMM rate, full attention and the
// reference kernel, all measured in the same run on the same inputs (docs/kernels.md has the table).
//
//   build/tools/mita-kernel-bench                 # default grid: N {1K,4K,16K,64K} x d {32,64} x H {4,8}
//                                                 #               x (m,k) {(16,16),(64,64),(256,256)}
//   build/tools/mita-kernel-bench --quick         # N {1K,4K}, d 64, H 4: a few seconds
//   build/tools/mita-kernel-bench --tokens=65536 --head_dims=64 --heads=8 --budgets=64x64
//
// Inputs: --batch_size items (B, default 1), q, k, v ~ N(0, 1) float32 [B, H, N, d] from at::manual_seed(--seed),
// sequence landmarks (adaptive 1-D average pooling of q into m windows), expert width k. Landmarks are computed before
// the clock starts: they are an input of the kernel.
//
// Columns:
//   MiTA ms     median wall time of MitaAttentionForward(kAuto) over --repeats runs after the warm-up: runs not
//               timed until 3 in a row make no minor page fault (at most --max_warm_up_runs). A new shape grows the
//               C heap for its first few runs (memalign'd outputs that do not fit the chunks freed before), and each
//               first touch of a page costs a fault (about 8 us on the 2-core VM of docs/kernels.md), so one
//               warm-up run is not enough at 64K tokens.
//   faults      minor page faults per timed MiTA run (median): 0 when the warm-up reached the steady state.
//   GFLOP/s     useful MiTA FLOPs / MiTA time, counting a multiply-add as 2 FLOPs, per head:
//                 2 N d (4 m + 2 k) = S = l K^T (2 m N d) + A = softmax(S s) V (2 m N d) + gate G = Q l^T
//                 (2 N m d) + routed logits (2 N k d) + output (2 N (m + k) d).
//               The compressed logits q . l s^2 equal the gate times s^2, so they are not counted a second
//               time; exponentials, top-k selection and gathers are not counted.
//   GEMM        the fp32 GEMM rate of this machine (GFLOP/s): at::mm on --gemm_size^3 fp32 squares, all
//               threads, best of 3, measured again right before each (N, d, H) group of rows (the machine is
//               shared, so the rate available moves during a run); the start and end of the run are printed too.
//   %GEMM       GFLOP/s / GEMM.
//   full ms     FullAttentionForward (the project's full attention: LibTorch's fused attention for a batch of at
//               most 2^24 scores, else chunked ATen mm + softmax + mm) on the
//               same q, k, v, once per (N, d, H) (when a run takes under a second: the median of up to --repeats
//               runs within 2 s, after one not counted) and reused across (m, k) (it does not depend on them).
//               FLOPs 4 N^2 d per head.
//   x full      full ms / MiTA ms.
//   ref ms      the reference kernel (kReference: plain ATen sort/gather/softmax), one run, head by head
//               (q[:, h] etc.; the same work as all heads at once with 1/H of the peak memory), summed over
//               heads.
//   x ref       ref ms / MiTA ms.
//   per-expert ms  where the kernel's small-input path applies (internal::SmallInputPathApplies, e.g. the
//               embedded image model's 50 tokens of d = 24 at m = 9, k = 16), the same kernel with that path turned off
//               (every output computed per routed expert, as for larger N), timed in the same loop as MiTA ms,
//               run for run; "-" elsewhere.
//   x per-expert   per-expert ms / MiTA ms.
//   x N/4       time(N) / time(N/4) for the same d, H, m, k (when the grid has N/4), measured run for run: each
//               timed run at N is preceded by two runs of the N/4 row's inputs, the second timed, and the median of
//               the --repeats ratios is shown (pairs see the same load on a shared machine). 4.0 for a cost linear
//               in N.
// --phases adds a second table: one more run of each row with the kernel's phase timers on
// (internal::MitaForwardOptions::phase_seconds; repeated, as the warm-up, until 3 runs in a row make no fault),
// the thread time of each phase summed over the heads, in ms, the wall time and minor page faults of that run;
// and, from the same run, the kernel's BLAS calls (gemm_totals): their thread time (BLAS ms, part of the phases),
// count, rate (executed FLOPs / BLAS thread time x threads: BLAS GFLOP/s, as a share of the GEMM column: BLAS
// %GEMM) and "bound %GEMM", the %GEMM the row would reach if all its work outside BLAS took no time (counted FLOPs /
// (BLAS thread time / threads) / GEMM).
// Full attention and the reference are skipped where a prediction from a smaller N with the same other
// parameters (N^2 for full attention, N for the reference) exceeds --full_max_seconds / --reference_max_seconds,
// or where the reference's gathered keys and values (2 N k d floats per head) exceed --reference_max_bytes;
// such cells show the prediction marked '~' (extrapolated, not measured).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>
#include <ATen/core/grad_mode.h>
#include <ATen/Context.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/mita_attention.h"
#include "kernels/mita_attention_internal.h"
#include "kernels/runtime_environment.h"

ABSL_FLAG(std::string, tokens, "1024,4096,16384,65536", "comma-separated token counts N");
ABSL_FLAG(std::string, head_dims, "32,64", "comma-separated head dimensions d");
ABSL_FLAG(std::string, heads, "4,8", "comma-separated head counts H");
ABSL_FLAG(std::string, budgets, "16x16,64x64,256x256", "comma-separated expert_count x expert_width (m x k)");
ABSL_FLAG(bool, quick, false, "reduced grid: N {1024, 4096}, d 64, H 4, all budgets (overrides the lists)");
ABSL_FLAG(int, threads, 0, "LibTorch intra-op threads; 0 = all cores (LibTorch 1.13 would start with half)");
ABSL_FLAG(int, repeats, 5, "timed MiTA runs per row (median), after the warm-up");
ABSL_FLAG(int, max_warm_up_runs, 20,
          "untimed MiTA runs per row at most: the warm-up stops after 3 runs in a row that make no minor page fault");
ABSL_FLAG(int64_t, gemm_size, 2048, "side of the square fp32 matrices of the GEMM rate measurement");
ABSL_FLAG(double, full_max_seconds, 150, "skip (and extrapolate) full attention predicted to take longer");
ABSL_FLAG(double, reference_max_seconds, 20, "skip (and extrapolate) a reference run predicted to take longer");
ABSL_FLAG(double, reference_max_bytes, 3e9, "skip (and extrapolate) a reference run gathering more bytes per head");
ABSL_FLAG(bool, no_full, false, "do not run full attention");
ABSL_FLAG(bool, no_reference, false, "do not run the reference kernel");
ABSL_FLAG(uint64_t, seed, 1, "at::manual_seed for the random inputs");
ABSL_FLAG(int64_t, batch_size, 1,
          "batch items B, each of N tokens with its own landmarks (the reference runs only at B = 1)");
ABSL_FLAG(bool, keep_freed_memory, true,
          "keep freed memory in the C heap for the next run, as mita-server does by default "
          "(kernels/runtime_environment.h); false: glibc's default, which maps and faults in every block over its "
          "mmap threshold afresh each run");
ABSL_FLAG(int64_t, keep_freed_memory_limit_bytes, int64_t{512} << 20,
          "with --keep_freed_memory: the most resident memory the heap keeps free, as mita-server's flag of the same "
          "name (checked every second, returned above it; kernels::FreedMemoryLimit); 0: no limit");
ABSL_FLAG(bool, phases, false, "also print the CPU kernel's time per phase (one extra run per row)");

namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::vector<int64_t> ParseIntegers(const std::string& text) {
  std::vector<int64_t> values;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t value = 0;
    if (!absl::SimpleAtoi(part, &value) || value < 1) {
      std::fprintf(stderr, "not a positive integer: '%s'\n", std::string(part).c_str());
      std::exit(2);
    }
    values.push_back(value);
  }
  return values;
}

// Whether the largest group's q, k, v and output (4 float32 tensors [B, H, N, d]) fit in the machine's physical
// memory; if not, says so on stderr naming the flags (a refused allocation would abort the run in LibTorch).
bool InputsFitInMemory(int64_t tokens, const std::vector<int64_t>& head_dims, const std::vector<int64_t>& heads,
                       int64_t batch_size) {
  const double needed = 4.0 * sizeof(float) * static_cast<double>(batch_size) * static_cast<double>(tokens) *
                        static_cast<double>(*std::max_element(head_dims.begin(), head_dims.end())) *
                        static_cast<double>(*std::max_element(heads.begin(), heads.end()));
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  if (needed <= physical) return true;
  std::fprintf(stderr,
               "--tokens=%lld with --batch_size=%lld and the largest --heads and --head_dims needs %.1f GiB for q, k, "
               "v and the output; this machine has %.1f GiB of memory\n",
               static_cast<long long>(tokens), static_cast<long long>(batch_size), needed / (1 << 30),
               physical / (1 << 30));
  return false;
}

std::vector<std::pair<int64_t, int64_t>> ParseBudgets(const std::string& text) {
  std::vector<std::pair<int64_t, int64_t>> budgets;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::vector<std::string> sides = absl::StrSplit(part, 'x');
    int64_t m = 0, k = 0;
    if (sides.size() != 2 || !absl::SimpleAtoi(sides[0], &m) || !absl::SimpleAtoi(sides[1], &k) || m < 1 || k < 1) {
      std::fprintf(stderr, "budget '%s' is not MxK with positive integers\n", std::string(part).c_str());
      std::exit(2);
    }
    budgets.emplace_back(m, k);
  }
  return budgets;
}

// Minor page faults of this process so far (getrusage): first touches of pages the C heap has just grown by.
int64_t MinorPageFaults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// Runs `run` until kFaultFreeRuns runs in a row make no minor page fault, at most `max_runs` times (at least once).
// One fault-free run is not enough: the heap's layout can alternate between runs, so that a run after a fault-free
// one still grows it (N 16K, d 64, H 8, m = k = 64: 0, then 8,192 faults). Returns the faults of the last run: 0
// when the heap reached its steady state for this shape.
constexpr int kFaultFreeRuns = 3;
template <typename Run>
int64_t WarmUp(const Run& run, int max_runs) {
  int64_t faults = 0;
  int fault_free_in_a_row = 0;
  for (int attempt = 0; attempt < std::max(1, max_runs) && fault_free_in_a_row < kFaultFreeRuns; ++attempt) {
    const int64_t before = MinorPageFaults();
    run();
    faults = MinorPageFaults() - before;
    fault_free_in_a_row = faults == 0 ? fault_free_in_a_row + 1 : 0;
  }
  return faults;
}

// Median of a non-empty list (the upper one of the two middle values for an even count).
double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Best fp32 GEMM rate (GFLOP/s, 2 n^3 FLOPs per n x n x n product) of at::mm over `runs` runs after a warm-up.
double MeasureGemmRate(int64_t size, int runs = 5) {
  const at::Tensor a = at::randn({size, size}), b = at::randn({size, size});
  at::Tensor c = at::empty({size, size});
  at::mm_out(c, a, b);
  double best = 1e30;
  for (int run = 0; run < runs; ++run) {
    const Clock::time_point start = Clock::now();
    at::mm_out(c, a, b);
    best = std::min(best, SecondsSince(start));
  }
  return 2.0 * size * size * size / best / 1e9;
}

void Check(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s failed: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

// A measured or extrapolated time (seconds).
struct Timing {
  double seconds = 0;
  bool extrapolated = false;
  bool missing = false;  // neither measured nor predictable
};

std::string FormatMilliseconds(const Timing& timing) {
  if (timing.missing) return "-";
  const double milliseconds = timing.seconds * 1e3;
  return absl::StrFormat(milliseconds < 10 ? "%s%.3f" : "%s%.1f", timing.extrapolated ? "~" : "", milliseconds);
}

std::string FormatRatio(const Timing& numerator, double denominator_seconds) {
  if (numerator.missing) return "-";
  const double ratio = numerator.seconds / denominator_seconds;
  return absl::StrFormat(ratio < 10 ? "%s%.2fx" : "%s%.1fx", numerator.extrapolated ? "~" : "", ratio);
}

}  // namespace

int main(int argc, char** argv) {
  mita::kernels::ReexecWithOpenMpWaitSettingsIfUnset(argv);
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) { return absl::EndsWith(file, "/kernel_bench.cc"); };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "MiTA CPU kernel vs GEMM rate, full attention and the reference kernel. Flags below.");
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_threads) < 0 || absl::GetFlag(FLAGS_batch_size) < 1) {
    std::fprintf(stderr, "--threads must be >= 0 (0: all cores) and --batch_size >= 1 (got %d and %lld)\n",
                 absl::GetFlag(FLAGS_threads), static_cast<long long>(absl::GetFlag(FLAGS_batch_size)));
    return 2;
  }

  int threads = absl::GetFlag(FLAGS_threads);
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  mita::kernels::SetIntraOpThreads(threads);
  const bool keep_freed_memory =
      absl::GetFlag(FLAGS_keep_freed_memory) && mita::kernels::KeepFreedMemoryForReuse();
  const int64_t freed_memory_limit_bytes = absl::GetFlag(FLAGS_keep_freed_memory_limit_bytes);
  std::unique_ptr<mita::kernels::FreedMemoryLimit> freed_memory_limit;
  if (keep_freed_memory && freed_memory_limit_bytes > 0) {
    freed_memory_limit =
        std::make_unique<mita::kernels::FreedMemoryLimit>(freed_memory_limit_bytes, absl::Seconds(1));
  }
  at::NoGradGuard no_grad;

  std::vector<int64_t> token_counts = ParseIntegers(absl::GetFlag(FLAGS_tokens));
  std::vector<int64_t> head_dims = ParseIntegers(absl::GetFlag(FLAGS_head_dims));
  std::vector<int64_t> head_counts = ParseIntegers(absl::GetFlag(FLAGS_heads));
  const std::vector<std::pair<int64_t, int64_t>> budgets = ParseBudgets(absl::GetFlag(FLAGS_budgets));
  if (absl::GetFlag(FLAGS_quick)) {
    token_counts = {1024, 4096};
    head_dims = {64};
    head_counts = {4};
  }
  std::sort(token_counts.begin(), token_counts.end());  // extrapolation uses smaller N
  if (!InputsFitInMemory(token_counts.back(), head_dims, head_counts, absl::GetFlag(FLAGS_batch_size))) return 2;

  const double gemm_rate = MeasureGemmRate(absl::GetFlag(FLAGS_gemm_size));
  std::printf("batch size %lld, threads %d, OMP_WAIT_POLICY=%s, keep_freed_memory=%s (limit %lld bytes), fp32 "
              "GEMM rate (at::mm %lld^3, best of 5) %.1f GFLOP/s\n\n",
              static_cast<long long>(absl::GetFlag(FLAGS_batch_size)), threads,
              std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : "(unset)",
              keep_freed_memory ? "true" : "false",
              static_cast<long long>(freed_memory_limit != nullptr ? freed_memory_limit_bytes : 0),
              static_cast<long long>(absl::GetFlag(FLAGS_gemm_size)), gemm_rate);
  std::printf(
      "| N | d | H | m | k | MiTA ms | faults | GFLOP/s | GEMM | %%GEMM | full ms | x full | ref ms | x ref "
      "| per-expert ms | x per-expert | x N/4 |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  std::fflush(stdout);

  // Largest measured N so far, and its time, per key (for extrapolation).
  std::map<std::tuple<int64_t, int64_t>, std::pair<int64_t, double>> full_measured;                  // (d, H)
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, std::pair<int64_t, double>> ref_measured;  // (d,H,m,k)
  const double full_limit = absl::GetFlag(FLAGS_full_max_seconds);
  const double reference_limit = absl::GetFlag(FLAGS_reference_max_seconds);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  const int64_t batch_size = absl::GetFlag(FLAGS_batch_size);
  const Clock::time_point run_start = Clock::now();
  const int max_warm_up_runs = absl::GetFlag(FLAGS_max_warm_up_runs);
  // The q, k, v of each (N, d, H) group while a later group at 4 N may still need them (x N/4).
  struct GroupInputs {
    at::Tensor q, k, v;
  };
  std::map<std::tuple<int64_t, int64_t, int64_t>, GroupInputs> group_inputs;  // (N, d, H)
  std::vector<std::string> phase_rows;

  for (int64_t tokens : token_counts) {
    for (auto group = group_inputs.begin(); group != group_inputs.end();) {
      group = std::get<0>(group->first) * 4 < tokens ? group_inputs.erase(group) : std::next(group);
    }
    for (int64_t head_dim : head_dims) {
      for (int64_t heads : head_counts) {
        const double group_gemm_rate = MeasureGemmRate(absl::GetFlag(FLAGS_gemm_size), 3);
        at::manual_seed(absl::GetFlag(FLAGS_seed));
        const at::Tensor q = at::randn({batch_size, heads, tokens, head_dim});
        const at::Tensor k = at::randn({batch_size, heads, tokens, head_dim});
        const at::Tensor v = at::randn({batch_size, heads, tokens, head_dim});
        group_inputs[std::make_tuple(tokens, head_dim, heads)] = {q, k, v};
        const GroupInputs* quarter = nullptr;
        if (tokens % 4 == 0) {
          const auto found = group_inputs.find(std::make_tuple(tokens / 4, head_dim, heads));
          if (found != group_inputs.end()) quarter = &found->second;
        }

        // Full attention: once per (N, d, H).
        Timing full;
        const auto full_key = std::make_tuple(head_dim, heads);
        const auto full_previous = full_measured.find(full_key);
        double full_prediction = -1;
        if (full_previous != full_measured.end()) {
          const double ratio = static_cast<double>(tokens) / full_previous->second.first;
          full_prediction = full_previous->second.second * ratio * ratio;
        }
        if (absl::GetFlag(FLAGS_no_full)) {
          full.missing = true;
        } else if (full_prediction > full_limit) {
          full = {full_prediction, true, false};
        } else {
          // One run (up to minutes at large N); runs under a second are repeated, up to --repeats times and 2 s
          // in all, after a first one not counted (a first call's one-time costs, allocator and thread pool: 2.26
          // ms against 0.33 ms at N 50-64), and the median kept, as for MiTA ms.
          std::vector<double> full_times;
          const Clock::time_point full_start = Clock::now();
          for (int run = 0; run <= repeats; ++run) {
            const Clock::time_point start = Clock::now();
            Check(mita::kernels::FullAttentionForward(q, k, v).status(), "full attention");
            const double seconds = SecondsSince(start);
            if (seconds >= 1.0) {
              full_times = {seconds};
              break;
            }
            if (run > 0) full_times.push_back(seconds);
            if (SecondsSince(full_start) > 2.0 && !full_times.empty()) break;
          }
          full.seconds = Median(full_times);
          full_measured[full_key] = {tokens, full.seconds};
        }

        for (const auto& [expert_count, width] : budgets) {
          if (expert_count > tokens || width > tokens) {
            std::fprintf(stderr, "no row for m=%lld k=%lld at N=%lld: a budget larger than N runs as min(m, N), "
                         "min(k, N)\n", static_cast<long long>(expert_count), static_cast<long long>(width),
                         static_cast<long long>(tokens));
            continue;
          }
          absl::StatusOr<at::Tensor> landmarks = mita::kernels::SequenceLandmarks(q, expert_count);
          Check(landmarks.status(), "landmarks");
          std::vector<mita::kernels::MitaItem> items;
          for (int64_t b = 0; b < batch_size; ++b) items.push_back({(*landmarks)[b], width});

          // The same budget on the N/4 group's inputs, run before each timed run for the paired x N/4.
          std::vector<mita::kernels::MitaItem> quarter_items;
          if (quarter != nullptr && expert_count <= tokens / 4 && width <= tokens / 4) {
            absl::StatusOr<at::Tensor> quarter_landmarks = mita::kernels::SequenceLandmarks(quarter->q, expert_count);
            Check(quarter_landmarks.status(), "landmarks of N/4");
            for (int64_t b = 0; b < batch_size; ++b) quarter_items.push_back({(*quarter_landmarks)[b], width});
          }
          auto run_quarter = [&] {
            Check(mita::kernels::MitaAttentionForward(quarter->q, quarter->k, quarter->v, quarter_items).status(),
                  "MiTA at N/4");
          };

          // MiTA CPU kernel: warm-up, then the median of `repeats` runs; where the small-input path applies,
          // each run is followed by one with it turned off (the per-expert baseline).
          const bool small_input = mita::kernels::internal::SmallInputPathApplies(tokens, head_dim, expert_count, width,
                                                                                  /*include_shared_expert=*/true);
          mita::kernels::internal::MitaForwardOptions per_expert_options;
          per_expert_options.small_input_path = false;
          auto run_per_expert = [&] {
            Check(mita::kernels::internal::MitaAttentionForwardWithOptions(
                      q, k, v, items, nullptr, mita::kernels::MitaBackend::kAuto, per_expert_options)
                      .status(),
                  "MiTA per expert");
          };
          auto run_mita = [&] { Check(mita::kernels::MitaAttentionForward(q, k, v, items).status(), "MiTA"); };
          WarmUp(run_mita, max_warm_up_runs);
          if (small_input) WarmUp(run_per_expert, max_warm_up_runs);
          if (!quarter_items.empty()) WarmUp(run_quarter, max_warm_up_runs);
          std::vector<double> times, per_expert_times, quarter_ratios, run_faults;
          for (int run = 0; run < repeats; ++run) {
            double quarter_seconds = 0;
            if (!quarter_items.empty()) {
              run_quarter();  // the first run after the N run refills the caches with the N/4 inputs
              const Clock::time_point quarter_start = Clock::now();
              run_quarter();
              quarter_seconds = SecondsSince(quarter_start);
            }
            const int64_t faults_before = MinorPageFaults();
            Clock::time_point start = Clock::now();
            run_mita();
            times.push_back(SecondsSince(start));
            run_faults.push_back(static_cast<double>(MinorPageFaults() - faults_before));
            if (!quarter_items.empty()) quarter_ratios.push_back(times.back() / quarter_seconds);
            if (!small_input) continue;
            start = Clock::now();
            run_per_expert();
            per_expert_times.push_back(SecondsSince(start));
          }
          const double mita_seconds = Median(times);
          Timing per_expert;
          if (small_input) {
            per_expert.seconds = Median(per_expert_times);
          } else {
            per_expert.missing = true;
          }
          const std::string linearity =
              quarter_ratios.empty() ? "-" : absl::StrFormat("%.2fx", Median(quarter_ratios));
          const double flops = 2.0 * tokens * head_dim * (4.0 * expert_count + 2.0 * width) * heads * batch_size;
          const double gflops = flops / mita_seconds / 1e9;
          if (absl::GetFlag(FLAGS_phases)) {
            std::vector<mita::kernels::internal::MitaPhaseSeconds> phase_seconds;
            std::vector<mita::kernels::internal::MitaGemmTotals> gemm_totals;
            mita::kernels::internal::MitaForwardOptions phase_options;
            phase_options.phase_seconds = &phase_seconds;
            phase_options.gemm_totals = &gemm_totals;
            double wall = 0;
            const int64_t phase_faults = WarmUp(
                [&] {
                  const Clock::time_point start = Clock::now();
                  Check(mita::kernels::internal::MitaAttentionForwardWithOptions(
                            q, k, v, items, nullptr, mita::kernels::MitaBackend::kAuto, phase_options)
                            .status(),
                        "MiTA with phase timers");
                  wall = SecondsSince(start);
                },
                max_warm_up_runs);
            std::string row = absl::StrFormat("| %d | %d | %d | %d | %d | %s | %d |", tokens, head_dim, heads,
                                              expert_count, width, FormatMilliseconds({wall, false, false}),
                                              phase_faults);
            double total = 0;
            for (int phase = 0; phase < mita::kernels::internal::kPhaseCount; ++phase) {
              double seconds = 0;
              for (const auto& head : phase_seconds) seconds += head[phase];
              total += seconds;
              absl::StrAppendFormat(&row, " %s |", FormatMilliseconds({seconds, false, false}));
            }
            mita::kernels::internal::MitaGemmTotals gemm;
            for (const auto& head : gemm_totals) {
              gemm.calls += head.calls;
              gemm.flops += head.flops;
              gemm.seconds += head.seconds;
            }
            // The kernel's GEMMs at their own shapes, as a rate of all threads (comparable to the GEMM column),
            // and the %GEMM the row would reach if all its work outside BLAS took no time.
            const double shape_rate = gemm.flops / (gemm.seconds / threads) / 1e9;
            const double bound = flops / (gemm.seconds / threads) / 1e9 / group_gemm_rate;
            absl::StrAppendFormat(&row, " %s | %s | %lld | %.1f | %.0f%% | %.0f%% |",
                                  FormatMilliseconds({total, false, false}),
                                  FormatMilliseconds({gemm.seconds, false, false}),
                                  static_cast<long long>(gemm.calls), shape_rate,
                                  100.0 * shape_rate / group_gemm_rate, 100.0 * bound);
            phase_rows.push_back(row);
          }

          // Reference: head by head, once.
          Timing reference;
          const auto ref_key = std::make_tuple(head_dim, heads, expert_count, width);
          const auto ref_previous = ref_measured.find(ref_key);
          double ref_prediction = -1;
          if (ref_previous != ref_measured.end()) {
            ref_prediction = ref_previous->second.second * tokens / ref_previous->second.first;
          }
          const double gathered_bytes = 2.0 * tokens * width * head_dim * sizeof(float);
          if (absl::GetFlag(FLAGS_no_reference) || batch_size > 1) {
            reference.missing = true;
          } else if (ref_prediction > reference_limit ||
                     gathered_bytes > absl::GetFlag(FLAGS_reference_max_bytes)) {
            if (ref_prediction > 0) {
              reference = {ref_prediction, true, false};
            } else {
              reference.missing = true;
            }
          } else {
            double total = 0;
            for (int64_t h = 0; h < heads; ++h) {
              const std::vector<mita::kernels::MitaItem> head_items = {
                  {items[0].landmarks.narrow(0, h, 1), width}};
              const at::Tensor qh = q.narrow(1, h, 1), kh = k.narrow(1, h, 1), vh = v.narrow(1, h, 1);
              const Clock::time_point start = Clock::now();
              Check(mita::kernels::MitaAttentionForward(qh, kh, vh, head_items, nullptr,
                                                        mita::kernels::MitaBackend::kReference)
                        .status(),
                    "reference");
              total += SecondsSince(start);
            }
            reference.seconds = total;
            ref_measured[ref_key] = {tokens, total};
          }

          std::printf("| %lld | %lld | %lld | %lld | %lld | %.3f | %.0f | %.1f | %.1f | %.0f%% | %s | %s | %s | %s "
                      "| %s | %s | %s |\n",
                      static_cast<long long>(tokens), static_cast<long long>(head_dim),
                      static_cast<long long>(heads), static_cast<long long>(expert_count),
                      static_cast<long long>(width), mita_seconds * 1e3, Median(run_faults), gflops,
                      group_gemm_rate,
                      100.0 * gflops / group_gemm_rate,
                      FormatMilliseconds(full).c_str(), FormatRatio(full, mita_seconds).c_str(),
                      FormatMilliseconds(reference).c_str(), FormatRatio(reference, mita_seconds).c_str(),
                      FormatMilliseconds(per_expert).c_str(), FormatRatio(per_expert, mita_seconds).c_str(),
                      linearity.c_str());
          std::fflush(stdout);
        }
      }
    }
  }
  if (!phase_rows.empty()) {
    std::printf("\nThread time per phase (ms, summed over heads), one run with the phase timers on:\n\n");
    std::printf("| N | d | H | m | k | wall ms | faults |");
    for (const char* name : mita::kernels::internal::kMitaPhaseNames) std::printf(" %s |", name);
    std::printf(" sum | BLAS ms | BLAS calls | BLAS GFLOP/s | BLAS %%GEMM | bound %%GEMM |\n|");
    for (int column = 0; column < 13 + mita::kernels::internal::kPhaseCount; ++column) std::printf("---:|");
    std::printf("\n");
    for (const std::string& row : phase_rows) std::printf("%s\n", row.c_str());
  }
  std::printf("\nfp32 GEMM rate at the end of the run: %.1f GFLOP/s; total run %.0f s\n",
              MeasureGemmRate(absl::GetFlag(FLAGS_gemm_size)), SecondsSince(run_start));
  return 0;
}
