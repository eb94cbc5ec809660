// mita-attention-forward: the serving MiTA forward (kernels::MitaAttentionForward) on given q, k, v and landmarks,
// for comparison with other implementations (tests/sparse_attention_test.py checks tools/mita_sparse.py against it).
//
//   mita-attention-forward --inputs=DIR --out=FILE [--backend=kernel|reference] [--threads=T]
//       DIR/inputs.json: {"dtype": "float64" | "float32", "shape": [B, H, N, d],
//                         "items": [{"expert_count": M_b, "expert_width": k_b}, ... B entries]}
//       DIR/q.bin, DIR/k.bin, DIR/v.bin: raw little-endian [B, H, N, d] of that dtype;
//       DIR/landmarks_<b>.bin: raw [H, M_b, d], item b's landmarks.
//   Writes the output [B, H, N, d] of the same dtype, raw, to FILE. backend kernel: the CPU kernel
//   (MitaBackend::kAuto on the CPU); reference: the plain-ATen reference.
// Exit status: 0 done, 1 the forward or a file failed, 2 a bad flag or input description.
#include <ATen/ops/from_blob.h>

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
#include "kernels/mita_attention.h"
#include "kernels/runtime_environment.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, inputs, "", "folder with inputs.json, q.bin, k.bin, v.bin, landmarks_<b>.bin (file comment)");
ABSL_FLAG(std::string, out, "", "output file: raw [B, H, N, d] of the inputs' dtype");
ABSL_FLAG(std::string, backend, "kernel", "kernel (the CPU kernel the server runs) or reference (plain ATen)");
ABSL_FLAG(int, threads, 1, "LibTorch intra-op threads");

namespace {

int Fail(const std::string& message, int code = 1) {
  std::fprintf(stderr, "mita-attention-forward: %s\n", message.c_str());
  return code;
}

// The file's bytes as a tensor of `shape` and `dtype`, or an undefined tensor when the file is missing or its
// size does not match.
at::Tensor ReadTensor(const std::string& path, at::IntArrayRef shape, at::ScalarType dtype) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return {};
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  int64_t elements = 1;
  for (int64_t size : shape) elements *= size;
  if (static_cast<int64_t>(bytes.size()) != elements * static_cast<int64_t>(c10::elementSize(dtype))) return {};
  return at::from_blob(bytes.data(), shape, at::TensorOptions().dtype(dtype)).clone();
}

}  // namespace

int main(int argc, char** argv) {
  mita::kernels::ReexecWithOpenMpWaitSettingsIfUnset(argv);
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "/attention_forward.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage("The serving MiTA forward on given q, k, v and landmarks (see the file comment).");
  absl::ParseCommandLine(argc, argv);
  const std::string folder = absl::GetFlag(FLAGS_inputs);
  if (folder.empty() || absl::GetFlag(FLAGS_out).empty()) return Fail("--inputs and --out are required", 2);
  const std::string backend_name = absl::GetFlag(FLAGS_backend);
  if (backend_name != "kernel" && backend_name != "reference") {
    return Fail("--backend must be kernel or reference, not '" + backend_name + "'", 2);
  }
  mita::kernels::SetIntraOpThreads(absl::GetFlag(FLAGS_threads));

  nlohmann::json description;
  try {
    std::ifstream file(folder + "/inputs.json");
    if (!file) return Fail("cannot read " + folder + "/inputs.json", 2);
    description = nlohmann::json::parse(file);
    const std::string dtype_name = description.at("dtype").get<std::string>();
    if (dtype_name != "float32" && dtype_name != "float64") return Fail("dtype must be float32 or float64", 2);
    const at::ScalarType dtype = dtype_name == "float64" ? at::kDouble : at::kFloat;
    const std::vector<int64_t> shape = description.at("shape").get<std::vector<int64_t>>();
    if (shape.size() != 4) return Fail("shape must be [B, H, N, d]", 2);
    const at::Tensor q = ReadTensor(folder + "/q.bin", shape, dtype);
    const at::Tensor k = ReadTensor(folder + "/k.bin", shape, dtype);
    const at::Tensor v = ReadTensor(folder + "/v.bin", shape, dtype);
    if (!q.defined() || !k.defined() || !v.defined()) return Fail("q.bin, k.bin or v.bin is missing or mis-sized", 2);
    const auto& items_json = description.at("items");
    std::vector<mita::kernels::MitaItem> items;
    for (size_t b = 0; b < items_json.size(); ++b) {
      const int64_t expert_count = items_json[b].at("expert_count").get<int64_t>();
      mita::kernels::MitaItem item;
      item.expert_width = items_json[b].at("expert_width").get<int64_t>();
      item.landmarks = ReadTensor(folder + "/landmarks_" + std::to_string(b) + ".bin",
                                  {shape[1], expert_count, shape[3]}, dtype);
      if (!item.landmarks.defined()) return Fail("landmarks_" + std::to_string(b) + ".bin is missing or mis-sized", 2);
      items.push_back(std::move(item));
    }
    const absl::StatusOr<at::Tensor> output = mita::kernels::MitaAttentionForward(
        q, k, v, items, nullptr,
        backend_name == "kernel" ? mita::kernels::MitaBackend::kAuto : mita::kernels::MitaBackend::kReference);
    if (!output.ok()) return Fail(std::string(output.status().message()));
    const at::Tensor result = output->contiguous();
    std::ofstream out(absl::GetFlag(FLAGS_out), std::ios::binary);
    out.write(static_cast<const char*>(result.data_ptr()), static_cast<std::streamsize>(result.nbytes()));
    if (!out) return Fail("cannot write " + absl::GetFlag(FLAGS_out));
  } catch (const nlohmann::json::exception& error) {
    return Fail(std::string("inputs.json: ") + error.what(), 2);
  }
  return 0;
}
