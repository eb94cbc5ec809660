// mita_cuda_check: correctness and timing of the CUDA MiTA kernel (kernels/mita_attention_cuda.h), standalone
// (CUDA runtime only, no torch), run by scripts/gpu_check.sh on a GPU machine and by ctest everywhere (exit 77 =
// skipped when there is no CUDA device, as on CI).
//
// Correctness: seeded random inputs (std::mt19937_64), float32 and bfloat16, against an independent float64
// loop written here (docs/design.md section 2, one query at a time): output within 1e-5 + 1e-4 |expected| (float32)
// or 1e-5 + 2^-7 |expected| (bfloat16: the loop gets the bfloat16-rounded inputs, the kernel rounds its float32
// result once), and the statistics counts (queries per expert, pruned and overlapping keys) equal. Shapes: odd N,
// N not divisible by m, k = N, m = 1, d not a multiple of 32, a batch whose items have different (m, k), exact
// ties (small integers), strided q/k/v (a fused qkv layout).
// Timing (--time, default on): N in {4K, 16K, 64K}, H = 8, d = 64, (m, k) in {(64, 64), (256, 256)}, median of
// 10 runs with CUDA events; GFLOP/s with the formula of tools/kernel_bench.cc, 2 N d (4 m + 2 k) per head.
// --profile: only the bfloat16 N = 64K, m = k = 64 timing (for a per-kernel breakdown under ncu).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/mita_attention_cuda.h"

namespace {

using mita::kernels::cuda::CudaHeadCounts;
using mita::kernels::cuda::CudaMitaItem;
using mita::kernels::cuda::CudaMitaProblem;
using mita::kernels::cuda::ElementType;

#define CHECK_CUDA(call)                                                                              \
  do {                                                                                                \
    cudaError_t error_ = (call);                                                                      \
    if (error_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(error_)); \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

// bfloat16 by round-to-nearest-even of the float32 bits (what __float2bfloat16 does for finite values).
uint16_t ToBFloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float FromBFloat16(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float result;
  std::memcpy(&result, &bits, 4);
  return result;
}

struct Budget {
  int64_t expert_count, width;
};

struct Case {
  std::string name;
  int64_t batch, heads, tokens, head_dim;
  std::vector<Budget> budgets;  // per item
  bool small_integers = false;  // exact ties
  bool fused_qkv = false;       // q, k, v as slices of one [B, N, 3, H, d] buffer
};

// Host data, [B, H, N, d] contiguous doubles (already rounded to the element type).
struct HostProblem {
  std::vector<double> q, k, v;
  std::vector<std::vector<double>> landmarks;  // per item [H, M, d]
};

struct LoopResult {
  std::vector<double> output;
  std::vector<std::vector<int64_t>> load;  // [B * H][M]
  std::vector<int64_t> pruned, overlapping;  // [B * H]
};

double Dot(const double* a, const double* b, int64_t size) {
  double sum = 0;
  for (int64_t c = 0; c < size; ++c) sum += a[c] * b[c];
  return sum;
}

LoopResult Loop(const Case& test, const HostProblem& data) {
  const int64_t H = test.heads, N = test.tokens, d = test.head_dim;
  const double s = 1.0 / std::sqrt(static_cast<double>(d));
  LoopResult result;
  result.output.assign(test.batch * H * N * d, 0.0);
  for (int64_t b = 0; b < test.batch; ++b) {
    const int64_t M = test.budgets[b].expert_count, width = test.budgets[b].width;
    for (int64_t h = 0; h < H; ++h) {
      auto row = [&](const std::vector<double>& x, int64_t n) { return x.data() + ((b * H + h) * N + n) * d; };
      auto landmark = [&](int64_t i) { return data.landmarks[b].data() + (h * M + i) * d; };
      std::vector<std::vector<int64_t>> keys(M);
      std::vector<int> selected(N, 0);
      std::vector<std::vector<double>> shared(M, std::vector<double>(d, 0.0));
      for (int64_t i = 0; i < M; ++i) {
        std::vector<double> scores(N);
        for (int64_t j = 0; j < N; ++j) scores[j] = Dot(landmark(i), row(data.k, j), d);
        std::vector<int64_t> order(N);
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
          return scores[x] > scores[y] || (scores[x] == scores[y] && x < y);
        });
        keys[i].assign(order.begin(), order.begin() + width);
        for (int64_t key : keys[i]) ++selected[key];
        const double maximum = *std::max_element(scores.begin(), scores.end()) * s;
        double sum = 0;
        std::vector<double> weights(N);
        for (int64_t j = 0; j < N; ++j) sum += (weights[j] = std::exp(scores[j] * s - maximum));
        for (int64_t j = 0; j < N; ++j) {
          for (int64_t c = 0; c < d; ++c) shared[i][c] += weights[j] / sum * row(data.v, j)[c];
        }
      }
      std::vector<int64_t> load(M, 0);
      for (int64_t n = 0; n < N; ++n) {
        const double* query = row(data.q, n);
        int64_t expert = 0;
        for (int64_t i = 1; i < M; ++i) {
          if (Dot(landmark(i), query, d) > Dot(landmark(expert), query, d)) expert = i;
        }
        ++load[expert];
        std::vector<double> logits;
        std::vector<const double*> values;
        for (int64_t i = 0; i < M; ++i) {
          logits.push_back(Dot(query, landmark(i), d) * s * s);
          values.push_back(shared[i].data());
        }
        for (int64_t key : keys[expert]) {
          logits.push_back(Dot(query, row(data.k, key), d) * s);
          values.push_back(row(data.v, key));
        }
        const double maximum = *std::max_element(logits.begin(), logits.end());
        double sum = 0;
        for (double& logit : logits) sum += (logit = std::exp(logit - maximum));
        double* out = result.output.data() + ((b * H + h) * N + n) * d;
        for (size_t j = 0; j < logits.size(); ++j) {
          for (int64_t c = 0; c < d; ++c) out[c] += logits[j] / sum * values[j][c];
        }
      }
      result.load.push_back(load);
      result.pruned.push_back(std::count(selected.begin(), selected.end(), 0));
      result.overlapping.push_back(std::count_if(selected.begin(), selected.end(), [](int x) { return x >= 2; }));
    }
  }
  return result;
}

// Device buffer of `count` elements of `type` holding `values` (converted).
void* Upload(const std::vector<double>& values, ElementType type) {
  void* device = nullptr;
  if (type == ElementType::kFloat32) {
    std::vector<float> host(values.begin(), values.end());
    CHECK_CUDA(cudaMalloc(&device, host.size() * 4));
    CHECK_CUDA(cudaMemcpy(device, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  } else {
    std::vector<uint16_t> host(values.size());
    for (size_t i = 0; i < values.size(); ++i) host[i] = ToBFloat16(static_cast<float>(values[i]));
    CHECK_CUDA(cudaMalloc(&device, host.size() * 2));
    CHECK_CUDA(cudaMemcpy(device, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  }
  return device;
}

std::vector<double> Download(const void* device, int64_t count, ElementType type) {
  std::vector<double> values(count);
  if (type == ElementType::kFloat32) {
    std::vector<float> host(count);
    CHECK_CUDA(cudaMemcpy(host.data(), device, count * 4, cudaMemcpyDeviceToHost));
    std::copy(host.begin(), host.end(), values.begin());
  } else {
    std::vector<uint16_t> host(count);
    CHECK_CUDA(cudaMemcpy(host.data(), device, count * 2, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < count; ++i) values[i] = FromBFloat16(host[i]);
  }
  return values;
}

double RoundTo(double value, ElementType type) {
  const float single = static_cast<float>(value);
  return type == ElementType::kFloat32 ? single : FromBFloat16(ToBFloat16(single));
}

// Random data for `test` (seeded), rounded to `type`; sequence landmarks (adaptive 1-D average pooling of q).
HostProblem MakeData(const Case& test, ElementType type, uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> small(-2, 2);
  const int64_t size = test.batch * test.heads * test.tokens * test.head_dim;
  auto draw = [&](bool integers) {
    std::vector<double> values(size);
    for (double& value : values) value = RoundTo(integers ? small(generator) : normal(generator), type);
    return values;
  };
  HostProblem data;
  data.q = draw(test.small_integers);
  data.k = draw(test.small_integers);
  data.v = draw(false);
  const int64_t H = test.heads, N = test.tokens, d = test.head_dim;
  for (int64_t b = 0; b < test.batch; ++b) {
    const int64_t M = test.budgets[b].expert_count;
    std::vector<double> landmarks(H * M * d, 0.0);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < M; ++i) {
        const int64_t begin = i * N / M, end = ((i + 1) * N + M - 1) / M;
        for (int64_t c = 0; c < d; ++c) {
          double sum = 0;
          for (int64_t n = begin; n < end; ++n) sum += data.q[((b * H + h) * N + n) * d + c];
          // Integer inputs: integer landmarks (window sums) keep every score exact, so ties stay exact.
          landmarks[(h * M + i) * d + c] = RoundTo(test.small_integers ? sum : sum / (end - begin), type);
        }
      }
    }
    data.landmarks.push_back(landmarks);
  }
  return data;
}

// Runs the kernel on `data`; fills output and counts.
struct DeviceRun {
  std::vector<double> output;
  std::vector<std::vector<int64_t>> load;
  std::vector<CudaHeadCounts> counts;
};

DeviceRun RunKernel(const Case& test, const HostProblem& data, ElementType type) {
  const int64_t B = test.batch, H = test.heads, N = test.tokens, d = test.head_dim;
  CudaMitaProblem problem;
  problem.type = type;
  problem.batch = B;
  problem.heads = H;
  problem.tokens = N;
  problem.head_dim = d;
  std::vector<void*> buffers;
  if (test.fused_qkv) {
    // [B, N, 3, H, d]: element (b, h, n, c) of q/k/v at ((b * N + n) * 3 + which) * H * d + h * d + c.
    std::vector<double> fused(B * N * 3 * H * d);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t c = 0; c < d; ++c) {
            const int64_t source = ((b * H + h) * N + n) * d + c;
            const int64_t base = (b * N + n) * 3 * H * d + h * d + c;
            fused[base] = data.q[source];
            fused[base + H * d] = data.k[source];
            fused[base + 2 * H * d] = data.v[source];
          }
        }
      }
    }
    void* device = Upload(fused, type);
    buffers.push_back(device);
    const int64_t element = type == ElementType::kFloat32 ? 4 : 2;
    problem.q = device;
    problem.k = static_cast<char*>(device) + H * d * element;
    problem.v = static_cast<char*>(device) + 2 * H * d * element;
    for (int64_t* strides : {problem.q_strides, problem.k_strides, problem.v_strides}) {
      strides[0] = N * 3 * H * d;
      strides[1] = d;
      strides[2] = 3 * H * d;
    }
  } else {
    problem.q = Upload(data.q, type);
    problem.k = Upload(data.k, type);
    problem.v = Upload(data.v, type);
    buffers.insert(buffers.end(), {const_cast<void*>(problem.q), const_cast<void*>(problem.k),
                                   const_cast<void*>(problem.v)});
    for (int64_t* strides : {problem.q_strides, problem.k_strides, problem.v_strides}) {
      strides[0] = H * N * d;
      strides[1] = N * d;
      strides[2] = d;
    }
  }
  std::vector<CudaMitaItem> items(B);
  for (int64_t b = 0; b < B; ++b) {
    void* landmarks = Upload(data.landmarks[b], type);
    buffers.push_back(landmarks);
    items[b] = {landmarks, test.budgets[b].expert_count, test.budgets[b].width};
  }
  void* output = nullptr;
  CHECK_CUDA(cudaMalloc(&output, B * H * N * d * 4));
  buffers.push_back(output);
  DeviceRun run;
  run.load.resize(B * H);
  run.counts.resize(B * H);
  for (int64_t task = 0; task < B * H; ++task) {
    run.load[task].assign(test.budgets[task / H].expert_count, -1);
    run.counts[task].queries_per_expert = run.load[task].data();
  }
  problem.output = output;
  problem.items = items.data();
  problem.head_counts = run.counts.data();
  const std::string error = mita::kernels::cuda::MitaAttentionForwardCuda(problem);
  if (!error.empty()) {
    std::fprintf(stderr, "%s: kernel failed: %s\n", test.name.c_str(), error.c_str());
    std::exit(1);
  }
  run.output = Download(output, B * H * N * d, type);
  for (void* buffer : buffers) CHECK_CUDA(cudaFree(buffer));
  return run;
}

bool CheckCase(const Case& test, ElementType type, uint64_t seed) {
  const HostProblem data = MakeData(test, type, seed);
  const LoopResult expected = Loop(test, data);
  const DeviceRun run = RunKernel(test, data, type);
  const double relative = type == ElementType::kFloat32 ? 1e-4 : 1.0 / 128;
  double worst = 0, worst_allowed = 0;
  bool ok = true;
  for (size_t i = 0; i < expected.output.size(); ++i) {
    const double difference = std::abs(run.output[i] - expected.output[i]);
    const double allowed = 1e-5 + relative * std::abs(expected.output[i]);
    if (!(difference <= allowed)) ok = false;
    if (difference > worst) {
      worst = difference;
      worst_allowed = allowed;
    }
  }
  bool counts_ok = true;
  for (size_t task = 0; task < expected.load.size(); ++task) {
    counts_ok = counts_ok && run.load[task] == expected.load[task] &&
                run.counts[task].pruned_keys == expected.pruned[task] &&
                run.counts[task].overlapping_keys == expected.overlapping[task];
  }
  std::printf("%-8s %-36s max |diff| %.2e (allowed there %.2e)  statistics %s  %s\n",
              type == ElementType::kFloat32 ? "float32" : "bfloat16", test.name.c_str(), worst, worst_allowed,
              counts_ok ? "equal" : "DIFFER", ok && counts_ok ? "PASS" : "FAIL");
  return ok && counts_ok;
}

void Time(ElementType type, int64_t tokens, int64_t heads, int64_t head_dim, Budget budget) {
  const int64_t size = heads * tokens * head_dim;
  std::mt19937_64 generator(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<double> values(size);
  for (double& value : values) value = normal(generator);
  void* q = Upload(values, type);
  void* k = Upload(values, type);
  void* v = Upload(values, type);
  std::vector<double> landmark_values(heads * budget.expert_count * head_dim);
  for (double& value : landmark_values) value = normal(generator) * 0.1;
  void* landmarks = Upload(landmark_values, type);
  void* output = nullptr;
  CHECK_CUDA(cudaMalloc(&output, size * 4));
  CudaMitaItem item{landmarks, budget.expert_count, budget.width};
  CudaMitaProblem problem;
  problem.type = type;
  problem.batch = 1;
  problem.heads = heads;
  problem.tokens = tokens;
  problem.head_dim = head_dim;
  problem.q = q;
  problem.k = k;
  problem.v = v;
  for (int64_t* strides : {problem.q_strides, problem.k_strides, problem.v_strides}) {
    strides[0] = size;
    strides[1] = tokens * head_dim;
    strides[2] = head_dim;
  }
  problem.output = output;
  problem.items = &item;
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int run = 0; run < 11; ++run) {
    CHECK_CUDA(cudaEventRecord(start));
    const std::string error = mita::kernels::cuda::MitaAttentionForwardCuda(problem);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    if (!error.empty()) {
      std::fprintf(stderr, "timing run failed: %s\n", error.c_str());
      std::exit(1);
    }
    float milliseconds = 0;
    CHECK_CUDA(cudaEventElapsedTime(&milliseconds, start, stop));
    if (run > 0) times.push_back(milliseconds);  // run 0 warms up
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  const double flops = 2.0 * tokens * head_dim * (4.0 * budget.expert_count + 2.0 * budget.width) * heads;
  std::printf("| %s | %lld | %lld | %lld | %lld | %lld | %.3f | %.0f |\n",
              type == ElementType::kFloat32 ? "float32" : "bfloat16", static_cast<long long>(tokens),
              static_cast<long long>(head_dim), static_cast<long long>(heads),
              static_cast<long long>(budget.expert_count), static_cast<long long>(budget.width), median,
              flops / (median * 1e-3) / 1e9);
  for (void* buffer : {q, k, v, landmarks, output}) CHECK_CUDA(cudaFree(buffer));
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
}

}  // namespace

int main(int argc, char** argv) {
  bool time = true, profile = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--no_time") time = false;
    if (std::string(argv[i]) == "--profile") profile = true;
  }
  if (mita::kernels::cuda::CudaDeviceCount() == 0) {
    std::printf("mita_cuda_check: no CUDA device (or no driver): skipped\n");
    return 77;
  }
  cudaDeviceProp properties;
  CHECK_CUDA(cudaGetDeviceProperties(&properties, 0));
  std::printf("device 0: %s (sm_%d%d)\n", properties.name, properties.major, properties.minor);
  if (profile) {  // one timing configuration only, for a profiler's per-kernel breakdown (scripts/gpu_check.sh)
    Time(ElementType::kBFloat16, 65536, 8, 64, Budget{64, 64});
    return 0;
  }

  const std::vector<Case> cases = {
      {"odd N, N not divisible by m", 2, 3, 37, 8, {{5, 7}, {5, 7}}},
      {"k = N", 1, 2, 19, 16, {{4, 19}}},
      {"m = 1", 2, 2, 23, 8, {{1, 5}, {1, 23}}},
      {"items with different (m, k)", 3, 2, 41, 8, {{1, 41}, {6, 9}, {13, 1}}},
      {"d = 48 (not a multiple of 32)", 1, 2, 300, 48, {{9, 40}}},
      {"d = 64, N = 1025, fused qkv", 2, 4, 1025, 64, {{16, 64}, {64, 16}}, false, true},
      {"exact ties (small integers)", 1, 2, 700, 4, {{6, 37}}, true},
      {"exact ties, k = N - 1", 1, 2, 700, 4, {{6, 699}}, true},
      {"d = 128, m = 256 > 32 lanes", 1, 2, 1000, 128, {{256, 100}}},
  };
  bool all_ok = true;
  uint64_t seed = 1;
  for (const Case& test : cases) {
    for (ElementType type : {ElementType::kFloat32, ElementType::kBFloat16}) {
      all_ok = CheckCase(test, type, seed++) && all_ok;
    }
  }
  std::printf("correctness: %s\n", all_ok ? "PASS" : "FAIL");

  if (time) {
    std::printf("\n| dtype | N | d | H | m | k | ms | GFLOP/s |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (ElementType type : {ElementType::kFloat32, ElementType::kBFloat16}) {
      for (int64_t tokens : {4096, 16384, 65536}) {
        for (Budget budget : {Budget{64, 64}, Budget{256, 256}}) Time(type, tokens, 8, 64, budget);
      }
    }
  }
  return all_ok ? 0 : 1;
}
