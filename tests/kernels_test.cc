// Tests of kernels/: the production CPU MiTA forward and the ATen reference against an independent float64
// per-query loop written here (plain std::vector<double>, no ATen math), landmarks against hand loops, full
// attention, the documented tie rules, statistics, argument validation, and ATen exceptions as a Status.
// Math: docs/design.md section 2.
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <ostream>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/adaptive_avg_pool1d.h>
#include <ATen/ops/adaptive_avg_pool2d.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/aten_errors.h"
#include "kernels/blas_library.h"
#include "kernels/depthwise_convolution.h"
#include "kernels/mita_attention.h"
#include "kernels/mita_attention_internal.h"
#include "kernels/runtime_environment.h"
#include "tests/test_util.h"

namespace mita::kernels {
namespace {

// Whether this build runs under AddressSanitizer (its allocator replaces glibc's and aborts on huge requests).
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
constexpr bool kAddressSanitizer = __has_feature(address_sanitizer);
#else
constexpr bool kAddressSanitizer = false;
#endif

// ---------------------------------------------------------------------------------------------------------
// Data helpers.

struct Dims {
  int64_t batch, heads, tokens, head_dim;
};

std::vector<double> RandomNormal(int64_t count, uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> data(count);
  for (double& value : data) value = normal(generator);
  return data;
}

at::Tensor MakeTensor(const std::vector<double>& data, std::vector<int64_t> sizes, at::ScalarType type) {
  return at::from_blob(const_cast<double*>(data.data()), sizes, at::kDouble).clone().to(type);
}

std::vector<double> ToDoubles(const at::Tensor& tensor) {
  const at::Tensor contiguous = tensor.to(at::kDouble).contiguous();
  const double* data = contiguous.data_ptr<double>();
  return std::vector<double>(data, data + contiguous.numel());
}

double MaxAbsDifference(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double difference = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) difference = std::max(difference, std::abs(a[i] - b[i]));
  return difference;
}

double Dot(const double* a, const double* b, int64_t size) {
  double sum = 0;
  for (int64_t c = 0; c < size; ++c) sum += a[c] * b[c];
  return sum;
}

// ---------------------------------------------------------------------------------------------------------
// The independent float64 loop: docs/design.md section 2, one query at a time.

struct LoopItem {
  std::vector<double> landmarks;  // [H, M, d]
  int64_t expert_count;
  int64_t width;
  int64_t token_count = 0;  // the item's tokens, 0 = all N (MitaItem::token_count); output rows beyond are 0
};

struct LoopResult {
  std::vector<double> output;                       // [B, H, N, d]
  std::vector<internal::MitaHeadRouting> routing;   // B * H
  std::vector<MitaItemStatistics> statistics;       // B
};

LoopResult MitaLoop(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                    const Dims& dims, const std::vector<LoopItem>& items, bool include_shared_expert = true) {
  const int64_t heads = dims.heads, all_tokens = dims.tokens, d = dims.head_dim;
  const double s = 1.0 / std::sqrt(static_cast<double>(d));
  auto row = [&](const std::vector<double>& data, int64_t b, int64_t h, int64_t n) {
    return data.data() + ((b * heads + h) * all_tokens + n) * d;
  };
  LoopResult result;
  result.output.assign(dims.batch * heads * all_tokens * d, 0.0);
  result.routing.resize(dims.batch * heads);
  result.statistics.resize(dims.batch);
  for (int64_t b = 0; b < dims.batch; ++b) {
    const int64_t experts = items[b].expert_count, width = items[b].width;
    const int64_t tokens = items[b].token_count == 0 ? dims.tokens : items[b].token_count;
    MitaItemStatistics& statistics = result.statistics[b];
    statistics.queries_per_expert.assign(experts, 0.0);
    for (int64_t h = 0; h < heads; ++h) {
      auto landmark = [&](int64_t i) { return items[b].landmarks.data() + (h * experts + i) * d; };
      internal::MitaHeadRouting& routing = result.routing[b * heads + h];
      // Routed experts: the `width` keys with the largest l_i . k_j; ties to the lower key index.
      routing.expert_keys.assign(experts, {});
      std::vector<int> selections(tokens, 0);
      for (int64_t i = 0; i < experts; ++i) {
        std::vector<double> scores(tokens);
        for (int64_t j = 0; j < tokens; ++j) scores[j] = Dot(landmark(i), row(k, b, h, j), d);
        std::vector<int64_t> order(tokens);
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
          return scores[x] > scores[y] || (scores[x] == scores[y] && x < y);
        });
        routing.expert_keys[i].assign(order.begin(), order.begin() + width);
        std::sort(routing.expert_keys[i].begin(), routing.expert_keys[i].end());
        for (int64_t key : routing.expert_keys[i]) ++selections[key];
      }
      // Shared expert A_i = sum_j softmax_j(l_i . k_j s) v_j.
      std::vector<std::vector<double>> shared(experts, std::vector<double>(d, 0.0));
      for (int64_t i = 0; i < experts; ++i) {
        std::vector<double> logits(tokens);
        for (int64_t j = 0; j < tokens; ++j) logits[j] = Dot(landmark(i), row(k, b, h, j), d) * s;
        const double max_logit = *std::max_element(logits.begin(), logits.end());
        double sum = 0;
        for (double& logit : logits) sum += (logit = std::exp(logit - max_logit));
        for (int64_t j = 0; j < tokens; ++j) {
          for (int64_t c = 0; c < d; ++c) shared[i][c] += logits[j] / sum * row(v, b, h, j)[c];
        }
      }
      // Gate: first maximum of l_i . q_n over i; then one softmax over the M + k logits of each query.
      routing.expert_of_query.assign(tokens, 0);
      std::vector<int64_t> load(experts, 0);
      for (int64_t n = 0; n < tokens; ++n) {
        const double* query = row(q, b, h, n);
        int64_t expert = 0;
        for (int64_t i = 1; i < experts; ++i) {
          if (Dot(landmark(i), query, d) > Dot(landmark(expert), query, d)) expert = i;
        }
        routing.expert_of_query[n] = expert;
        ++load[expert];
        std::vector<double> logits;
        std::vector<const double*> values;
        if (include_shared_expert) {
          for (int64_t i = 0; i < experts; ++i) {
            logits.push_back(Dot(query, landmark(i), d) * s * s);
            values.push_back(shared[i].data());
          }
        }
        for (int64_t key : routing.expert_keys[expert]) {
          logits.push_back(Dot(query, row(k, b, h, key), d) * s);
          values.push_back(row(v, b, h, key));
        }
        const double max_logit = *std::max_element(logits.begin(), logits.end());
        double sum = 0;
        for (double& logit : logits) sum += (logit = std::exp(logit - max_logit));
        double* out = result.output.data() + ((b * heads + h) * all_tokens + n) * d;
        for (size_t j = 0; j < logits.size(); ++j) {
          for (int64_t c = 0; c < d; ++c) out[c] += logits[j] / sum * values[j][c];
        }
      }
      // Statistics of this head, averaged over heads below.
      const double n_tokens = static_cast<double>(tokens);
      double entropy = 0;
      for (int64_t i = 0; i < experts; ++i) {
        statistics.queries_per_expert[i] += static_cast<double>(load[i]) / heads;
        if (load[i] > 0) entropy -= load[i] / n_tokens * std::log(load[i] / n_tokens);
      }
      const double mean_load = n_tokens / experts;
      statistics.load_imbalance += *std::max_element(load.begin(), load.end()) / mean_load / heads;
      statistics.routing_entropy += (experts == 1 ? 1.0 : entropy / std::log(static_cast<double>(experts))) / heads;
      statistics.pruned_key_fraction += std::count(selections.begin(), selections.end(), 0) / n_tokens / heads;
      statistics.expert_overlap_fraction +=
          std::count_if(selections.begin(), selections.end(), [](int count) { return count >= 2; }) / n_tokens /
          heads;
    }
  }
  return result;
}

// softmax(q k^T s) v, one query at a time.
std::vector<double> FullAttentionLoop(const std::vector<double>& q, const std::vector<double>& k,
                                      const std::vector<double>& v, const Dims& dims) {
  const int64_t tokens = dims.tokens, d = dims.head_dim;
  const double s = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> output(q.size(), 0.0);
  for (int64_t head = 0; head < dims.batch * dims.heads; ++head) {
    const int64_t base = head * tokens * d;
    for (int64_t n = 0; n < tokens; ++n) {
      std::vector<double> logits(tokens);
      for (int64_t j = 0; j < tokens; ++j) logits[j] = Dot(&q[base + n * d], &k[base + j * d], d) * s;
      const double max_logit = *std::max_element(logits.begin(), logits.end());
      double sum = 0;
      for (double& logit : logits) sum += (logit = std::exp(logit - max_logit));
      for (int64_t j = 0; j < tokens; ++j) {
        for (int64_t c = 0; c < d; ++c) output[base + n * d + c] += logits[j] / sum * v[base + j * d + c];
      }
    }
  }
  return output;
}

void ExpectStatisticsNear(const std::vector<MitaItemStatistics>& actual,
                          const std::vector<MitaItemStatistics>& expected, const std::string& label) {
  ASSERT_EQ(actual.size(), expected.size()) << label;
  constexpr double kTolerance = 1e-12;
  for (size_t b = 0; b < expected.size(); ++b) {
    SCOPED_TRACE(label + " item " + std::to_string(b));
    ASSERT_EQ(actual[b].queries_per_expert.size(), expected[b].queries_per_expert.size());
    for (size_t i = 0; i < expected[b].queries_per_expert.size(); ++i) {
      EXPECT_NEAR(actual[b].queries_per_expert[i], expected[b].queries_per_expert[i], kTolerance) << "expert " << i;
    }
    EXPECT_NEAR(actual[b].load_imbalance, expected[b].load_imbalance, kTolerance);
    EXPECT_NEAR(actual[b].routing_entropy, expected[b].routing_entropy, kTolerance);
    EXPECT_NEAR(actual[b].pruned_key_fraction, expected[b].pruned_key_fraction, kTolerance);
    EXPECT_NEAR(actual[b].expert_overlap_fraction, expected[b].expert_overlap_fraction, kTolerance);
  }
}

void ExpectRoutingEqual(const std::vector<internal::MitaHeadRouting>& actual,
                        const std::vector<internal::MitaHeadRouting>& expected, const std::string& label) {
  ASSERT_EQ(actual.size(), expected.size()) << label;
  for (size_t task = 0; task < expected.size(); ++task) {
    EXPECT_EQ(actual[task].expert_of_query, expected[task].expert_of_query) << label << " (item, head) " << task;
    EXPECT_EQ(actual[task].expert_keys, expected[task].expert_keys) << label << " (item, head) " << task;
  }
}

// Runs one backend with routing and statistics.
struct BackendRun {
  at::Tensor output;
  std::vector<MitaItemStatistics> statistics;
  std::vector<internal::MitaHeadRouting> routing;
};

BackendRun RunBackend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<MitaItem>& items,
                      MitaBackend backend, bool include_shared_expert = true, bool small_input_path = true,
                      int64_t query_tile_rows = 0) {
  BackendRun run;
  internal::MitaForwardOptions options;
  options.query_tile_rows = query_tile_rows;
  options.include_shared_expert = include_shared_expert;
  options.small_input_path = small_input_path;
  options.routing = &run.routing;
  absl::StatusOr<at::Tensor> output =
      internal::MitaAttentionForwardWithOptions(q, k, v, items, &run.statistics, backend, options);
  EXPECT_TRUE(output.ok()) << output.status();
  if (output.ok()) run.output = *output;
  return run;
}

const char* BackendName(MitaBackend backend) { return backend == MitaBackend::kAuto ? "cpu kernel" : "reference"; }

// Random q, k, v as the model produces them: slices of one [B, N, 3, H, d] qkv tensor (non-contiguous).
struct RandomProblem {
  Dims dims;
  at::Tensor q, k, v;
  std::vector<double> q_values, k_values, v_values;  // contiguous [B, H, N, d], exactly the tensors' values
};

RandomProblem MakeRandomProblem(const Dims& dims, at::ScalarType type, uint64_t seed) {
  RandomProblem problem{dims};
  const at::Tensor qkv = MakeTensor(RandomNormal(dims.batch * dims.tokens * 3 * dims.heads * dims.head_dim, seed),
                                    {dims.batch, dims.tokens, 3, dims.heads, dims.head_dim}, type)
                             .permute({2, 0, 3, 1, 4});
  problem.q = qkv[0];
  problem.k = qkv[1];
  problem.v = qkv[2];
  problem.q_values = ToDoubles(problem.q);
  problem.k_values = ToDoubles(problem.k);
  problem.v_values = ToDoubles(problem.v);
  return problem;
}

// Items with sequence landmarks of q (each item its own expert count M) and the given expert widths.
std::vector<MitaItem> SequenceItems(const at::Tensor& q, const std::vector<std::pair<int64_t, int64_t>>& budgets) {
  std::vector<MitaItem> items;
  for (size_t b = 0; b < budgets.size(); ++b) {
    absl::StatusOr<at::Tensor> landmarks = SequenceLandmarks(q.narrow(0, b, 1), budgets[b].first);
    EXPECT_TRUE(landmarks.ok()) << landmarks.status();
    items.push_back(MitaItem{(*landmarks)[0], budgets[b].second});
  }
  return items;
}

std::vector<LoopItem> ToLoopItems(const std::vector<MitaItem>& items) {
  std::vector<LoopItem> loop_items;
  for (const MitaItem& item : items) {
    loop_items.push_back(
        LoopItem{ToDoubles(item.landmarks), item.landmarks.size(1), item.expert_width, item.token_count});
  }
  return loop_items;
}

// ---------------------------------------------------------------------------------------------------------
// (1), (2): both backends against the loop on random shapes.

struct RandomCase {
  std::string name;
  Dims dims;
  std::vector<std::pair<int64_t, int64_t>> budgets;  // per item: (expert count M, expert width k)
  at::ScalarType type;
};

void PrintTo(const RandomCase& test_case, std::ostream* stream) { *stream << test_case.name; }

class MitaRandomTest : public ::testing::TestWithParam<RandomCase> {};

TEST_P(MitaRandomTest, BackendsMatchFloat64Loop) {
  at::set_num_threads(2);
  const RandomCase& test_case = GetParam();
  const RandomProblem problem = MakeRandomProblem(test_case.dims, test_case.type, /*seed=*/test_case.dims.tokens);
  const std::vector<MitaItem> items = SequenceItems(problem.q, test_case.budgets);
  const LoopResult expected =
      MitaLoop(problem.q_values, problem.k_values, problem.v_values, problem.dims, ToLoopItems(items));
  const double tolerance = test_case.type == at::kDouble ? 1e-10 : 1e-5;
  for (MitaBackend backend : {MitaBackend::kAuto, MitaBackend::kReference}) {
    SCOPED_TRACE(BackendName(backend));
    const BackendRun run = RunBackend(problem.q, problem.k, problem.v, items, backend);
    ASSERT_TRUE(run.output.defined());
    EXPECT_EQ(run.output.sizes(), problem.q.sizes());
    EXPECT_EQ(run.output.scalar_type(), test_case.type);
    ExpectRoutingEqual(run.routing, expected.routing, BackendName(backend));
    EXPECT_LT(MaxAbsDifference(ToDoubles(run.output), expected.output), tolerance);
    ExpectStatisticsNear(run.statistics, expected.statistics, BackendName(backend));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MitaRandomTest,
    ::testing::Values(
        RandomCase{"OddTokensNotDivisibleByExperts", {2, 3, 37, 8}, {{5, 7}, {5, 7}}, at::kDouble},
        RandomCase{"WidthEqualsTokens", {1, 2, 19, 16}, {{4, 19}}, at::kDouble},
        RandomCase{"SingleExpert", {2, 2, 23, 8}, {{1, 5}, {1, 23}}, at::kDouble},
        RandomCase{"MixedBudgetsPerItem", {3, 2, 41, 8}, {{1, 41}, {6, 9}, {13, 1}}, at::kDouble},
        // Several key blocks (256), query chunks (128) and top-k compactions.
        RandomCase{"ManyBlocks", {2, 2, 701, 16}, {{1, 300}, {9, 3}}, at::kDouble},
        RandomCase{"Float32", {2, 2, 53, 16}, {{7, 11}, {3, 53}}, at::kFloat},
        RandomCase{"Float32ManyBlocks", {1, 3, 530, 32}, {{16, 40}}, at::kFloat}),
    [](const ::testing::TestParamInfo<RandomCase>& info) { return info.param.name; });

// The CPU kernel's two ways to the output on the same inputs, each against the float64 loop: the small-input
// path (one q K^T GEMM, dense weight matrices) and the per-routed-expert path (forced with small_input_path =
// false); and where SmallInputPathApplies draws the line.
TEST(MitaCpuKernel, SmallInputPathAndPerExpertPathMatchLoop) {
  // N <= 2 (M + k), N^2 d <= 64^3 multiply-adds, and the shared expert.
  EXPECT_TRUE(internal::SmallInputPathApplies(50, 24, 9, 16, true));     // 50 <= 2 (9 + 16)
  EXPECT_FALSE(internal::SmallInputPathApplies(51, 24, 9, 16, true));
  EXPECT_FALSE(internal::SmallInputPathApplies(50, 24, 4, 8, true));
  EXPECT_TRUE(internal::SmallInputPathApplies(104, 24, 49, 50, true));   // 259,584 <= 262,144
  EXPECT_FALSE(internal::SmallInputPathApplies(105, 24, 49, 50, true));  // 264,600
  EXPECT_TRUE(internal::SmallInputPathApplies(64, 64, 16, 32, true));    // 64^3 exactly
  EXPECT_TRUE(internal::SmallInputPathApplies(17, 64, 256, 8, true));    // the gate keeps all N rows: no block bound
  EXPECT_FALSE(internal::SmallInputPathApplies(50, 24, 9, 16, false));
  // The embedded image model's attention: 50 tokens, 4 heads of 24; budgets where the small-input path applies
  // (m = 9 and 16, and k = N) and one where it does not (m = 4, k = 8), for the per-expert run to compare with.
  const Dims dims{4, 4, 50, 24};
  for (at::ScalarType type : {at::kDouble, at::kFloat}) {
    SCOPED_TRACE(type == at::kDouble ? "float64" : "float32");
    const RandomProblem problem = MakeRandomProblem(dims, type, /*seed=*/21);
    const std::vector<MitaItem> items = SequenceItems(problem.q, {{9, 16}, {16, 32}, {4, 50}, {4, 8}});
    const LoopResult expected =
        MitaLoop(problem.q_values, problem.k_values, problem.v_values, dims, ToLoopItems(items));
    const double tolerance = type == at::kDouble ? 1e-10 : 1e-5;
    for (bool small_input_path : {true, false}) {
      SCOPED_TRACE(small_input_path ? "small-input path" : "per-expert path");
      const BackendRun run = RunBackend(problem.q, problem.k, problem.v, items, MitaBackend::kAuto,
                                        /*include_shared_expert=*/true, small_input_path);
      ASSERT_TRUE(run.output.defined());
      ExpectRoutingEqual(run.routing, expected.routing, "cpu kernel");
      EXPECT_LT(MaxAbsDifference(ToDoubles(run.output), expected.output), tolerance);
      ExpectStatisticsNear(run.statistics, expected.statistics, "cpu kernel");
    }
  }
}

// The CPU kernel's gate and per-expert output run by query tiles (a few thousand queries at the benchmark's
// sizes, the whole N in these tests): forced down to a few queries, so that experts have queries in some tiles and
// not in others, chunks split within a tile and the last tile is short, each against the float64 loop.
TEST(MitaCpuKernel, QueryTilesMatchLoop) {
  const Dims dims{2, 2, 301, 16};
  for (at::ScalarType type : {at::kDouble, at::kFloat}) {
    SCOPED_TRACE(type == at::kDouble ? "float64" : "float32");
    const RandomProblem problem = MakeRandomProblem(dims, type, /*seed=*/33);
    const std::vector<MitaItem> items = SequenceItems(problem.q, {{9, 20}, {3, 301}});
    const LoopResult expected =
        MitaLoop(problem.q_values, problem.k_values, problem.v_values, dims, ToLoopItems(items));
    const double tolerance = type == at::kDouble ? 1e-10 : 1e-5;
    for (int64_t tile_rows : {1, 7, 64, 300}) {
      SCOPED_TRACE("query tile rows " + std::to_string(tile_rows));
      const BackendRun run = RunBackend(problem.q, problem.k, problem.v, items, MitaBackend::kAuto,
                                        /*include_shared_expert=*/true, /*small_input_path=*/true, tile_rows);
      ASSERT_TRUE(run.output.defined());
      ExpectRoutingEqual(run.routing, expected.routing, "cpu kernel");
      EXPECT_LT(MaxAbsDifference(ToDoubles(run.output), expected.output), tolerance);
      ExpectStatisticsNear(run.statistics, expected.statistics, "cpu kernel");
    }
  }
}

// SetIntraOpThreads sets LibTorch's and the process BLAS's thread counts together (kernels/blas_library.h); the
// returned count is read back from the BLAS itself.
TEST(IntraOpThreads, LibTorchAndTheBlasGetTheSameCount) {
  const int before = at::get_num_threads();
  for (int threads : {1, 2, 1}) {
    EXPECT_EQ(SetIntraOpThreads(threads), threads) << BlasLibrary::Get().description() << " thread count after setting " << threads;
    EXPECT_EQ(at::get_num_threads(), threads);
  }
  EXPECT_EQ(SetIntraOpThreads(0), 1) << "counts below 1 are taken as 1";
  SetIntraOpThreads(before);
}

// One elementwise op of LibTorch over 2^16 values: two chunks of its grain, so a parallel region on 2 threads.
void RunParallelRegion() { at::ones({int64_t{1} << 16}).add_(1); }

// ReleaseCallingThreadIntraOpTeam ends the calling thread's OpenMP workers (while any thread keeps them, libgomp
// manages more threads than a 2-CPU machine has, and no worker of any team spins); its next region starts new ones.
TEST(IntraOpThreads, ReleasingTheCallingThreadsTeamEndsItsWorkers) {
  std::thread([] {
    SetCallingThreadIntraOpThreads(2);
    const int before = test_util::ProcessThreadCount();
    RunParallelRegion();
    ASSERT_EQ(test_util::ProcessThreadCount(), before + 1) << "a team of 2 threads: this one and a worker";
    ReleaseCallingThreadIntraOpTeam();
    EXPECT_EQ(test_util::WaitForProcessThreadCountAtMost(before, absl::Seconds(10)), before)
        << "the worker did not end";
    RunParallelRegion();
    EXPECT_EQ(test_util::ProcessThreadCount(), before + 1) << "the next region starts a team again";
    ReleaseCallingThreadIntraOpTeam();
    EXPECT_EQ(test_util::WaitForProcessThreadCountAtMost(before, absl::Seconds(10)), before);
  }).join();
}

// Minor page faults of this process so far (getrusage).
int64_t MinorPageFaults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// Allocates `bytes` with malloc, writes one byte per 4 KiB page, frees it; returns the minor page faults it took.
int64_t FaultsOfTouchingFreshBuffer(size_t bytes) {
  const int64_t before = MinorPageFaults();
  auto* buffer = static_cast<volatile char*>(std::malloc(bytes));
  if (buffer == nullptr) return -1;
  for (size_t i = 0; i < bytes; i += 4096) buffer[i] = static_cast<char>(i);
  const int64_t faults = MinorPageFaults() - before;
  std::free(const_cast<char*>(buffer));
  return faults;
}

// KeepFreedMemoryForReuse: a second 96 MiB buffer (over glibc's largest mmap threshold, 32 MiB, like a long
// document's activations) reuses the first one's pages instead of faulting 24,576 new ones in. glibc's default
// is checked first, in the same process, so the test also says when a glibc no longer needs this. Runs in a
// child process (mallopt is process-wide). Not under the sanitizers, whose allocator ignores mallopt.
TEST(KeepFreedMemoryForReuse, SecondLargeBufferReusesThePagesOfTheFirst) {
  if (kAddressSanitizer) GTEST_SKIP() << "the sanitizer allocator replaces glibc's malloc";
  constexpr size_t kBytes = size_t{96} << 20;
  constexpr int64_t kPages = static_cast<int64_t>(kBytes / 4096);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        // glibc's default: the block is mapped afresh each time.
        FaultsOfTouchingFreshBuffer(kBytes);
        const int64_t default_second = FaultsOfTouchingFreshBuffer(kBytes);
        if (!KeepFreedMemoryForReuse()) {
          std::fprintf(stderr, "mallopt refused\n");
          std::exit(2);
        }
        const int64_t kept_first = FaultsOfTouchingFreshBuffer(kBytes);
        const int64_t kept_second = FaultsOfTouchingFreshBuffer(kBytes);
        std::fprintf(stderr, "faults: default second %lld, kept first %lld, kept second %lld (of %lld pages)\n",
                     static_cast<long long>(default_second), static_cast<long long>(kept_first),
                     static_cast<long long>(kept_second), static_cast<long long>(kPages));
        const bool default_refaults = default_second > kPages / 2;
        const bool kept_reuses = kept_second < kPages / 20;
        std::exit(default_refaults && kept_reuses ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "kept second");
}

// Touches and frees three 96 MiB buffers (288 MiB the heap then holds free).
void TouchAndFree() {
  constexpr size_t kBytes = size_t{96} << 20;
  std::vector<char*> blocks;
  for (int i = 0; i < 3; ++i) {
    blocks.push_back(static_cast<char*>(std::malloc(kBytes)));
    ASSERT_NE(blocks.back(), nullptr);
    std::memset(blocks.back(), 1, kBytes);
  }
  for (char* block : blocks) std::free(block);
}

// FreedMemoryLimit: freed memory under the limit stays resident (the next request reuses it); over the limit it
// is returned to the system, and the limit's start returns what was free then. Checks are called directly (the
// limit's own thread checks once an hour here).
TEST(FreedMemoryLimit, FreedMemoryOverTheLimitIsReturnedAndUnderItIsKept) {
  if (!KeepFreedMemoryForReuse()) GTEST_SKIP() << "glibc refused the mallopt settings";
  constexpr int64_t kMiB = int64_t{1} << 20;
  FreedMemoryLimit generous(1024 * kMiB, absl::Hours(1));
  TouchAndFree();
  const FreedMemoryLimit::Stats kept = generous.Check();
  EXPECT_GE(kept.kept_bytes, 250 * kMiB);
  EXPECT_EQ(kept.returns, 1);  // the one at start
  const int64_t resident_kept = ReadHeapMemory().resident_anonymous_bytes;

  FreedMemoryLimit tight(64 * kMiB, absl::Hours(1));  // returns the 288 MiB the heap holds free
  const int64_t resident_returned = ReadHeapMemory().resident_anonymous_bytes;
  EXPECT_GE(resident_kept - resident_returned, 250 * kMiB);
  const int64_t returned_at_start = tight.stats().returned_bytes;
  EXPECT_GE(returned_at_start, 250 * kMiB);
  TouchAndFree();
  const FreedMemoryLimit::Stats returned = tight.Check();
  EXPECT_EQ(returned.returns, 2);
  EXPECT_EQ(returned.kept_bytes, 0);
  EXPECT_GE(returned.returned_bytes - returned_at_start, 250 * kMiB);
  EXPECT_LE(ReadHeapMemory().resident_anonymous_bytes - resident_returned, 64 * kMiB);
}

// Explicit random landmarks (not pooled from q) and M > N also work.
TEST(MitaAttention, ArbitraryLandmarksMatchLoop) {
  const Dims dims{2, 2, 11, 4};
  const RandomProblem problem = MakeRandomProblem(dims, at::kDouble, 7);
  std::vector<MitaItem> items = {
      MitaItem{MakeTensor(RandomNormal(2 * 3 * 4, 8), {2, 3, 4}, at::kDouble), 4},
      MitaItem{MakeTensor(RandomNormal(2 * 15 * 4, 9), {2, 15, 4}, at::kDouble).transpose(0, 1).contiguous()
                   .transpose(0, 1),  // non-contiguous landmarks
               2}};
  const LoopResult expected =
      MitaLoop(problem.q_values, problem.k_values, problem.v_values, dims, ToLoopItems(items));
  for (MitaBackend backend : {MitaBackend::kAuto, MitaBackend::kReference}) {
    SCOPED_TRACE(BackendName(backend));
    const BackendRun run = RunBackend(problem.q, problem.k, problem.v, items, backend);
    ASSERT_TRUE(run.output.defined());
    ExpectRoutingEqual(run.routing, expected.routing, BackendName(backend));
    EXPECT_LT(MaxAbsDifference(ToDoubles(run.output), expected.output), 1e-10);
    ExpectStatisticsNear(run.statistics, expected.statistics, BackendName(backend));
  }
}

// Any strides: q with a non-unit last stride (copied by the kernel), k shared by both items through a zero
// batch stride (read in place), v from the qkv layout.
TEST(MitaAttention, StridedInputsMatchLoop) {
  const Dims dims{2, 2, 23, 8};
  const RandomProblem problem = MakeRandomProblem(dims, at::kDouble, 13);
  const at::Tensor q = problem.q.transpose(2, 3).contiguous().transpose(2, 3);
  const at::Tensor k = problem.k.narrow(0, 0, 1).expand({2, 2, 23, 8});
  ASSERT_NE(q.stride(3), 1);
  ASSERT_EQ(k.stride(0), 0);
  const std::vector<double> k_values = ToDoubles(k);
  const std::vector<MitaItem> items = SequenceItems(q, {{3, 5}, {4, 23}});
  const LoopResult expected = MitaLoop(problem.q_values, k_values, problem.v_values, dims, ToLoopItems(items));
  for (MitaBackend backend : {MitaBackend::kAuto, MitaBackend::kReference}) {
    SCOPED_TRACE(BackendName(backend));
    const BackendRun run = RunBackend(q, k, problem.v, items, backend);
    ASSERT_TRUE(run.output.defined());
    ExpectRoutingEqual(run.routing, expected.routing, BackendName(backend));
    EXPECT_LT(MaxAbsDifference(ToDoubles(run.output), expected.output), 1e-10);
  }
}

// The public entry point with its defaults (no statistics, kAuto) gives the CPU kernel's output.
TEST(MitaAttention, PublicApiMatchesLoop) {
  const Dims dims{1, 2, 17, 8};
  const RandomProblem problem = MakeRandomProblem(dims, at::kDouble, 3);
  const std::vector<MitaItem> items = SequenceItems(problem.q, {{4, 6}});
  absl::StatusOr<at::Tensor> output = MitaAttentionForward(problem.q, problem.k, problem.v, items);
  ASSERT_TRUE(output.ok()) << output.status();
  const LoopResult expected =
      MitaLoop(problem.q_values, problem.k_values, problem.v_values, dims, ToLoopItems(items));
  EXPECT_LT(MaxAbsDifference(ToDoubles(*output), expected.output), 1e-10);
}

// The CPU kernel computes each (item, head) independently: the thread count cannot change a single bit.
TEST(MitaAttention, CpuKernelIsIndependentOfThreadCount) {
  const Dims dims{2, 3, 300, 16};
  const RandomProblem problem = MakeRandomProblem(dims, at::kFloat, 11);
  const std::vector<MitaItem> items = SequenceItems(problem.q, {{8, 20}, {3, 64}});
  at::set_num_threads(1);
  absl::StatusOr<at::Tensor> one_thread = MitaAttentionForward(problem.q, problem.k, problem.v, items);
  at::set_num_threads(2);
  absl::StatusOr<at::Tensor> two_threads = MitaAttentionForward(problem.q, problem.k, problem.v, items);
  ASSERT_TRUE(one_thread.ok() && two_threads.ok());
  EXPECT_TRUE(one_thread->equal(*two_threads));
}

// Each thread keeps its workspace for its next call (kernels/mita_attention_cpu.cc, ThreadWorkspace): a call after
// calls of other lengths, budgets and paths (one key block, several with compactions, the small-input path) gives
// the same bits as before them. The output's memory is heads-merged, [B, N, H, d].
TEST(MitaAttention, CpuKernelGivesTheSameBitsAfterCallsOfOtherShapes) {
  const RandomProblem problem = MakeRandomProblem(Dims{2, 3, 300, 16}, at::kFloat, 12);
  const std::vector<MitaItem> items = SequenceItems(problem.q, {{8, 20}, {3, 64}});
  absl::StatusOr<at::Tensor> first = MitaAttentionForward(problem.q, problem.k, problem.v, items);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->transpose(1, 2).is_contiguous());
  const RandomProblem longer = MakeRandomProblem(Dims{1, 2, 2000, 16}, at::kFloat, 13);
  const RandomProblem shorter = MakeRandomProblem(Dims{3, 4, 50, 24}, at::kFloat, 14);
  for (const auto& [other, budgets] : {std::pair<const RandomProblem*, std::vector<std::pair<int64_t, int64_t>>>{
                                           &longer, {{32, 128}}},
                                       {&shorter, {{9, 16}, {4, 8}, {16, 50}}}}) {
    ASSERT_TRUE(MitaAttentionForward(other->q, other->k, other->v, SequenceItems(other->q, budgets)).ok());
  }
  absl::StatusOr<at::Tensor> again = MitaAttentionForward(problem.q, problem.k, problem.v, items);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(first->equal(*again));
}

// Works under InferenceMode, and on inputs that require grad (the result carries no autograd history).
TEST(MitaAttention, WorksWithoutAutograd) {
  const Dims dims{1, 2, 10, 4};
  RandomProblem problem = MakeRandomProblem(dims, at::kFloat, 5);
  {
    c10::InferenceMode inference_mode;
    const at::Tensor q = problem.q.clone(), k = problem.k.clone(), v = problem.v.clone();
    absl::StatusOr<at::Tensor> landmarks = ImageLandmarks(q, 3);
    ASSERT_TRUE(landmarks.ok()) << landmarks.status();
    EXPECT_TRUE(MitaAttentionForward(q, k, v, {MitaItem{(*landmarks)[0], 4}}).ok());
    EXPECT_TRUE(FullAttentionForward(q, k, v).ok());
  }
  const at::Tensor q = problem.q.detach().clone().set_requires_grad(true);
  absl::StatusOr<at::Tensor> landmarks = SequenceLandmarks(q, 3);
  ASSERT_TRUE(landmarks.ok()) << landmarks.status();
  EXPECT_FALSE(landmarks->requires_grad());
  absl::StatusOr<at::Tensor> output =
      MitaAttentionForward(q, problem.k, problem.v, {MitaItem{(*landmarks)[0], 4}}, nullptr, MitaBackend::kReference);
  ASSERT_TRUE(output.ok()) << output.status();
  EXPECT_FALSE(output->requires_grad());
}

// Non-finite inputs reach the output but never crash the top-k selection (which needs a total order).
TEST(MitaAttention, NonFiniteInputsDoNotCrash) {
  const Dims dims{1, 2, 300, 8};
  RandomProblem problem = MakeRandomProblem(dims, at::kFloat, 17);
  at::Tensor k = problem.k.clone();
  k.narrow(2, 3, 40).fill_(std::numeric_limits<float>::quiet_NaN());
  k.narrow(2, 100, 5).fill_(std::numeric_limits<float>::infinity());
  k.narrow(2, 200, 5).fill_(-std::numeric_limits<float>::infinity());
  const std::vector<MitaItem> items = SequenceItems(problem.q, {{6, 20}});
  for (MitaBackend backend : {MitaBackend::kAuto, MitaBackend::kReference}) {
    std::vector<MitaItemStatistics> statistics;
    absl::StatusOr<at::Tensor> output = MitaAttentionForward(problem.q, k, problem.v, items, &statistics, backend);
    ASSERT_TRUE(output.ok()) << output.status();
    EXPECT_EQ(output->sizes(), problem.q.sizes());
    ASSERT_EQ(statistics.size(), 1u);
  }
  EXPECT_TRUE(FullAttentionForward(problem.q, k, problem.v).ok());
}

TEST(MitaAttention, EmptyBatchGivesEmptyOutput) {
  const at::Tensor q = at::zeros({0, 2, 5, 4});
  std::vector<MitaItemStatistics> statistics(3);
  absl::StatusOr<at::Tensor> output = MitaAttentionForward(q, q, q, {}, &statistics);
  ASSERT_TRUE(output.ok()) << output.status();
  EXPECT_EQ(output->sizes(), q.sizes());
  EXPECT_TRUE(statistics.empty());
}

// ---------------------------------------------------------------------------------------------------------
// (3) Full attention, and the identity "k = N without the compressed branch = full attention".

TEST(FullAttention, MatchesLoop) {
  for (at::ScalarType type : {at::kDouble, at::kFloat}) {
    const Dims dims{2, 3, 29, 8};
    const RandomProblem problem = MakeRandomProblem(dims, type, 21);
    absl::StatusOr<at::Tensor> output = FullAttentionForward(problem.q, problem.k, problem.v);
    ASSERT_TRUE(output.ok()) << output.status();
    EXPECT_EQ(output->scalar_type(), type);
    EXPECT_LT(MaxAbsDifference(ToDoubles(*output),
                               FullAttentionLoop(problem.q_values, problem.k_values, problem.v_values, dims)),
              type == at::kDouble ? 1e-12 : 1e-5);
  }
}

// Short inputs on the CPU (internal::UsesShortFullAttention): q, k and v read in place from a fused
// [B, N, 3, H, d] qkv projection, several blocks of queries per head, the output in the heads-merged layout, and an
// item whose caller left answered with zero rows; also at the longest input the path takes and one token more.
TEST(FullAttention, ShortInputsReadAFusedQkvInPlaceAndStopTheirItems) {
  for (at::ScalarType type : {at::kDouble, at::kFloat}) {
    const Dims dims{3, 3, 197, 64};
    const RandomProblem problem = MakeRandomProblem(dims, type, 33);
    at::Tensor fused = at::empty({dims.batch, dims.tokens, 3, dims.heads, dims.head_dim}, problem.q.options());
    fused.select(2, 0).copy_(problem.q.transpose(1, 2));
    fused.select(2, 1).copy_(problem.k.transpose(1, 2));
    fused.select(2, 2).copy_(problem.v.transpose(1, 2));
    const at::Tensor q = fused.select(2, 0).transpose(1, 2), k = fused.select(2, 1).transpose(1, 2);
    const at::Tensor v = fused.select(2, 2).transpose(1, 2);
    // The short path needs a BLAS that keeps each block's GEMMs on the calling thread (MKL, as under ctest).
    const bool short_path = BlasLibrary::Get().has_thread_local_threads();
    EXPECT_EQ(internal::UsesShortFullAttention(q), short_path);
    std::vector<int64_t> asked;
    absl::StatusOr<at::Tensor> output = FullAttentionForward(q, k, v, [&](int64_t item) {
      asked.push_back(item);
      return item == 1;
    });
    ASSERT_TRUE(output.ok()) << output.status();
    EXPECT_EQ(asked, (std::vector<int64_t>{0, 1, 2}));
    if (short_path) EXPECT_TRUE(output->transpose(1, 2).is_contiguous()) << "heads merged";
    std::vector<double> expected = FullAttentionLoop(problem.q_values, problem.k_values, problem.v_values, dims);
    const int64_t item_values = dims.heads * dims.tokens * dims.head_dim;
    std::fill(expected.begin() + item_values, expected.begin() + 2 * item_values, 0.0);
    EXPECT_LT(MaxAbsDifference(ToDoubles(*output), expected), type == at::kDouble ? 1e-12 : 1e-5);
  }
  // One token whose row stride is below d (valid for a single row; BLAS takes a leading dimension >= d only).
  const at::Tensor one = at::randn({2, 3, 8}, at::kDouble).as_strided({2, 3, 1, 8}, {24, 8, 1, 1});
  absl::StatusOr<at::Tensor> single = FullAttentionForward(one, one, one);
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_TRUE(single->equal(one)) << "one key: the output is its value";
  for (const int64_t tokens : {internal::kMaxShortFullAttentionTokens, internal::kMaxShortFullAttentionTokens + 1}) {
    const Dims dims{1, 2, tokens, 4};
    const RandomProblem problem = MakeRandomProblem(dims, at::kDouble, 35);
    EXPECT_EQ(internal::UsesShortFullAttention(problem.q),
              tokens <= internal::kMaxShortFullAttentionTokens && BlasLibrary::Get().has_thread_local_threads());
    absl::StatusOr<at::Tensor> output = FullAttentionForward(problem.q, problem.k, problem.v);
    ASSERT_TRUE(output.ok()) << output.status();
    EXPECT_LT(MaxAbsDifference(ToDoubles(*output),
                               FullAttentionLoop(problem.q_values, problem.k_values, problem.v_values, dims)),
              1e-12)
        << tokens << " tokens";
  }
}

// On the CPU a bfloat16 batch (float32 and float64 inputs of up to kMaxShortFullAttentionTokens take the short
// path) whose scores pass 2^24 runs the fused kernel in groups of items (here 3 groups of 3: each item has
// 4 x 1100^2 scores), each item's interrupt asked before its group.
TEST(FullAttention, GroupsOfItemsMatchLoopAndStopTheirItems) {
  const Dims dims{9, 4, 1100, 4};
  const RandomProblem problem = MakeRandomProblem(dims, at::kFloat, 23);
  const at::Tensor q = problem.q.to(at::kBFloat16), k = problem.k.to(at::kBFloat16), v = problem.v.to(at::kBFloat16);
  ASSERT_FALSE(internal::UsesShortFullAttention(q));
  std::vector<int64_t> asked;
  absl::StatusOr<at::Tensor> output = FullAttentionForward(q, k, v, [&](int64_t item) {
    asked.push_back(item);
    return item == 4;
  });
  ASSERT_TRUE(output.ok()) << output.status();
  EXPECT_EQ(asked, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_TRUE(output->is_contiguous());
  std::vector<double> expected = FullAttentionLoop(ToDoubles(q), ToDoubles(k), ToDoubles(v), dims);
  const int64_t item_values = dims.heads * dims.tokens * dims.head_dim;
  std::fill(expected.begin() + 4 * item_values, expected.begin() + 5 * item_values, 0.0);
  const std::vector<double> actual = ToDoubles(*output);
  EXPECT_LT(MaxAbsDifference(actual, expected), 2e-2);
  EXPECT_TRUE(std::all_of(actual.begin() + 4 * item_values, actual.begin() + 5 * item_values,
                          [](double value) { return value == 0.0; }));
}

// An item of more than 2^24 scores runs in chunks of its queries (here 4,200 tokens, 1 head: chunks of 3,994
// queries), its interrupt asked before each: stopped after the first, the rest of its rows are 0.
TEST(FullAttention, LongItemsRunInQueryChunksAndStopBetweenThem) {
  const Dims dims{2, 1, 4200, 4};
  const RandomProblem problem = MakeRandomProblem(dims, at::kDouble, 27);
  const std::vector<double> expected = FullAttentionLoop(problem.q_values, problem.k_values, problem.v_values, dims);
  absl::StatusOr<at::Tensor> output = FullAttentionForward(problem.q, problem.k, problem.v);
  ASSERT_TRUE(output.ok()) << output.status();
  EXPECT_LT(MaxAbsDifference(ToDoubles(*output), expected), 1e-12);
  std::vector<int64_t> asked;
  output = FullAttentionForward(problem.q, problem.k, problem.v, [&](int64_t item) {
    asked.push_back(item);
    return item == 1 && asked.size() == 4;  // item 1's second chunk
  });
  ASSERT_TRUE(output.ok()) << output.status();
  EXPECT_EQ(asked, (std::vector<int64_t>{0, 0, 1, 1}));
  std::vector<double> stopped = expected;
  const int64_t item_values = dims.tokens * dims.head_dim, first_chunk = (int64_t{1} << 24) / dims.tokens;
  std::fill(stopped.begin() + item_values + first_chunk * dims.head_dim, stopped.end(), 0.0);
  EXPECT_LT(MaxAbsDifference(ToDoubles(*output), stopped), 1e-12);
}

// bfloat16 on the CPU: the MiTA kernel is the float32 kernel on the widened inputs, rounded once; full attention
// is LibTorch's bfloat16 attention, close to float32's.
TEST(MitaAttention, Bfloat16OnTheCpuIsTheFloat32KernelOnWidenedInputs) {
  const Dims dims{2, 3, 197, 16};
  const RandomProblem problem = MakeRandomProblem(dims, at::kFloat, 29);
  const at::Tensor q = problem.q.to(at::kBFloat16), k = problem.k.to(at::kBFloat16), v = problem.v.to(at::kBFloat16);
  const std::vector<MitaItem> items = SequenceItems(q, {{9, 16}, {25, 64}});
  std::vector<MitaItem> widened = items;
  for (MitaItem& item : widened) item.landmarks = item.landmarks.to(at::kFloat);
  std::vector<MitaItemStatistics> statistics, widened_statistics;
  absl::StatusOr<at::Tensor> output = MitaAttentionForward(q, k, v, items, &statistics);
  absl::StatusOr<at::Tensor> expected = MitaAttentionForward(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat),
                                                             widened, &widened_statistics);
  ASSERT_TRUE(output.ok()) << output.status();
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(output->scalar_type(), at::kBFloat16);
  EXPECT_TRUE(output->equal(expected->to(at::kBFloat16)));
  ASSERT_EQ(statistics.size(), 2u);
  EXPECT_EQ(statistics[1].queries_per_expert, widened_statistics[1].queries_per_expert);
  absl::StatusOr<at::Tensor> full = FullAttentionForward(q, k, v);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->scalar_type(), at::kBFloat16);
  EXPECT_LT(MaxAbsDifference(ToDoubles(*full), FullAttentionLoop(ToDoubles(q), ToDoubles(k), ToDoubles(v), dims)),
            2e-2);
}

TEST(FullAttention, WidthEqualsTokensWithoutCompressedBranchIsFullAttention) {
  const Dims dims{2, 2, 300, 8};  // more than one key block
  const RandomProblem problem = MakeRandomProblem(dims, at::kDouble, 31);
  const std::vector<MitaItem> items = SequenceItems(problem.q, {{5, 300}, {1, 300}});
  absl::StatusOr<at::Tensor> full = FullAttentionForward(problem.q, problem.k, problem.v);
  ASSERT_TRUE(full.ok());
  const std::vector<double> full_values = ToDoubles(*full);
  EXPECT_LT(MaxAbsDifference(full_values,
                             FullAttentionLoop(problem.q_values, problem.k_values, problem.v_values, dims)),
            1e-12);
  for (MitaBackend backend : {MitaBackend::kAuto, MitaBackend::kReference}) {
    SCOPED_TRACE(BackendName(backend));
    const BackendRun run = RunBackend(problem.q, problem.k, problem.v, items, backend, /*include_shared_expert=*/false);
    ASSERT_TRUE(run.output.defined());
    EXPECT_LT(MaxAbsDifference(ToDoubles(run.output), full_values), 1e-12);
    // With the compressed branch (the public API), k = N is not full attention.
    absl::StatusOr<at::Tensor> with_shared = MitaAttentionForward(problem.q, problem.k, problem.v, items, nullptr,
                                                                  backend);
    ASSERT_TRUE(with_shared.ok());
    EXPECT_GT(MaxAbsDifference(ToDoubles(*with_shared), full_values), 1e-4);
  }
}

TEST(MitaAttention, WithoutCompressedBranchMatchesLoop) {
  const Dims dims{2, 2, 31, 8};
  const RandomProblem problem = MakeRandomProblem(dims, at::kDouble, 41);
  const std::vector<MitaItem> items = SequenceItems(problem.q, {{4, 5}, {2, 12}});
  const LoopResult expected = MitaLoop(problem.q_values, problem.k_values, problem.v_values, dims,
                                       ToLoopItems(items), /*include_shared_expert=*/false);
  for (MitaBackend backend : {MitaBackend::kAuto, MitaBackend::kReference}) {
    SCOPED_TRACE(BackendName(backend));
    const BackendRun run = RunBackend(problem.q, problem.k, problem.v, items, backend, false);
    ASSERT_TRUE(run.output.defined());
    EXPECT_LT(MaxAbsDifference(ToDoubles(run.output), expected.output), 1e-10);
  }
}

// ---------------------------------------------------------------------------------------------------------
// (4) Ties. Small integer values make every dot product exact in any summation order, so ties are exact in
// every implementation.

TEST(MitaTies, EqualScoresPreferLowerKeyIndexAndFirstExpert) {
  const int64_t tokens = 10, d = 4;
  // Key j = (a_j, 1, 0, 0): landmark (1, 0, 0, 0) scores a_j. Keys 2, 5 and 7 tie at the top (5), keys 4 and
  // 9 tie next (3), then key 3 (2).
  const std::vector<double> first_channel = {0, 1, 5, 2, 3, 5, 1, 5, 0, 3};
  std::vector<double> keys(tokens * d, 0.0), queries(tokens * d, 0.0), values(tokens * d, 0.0);
  for (int64_t j = 0; j < tokens; ++j) {
    keys[j * d] = first_channel[j];
    keys[j * d + 1] = 1;
    queries[j * d + j % d] = 1 + j;  // arbitrary queries
    values[j * d + (j + 1) % d] = j;
  }
  // Landmarks: 0 = (1, 0, 0, 0), 1 = a duplicate of 0 (so its gate always ties with 0), 2 = (0, 0, 0, 1).
  const std::vector<double> landmarks = {1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1};
  const Dims dims{1, 1, tokens, d};
  for (at::ScalarType type : {at::kFloat, at::kDouble}) {
    const at::Tensor q = MakeTensor(queries, {1, 1, tokens, d}, type);
    const at::Tensor k = MakeTensor(keys, {1, 1, tokens, d}, type);
    const at::Tensor v = MakeTensor(values, {1, 1, tokens, d}, type);
    for (int64_t width : {2, 4, 6}) {
      const std::vector<MitaItem> items = {MitaItem{MakeTensor(landmarks, {1, 3, d}, type), width}};
      const LoopResult expected = MitaLoop(queries, keys, values, dims, ToLoopItems(items));
      // The rule spelled out: width 2 -> the two lowest of the tied top keys {2, 5, 7}; width 4 -> all three
      // plus the lower of the tied next keys {4, 9}; width 6 -> both of those.
      const std::vector<std::vector<int64_t>> expected_top = {{2, 5}, {2, 4, 5, 7}, {2, 4, 5, 7, 9, 3}};
      std::vector<int64_t> top = expected_top[width / 2 - 1];
      std::sort(top.begin(), top.end());
      ASSERT_EQ(expected.routing[0].expert_keys[0], top) << "the test's own loop, width " << width;
      // Landmark 2 scores 0 for every key: all tie, so it owns keys 0 .. width-1.
      std::vector<int64_t> first_keys(width);
      std::iota(first_keys.begin(), first_keys.end(), 0);
      ASSERT_EQ(expected.routing[0].expert_keys[2], first_keys);
      for (MitaBackend backend : {MitaBackend::kAuto, MitaBackend::kReference}) {
        SCOPED_TRACE(std::string(BackendName(backend)) + " width " + std::to_string(width));
        const BackendRun run = RunBackend(q, k, v, items, backend);
        ASSERT_EQ(run.routing.size(), 1u);
        EXPECT_EQ(run.routing[0].expert_keys, expected.routing[0].expert_keys);
        EXPECT_EQ(run.routing[0].expert_of_query, expected.routing[0].expert_of_query);
        // Expert 1 duplicates expert 0: the first maximum wins, so it never receives a query.
        EXPECT_EQ(std::count(run.routing[0].expert_of_query.begin(), run.routing[0].expert_of_query.end(), 1), 0);
        EXPECT_EQ(run.statistics[0].queries_per_expert[1], 0.0);
        EXPECT_LT(MaxAbsDifference(ToDoubles(run.output), expected.output), 1e-5);
      }
    }
  }
}

// All-zero landmarks: every score and every gate value ties. Expert i owns keys 0 .. k-1 and every query goes
// to expert 0; the statistics follow in closed form.
TEST(MitaTies, AllTiedRouting) {
  const Dims dims{1, 2, 12, 4};
  const int64_t experts = 3, width = 5;
  const RandomProblem problem = MakeRandomProblem(dims, at::kFloat, 51);
  const std::vector<MitaItem> items = {MitaItem{at::zeros({2, experts, 4}), width}};
  for (MitaBackend backend : {MitaBackend::kAuto, MitaBackend::kReference}) {
    SCOPED_TRACE(BackendName(backend));
    const BackendRun run = RunBackend(problem.q, problem.k, problem.v, items, backend);
    for (const internal::MitaHeadRouting& routing : run.routing) {
      EXPECT_EQ(routing.expert_of_query, std::vector<int64_t>(12, 0));
      for (const std::vector<int64_t>& keys : routing.expert_keys) {
        EXPECT_EQ(keys, (std::vector<int64_t>{0, 1, 2, 3, 4}));
      }
    }
    const MitaItemStatistics& statistics = run.statistics[0];
    EXPECT_EQ(statistics.queries_per_expert, (std::vector<double>{12, 0, 0}));
    EXPECT_DOUBLE_EQ(statistics.load_imbalance, 3.0);
    EXPECT_DOUBLE_EQ(statistics.routing_entropy, 0.0);
    EXPECT_DOUBLE_EQ(statistics.pruned_key_fraction, 7.0 / 12);
    EXPECT_DOUBLE_EQ(statistics.expert_overlap_fraction, 5.0 / 12);
  }
}

// Small random integers: scores collide all the time, across the kernel's key blocks and top-k compactions.
TEST(MitaTies, ManyTiesAcrossKeyBlocks) {
  const Dims dims{1, 2, 700, 4};
  std::mt19937_64 generator(81);
  std::uniform_int_distribution<int> small_integer(-2, 2);
  auto random_integers = [&](int64_t count) {
    std::vector<double> values(count);
    for (double& value : values) value = small_integer(generator);
    return values;
  };
  const int64_t size = dims.batch * dims.heads * dims.tokens * dims.head_dim;
  const std::vector<double> queries = random_integers(size), keys = random_integers(size);
  const std::vector<double> values = RandomNormal(size, 82), landmarks = random_integers(2 * 6 * 4);
  for (at::ScalarType type : {at::kFloat, at::kDouble}) {
    const std::vector<int64_t> shape = {1, 2, 700, 4};
    const at::Tensor q = MakeTensor(queries, shape, type), k = MakeTensor(keys, shape, type);
    const at::Tensor v = MakeTensor(values, shape, type);
    const std::vector<double> v_values = ToDoubles(v);
    for (int64_t width : {1, 37, 350, 699}) {
      const std::vector<MitaItem> items = {MitaItem{MakeTensor(landmarks, {2, 6, 4}, type), width}};
      const LoopResult expected = MitaLoop(queries, keys, v_values, dims, ToLoopItems(items));
      for (MitaBackend backend : {MitaBackend::kAuto, MitaBackend::kReference}) {
        SCOPED_TRACE(std::string(BackendName(backend)) + " width " + std::to_string(width));
        const BackendRun run = RunBackend(q, k, v, items, backend);
        ExpectRoutingEqual(run.routing, expected.routing, BackendName(backend));
        EXPECT_LT(MaxAbsDifference(ToDoubles(run.output), expected.output), 1e-5);
        ExpectStatisticsNear(run.statistics, expected.statistics, BackendName(backend));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// (5) Landmarks against hand loops.

// Window i of an adaptive pool of `size` inputs into `outputs` windows: [floor(i*size/outputs),
// ceil((i+1)*size/outputs)).
std::pair<int64_t, int64_t> Window(int64_t i, int64_t size, int64_t outputs) {
  return {i * size / outputs, ((i + 1) * size + outputs - 1) / outputs};
}

TEST(Landmarks, ImageLandmarksMatchHandLoopWithOneTokenShift) {
  const int64_t side = 7, tokens = side * side + 1, d = 3, batch = 2, heads = 2;
  const std::vector<double> values = RandomNormal(batch * heads * tokens * d, 61);
  const at::Tensor q = MakeTensor(values, {batch, heads, tokens, d}, at::kDouble);
  for (int64_t pool : {1, 3, 4, 7}) {  // 4 on 7 has overlapping windows: [0,2) [1,4) [3,6) [5,7)
    SCOPED_TRACE("pool side " + std::to_string(pool));
    absl::StatusOr<at::Tensor> landmarks = ImageLandmarks(q, pool);
    ASSERT_TRUE(landmarks.ok()) << landmarks.status();
    ASSERT_EQ(landmarks->sizes(), (std::vector<int64_t>{batch, heads, pool * pool, d}));
    std::vector<double> expected;
    for (int64_t head = 0; head < batch * heads; ++head) {
      for (int64_t row = 0; row < pool; ++row) {
        for (int64_t column = 0; column < pool; ++column) {
          const auto [row_begin, row_end] = Window(row, side, pool);
          const auto [column_begin, column_end] = Window(column, side, pool);
          for (int64_t c = 0; c < d; ++c) {
            double sum = 0;
            for (int64_t y = row_begin; y < row_end; ++y) {
              for (int64_t x = column_begin; x < column_end; ++x) {
                const int64_t token = y * side + x;  // tokens 0 .. N-2: cls first, last patch dropped
                sum += values[(head * tokens + token) * d + c];
              }
            }
            expected.push_back(sum / static_cast<double>((row_end - row_begin) * (column_end - column_begin)));
          }
        }
      }
    }
    EXPECT_LT(MaxAbsDifference(ToDoubles(*landmarks), expected), 1e-12);
  }
  EXPECT_EQ(Window(1, 7, 4), std::make_pair(int64_t{1}, int64_t{4}));  // the windows really overlap

  // The last patch token has no influence; the cls token (token 0) has.
  absl::StatusOr<at::Tensor> base = ImageLandmarks(q, 3);
  at::Tensor changed_last = q.clone();
  changed_last.narrow(2, tokens - 1, 1).fill_(100.0);
  absl::StatusOr<at::Tensor> after_last = ImageLandmarks(changed_last, 3);
  at::Tensor changed_cls = q.clone();
  changed_cls.narrow(2, 0, 1).fill_(100.0);
  absl::StatusOr<at::Tensor> after_cls = ImageLandmarks(changed_cls, 3);
  ASSERT_TRUE(base.ok() && after_last.ok() && after_cls.ok());
  EXPECT_TRUE(after_last->equal(*base));
  EXPECT_GT(MaxAbsDifference(ToDoubles(*after_cls), ToDoubles(*base)), 1.0);
}

// The CPU path reads q's rows in place; LibTorch's adaptive_avg_pool1d on the transposed view (the path it replaced,
// and the PyTorch twin's) gives the same landmarks bit for bit, at the models' strided layout (a view of the fused
// qkv output), uneven overlapping windows included.
TEST(Landmarks, SequenceLandmarksOnTheCpuEqualLibTorchsPoolingBitForBit) {
  const int64_t heads = 2, d = 32;
  for (const at::ScalarType type : {at::kFloat, at::kDouble}) {
    for (const int64_t tokens : {int64_t{16384}, int64_t{1000}}) {
      const at::Tensor qkv = at::randn({tokens, 3 * heads * d}).to(type);
      const at::Tensor q = qkv.view({1, tokens, 3, heads, d}).permute({2, 0, 3, 1, 4})[0];  // [1, H, N, d]
      for (const int64_t experts : {int64_t{1}, int64_t{8}, int64_t{37}, int64_t{256}, tokens}) {
        SCOPED_TRACE(std::to_string(tokens) + " tokens, " + std::to_string(experts) + " experts");
        absl::StatusOr<at::Tensor> landmarks = SequenceLandmarks(q, experts);
        ASSERT_TRUE(landmarks.ok()) << landmarks.status();
        const at::Tensor expected = at::adaptive_avg_pool1d(q.reshape({heads, tokens, d}).transpose(1, 2), {experts})
                                        .transpose(1, 2)
                                        .reshape({1, heads, experts, d});
        EXPECT_TRUE(landmarks->equal(expected)) << MaxAbsDifference(ToDoubles(*landmarks), ToDoubles(expected));
      }
    }
  }
}

// The same for image landmarks: LibTorch's adaptive_avg_pool2d on the grid (the path it replaced, and the twin's).
TEST(Landmarks, ImageLandmarksOnTheCpuEqualLibTorchsPoolingBitForBit) {
  const int64_t heads = 3, d = 32, batch = 2;
  for (const at::ScalarType type : {at::kFloat, at::kDouble}) {
    for (const int64_t side : {int64_t{7}, int64_t{14}, int64_t{56}}) {
      const int64_t tokens = side * side + 1;
      const at::Tensor qkv = at::randn({batch, tokens, 3 * heads * d}).to(type);
      const at::Tensor q = qkv.view({batch, tokens, 3, heads, d}).permute({2, 0, 3, 1, 4})[0];  // [B, H, N, d]
      for (const int64_t pool : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{5}, int64_t{7}, side}) {
        SCOPED_TRACE(std::to_string(tokens) + " tokens, pool side " + std::to_string(pool));
        absl::StatusOr<at::Tensor> landmarks = ImageLandmarks(q, pool);
        ASSERT_TRUE(landmarks.ok()) << landmarks.status();
        const at::Tensor grid = q.narrow(2, 0, tokens - 1).reshape({batch * heads, side, side, d});
        const at::Tensor expected = at::adaptive_avg_pool2d(grid.permute({0, 3, 1, 2}), {pool, pool})
                                        .permute({0, 2, 3, 1})
                                        .reshape({batch, heads, pool * pool, d});
        EXPECT_TRUE(landmarks->equal(expected)) << MaxAbsDifference(ToDoubles(*landmarks), ToDoubles(expected));
      }
    }
  }
}

TEST(Landmarks, SequenceLandmarksMatchHandLoop) {
  const int64_t tokens = 10, d = 3, batch = 2, heads = 3;
  const std::vector<double> values = RandomNormal(batch * heads * tokens * d, 71);
  const at::Tensor q = MakeTensor(values, {batch, heads, tokens, d}, at::kFloat);
  const std::vector<double> q_values = ToDoubles(q);
  for (int64_t experts : {1, 3, 4, 7, 10}) {  // 4 and 7 on 10 tokens: uneven, overlapping windows
    SCOPED_TRACE("expert count " + std::to_string(experts));
    absl::StatusOr<at::Tensor> landmarks = SequenceLandmarks(q.transpose(2, 3).contiguous().transpose(2, 3),
                                                             experts);
    ASSERT_TRUE(landmarks.ok()) << landmarks.status();
    ASSERT_EQ(landmarks->sizes(), (std::vector<int64_t>{batch, heads, experts, d}));
    std::vector<double> expected;
    for (int64_t head = 0; head < batch * heads; ++head) {
      for (int64_t i = 0; i < experts; ++i) {
        const auto [begin, end] = Window(i, tokens, experts);
        for (int64_t c = 0; c < d; ++c) {
          double sum = 0;
          for (int64_t n = begin; n < end; ++n) sum += q_values[(head * tokens + n) * d + c];
          expected.push_back(sum / static_cast<double>(end - begin));
        }
      }
    }
    EXPECT_LT(MaxAbsDifference(ToDoubles(*landmarks), expected), 1e-5);
  }
}

// ---------------------------------------------------------------------------------------------------------
// (7) The fast CPU kernel equals the reference kernel: same selected keys and experts, outputs within 1e-5,
// equal statistics, on seeded random float32 shapes (at::manual_seed).

struct KernelCase {
  std::string name;
  int64_t heads, tokens, head_dim;
  // Per item: expert count M, expert width k, token count (0 = all N).
  std::vector<std::array<int64_t, 3>> items;
  bool small_integers;  // q, k from {-2..2}: exact score and gate ties in any summation order
};

void PrintTo(const KernelCase& test_case, std::ostream* stream) { *stream << test_case.name; }

class FastKernelTest : public ::testing::TestWithParam<KernelCase> {};

TEST_P(FastKernelTest, EqualsReference) {
  at::set_num_threads(2);
  const KernelCase& test_case = GetParam();
  at::manual_seed(static_cast<uint64_t>(std::hash<std::string>{}(test_case.name) % 100000));
  const int64_t batch = static_cast<int64_t>(test_case.items.size());
  const std::vector<int64_t> shape = {batch, test_case.heads, test_case.tokens, test_case.head_dim};
  const at::Tensor q = test_case.small_integers ? at::randint(-2, 3, shape, at::kFloat) : at::randn(shape);
  const at::Tensor k = test_case.small_integers ? at::randint(-2, 3, shape, at::kFloat) : at::randn(shape);
  const at::Tensor v = at::randn(shape);
  std::vector<MitaItem> items;
  for (int64_t b = 0; b < batch; ++b) {
    const auto [expert_count, width, token_count] = test_case.items[b];
    const int64_t item_tokens = token_count == 0 ? test_case.tokens : token_count;
    // Landmarks pooled from the item's own tokens; with integer inputs, window sums (integers: ties stay exact).
    absl::StatusOr<at::Tensor> pooled = SequenceLandmarks(q.narrow(0, b, 1).narrow(2, 0, item_tokens), expert_count);
    ASSERT_TRUE(pooled.ok()) << pooled.status();
    at::Tensor landmarks = (*pooled)[0];
    if (test_case.small_integers) landmarks = landmarks.mul(3).round();
    items.push_back(MitaItem{landmarks, width, token_count});
  }
  const BackendRun fast = RunBackend(q, k, v, items, MitaBackend::kAuto);
  const BackendRun reference = RunBackend(q, k, v, items, MitaBackend::kReference);
  ASSERT_TRUE(fast.output.defined() && reference.output.defined());
  ExpectRoutingEqual(fast.routing, reference.routing, "cpu kernel vs reference");
  EXPECT_LT(MaxAbsDifference(ToDoubles(fast.output), ToDoubles(reference.output)), 1e-5);
  ExpectStatisticsNear(fast.statistics, reference.statistics, "cpu kernel vs reference");
  // Padding rows of shorter items are exactly 0 in both.
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t token_count = test_case.items[b][2];
    if (token_count == 0) continue;
    EXPECT_EQ(fast.output[b].narrow(1, token_count, test_case.tokens - token_count).abs().max().item<float>(), 0.0f);
    EXPECT_EQ(reference.output[b].narrow(1, token_count, test_case.tokens - token_count).abs().max().item<float>(),
              0.0f);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FastKernelTest,
    ::testing::Values(KernelCase{"OddTokens", 3, 37, 8, {{5, 7, 0}, {3, 11, 0}}, false},
                      KernelCase{"TokensNotDivisibleByExperts", 2, 1001, 32, {{7, 64, 0}}, false},
                      KernelCase{"WidthEqualsTokens", 2, 513, 16, {{9, 513, 0}}, false},
                      KernelCase{"SingleExpert", 2, 300, 16, {{1, 40, 0}, {1, 300, 0}}, false},
                      KernelCase{"SingleToken", 2, 1, 8, {{1, 1, 0}}, false},
                      KernelCase{"ExactTies", 2, 900, 4, {{6, 37, 0}, {16, 450, 0}}, true},
                      KernelCase{"ItemsWithDifferentTokensExpertsAndWidths", 2, 700, 16,
                                 {{16, 64, 0}, {3, 5, 101}, {1, 29, 29}, {64, 1, 333}}, false},
                      KernelCase{"Larger", 4, 4096, 64, {{64, 64, 0}}, false}),
    [](const ::testing::TestParamInfo<KernelCase>& info) { return info.param.name; });

// An item with token_count N_b < N is exactly the item's first N_b tokens run alone (and both match the loop).
TEST(MitaAttention, ShorterItemEqualsItsOwnCallAndLoop) {
  const Dims dims{2, 2, 61, 8};
  const RandomProblem problem = MakeRandomProblem(dims, at::kDouble, 91);
  std::vector<MitaItem> items = SequenceItems(problem.q, {{4, 9}, {3, 6}});
  items[1].token_count = 40;
  items[1].landmarks = (*SequenceLandmarks(problem.q.narrow(0, 1, 1).narrow(2, 0, 40), 3))[0];
  const LoopResult expected =
      MitaLoop(problem.q_values, problem.k_values, problem.v_values, dims, ToLoopItems(items));
  for (MitaBackend backend : {MitaBackend::kAuto, MitaBackend::kReference}) {
    SCOPED_TRACE(BackendName(backend));
    const BackendRun run = RunBackend(problem.q, problem.k, problem.v, items, backend);
    ASSERT_TRUE(run.output.defined());
    EXPECT_LT(MaxAbsDifference(ToDoubles(run.output), expected.output), 1e-10);
    ExpectStatisticsNear(run.statistics, expected.statistics, BackendName(backend));
    ASSERT_EQ(run.routing[2].expert_of_query.size(), 40u);
    auto alone = [&](const at::Tensor& x) { return x.narrow(0, 1, 1).narrow(2, 0, 40); };
    absl::StatusOr<at::Tensor> own = MitaAttentionForward(alone(problem.q), alone(problem.k), alone(problem.v),
                                                          {MitaItem{items[1].landmarks, 6}}, nullptr, backend);
    ASSERT_TRUE(own.ok()) << own.status();
    EXPECT_LT(MaxAbsDifference(ToDoubles(run.output.narrow(0, 1, 1).narrow(2, 0, 40)), ToDoubles(*own)), 1e-12);
  }
}

// On a CUDA device (a LibTorch with CUDA and a GPU: scripts/gpu_check.sh), kAuto runs the CUDA kernel; it must
// equal the CPU kernel (float32) and stay close in bfloat16. Skipped where LibTorch has no CUDA (Debian's).
TEST(MitaCuda, CudaKernelMatchesCpuKernel) {
  if (!at::hasCUDA()) GTEST_SKIP() << "LibTorch has no CUDA device here";
  at::manual_seed(2024);
  const std::vector<int64_t> shape = {3, 4, 1537, 64};
  const at::Tensor q = at::randn(shape), k = at::randn(shape), v = at::randn(shape);
  std::vector<MitaItem> items;
  const std::vector<std::array<int64_t, 3>> budgets = {{16, 64, 0}, {64, 17, 1000}, {1, 1537, 0}};
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t item_tokens = budgets[b][2] == 0 ? 1537 : budgets[b][2];
    items.push_back(MitaItem{(*SequenceLandmarks(q.narrow(0, b, 1).narrow(2, 0, item_tokens), budgets[b][0]))[0],
                             budgets[b][1], budgets[b][2]});
  }
  std::vector<MitaItemStatistics> cpu_statistics;
  absl::StatusOr<at::Tensor> cpu = MitaAttentionForward(q, k, v, items, &cpu_statistics);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  for (at::ScalarType type : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(type == at::kFloat ? "float32" : "bfloat16");
    const at::Device device(at::kCUDA, 0);
    std::vector<MitaItem> device_items = items;
    for (MitaItem& item : device_items) item.landmarks = item.landmarks.to(device, type);
    std::vector<MitaItemStatistics> statistics;
    absl::StatusOr<at::Tensor> output =
        MitaAttentionForward(q.to(device, type), k.to(device, type), v.to(device, type), device_items, &statistics);
    ASSERT_TRUE(output.ok()) << output.status();
    EXPECT_EQ(output->scalar_type(), type);
    if (type == at::kFloat) {
      EXPECT_LT(MaxAbsDifference(ToDoubles(output->cpu()), ToDoubles(*cpu)), 1e-4);
      ExpectStatisticsNear(statistics, cpu_statistics, "cuda vs cpu");
    } else {
      // bfloat16 inputs change the routing of near-ties: compare the bulk, not every element.
      const at::Tensor difference = output->cpu().to(at::kFloat).sub(*cpu).abs();
      EXPECT_LT(difference.mean().item<float>(), 2e-2);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// (6) Every invalid argument is INVALID_ARGUMENT, without a crash.

void ExpectInvalid(const absl::Status& status, const std::string& message_part) {
  test_util::ExpectStatus(status, absl::StatusCode::kInvalidArgument, message_part);
}

TEST(Validation, MitaAttentionRejectsEveryInvalidArgument) {
  const int64_t heads = 2, tokens = 9, d = 4;
  const at::Tensor q = at::zeros({2, heads, tokens, d});
  const at::Tensor landmarks = at::zeros({heads, 3, d});
  const std::vector<MitaItem> good = {MitaItem{landmarks, 4}, MitaItem{landmarks, 4}};
  ASSERT_TRUE(MitaAttentionForward(q, q, q, good).ok());
  auto forward = [&](const at::Tensor& q_arg, const at::Tensor& k_arg, const at::Tensor& v_arg,
                     const std::vector<MitaItem>& items) {
    std::vector<absl::Status> statuses;
    for (MitaBackend backend : {MitaBackend::kAuto, MitaBackend::kReference}) {
      std::vector<MitaItemStatistics> statistics;
      statuses.push_back(MitaAttentionForward(q_arg, k_arg, v_arg, items, &statistics, backend).status());
    }
    EXPECT_EQ(statuses[0], statuses[1]);
    return statuses[0];
  };
  auto with_item = [&](int64_t b, MitaItem item) {
    std::vector<MitaItem> items = good;
    items[b] = std::move(item);
    return items;
  };
  ExpectInvalid(forward(at::Tensor(), q, q, good), "q is undefined");
  ExpectInvalid(forward(q[0], q[0], q[0], good), "q must be a 4-D tensor [B, H, N, d], got 3-D");
  ExpectInvalid(forward(q, q.narrow(2, 0, 8), q, good), "k shape [2, 2, 8, 4] differs from q shape [2, 2, 9, 4]");
  ExpectInvalid(forward(q, q, q.narrow(3, 0, 3), good), "v shape");
  ExpectInvalid(forward(q.to(at::kHalf), q.to(at::kHalf), q.to(at::kHalf), good), "q has dtype float16");
  ExpectInvalid(forward(q.to(at::kLong), q.to(at::kLong), q.to(at::kLong), good), "supported dtypes");
  ExpectInvalid(forward(q, q.to(at::kDouble), q, good), "k dtype float64 differs from q dtype float32");
  ExpectInvalid(forward(q, q, q, {good[0]}), "items.size() 1 differs from the batch size B = 2");
  ExpectInvalid(forward(q, q, q, with_item(1, MitaItem{landmarks, 0})), "items[1].expert_width 0 is outside [1, 9]");
  ExpectInvalid(forward(q, q, q, with_item(0, MitaItem{landmarks, 10})), "items[0].expert_width 10 is outside");
  ExpectInvalid(forward(q, q, q, with_item(0, MitaItem{landmarks, -3})), "items[0].expert_width -3");
  ExpectInvalid(forward(q, q, q, with_item(1, MitaItem{landmarks, 4, 10})),
                "items[1].token_count 10 is outside [0, 9]");
  ExpectInvalid(forward(q, q, q, with_item(1, MitaItem{landmarks, 4, -1})), "items[1].token_count -1");
  ExpectInvalid(forward(q, q, q, with_item(0, MitaItem{landmarks, 5, 4})), "items[0].expert_width 5 is outside [1, 4]");
  ExpectInvalid(forward(q, q, q, with_item(1, MitaItem{at::Tensor(), 4})), "items[1].landmarks is undefined");
  ExpectInvalid(forward(q, q, q, with_item(1, MitaItem{at::zeros({3, d}), 4})),
                "items[1].landmarks must have shape [H, M, d] = [2, M >= 1, 4], got [3, 4]");
  ExpectInvalid(forward(q, q, q, with_item(0, MitaItem{at::zeros({heads, 0, d}), 4})), "M >= 1");
  ExpectInvalid(forward(q, q, q, with_item(0, MitaItem{at::zeros({heads + 1, 3, d}), 4})), "items[0].landmarks");
  ExpectInvalid(forward(q, q, q, with_item(0, MitaItem{at::zeros({heads, 3, d + 1}), 4})), "items[0].landmarks");
  ExpectInvalid(forward(q, q, q, with_item(0, MitaItem{landmarks.to(at::kDouble), 4})),
                "items[0].landmarks dtype float64 differs");
  ExpectInvalid(forward(at::zeros({1, heads, 0, d}), at::zeros({1, heads, 0, d}), at::zeros({1, heads, 0, d}),
                        {MitaItem{landmarks, 1}}),
                "N = 0");
  ExpectInvalid(forward(at::zeros({1, 0, tokens, d}), at::zeros({1, 0, tokens, d}), at::zeros({1, 0, tokens, d}),
                        {MitaItem{at::zeros({0, 3, d}), 1}}),
                "H = 0");
}

TEST(Validation, FullAttentionAndLandmarksRejectInvalidArguments) {
  const at::Tensor q = at::zeros({1, 2, 10, 4});  // N - 1 = 9 = 3 x 3
  ExpectInvalid(FullAttentionForward(q, q.narrow(2, 0, 5), q).status(), "k shape");
  ExpectInvalid(FullAttentionForward(q, q, q.to(at::kDouble)).status(), "v dtype");
  ExpectInvalid(FullAttentionForward(q[0], q[0], q[0]).status(), "4-D");
  ExpectInvalid(FullAttentionForward(q.to(at::kInt), q.to(at::kInt), q.to(at::kInt)).status(), "supported dtypes");

  ExpectInvalid(ImageLandmarks(at::zeros({1, 2, 11, 4}), 2).status(), "perfect square");
  ExpectInvalid(ImageLandmarks(at::zeros({1, 2, 1, 4}), 1).status(), "perfect square");
  ExpectInvalid(ImageLandmarks(q, 0).status(), "pool_side 0 is outside [1, 3]");
  ExpectInvalid(ImageLandmarks(q, 4).status(), "pool_side 4 is outside [1, 3]");
  ExpectInvalid(ImageLandmarks(q[0], 2).status(), "4-D");
  ExpectInvalid(ImageLandmarks(at::Tensor(), 2).status(), "undefined");
  ExpectInvalid(ImageLandmarks(q.to(at::kLong), 2).status(), "supported dtypes");

  ExpectInvalid(SequenceLandmarks(q, 0).status(), "expert_count 0 is outside [1, 10]");
  ExpectInvalid(SequenceLandmarks(q, 11).status(), "expert_count 11 is outside [1, 10]");
  ExpectInvalid(SequenceLandmarks(q[0][0], 2).status(), "4-D");
}

// ---------------------------------------------------------------------------------------------------------
// (8) Exceptions ATen throws become a Status (aten_errors.h): running out of memory is RESOURCE_EXHAUSTED, in
// every form LibTorch reports it; anything else is INTERNAL.

// The Status CurrentExceptionStatus("op") gives for what `thrower` throws (OK when it throws nothing).
absl::Status StatusOfThrown(const std::function<void()>& thrower) {
  try {
    thrower();
  } catch (...) {
    return CurrentExceptionStatus("op");
  }
  return absl::OkStatus();
}

using test_util::ExpectStatus;

TEST(AtenErrors, RealAllocationFailureIsResourceExhausted) {
  if (kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer aborts on an allocation this large instead of failing it";
  // 2^45 floats (128 TiB): LibTorch's CPU allocator fails at once ("DefaultCPUAllocator: can't allocate
  // memory: ..." here, a c10::Error); the kernels once mapped this to INTERNAL.
  const absl::Status status = StatusOfThrown([] { (void)at::empty({int64_t{1} << 45}, at::kFloat); });
  ExpectStatus(status, absl::StatusCode::kResourceExhausted, "op: ");
  EXPECT_TRUE(IsOutOfMemoryMessage(std::string(status.message()))) << status;
}

TEST(AtenErrors, EveryOutOfMemoryFormIsResourceExhaustedAndTheRestInternal) {
  ExpectStatus(StatusOfThrown([] { throw std::bad_alloc(); }), absl::StatusCode::kResourceExhausted,
               "op: out of memory");
  // The CPU allocator's wordings (posix_memalign failing; elsewhere) and the CUDA allocator's exception type.
  ExpectStatus(StatusOfThrown([] {
                 TORCH_CHECK(false, "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes.");
               }),
               absl::StatusCode::kResourceExhausted, "op: DefaultCPUAllocator: can't allocate memory");
  ExpectStatus(StatusOfThrown([] {
                 TORCH_CHECK(false, "DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes.");
               }),
               absl::StatusCode::kResourceExhausted, "op: DefaultCPUAllocator: not enough memory");
  ExpectStatus(StatusOfThrown([] { TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried 2 GiB"); }),
               absl::StatusCode::kResourceExhausted, "op: CUDA out of memory");
  ExpectStatus(StatusOfThrown([] { TORCH_CHECK_WITH(OutOfMemoryError, false, "allocation failed"); }),
               absl::StatusCode::kResourceExhausted, "op: allocation failed");
  // Anything else is INTERNAL, with the operation and the message.
  ExpectStatus(StatusOfThrown([] { TORCH_CHECK(false, "expected a 4-D tensor"); }), absl::StatusCode::kInternal,
               "op failed: expected a 4-D tensor");
  ExpectStatus(StatusOfThrown([] { throw std::runtime_error("boom"); }), absl::StatusCode::kInternal,
               "op failed: boom");
  ExpectStatus(StatusOfThrown([] { throw 42; }), absl::StatusCode::kInternal, "op failed: unknown exception");
  EXPECT_TRUE(StatusOfThrown([] {}).ok());
  EXPECT_FALSE(IsOutOfMemoryMessage("expected a 4-D tensor"));
}

// The models' depthwise convolutions against LibTorch's float64 conv2d on a channels-first copy: read from and added
// to strided token rows (the image model's v inside a fused qkv output; the document model's rows), on 2-D grids
// and on one row (the document position convolution), in float32 and float64 (the in-place pass) and bfloat16
// (LibTorch's path).
TEST(DepthwiseConvolution, AddsLibTorchsConvolutionToStridedTokenRows) {
  struct Case {
    int64_t batch, rows, columns, channels, kernel_rows, kernel_columns;
  };
  for (const Case& c : {Case{1, 7, 7, 96, 3, 3}, Case{3, 14, 14, 24, 3, 3}, Case{2, 1, 1000, 64, 1, 7},
                        Case{1, 1, 1, 8, 1, 5}, Case{2, 5, 3, 16, 5, 3}}) {
    for (const at::ScalarType type : {at::kFloat, at::kDouble, at::kBFloat16}) {
      SCOPED_TRACE(absl::StrCat(c.batch, " x ", c.rows, " x ", c.columns, " grid, C ", c.channels, ", kernel ",
                                c.kernel_rows, " x ", c.kernel_columns, ", ", c10::toString(type)));
      const int64_t tokens = c.rows * c.columns;
      const at::Tensor fused = at::randn({c.batch, tokens, 3 * c.channels}).to(type);
      const at::Tensor input = fused.narrow(2, 2 * c.channels, c.channels);  // [B, T, C], token stride 3C
      const at::Tensor weight = at::randn({c.channels, 1, c.kernel_rows, c.kernel_columns}).to(type);
      const at::Tensor bias = at::randn({c.channels}).to(type);
      const at::Tensor target = at::randn({c.batch, tokens + 1, c.channels}).to(type);
      const at::Tensor output = target.narrow(1, 1, tokens);  // [B, T, C], batch stride (T + 1) C
      const at::Tensor before = output.to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);
      const at::Tensor outside = target.select(1, 0).clone();  // the row before output's tokens: left alone
      AddDepthwiseConvolution(input, weight, bias, c.rows, c.columns, output);
      const at::Tensor grid = input.to(at::kDouble).reshape({c.batch, c.rows, c.columns, c.channels});
      auto convolve = [&](const at::Tensor& values, const at::Tensor& taps, const at::Tensor& offsets) {
        return at::conv2d(values.permute({0, 3, 1, 2}), taps, offsets, {1, 1},
                          {c.kernel_rows / 2, c.kernel_columns / 2}, {1, 1}, c.channels)
            .permute({0, 2, 3, 1})
            .reshape({c.batch, tokens, c.channels});
      };
      const at::Tensor expected = convolve(grid, weight.to(at::kDouble), bias.to(at::kDouble)).add(before);
      const at::Tensor difference = output.to(at::kDouble).sub(expected).abs();
      if (type == at::kBFloat16) {
        // LibTorch's bfloat16 convolution, rounded, then the add, rounded: per value within 2^-6 of the sum of its
        // terms' magnitudes (4 units of bfloat16's 2^-8 rounding), where a tap left out or misplaced moves it by one
        // term's whole magnitude.
        const at::Tensor magnitudes =
            convolve(grid.abs(), weight.to(at::kDouble).abs(), bias.to(at::kDouble).abs()).add(before.abs());
        EXPECT_TRUE(difference.le(magnitudes.mul(std::ldexp(1.0, -6)).add(1e-6)).all().item<bool>())
            << "largest difference " << difference.max().item<double>();
      } else {
        EXPECT_LT(difference.max().item<double>(), type == at::kDouble ? 1e-12 : 1e-5);
      }
      EXPECT_TRUE(target.select(1, 0).equal(outside));
    }
  }
}

TEST(DepthwiseConvolution, RefusesShapesThatDisagree) {
  const at::Tensor input = at::randn({1, 12, 8});
  const at::Tensor output = at::zeros({1, 12, 8});
  EXPECT_THROW(AddDepthwiseConvolution(input, at::randn({8, 1, 3, 3}), at::randn({8}), 3, 5, output), c10::Error);
  EXPECT_THROW(AddDepthwiseConvolution(input, at::randn({8, 1, 2, 3}), at::randn({8}), 3, 4, output), c10::Error);
  EXPECT_THROW(AddDepthwiseConvolution(input, at::randn({4, 1, 3, 3}), at::randn({8}), 3, 4, output), c10::Error);
  EXPECT_THROW(AddDepthwiseConvolution(input, at::randn({8, 1, 3, 3}), at::randn({4}), 3, 4, output), c10::Error);
  EXPECT_THROW(AddDepthwiseConvolution(input, at::randn({8, 1, 3, 3}), at::randn({8}), 3, 4, at::zeros({1, 12, 4})),
               c10::Error);
  EXPECT_TRUE(output.eq(0).all().item<bool>());
}

}  // namespace
}  // namespace mita::kernels
