// mita-bench-documents: latency and peak memory of ONE long document (4K to 64K tokens of real text) through a
// document model, with MiTA at several budgets and with full attention on the same weights, in one run.
//
//   mita-bench-documents --model=models/repository/linux-doc-mita --corpus=build/linux-doc-corpus --threads=2
// The text: the held-out documents of the corpus concatenated (blank line between them) and tokenized with the
// package's tokenizer; a case of N tokens uses the first N ids. Each (N, budget) case runs in a fresh child
// process (this program with --child), so its peak resident memory (getrusage ru_maxrss) is its own: the child
// loads the package, records ru_maxrss (the baseline: libraries + weights), runs one warm-up forward on the
// first 512 tokens, then --repeats timed forwards of the N-token document (--full_repeats for full attention at
// N >= 32768, whose single forward takes tens of seconds here), and reports the median latency and ru_maxrss.
// Latency is end to end in-process: Forward() from token ids to logits (embedding, position convolution, every
// layer, pooling, head; tokenization excluded). The speedup column is full attention's median / the case's
// median at the same N, measured in the same run.
// Memory: with --keep_freed_memory (default) each child calls mita::kernels::KeepFreedMemoryForReuse()
// (mallopt(M_MMAP_MAX, 0), mallopt(M_TRIM_THRESHOLD, max)), as mita-server does by default, so that multi-MiB
// buffers are reused from the heap instead of being mapped and page-faulted in again at every layer (a fresh
// 64 MiB buffer costs ~220 ms of page faults on this machine); the same setting applies to every case. Above
// --keep_freed_memory_limit_bytes of freed memory (checked every second) the heap returns it, as mita-server's does.
// --pack=P adds, per case, one packed forward of P copies of the document (the server's packed batch) timed
// alternately with the P forwards one after another; --full=false leaves out full attention.
// --device=cuda:N (--weights_dtype=bfloat16) runs the children on a CUDA device (ids copied from pinned memory;
// Forward returns the logits to the host, so each timed forward includes the wait for the device) and adds the
// caching allocator's peak GPU memory to the table.
#include <sys/resource.h>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
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
#include "absl/types/span.h"
#include "kernels/device.h"
#include "kernels/runtime_environment.h"
#include "models/model_package.h"
#include "tools/document_corpus.h"

ABSL_FLAG(std::string, model, "models/repository/linux-doc-mita", "document model package folder");
ABSL_FLAG(std::string, corpus, "build/linux-doc-corpus", "corpus folder (tools/build_document_corpus.py)");
ABSL_FLAG(std::string, tokens, "4096,16384,32768,65536", "comma-separated document lengths, tokens");
ABSL_FLAG(std::string, budgets, "8x32,16x64,32x128",
          "comma-separated expert_count x expert_width budgets; full attention is added unless --full=false");
ABSL_FLAG(int, repeats, 3, "timed forwards per case (the median is reported)");
ABSL_FLAG(int, full_repeats, 1, "timed forwards for full attention at N >= 32768");
ABSL_FLAG(bool, full, true, "also time full attention on the same weights (the speedup column's baseline)");
ABSL_FLAG(int, pack, 1,
          "documents per case: with P > 1 each case also times P copies of the N-token document as one packed "
          "batch (one Forward of P*N tokens) against the same P documents one after another, alternated");
ABSL_FLAG(int, threads, 2, "LibTorch intra-op threads");
ABSL_FLAG(std::string, device, "cpu", "where the model runs: cpu or cuda:N");
ABSL_FLAG(std::string, weights_dtype, "float32",
          "float32, or bfloat16 (a CUDA device, or a CPU with AVX512-BF16 or AMX-BF16)");
ABSL_FLAG(bool, keep_freed_memory, true, "mallopt: keep freed memory in the heap for reuse (see the file comment)");
ABSL_FLAG(int64_t, keep_freed_memory_limit_bytes, int64_t{512} << 20,
          "with --keep_freed_memory: the most resident memory the heap keeps free, as mita-server's flag of the same "
          "name (checked every second, returned above it; kernels::FreedMemoryLimit); 0: no limit");
// Internal: run one case and print one result line.
ABSL_FLAG(bool, child, false, "internal: run one case (used by the parent process)");
ABSL_FLAG(std::string, ids_file, "", "internal: token ids, raw int64");
ABSL_FLAG(std::string, budget, "", "internal: the case's budget, 'MxK' or 'full'");

namespace {

using Clock = std::chrono::steady_clock;

int64_t MaxRssKilobytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

// One case in this (child) process: prints "RESULT median_ms=... baseline_kb=... peak_kb=...".
int RunChild() {
  std::unique_ptr<mita::kernels::FreedMemoryLimit> freed_memory_limit;
  if (absl::GetFlag(FLAGS_keep_freed_memory) && mita::kernels::KeepFreedMemoryForReuse() &&
      absl::GetFlag(FLAGS_keep_freed_memory_limit_bytes) > 0) {
    freed_memory_limit = std::make_unique<mita::kernels::FreedMemoryLimit>(
        absl::GetFlag(FLAGS_keep_freed_memory_limit_bytes), absl::Seconds(1));
  }
  mita::kernels::SetIntraOpThreads(absl::GetFlag(FLAGS_threads));
  absl::StatusOr<mita::models::Placement> placement =
      mita::models::ParsePlacement(absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_weights_dtype));
  if (!placement.ok()) {
    std::fprintf(stderr, "child: %s\n", placement.status().ToString().c_str());
    return 1;
  }
  auto loaded = mita::models::LoadDocumentClassifier(absl::GetFlag(FLAGS_model), *placement);
  if (!loaded.ok()) {
    std::fprintf(stderr, "child: %s\n", loaded.status().ToString().c_str());
    return 1;
  }
  std::ifstream file(absl::GetFlag(FLAGS_ids_file), std::ios::binary);
  std::vector<int64_t> ids;
  int64_t id = 0;
  while (file.read(reinterpret_cast<char*>(&id), sizeof(id))) ids.push_back(id);
  auto budget = mita::models::ParseBudget(absl::GetFlag(FLAGS_budget));
  if (!budget.ok()) {
    std::fprintf(stderr, "child: %s\n", budget.status().ToString().c_str());
    return 1;
  }
  const auto tokens = static_cast<int64_t>(ids.size());
  at::Tensor document = at::tensor(ids, at::TensorOptions().dtype(at::kLong));
  // On a CUDA device from pinned memory, as mita-server's batches are.
  if (placement->device.is_cuda()) document = document.pin_memory();
  const int64_t baseline_kb = MaxRssKilobytes();
  const mita::models::DocumentClassifier& model = **loaded;
  const int64_t warmup_tokens = std::min<int64_t>(512, tokens);
  const int repeats = budget->full_attention && tokens >= 32768 ? absl::GetFlag(FLAGS_full_repeats)
                                                                : absl::GetFlag(FLAGS_repeats);
  const int pack = std::max(1, absl::GetFlag(FLAGS_pack));
  // With --pack=P: P copies back to back, one packed forward (the server's packed batch), timed alternately with
  // the P documents one after another (pack_milliseconds: the packed forwards; milliseconds: the P single ones, per
  // document).
  const at::Tensor packed = pack > 1 ? document.repeat({pack}) : at::Tensor();
  const std::vector<int64_t> packed_lengths(pack, tokens);
  const mita::models::AttentionBudget applied = mita::models::ApplyBudget(*budget, tokens);
  const std::vector<mita::models::AttentionBudget> packed_budgets(pack, applied);
  // One forward; false (after printing why) when it failed.
  auto forward = [&model](const at::Tensor& ids, absl::Span<const int64_t> lengths,
                          absl::Span<const mita::models::AttentionBudget> budgets) {
    auto output = model.Forward(ids, lengths, budgets, false);
    if (!output.ok()) std::fprintf(stderr, "child: %s\n", output.status().ToString().c_str());
    return output.ok();
  };
  if (!forward(document.narrow(0, 0, warmup_tokens), {warmup_tokens},
               {mita::models::ApplyBudget(*budget, warmup_tokens)})) {
    return 1;
  }
  std::vector<double> milliseconds, pack_milliseconds;
  for (int r = 0; r < std::max(1, repeats); ++r) {
    if (pack > 1) {
      const auto start = Clock::now();
      if (!forward(packed, packed_lengths, packed_budgets)) return 1;
      pack_milliseconds.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    }
    const auto start = Clock::now();
    for (int p = 0; p < pack; ++p) {
      if (!forward(document, {tokens}, {applied})) return 1;
    }
    milliseconds.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count() / pack);
  }
  std::sort(milliseconds.begin(), milliseconds.end());
  std::sort(pack_milliseconds.begin(), pack_milliseconds.end());
  const double pack_median_ms = pack > 1 ? pack_milliseconds[pack_milliseconds.size() / 2] : 0.0;
  // On a CUDA device: the caching allocator's peak (weights, activations, attention scratch).
  int64_t device_peak_kb = 0;
  if (placement->device.is_cuda()) {
    absl::StatusOr<mita::kernels::DeviceMemory> memory = mita::kernels::CudaMemory(placement->device);
    if (memory.ok()) device_peak_kb = memory->peak_allocated_bytes / 1024;
  }
  std::printf(
      "RESULT median_ms=%.3f min_ms=%.3f runs=%zu baseline_kb=%lld peak_kb=%lld device_peak_kb=%lld "
      "pack_median_ms=%.3f\n",
      milliseconds[milliseconds.size() / 2], milliseconds.front(), milliseconds.size(),
      static_cast<long long>(baseline_kb), static_cast<long long>(MaxRssKilobytes()),
      static_cast<long long>(device_peak_kb), pack_median_ms);
  return 0;
}

struct CaseResult {
  double median_ms = 0, min_ms = 0;
  int runs = 0;
  long long baseline_kb = 0, peak_kb = 0, device_peak_kb = 0;
  double pack_median_ms = 0;  // --pack > 1: the packed forward of P documents
};

}  // namespace

int main(int argc, char** argv) {
  mita::kernels::ReexecWithOpenMpWaitSettingsIfUnset(argv);
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "/benchmark_documents.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "Latency and peak memory of one 4K-64K-token document, MiTA vs full attention.");
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_child)) return RunChild();

  // The parent only tokenizes, on the CPU; it checks the children's placement first.
  absl::StatusOr<mita::models::Placement> placement =
      mita::models::ParsePlacement(absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_weights_dtype));
  if (!placement.ok()) {
    std::fprintf(stderr, "--device/--weights_dtype: %s\n", placement.status().ToString().c_str());
    return 1;
  }
  const bool on_cuda = placement->device.is_cuda();
  auto loaded = mita::models::LoadDocumentClassifier(absl::GetFlag(FLAGS_model));
  if (!loaded.ok()) {
    std::fprintf(stderr, "%s\n", loaded.status().ToString().c_str());
    return 1;
  }
  const mita::models::DocumentClassifier& model = **loaded;
  if (model.tokenizer() == nullptr) {
    std::fprintf(stderr, "%s has no tokenizer\n", absl::GetFlag(FLAGS_model).c_str());
    return 1;
  }
  std::vector<int64_t> lengths;
  for (absl::string_view entry : absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',', absl::SkipEmpty())) {
    int64_t length = 0;
    if (!absl::SimpleAtoi(entry, &length) || length < 1 || length > model.config().max_tokens) {
      std::fprintf(stderr, "--tokens: '%s' is not in [1, %lld]\n", std::string(entry).c_str(),
                   static_cast<long long>(model.config().max_tokens));
      return 1;
    }
    lengths.push_back(length);
  }
  std::vector<std::string> budgets;
  for (absl::string_view entry : absl::StrSplit(absl::GetFlag(FLAGS_budgets), ',', absl::SkipEmpty())) {
    auto budget = mita::models::ParseBudget(entry);
    if (!budget.ok() || !mita::models::CheckBudget(model.description().knobs, *budget).ok()) {
      std::fprintf(stderr, "--budgets: '%s' is not a valid budget of this model\n", std::string(entry).c_str());
      return 1;
    }
    budgets.emplace_back(entry);
  }
  if (absl::GetFlag(FLAGS_full)) budgets.push_back("full");

  // Real text: held-out documents concatenated until the longest case is covered.
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  auto documents = mita::datasets::ReadCorpusSplit(absl::GetFlag(FLAGS_corpus), "heldout");
  if (!documents.ok()) {
    std::fprintf(stderr, "%s\n", documents.status().ToString().c_str());
    return 1;
  }
  std::string text;
  std::vector<int64_t> ids;
  size_t used = 0;
  for (const auto& document : *documents) {
    text += document.text;
    text += "\n\n";
    ++used;
    if (static_cast<int64_t>(text.size()) / 8 < longest) continue;  // cheap lower bound before tokenizing
    auto encoded = model.tokenizer()->Encode(text);
    if (!encoded.ok()) {
      std::fprintf(stderr, "%s\n", encoded.status().ToString().c_str());
      return 1;
    }
    ids = *std::move(encoded);
    if (static_cast<int64_t>(ids.size()) >= longest) break;
  }
  if (static_cast<int64_t>(ids.size()) < longest) {
    std::fprintf(stderr, "the held-out corpus gives only %zu tokens\n", ids.size());
    return 1;
  }
  std::printf("model %s (%s tokenizer, embed dim %lld, %lld blocks, %lld heads) on %s in %s; text: the first %zu "
              "held-out documents concatenated (%zu bytes, %zu tokens); %d threads; one child process per case\n",
              absl::GetFlag(FLAGS_model).c_str(), model.tokenizer()->name().c_str(),
              static_cast<long long>(model.config().embed_dim),
              static_cast<long long>(model.config().depth),
              static_cast<long long>(model.config().num_heads), absl::GetFlag(FLAGS_device).c_str(),
              absl::GetFlag(FLAGS_weights_dtype).c_str(), used, text.size(), ids.size(),
              absl::GetFlag(FLAGS_threads));
  std::fflush(stdout);

  const std::string ids_file = absl::StrCat("/tmp/mita_bench_documents_", getpid(), ".i64");
  std::map<std::pair<int64_t, std::string>, CaseResult> results;
  for (int64_t length : lengths) {
    {
      std::ofstream file(ids_file, std::ios::binary | std::ios::trunc);
      file.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(length * sizeof(int64_t)));
    }
    for (const std::string& budget : budgets) {
      const std::string command = absl::StrCat(
          "/proc/", getpid(), "/exe --child --model='", absl::GetFlag(FLAGS_model), "' --ids_file=", ids_file,
          " --budget=", budget, " --threads=", absl::GetFlag(FLAGS_threads), " --repeats=", absl::GetFlag(FLAGS_repeats),
          " --full_repeats=", absl::GetFlag(FLAGS_full_repeats), " --pack=", absl::GetFlag(FLAGS_pack),
          " --device=", absl::GetFlag(FLAGS_device),
          " --weights_dtype=", absl::GetFlag(FLAGS_weights_dtype),
          " --keep_freed_memory=", absl::GetFlag(FLAGS_keep_freed_memory) ? "true" : "false",
          " --keep_freed_memory_limit_bytes=", absl::GetFlag(FLAGS_keep_freed_memory_limit_bytes));
      FILE* pipe = popen(command.c_str(), "r");
      CaseResult result;
      char line[512];
      bool found = false;
      while (pipe != nullptr && std::fgets(line, sizeof(line), pipe) != nullptr) {
        found |= std::sscanf(line,
                             "RESULT median_ms=%lf min_ms=%lf runs=%d baseline_kb=%lld peak_kb=%lld "
                             "device_peak_kb=%lld pack_median_ms=%lf",
                             &result.median_ms, &result.min_ms, &result.runs, &result.baseline_kb, &result.peak_kb,
                             &result.device_peak_kb, &result.pack_median_ms) == 7;
      }
      if (pipe == nullptr || pclose(pipe) != 0 || !found) {
        std::fprintf(stderr, "case N=%lld budget %s failed\n", static_cast<long long>(length), budget.c_str());
        std::remove(ids_file.c_str());
        return 1;
      }
      results[{length, budget}] = result;
      std::fprintf(stderr, "N=%lld %s: %.1f ms, peak %.1f MiB\n", static_cast<long long>(length), budget.c_str(),
                   result.median_ms, result.peak_kb / 1024.0);
    }
  }
  std::remove(ids_file.c_str());

  const int pack = absl::GetFlag(FLAGS_pack);
  std::printf("\n| tokens N | attention | latency median (ms) | runs | speedup vs full | peak RSS (MiB) | "
              "peak RSS - baseline (MiB) |%s%s\n|---|---|---|---|---|---|---|%s%s\n",
              on_cuda ? " peak GPU allocated (MiB) |" : "",
              pack > 1 ? absl::StrCat(" packed ", pack, " documents (ms) | packed / one after another |").c_str() : "",
              on_cuda ? "---|" : "", pack > 1 ? "---|---|" : "");
  for (int64_t length : lengths) {
    const auto full = results.find({length, "full"});
    for (const std::string& budget : budgets) {
      const CaseResult& result = results[{length, budget}];
      const std::string name = mita::models::BudgetName(*mita::models::ParseBudget(budget));  // parsed above
      std::printf("| %lld | %s | %.1f | %d | %s | %.1f | %.1f |%s%s\n", static_cast<long long>(length),
                  name.c_str(), result.median_ms, result.runs,
                  full == results.end() ? "-" : absl::StrFormat("%.1fx", full->second.median_ms / result.median_ms).c_str(),
                  result.peak_kb / 1024.0, (result.peak_kb - result.baseline_kb) / 1024.0,
                  on_cuda ? absl::StrFormat(" %.1f |", result.device_peak_kb / 1024.0).c_str() : "",
                  pack > 1 ? absl::StrFormat(" %.1f | %.2f |", result.pack_median_ms,
                                             result.pack_median_ms / (pack * result.median_ms))
                                 .c_str()
                           : "");
    }
  }
  return 0;
}
