// mita-forward: the C++ forward of an image model package on given inputs, for comparison with other
// implementations of the same model (tests/timm_logits_test.py, scripts/bench_peers.py).
//
//   mita-forward --model=DIR --images=X.f32 --budgets=9x16,full --out=LOGITS.f32
//       images: raw little-endian float32 [B, in_channels, image_size, image_size], already normalised (the
//       model's input, as PreprocessImage makes it); budgets: B comma-separated budgets ("MxK" or "full"), or one
//       for every image; writes the logits, raw little-endian float32 [B, num_classes]. All B images run in one
//       batched forward, each with its own budget.
//   mita-forward --model=DIR --time --batch_size=32 --budget=25x25 --repeats=5 --threads=2
//       times VitClassifier::Forward on a batch of --batch_size images (--images if given, its first images
//       repeated as needed, else N(0, 1) values) after one warm-up forward, and prints one line per forward:
//       "forward_ms=<ms> batch_size=<B>" (end to end: preprocessed tensor in, logits out; no statistics).
// Exit status: 0 done, 1 a forward or a file failed, 2 a bad flag.
#include <ATen/Parallel.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/randn.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
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

ABSL_FLAG(std::string, model, "", "image model package folder");
ABSL_FLAG(std::string, images, "", "raw float32 model inputs [B, C, S, S] (see the file comment)");
ABSL_FLAG(std::string, budgets, "", "comma-separated budgets, one per image or one for all ('MxK' or 'full')");
ABSL_FLAG(std::string, out, "", "logits file to write (raw float32 [B, num_classes])");
ABSL_FLAG(bool, time, false, "time forwards instead of writing logits");
ABSL_FLAG(std::string, budget, "full", "--time: the budget of every image ('MxK' or 'full')");
ABSL_FLAG(int64_t, batch_size, 1, "--time: images per forward");
ABSL_FLAG(int, repeats, 5, "--time: timed forwards");
ABSL_FLAG(int, threads, 2, "LibTorch intra-op threads");
ABSL_FLAG(std::string, weights_dtype, "float32",
          "float32, or bfloat16 (a CUDA device, or a CPU with AVX512-BF16 or AMX-BF16)");

namespace {

using mita::models::AttentionBudget;

int Fail(const std::string& message, int code = 1) {
  std::fprintf(stderr, "mita-forward: %s\n", message.c_str());
  return code;
}

// The images of --images as a [B, C, S, S] tensor (B = file size / image size), or an undefined tensor when
// the file is missing or its size is not a whole number of images.
at::Tensor ReadImages(const std::string& path, const mita::models::VitConfig& config) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return {};
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const int64_t per_image = config.in_channels * config.image_size * config.image_size * 4;
  if (bytes.empty() || static_cast<int64_t>(bytes.size()) % per_image != 0) return {};
  const int64_t count = static_cast<int64_t>(bytes.size()) / per_image;
  return at::from_blob(bytes.data(), {count, config.in_channels, config.image_size, config.image_size},
                       at::TensorOptions().dtype(at::kFloat))
      .clone();
}

}  // namespace

int main(int argc, char** argv) {
  mita::kernels::ReexecWithOpenMpWaitSettingsIfUnset(argv);
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) { return absl::EndsWith(file, "/forward.cc"); };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage("The C++ forward of an image model package: logits of given inputs, or its time.");
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_model).empty()) return Fail("--model is required", 2);
  mita::kernels::SetIntraOpThreads(absl::GetFlag(FLAGS_threads));
  absl::StatusOr<mita::models::Placement> placement =
      mita::models::ParsePlacement("cpu", absl::GetFlag(FLAGS_weights_dtype));
  if (!placement.ok()) return Fail("--weights_dtype: " + std::string(placement.status().message()), 2);
  absl::StatusOr<std::unique_ptr<mita::models::VitClassifier>> model =
      mita::models::LoadVitClassifier(absl::GetFlag(FLAGS_model), *placement);
  if (!model.ok()) return Fail(std::string(model.status().message()), 2);
  const mita::models::VitConfig& config = (*model)->config();
  at::Tensor images;
  if (!absl::GetFlag(FLAGS_images).empty()) {
    images = ReadImages(absl::GetFlag(FLAGS_images), config);
    if (!images.defined()) {
      return Fail("--images " + absl::GetFlag(FLAGS_images) + ": missing, or not a whole number of float32 [" +
                  std::to_string(config.in_channels) + ", " + std::to_string(config.image_size) + ", " +
                  std::to_string(config.image_size) + "] images");
    }
  }

  if (absl::GetFlag(FLAGS_time)) {
    const int64_t batch = absl::GetFlag(FLAGS_batch_size);
    if (batch < 1 || batch > 4096) return Fail("--batch_size must be in [1, 4096]", 2);
    absl::StatusOr<AttentionBudget> budget = mita::models::ParseBudget(absl::GetFlag(FLAGS_budget));
    if (!budget.ok()) return Fail(std::string(budget.status().message()), 2);
    at::Tensor inputs;
    if (images.defined()) {
      std::vector<at::Tensor> parts;
      for (int64_t filled = 0; filled < batch; filled += images.size(0)) {
        parts.push_back(images.narrow(0, 0, std::min(images.size(0), batch - filled)));
      }
      inputs = at::cat(parts, 0);
    } else {
      inputs = at::randn({batch, config.in_channels, config.image_size, config.image_size});
    }
    const std::vector<AttentionBudget> budgets(static_cast<size_t>(batch), *budget);
    for (int r = -1; r < absl::GetFlag(FLAGS_repeats); ++r) {  // r = -1: the warm-up
      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<mita::models::ClassifierOutput> output = (*model)->Forward(inputs, budgets, false);
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (!output.ok()) return Fail(std::string(output.status().message()));
      if (r >= 0) std::printf("forward_ms=%.3f batch_size=%lld\n", ms, static_cast<long long>(batch));
    }
    return 0;
  }

  if (!images.defined()) return Fail("--images is required without --time", 2);
  if (absl::GetFlag(FLAGS_out).empty()) return Fail("--out is required without --time", 2);
  std::vector<AttentionBudget> budgets;
  for (absl::string_view text : absl::StrSplit(absl::GetFlag(FLAGS_budgets), ',')) {
    absl::StatusOr<AttentionBudget> budget = mita::models::ParseBudget(text);
    if (!budget.ok()) return Fail(std::string(budget.status().message()), 2);
    budgets.push_back(*budget);
  }
  const auto count = static_cast<size_t>(images.size(0));
  if (budgets.size() == 1) budgets.assign(count, budgets.front());
  if (budgets.size() != count) {
    return Fail("--budgets has " + std::to_string(budgets.size()) + " entries for " + std::to_string(count) +
                " images", 2);
  }
  absl::StatusOr<mita::models::ClassifierOutput> output = (*model)->Forward(images, budgets, false);
  if (!output.ok()) return Fail(std::string(output.status().message()));
  const at::Tensor logits = output->logits.contiguous();
  std::ofstream file(absl::GetFlag(FLAGS_out), std::ios::binary);
  file.write(static_cast<const char*>(logits.data_ptr()), static_cast<std::streamsize>(logits.nbytes()));
  if (!file) return Fail("cannot write " + absl::GetFlag(FLAGS_out));
  return 0;
}
