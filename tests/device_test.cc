// Devices: device and dtype names, the --device/--weights_dtype flags, placement checks, the start-up error of a
// CUDA device that is not there (a real mita-server process), the CUDA code compiled into the build, and, where
// a CUDA device is visible, the same logits on it as on the CPU for both embedded models (float32 and bfloat16,
// mixed budgets in one packed batch) and a CUDA out-of-memory that leaves the model working. The GPU tests skip
// without a CUDA device (CI, this machine); scripts/gpu_check.sh runs them on the GPU machine.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ops/randint.h>
#include <c10/util/Exception.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/aten_errors.h"
#include "kernels/device.h"
#include "models/model_package.h"
#include "server/engine/model_runner.h"
#include "server/process/placement.h"
#include "tests/test_util.h"
#ifdef MITA_HAVE_CUDA
#include "kernels/mita_attention_cuda.h"
#endif

#ifndef MITA_SERVER_PATH
#error "MITA_SERVER_PATH (the mita-server binary) must be defined by the build"
#endif

namespace mita {
namespace {

using ::testing::HasSubstr;
using test_util::ExpectStatus;
using test_util::ExpectStatusParts;

// ---------------------------------------------------------------------------------------------------------
// Names.

TEST(DeviceNameTest, ReadsCpuAndCudaIndices) {
  for (const char* name : {"cpu", "cuda:0", "cuda:1", "cuda:7", "cuda:10", "cuda:127"}) {
    absl::StatusOr<c10::Device> device = kernels::ParseDevice(name);
    ASSERT_TRUE(device.ok()) << name << ": " << device.status();
    EXPECT_EQ(kernels::DeviceName(*device), name);
  }
  EXPECT_TRUE(kernels::ParseDevice("cpu")->is_cpu());
  EXPECT_TRUE(kernels::ParseDevice("cuda:3")->is_cuda());
  EXPECT_EQ(kernels::ParseDevice("cuda:3")->index(), 3);
}

TEST(DeviceNameTest, RefusesOtherStringsNamingTheAllowedOnes) {
  for (const char* text : {"", "gpu", "cuda", "cuda:", "cuda:-1", "cuda:+1", "cuda:01", "cuda:1x", "cuda: 1",
                           "CUDA:0", "Cpu", "cpu:0", " cpu", "cuda:0 ", "cuda:128", "cuda:99999999999", "mps",
                           "cuda:0,cuda:1"}) {
    ExpectStatus(kernels::ParseDevice(text).status(), absl::StatusCode::kInvalidArgument,
                 absl::StrCat("'", text, "' is not a device: use cpu or cuda:N (N = 0, 1, ...)"));
  }
}

TEST(WeightsDtypeTest, ReadsFloat32AndBfloat16Only) {
  EXPECT_EQ(*kernels::ParseWeightsDtype("float32"), at::kFloat);
  EXPECT_EQ(*kernels::ParseWeightsDtype("bfloat16"), at::kBFloat16);
  EXPECT_EQ(kernels::DtypeName(at::kFloat), "float32");
  EXPECT_EQ(kernels::DtypeName(at::kBFloat16), "bfloat16");
  for (const char* text : {"", "fp32", "float", "float16", "half", "bf16", "BFLOAT16", "float64", "int8"}) {
    ExpectStatus(kernels::ParseWeightsDtype(text).status(), absl::StatusCode::kInvalidArgument,
                 absl::StrCat("'", text, "' is not a weights dtype: use float32 or bfloat16"));
  }
}

// ---------------------------------------------------------------------------------------------------------
// --device and --weights_dtype.

// A CUDA device index no process here sees: past the visible devices (cuda:0 on a machine without any).
c10::Device InvisibleCudaDevice() {
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(kernels::VisibleCudaDevices()));
}

TEST(PlacementFlagsTest, PlacesEveryModelOnTheDefaultAndNamedModelsOnTheirOwn) {
  const std::vector<std::string> models = {"a", "b", "c"};
  absl::StatusOr<server::PlacementFlags> defaults = server::PlacementFlags::Parse("", "");
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  absl::StatusOr<std::map<std::string, models::Placement>> placed = defaults->Resolve(models);
  ASSERT_TRUE(placed.ok()) << placed.status();
  ASSERT_EQ(placed->size(), 3u);
  for (const auto& [name, placement] : *placed) {
    EXPECT_TRUE(placement.device.is_cpu()) << name;
    EXPECT_EQ(placement.weights_dtype, at::kFloat) << name;
  }
  // A device no model ends up on is not checked: every model here is named onto the CPU.
  const std::string invisible = kernels::DeviceName(InvisibleCudaDevice());
  absl::StatusOr<server::PlacementFlags> named =
      server::PlacementFlags::Parse(absl::StrCat(invisible, ",a=cpu,b=cpu,c=cpu"), "float32,b=float32");
  ASSERT_TRUE(named.ok()) << named.status();
  placed = named->Resolve(models);
  ASSERT_TRUE(placed.ok()) << placed.status();
  for (const auto& [name, placement] : *placed) EXPECT_TRUE(placement.device.is_cpu()) << name;
  // Model c is left to the default device, which is not there.
  named = server::PlacementFlags::Parse(absl::StrCat(invisible, ",a=cpu,b=cpu"), "");
  ASSERT_TRUE(named.ok()) << named.status();
  ExpectStatusParts(named->Resolve(models).status(), absl::StatusCode::kFailedPrecondition,
                    {absl::StrCat("flag --device: ", invisible, ": ")});
}

TEST(PlacementFlagsTest, RefusesBadEntriesNamingTheFlag) {
  struct Case {
    const char* device;
    const char* dtype;
    const char* message;
  };
  for (const Case& c : std::vector<Case>{
           {"gpu", "", "flag --device: 'gpu' is not a device: use cpu or cuda:N (N = 0, 1, ...)"},
           {"a=gpu", "", "flag --device: model 'a': 'gpu' is not a device"},
           {"a=", "", "flag --device: model 'a': '' is not a device"},
           {"=cpu", "", "flag --device: '=cpu' names no model (use MODEL=VALUE)"},
           {"cpu,,a=cpu", "", "flag --device: empty entry in 'cpu,,a=cpu'"},
           {"cpu,", "", "flag --device: empty entry"},
           {"cpu,cuda:0", "", "flag --device: two values for the models not named in 'cpu,cuda:0'"},
           {"a=cpu,a=cuda:0", "", "flag --device: model 'a' is named twice"},
           {"", "fp16", "flag --weights_dtype: 'fp16' is not a weights dtype: use float32 or bfloat16"},
           {"", "a=bf16", "flag --weights_dtype: model 'a': 'bf16' is not a weights dtype"},
           {"", "float32,bfloat16", "flag --weights_dtype: two values for the models not named"},
       }) {
    SCOPED_TRACE(absl::StrCat("--device=", c.device, " --weights_dtype=", c.dtype));
    ExpectStatus(server::PlacementFlags::Parse(c.device, c.dtype).status(), absl::StatusCode::kInvalidArgument,
                 c.message);
  }
}

TEST(PlacementFlagsTest, RefusesUnknownModelsAndBfloat16OnACpuWithoutBfloat16DotProducts) {
  const std::vector<std::string> models = {"fashion-mnist-vit", "linux-doc-mita"};
  absl::StatusOr<server::PlacementFlags> flags = server::PlacementFlags::Parse("cpu,nosuch=cpu", "");
  ASSERT_TRUE(flags.ok()) << flags.status();
  ExpectStatus(flags->Resolve(models).status(), absl::StatusCode::kInvalidArgument,
               "flag --device: no model 'nosuch' in the model repository (models: fashion-mnist-vit, linux-doc-mita)");
  flags = server::PlacementFlags::Parse("", "nosuch=bfloat16");
  ASSERT_TRUE(flags.ok()) << flags.status();
  ExpectStatus(flags->Resolve(models).status(), absl::StatusCode::kInvalidArgument,
               "flag --weights_dtype: no model 'nosuch'");
  flags = server::PlacementFlags::Parse("", "linux-doc-mita=bfloat16");
  ASSERT_TRUE(flags.ok()) << flags.status();
  absl::StatusOr<std::map<std::string, models::Placement>> placements = flags->Resolve(models);
  if (kernels::CpuHasBfloat16DotProducts()) {
    ASSERT_TRUE(placements.ok()) << placements.status();
    EXPECT_EQ(placements->at("linux-doc-mita").weights_dtype, at::kBFloat16);
    EXPECT_EQ(placements->at("fashion-mnist-vit").weights_dtype, at::kFloat);
  } else {
    ExpectStatus(placements.status(), absl::StatusCode::kFailedPrecondition,
                 "flag --weights_dtype: model 'linux-doc-mita' on cpu: bfloat16 on the CPU needs AVX512-BF16 or "
                 "AMX-BF16, which this CPU lacks");
  }
}

// ---------------------------------------------------------------------------------------------------------
// Placement checks without a GPU.

TEST(DeviceCheckTest, ACudaDeviceThatIsNotThereIsFailedPrecondition) {
  EXPECT_TRUE(kernels::CheckDeviceUsable(c10::Device(c10::kCPU)).ok());
  const c10::Device device = InvisibleCudaDevice();
  const std::string name = kernels::DeviceName(device);
  const absl::Status status = kernels::CheckDeviceUsable(device);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(name + ": "));
#ifndef MITA_TORCH_HAS_CUDA
  EXPECT_THAT(std::string(status.message()), HasSubstr("this build's LibTorch has no CUDA"));
#else
  if (device.index() == 0) {
    EXPECT_THAT(std::string(status.message()), HasSubstr("cuda:0: no CUDA device is visible to this process"));
  } else {
    EXPECT_THAT(std::string(status.message()), HasSubstr(absl::StrCat("only ", device.index(), " CUDA device")));
  }
#endif
  ExpectStatus(kernels::CudaMemory(c10::Device(c10::kCPU)).status(), absl::StatusCode::kInvalidArgument,
               "cpu is not a CUDA device");
}

TEST(PlacementCheckTest, Bfloat16OnTheCpuNeedsBfloat16DotProductsAndOtherDtypesAreRefused) {
  // The kernel's CPUID reading against the kernel's own account of the CPU (Linux /proc/cpuinfo flags).
  const std::string cpuinfo = test_util::ReadFile("/proc/cpuinfo");
  const size_t flags_start = cpuinfo.find("\nflags");
  ASSERT_NE(flags_start, std::string::npos);
  const std::string flags = cpuinfo.substr(flags_start, cpuinfo.find('\n', flags_start + 1) - flags_start) + " ";
  EXPECT_EQ(kernels::CpuHasBfloat16DotProducts(),
            flags.find(" avx512_bf16 ") != std::string::npos || flags.find(" amx_bf16 ") != std::string::npos)
      << flags;
  models::Placement placement;
  placement.weights_dtype = at::kHalf;
  ExpectStatus(models::CheckPlacement(placement), absl::StatusCode::kInvalidArgument,
               "weights dtype float16 is not supported: use float32 or bfloat16");
  ExpectStatus(models::ParsePlacement("gpu", "float32").status(), absl::StatusCode::kInvalidArgument,
               "'gpu' is not a device");
  for (const char* model : {"fashion-mnist-vit", "linux-doc-mita"}) {
    placement = models::Placement{c10::Device(c10::kCPU), at::kBFloat16};
    absl::StatusOr<models::ModelPackage> bfloat16 =
        models::LoadModelPackage(test_util::RepositoryPath() + "/" + model, placement);
    if (kernels::CpuHasBfloat16DotProducts()) {
      ASSERT_TRUE(bfloat16.ok()) << bfloat16.status();
      EXPECT_EQ(bfloat16->classifier->description().weights_dtype, "bfloat16");
      EXPECT_THAT(bfloat16->classifier->description().Summary(), HasSubstr(", on cpu in bfloat16)"));
    } else {
      // Refused before the weights are read, for both architectures.
      ExpectStatus(bfloat16.status(), absl::StatusCode::kFailedPrecondition,
                   "bfloat16 on the CPU needs AVX512-BF16 or AMX-BF16, which this CPU lacks");
      EXPECT_THAT(std::string(bfloat16.status().message()), ::testing::StartsWith("bfloat16"));
    }
    placement = models::Placement{InvisibleCudaDevice(), at::kFloat};
    EXPECT_EQ(models::LoadModelPackage(test_util::RepositoryPath() + "/" + model, placement).status().code(),
              absl::StatusCode::kFailedPrecondition);
    absl::StatusOr<models::ModelPackage> cpu = models::LoadModelPackage(test_util::RepositoryPath() + "/" + model);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    EXPECT_EQ(cpu->classifier->description().device, "cpu");
    EXPECT_EQ(cpu->classifier->description().weights_dtype, "float32");
    EXPECT_THAT(cpu->classifier->description().Summary(), HasSubstr(", on cpu in float32)"));
  }
}

// ---------------------------------------------------------------------------------------------------------
// The CUDA code in the build.

TEST(CudaBuildTest, TheCudaKernelIsCompiledInForSm90) {
#ifndef MITA_HAVE_CUDA
  GTEST_SKIP() << "built without nvcc (MITA_CUDA): no CUDA kernel to find";
#else
  // The summary is computed in kernels/mita_attention_cuda.cu, from nvcc's own macros.
  EXPECT_THAT(kernels::cuda::KernelBuildSummary(), ::testing::StartsWith("sm_90 (CUDA "));
  EXPECT_THAT(kernels::CudaBuildSummary(), HasSubstr("CUDA MiTA kernel for sm_90 (CUDA "));
#ifdef MITA_TORCH_HAS_CUDA
  EXPECT_THAT(kernels::CudaBuildSummary(), HasSubstr("LibTorch with CUDA"));
#endif
#endif
}

// mita-server started as an operator would, with `arguments`: its exit status (-1: still running after 60 s) and
// its log.
struct ServerRun {
  int exit_status = -1;
  std::string log;
};
ServerRun RunServer(const std::vector<std::string>& arguments) {
  const std::string log_path = absl::StrCat(::testing::TempDir(), "/device_test_server_", getpid(), ".log");
  std::vector<std::string> all = {absl::StrCat("--model_repository=", test_util::RepositoryPath()),
                                  "--listen=127.0.0.1:0", "--metrics_listen="};
  all.insert(all.end(), arguments.begin(), arguments.end());
  const pid_t pid = test_util::StartProcess(MITA_SERVER_PATH, all, log_path);
  EXPECT_GT(pid, 0);
  ServerRun run;
  const int status = test_util::WaitForExit(pid, absl::Seconds(60));
  if (status != -1 && WIFEXITED(status)) run.exit_status = WEXITSTATUS(status);
  run.log = test_util::ReadFile(log_path);
  return run;
}

// mita-server started with `flag` exits 1 at start-up, its log saying "error: `message`...".
void ExpectStartUpError(const std::string& flag, const std::string& message) {
  const ServerRun run = RunServer({flag});
  EXPECT_EQ(run.exit_status, 1) << flag << "\n" << run.log;
  EXPECT_THAT(run.log, HasSubstr(absl::StrCat("error: ", message))) << flag << "\n" << run.log;
}

TEST(ServerStartTest, ACudaDeviceThatIsNotThereIsAStartUpErrorNamingTheFlag) {
  const std::string device = kernels::DeviceName(InvisibleCudaDevice());
  const ServerRun run = RunServer({absl::StrCat("--device=", device)});
  EXPECT_EQ(run.exit_status, 1) << run.log;
  EXPECT_THAT(run.log, HasSubstr(absl::StrCat("error: flag --device: ", device, ": "))) << run.log;
#ifdef MITA_TORCH_HAS_CUDA
  if (device == "cuda:0") EXPECT_THAT(run.log, HasSubstr("no CUDA device is visible to this process"));
#endif
#ifdef MITA_HAVE_CUDA
  // The server binary itself reports the CUDA kernel object it links.
  EXPECT_THAT(run.log, HasSubstr("CUDA MiTA kernel for sm_90")) << run.log;
#endif
  EXPECT_THAT(run.log, ::testing::Not(HasSubstr("serving gRPC")));
}

TEST(ServerStartTest, BadDeviceAndDtypeFlagsAreStartUpErrors) {
  ExpectStartUpError("--device=gpu", "flag --device: 'gpu' is not a device: use cpu or cuda:N");
  ExpectStartUpError("--weights_dtype=float16",
                     "flag --weights_dtype: 'float16' is not a weights dtype: use float32 or bfloat16");
  if (!kernels::CpuHasBfloat16DotProducts()) {
    ExpectStartUpError("--weights_dtype=bfloat16",
                       "flag --weights_dtype: model 'fashion-mnist-vit' on cpu: bfloat16 on the CPU needs "
                       "AVX512-BF16 or AMX-BF16, which this CPU lacks");
  }
  ExpectStartUpError("--device=cpu,nosuch=cpu", "flag --device: no model 'nosuch'");
}

TEST(ServerStartTest, BadBatchThreadsAreStartUpErrorsNamingTheFlag) {
  ExpectStartUpError("--batch_threads=two", "flag --batch_threads: 'two' is not a thread count: allowed [0, 1024] "
                                            "(0: the hardware concurrency)");
  ExpectStartUpError("--batch_threads=1,fashion-mnist-vit=2000",
                     "flag --batch_threads: model 'fashion-mnist-vit': '2000' is not a thread count");
  ExpectStartUpError("--batch_threads=1,nosuch=2", "flag --batch_threads: no model 'nosuch' in the model repository");
}

// ---------------------------------------------------------------------------------------------------------
// A failed batch on a device.

TEST(BatchFailureOnDeviceTest, CudaOutOfMemoryIsResourceExhaustedNamingTheDeviceAndTheBatch) {
  absl::Status forward;
  try {
    // What LibTorch's CUDA caching allocator throws.
    C10_THROW_ERROR(OutOfMemoryError, "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity");
  } catch (...) {
    forward = kernels::CurrentExceptionStatus("document forward (98304 tokens)");
  }
  ASSERT_EQ(forward.code(), absl::StatusCode::kResourceExhausted) << forward;
  const absl::Status answer = server::BatchFailure("linux-doc-mita", "cuda:0", 2, 98304, forward);
  ExpectStatusParts(answer, absl::StatusCode::kResourceExhausted,
                    {"model 'linux-doc-mita' ran out of memory on cuda:0 for this batch of 2 requests, 98304 tokens",
                     "CUDA out of memory. Tried to allocate 2.00 GiB", "retry later or with a smaller budget"});
  EXPECT_THAT(std::string(server::BatchFailure("m", "cpu", 1, 50, forward).message()),
              HasSubstr("on cpu for this batch of 1 request, 50 tokens"));
}

// ---------------------------------------------------------------------------------------------------------
// On a CUDA device (skipped without one).

bool HaveCudaDevice() { return kernels::VisibleCudaDevices() > 0; }

models::BudgetRequest Preset(const std::string& name) {
  models::BudgetRequest request;
  request.choice = models::BudgetRequest::Choice::kPreset;
  request.preset = name;
  return request;
}
models::BudgetRequest Experts(int64_t expert_count, int64_t expert_width) {
  models::BudgetRequest request;
  request.choice = models::BudgetRequest::Choice::kExperts;
  request.expert_count = expert_count;
  request.expert_width = expert_width;
  return request;
}
models::BudgetRequest FullAttention() {
  models::BudgetRequest request;
  request.choice = models::BudgetRequest::Choice::kFullAttention;
  return request;
}

// The models on the CPU in float32 and on cuda:0 in float32 and bfloat16.
struct PlacedModels {
  std::unique_ptr<models::Classifier> cpu, cuda_float32, cuda_bfloat16;
};
PlacedModels LoadPlaced(const std::string& model) {
  const std::string directory = test_util::RepositoryPath() + "/" + model;
  PlacedModels placed;
  for (auto [target, placement] : std::vector<std::pair<std::unique_ptr<models::Classifier>*, models::Placement>>{
           {&placed.cpu, {}},
           {&placed.cuda_float32, {c10::Device(c10::kCUDA, 0), at::kFloat}},
           {&placed.cuda_bfloat16, {c10::Device(c10::kCUDA, 0), at::kBFloat16}}}) {
    absl::StatusOr<models::ModelPackage> package = models::LoadModelPackage(directory, placement);
    EXPECT_TRUE(package.ok()) << package.status();
    if (package.ok()) *target = std::move(package->classifier);
  }
  return placed;
}

// How two [B, C] logits tensors differ, row by row (|a - b| per row, largest over the classes).
struct LogitsComparison {
  double max_magnitude = 0;       // largest |logit| of `expected`
  std::vector<double> row_differences;
  // Rows whose top class differs although the expected logit of the class found is not within `margin` of the
  // expected top logit (a near-tie may go either way).
  int64_t far_other_class_rows = 0;
};
LogitsComparison Compare(const at::Tensor& expected, const at::Tensor& found, double margin) {
  LogitsComparison comparison;
  comparison.max_magnitude = expected.abs().max().item<double>();
  const at::Tensor differences = found.sub(expected).abs().amax(1);
  const at::Tensor expected_class = expected.argmax(1), found_class = found.argmax(1);
  for (int64_t b = 0; b < expected.size(0); ++b) {
    comparison.row_differences.push_back(differences[b].item<double>());
    const int64_t e = expected_class[b].item<int64_t>(), f = found_class[b].item<int64_t>();
    if (e != f && expected[b][e].item<double>() - expected[b][f].item<double>() > margin) {
      ++comparison.far_other_class_rows;
    }
  }
  return comparison;
}

// Rows of `comparison` over `bound`.
int64_t RowsOver(const LogitsComparison& comparison, double bound) {
  return std::count_if(comparison.row_differences.begin(), comparison.row_differences.end(),
                       [bound](double d) { return d > bound; });
}

// The tolerances, stated for the embedded models (logits within about +-15). float32 on the GPU differs from the
// CPU by the order of float32 sums (cuBLAS, cuDNN and the CUDA MiTA kernel against MKL and the CPU kernel), so
// almost every row agrees to 2e-3; a top-k choice between two keys whose scores tie to float32 rounding may
// route one query differently in a few rows, which stay within 5% of the largest |logit|. bfloat16 weights and
// activations carry 8 significant bits: every row within 15% of the largest |logit|, 7 of 8 rows within 8%.
// The top class may differ only where the CPU's two candidates are within those bounds.
constexpr double kFloat32RowTolerance = 2e-3;
constexpr double kFloat32RelativeBound = 0.05;
constexpr double kBfloat16RelativeBulk = 0.08;
constexpr double kBfloat16RelativeBound = 0.15;

// `found` (a bfloat16 model's logits) against `expected` (float32's) within the bfloat16 bounds above; prints
// the differences under `label`.
void ExpectBfloat16Logits(const at::Tensor& expected, const at::Tensor& found, const char* label) {
  ASSERT_EQ(found.sizes(), expected.sizes());
  const double magnitude = expected.abs().max().item<double>();
  const LogitsComparison bf16 = Compare(expected, found, kBfloat16RelativeBound * magnitude);
  const int64_t rows = expected.size(0);
  const double bf16_max = *std::max_element(bf16.row_differences.begin(), bf16.row_differences.end());
  std::printf("%s, %lld items: largest |logit| %.3g; max |difference| %.3g (%.3f of it), %lld rows over %.2f of it\n",
              label, static_cast<long long>(rows), magnitude, bf16_max, bf16_max / magnitude,
              static_cast<long long>(RowsOver(bf16, kBfloat16RelativeBulk * magnitude)), kBfloat16RelativeBulk);
  EXPECT_LE(RowsOver(bf16, kBfloat16RelativeBulk * magnitude), rows / 8);
  EXPECT_EQ(RowsOver(bf16, kBfloat16RelativeBound * magnitude), 0);
  EXPECT_EQ(bf16.far_other_class_rows, 0);
}

// 64 Fashion-MNIST test images prepared by `model` with mixed budgets: the default, presets, extremes and full
// attention.
std::vector<models::BatchItem> MixedImageItems(const models::Classifier& model) {
  absl::StatusOr<test_util::TestImages> images = test_util::FashionMnistTestPngs(64);
  EXPECT_TRUE(images.ok()) << images.status();
  if (!images.ok()) return {};
  const std::vector<models::BudgetRequest> budgets = {
      {}, Preset("fast"), Experts(16, 32), FullAttention(), Experts(1, 50), Experts(49, 1)};
  std::vector<models::BatchItem> items;
  for (size_t i = 0; i < images->pngs.size(); ++i) {
    models::ClassifierInput input;
    input.kind = models::ClassifierInput::Kind::kImage;
    input.bytes = images->pngs[i];
    absl::StatusOr<models::BatchItem> item = model.Prepare(input, budgets[i % budgets.size()], {});
    EXPECT_TRUE(item.ok()) << item.status();
    if (item.ok()) items.push_back(*std::move(item));
  }
  return items;
}

// One packed batch of random documents of different lengths (9 to 20,000 tokens) and budgets (full attention
// included), prepared by `model`.
std::vector<models::BatchItem> MixedDocumentItems(const models::Classifier& model) {
  at::manual_seed(16);
  const std::vector<std::pair<int64_t, models::BudgetRequest>> documents = {
      {37, {}},
      {700, Preset("fast")},
      {4097, Experts(64, 256)},
      {1500, FullAttention()},
      {9, Experts(16, 64)},
      {20000, Preset("accurate")}};
  std::vector<models::BatchItem> items;
  for (const auto& [tokens, budget] : documents) {
    const at::Tensor random = at::randint(0, 4096, {tokens}, at::TensorOptions().dtype(at::kLong));
    models::ClassifierInput input;
    input.kind = models::ClassifierInput::Kind::kTokenIds;
    input.token_ids = absl::MakeConstSpan(random.data_ptr<int64_t>(), tokens);  // Prepare copies them
    absl::StatusOr<models::BatchItem> item = model.Prepare(input, budget, {});
    EXPECT_TRUE(item.ok()) << item.status();
    if (item.ok()) items.push_back(*std::move(item));
  }
  return items;
}

std::vector<const models::BatchItem*> Pointers(const std::vector<models::BatchItem>& items) {
  std::vector<const models::BatchItem*> pointers;
  for (const models::BatchItem& item : items) pointers.push_back(&item);
  return pointers;
}

void ExpectSameLogits(const models::Classifier& cpu, const models::Classifier& cuda_float32,
                      const models::Classifier& cuda_bfloat16, const std::vector<const models::BatchItem*>& items) {
  absl::StatusOr<models::ClassifierOutput> expected = cpu.Run(items, /*want_statistics=*/true);
  ASSERT_TRUE(expected.ok()) << expected.status();
  absl::StatusOr<models::ClassifierOutput> float32 = cuda_float32.Run(items, /*want_statistics=*/true);
  ASSERT_TRUE(float32.ok()) << float32.status();
  absl::StatusOr<models::ClassifierOutput> bfloat16 = cuda_bfloat16.Run(items, /*want_statistics=*/true);
  ASSERT_TRUE(bfloat16.ok()) << bfloat16.status();
  for (const models::ClassifierOutput* output : {&*float32, &*bfloat16}) {
    EXPECT_TRUE(output->logits.device().is_cpu());
    EXPECT_EQ(output->logits.scalar_type(), at::kFloat);
    ASSERT_EQ(output->logits.sizes(), expected->logits.sizes());
    ASSERT_EQ(output->statistics.size(), items.size());
    for (size_t b = 0; b < items.size(); ++b) {
      // Statistics come from the device for every item that ran MiTA, one entry per layer, as on the CPU.
      EXPECT_EQ(output->statistics[b].size(), expected->statistics[b].size()) << "item " << b;
    }
  }
  const double magnitude = expected->logits.abs().max().item<double>();
  const LogitsComparison f32 = Compare(expected->logits, float32->logits, kFloat32RelativeBound * magnitude);
  const int64_t rows = static_cast<int64_t>(items.size());
  const double f32_max = *std::max_element(f32.row_differences.begin(), f32.row_differences.end());
  std::printf("%lld items: largest |logit| %.3g; float32 on cuda:0: max |difference| %.3g, %lld rows over %.0e\n",
              static_cast<long long>(rows), magnitude, f32_max,
              static_cast<long long>(RowsOver(f32, kFloat32RowTolerance)), kFloat32RowTolerance);
  EXPECT_LE(RowsOver(f32, kFloat32RowTolerance), rows / 16);
  EXPECT_EQ(RowsOver(f32, kFloat32RelativeBound * magnitude), 0);
  EXPECT_EQ(f32.far_other_class_rows, 0);
  ExpectBfloat16Logits(expected->logits, bfloat16->logits, "bfloat16 on cuda:0");
  // float32 statistics: routing can differ only on near-ties, so the bulk agrees.
  for (size_t b = 0; b < items.size(); ++b) {
    for (size_t layer = 0; layer < expected->statistics[b].size() && layer < float32->statistics[b].size(); ++layer) {
      EXPECT_NEAR(float32->statistics[b][layer].pruned_key_fraction,
                  expected->statistics[b][layer].pruned_key_fraction, 0.05)
          << "item " << b << " layer " << layer;
    }
  }
}

// bfloat16 on the CPU (where it is allowed: PlacementCheckTest checks the refusal elsewhere): the embedded models'
// logits stay within bfloat16's bounds of float32's, in a mixed batch and alone.
TEST(CpuBfloat16Test, ModelsGiveTheFloat32LogitsWithinBfloat16BoundsWithMixedBudgets) {
  if (!kernels::CpuHasBfloat16DotProducts()) GTEST_SKIP() << "this CPU has no AVX512-BF16 or AMX-BF16";
  for (const char* model : {"fashion-mnist-vit", "linux-doc-mita"}) {
    SCOPED_TRACE(model);
    const std::string directory = test_util::RepositoryPath() + "/" + model;
    absl::StatusOr<models::ModelPackage> float32 = models::LoadModelPackage(directory);
    absl::StatusOr<models::ModelPackage> bfloat16 =
        models::LoadModelPackage(directory, models::Placement{c10::Device(c10::kCPU), at::kBFloat16});
    ASSERT_TRUE(float32.ok()) << float32.status();
    ASSERT_TRUE(bfloat16.ok()) << bfloat16.status();
    const std::vector<models::BatchItem> items = std::string(model) == "fashion-mnist-vit"
                                                     ? MixedImageItems(*float32->classifier)
                                                     : MixedDocumentItems(*float32->classifier);
    ASSERT_FALSE(items.empty());
    const std::vector<const models::BatchItem*> batch = Pointers(items);
    for (const std::vector<const models::BatchItem*>& run :
         std::vector<std::vector<const models::BatchItem*>>{batch, {batch.front()}}) {
      absl::StatusOr<models::ClassifierOutput> expected = float32->classifier->Run(run, /*want_statistics=*/true);
      absl::StatusOr<models::ClassifierOutput> found = bfloat16->classifier->Run(run, /*want_statistics=*/true);
      ASSERT_TRUE(expected.ok()) << expected.status();
      ASSERT_TRUE(found.ok()) << found.status();
      EXPECT_EQ(found->logits.scalar_type(), at::kFloat);
      ASSERT_EQ(found->statistics.size(), run.size());
      for (size_t b = 0; b < run.size(); ++b) EXPECT_EQ(found->statistics[b].size(), expected->statistics[b].size());
      ExpectBfloat16Logits(expected->logits, found->logits, "bfloat16 on the CPU");
    }
  }
}

TEST(CudaModelsTest, ImageModelGivesTheCpuLogitsOnCudaInFloat32AndBfloat16WithMixedBudgets) {
  if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device is visible";
  PlacedModels placed = LoadPlaced("fashion-mnist-vit");
  ASSERT_NE(placed.cuda_bfloat16, nullptr);
  EXPECT_EQ(placed.cuda_bfloat16->description().device, "cuda:0");
  EXPECT_EQ(placed.cuda_bfloat16->description().weights_dtype, "bfloat16");
  const std::vector<models::BatchItem> items = MixedImageItems(*placed.cpu);
  ASSERT_EQ(items.size(), 64u);
  const std::vector<const models::BatchItem*> batch = Pointers(items);
  ExpectSameLogits(*placed.cpu, *placed.cuda_float32, *placed.cuda_bfloat16, batch);
  // Batch size 1 too.
  ExpectSameLogits(*placed.cpu, *placed.cuda_float32, *placed.cuda_bfloat16, {batch.front()});
}

TEST(CudaModelsTest, DocumentModelGivesTheCpuLogitsOnCudaInFloat32AndBfloat16WithMixedBudgets) {
  if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device is visible";
  PlacedModels placed = LoadPlaced("linux-doc-mita");
  ASSERT_NE(placed.cuda_bfloat16, nullptr);
  const std::vector<models::BatchItem> items = MixedDocumentItems(*placed.cpu);
  ASSERT_EQ(items.size(), 6u);
  const std::vector<const models::BatchItem*> batch = Pointers(items);
  ExpectSameLogits(*placed.cpu, *placed.cuda_float32, *placed.cuda_bfloat16, batch);
}

TEST(CudaModelsTest, OutOfMemoryOnTheDeviceIsResourceExhaustedAndTheModelKeepsWorking) {
  if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device is visible";
  const c10::Device device(c10::kCUDA, 0);
  absl::StatusOr<models::ModelPackage> package =
      models::LoadModelPackage(test_util::RepositoryPath() + "/linux-doc-mita", {device, at::kFloat});
  ASSERT_TRUE(package.ok()) << package.status();
  const models::Classifier& model = *package->classifier;
  auto document = [&](int64_t tokens, const models::BudgetRequest& budget) {
    std::vector<int64_t> ids(static_cast<size_t>(tokens));
    for (int64_t t = 0; t < tokens; ++t) ids[static_cast<size_t>(t)] = (t * 31) % 4096;
    models::ClassifierInput input;
    input.kind = models::ClassifierInput::Kind::kTokenIds;
    input.token_ids = ids;
    absl::StatusOr<models::BatchItem> item = model.Prepare(input, budget, {});
    EXPECT_TRUE(item.ok()) << item.status();
    return *std::move(item);
  };
  const models::BatchItem small = document(200, {});
  ASSERT_TRUE(model.Run({&small}, true).ok());  // warms up cuBLAS and cuDNN (their workspaces)
  absl::StatusOr<kernels::DeviceMemory> memory = kernels::CudaMemory(device);
  ASSERT_TRUE(memory.ok()) << memory.status();
  ASSERT_GT(memory->total_bytes, 0);
  // What the allocator holds now plus 96 MiB: a 65,536-token document at m = 256, k = 1024 needs more (its
  // routing scores alone are 2 heads x 256 x 65,536 float32 = 128 MiB).
  const double fraction =
      static_cast<double>(memory->reserved_bytes + (int64_t{96} << 20)) / static_cast<double>(memory->total_bytes);
  ASSERT_TRUE(kernels::LimitCudaMemory(device, fraction).ok());
  const models::BatchItem large = document(65536, Experts(256, 1024));
  absl::StatusOr<models::ClassifierOutput> failed = model.Run({&large}, true);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
  EXPECT_THAT(std::string(failed.status().message()), HasSubstr("out of memory")) << failed.status();
  // The model goes on working under the same limit.
  absl::StatusOr<models::ClassifierOutput> after = model.Run({&small}, true);
  EXPECT_TRUE(after.ok()) << after.status();
  ASSERT_TRUE(kernels::LimitCudaMemory(device, 1.0).ok());
}

}  // namespace
}  // namespace mita
