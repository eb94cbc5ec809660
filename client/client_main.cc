// mita-client: classifies image files or documents with a MiTA Serve server, or evaluates a labelled
// manifest.
//
//   mita-client --server=localhost:50051 --model=fashion-mnist-vit [budget flags] image.png ...
//   mita-client --model=DOCUMENT_MODEL [budget flags] [--truncate] report.txt ...   (UTF-8 text)
//   mita-client --model=DOCUMENT_MODEL --input=token_ids ids.txt ...   (token ids: integers separated by
//                                                                      whitespace or commas)
//   mita-client --manifest=test.csv --concurrency=8 [--quiet]
//   mita-client --list                      (list the server's models and their knobs)
//
// --input=auto (the default) asks the server for the model's input kind (GetModel): files are images for an
// image model and UTF-8 text documents for a document model. For each document the client prints the token
// count the server attended over, the budget applied (expert count and width after clamping to the
// document's length), and the timings (queue delay, compute, server total, client round trip).
// Budget flags (at most one form): --expert_count/--expert_width, --preset, --full_attention, or
// --latency_target_ms (with --budget_floor). Each answer's line names the applied budget, why the server applied
// it (requested, most_accurate, lowered_at_admission, lowered_at_batch_start) and the time it predicted for it.
// Manifest: CSV lines "path,label_index"; relative paths are relative to the manifest's folder; empty lines
// and lines starting with '#' are skipped, and so is a first line whose label is not a number (a header).
// Exit status: 0 when every RPC succeeded; 1 when any RPC failed (its gRPC code and message are printed) or
// an image could not be read; 2 for bad flags or an unreadable manifest.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "base/percentile.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/flags/usage_config.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/percentile.h"
#include "client/connection_flags.h"
#include "client/mita_client.h"

ABSL_FLAG(std::string, model, "fashion-mnist-vit", "Model name (see --list).");
ABSL_FLAG(int64_t, expert_count, 0, "Expert count m of an explicit MiTA budget (0: not set).");
ABSL_FLAG(int64_t, expert_width, 0, "Expert width k of an explicit MiTA budget (0: not set).");
ABSL_FLAG(std::string, preset, "", "Named budget preset of the model, e.g. fast.");
ABSL_FLAG(bool, full_attention, false, "Run full attention instead of MiTA.");
ABSL_FLAG(std::optional<int64_t>, latency_target_ms, std::nullopt,
          "Latency target, ms: the server applies the most accurate budget of the model's accuracy order (see "
          "--list) predicted to answer within it (0: within --deadline_ms). Unset: no target.");
ABSL_FLAG(std::string, budget_floor, "",
          "With --latency_target_ms: the least accurate budget the server may apply, a name of the accuracy order "
          "(empty: its last).");
ABSL_FLAG(int32_t, top_n, 0, "Classes to return (0: server default, 5).");
ABSL_FLAG(int64_t, deadline_ms, 10000,
          "Deadline of each Classify call, milliseconds (0: none); --input=auto's model lookup takes at least 10 s.");
ABSL_FLAG(bool, statistics, false, "Ask for and print per-layer attention statistics.");
ABSL_FLAG(std::string, manifest, "", "CSV file of 'path,label_index' lines to evaluate.");
ABSL_FLAG(int32_t, concurrency, 1, "Manifest requests in flight at once (threads).");
ABSL_FLAG(bool, quiet, false, "With --manifest: print only failures and the summary.");
ABSL_FLAG(bool, list, false, "List the server's models and their knobs, then exit.");
ABSL_FLAG(std::string, input, "auto",
          "What the files hold: auto (ask the server for the model's input kind), image, text (UTF-8 document) "
          "or token_ids (document as integers separated by whitespace or commas).");
ABSL_FLAG(bool, truncate, false, "Documents: cut a document longer than the model's maximum tokens.");

namespace {

using mita::client::ClassifyOptions;
using mita::client::MitaClient;
namespace v1 = mita::v1;

struct Item {
  std::string path;
  int64_t label = -1;  // -1: unknown
};

struct Outcome {
  absl::Status status = absl::OkStatus();
  bool sent = false;  // false: the request was not sent (the file or the flags were wrong here, in the client)
  v1::ClassifyResponse response;
  absl::Duration latency;  // client side
};

absl::StatusOr<std::vector<Item>> ReadManifest(const std::string& manifest) {
  std::ifstream file(manifest);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open manifest '", manifest, "'"));
  const std::filesystem::path base = std::filesystem::path(manifest).parent_path();
  std::vector<Item> items;
  std::string line;
  for (int number = 1; std::getline(file, line); ++number) {
    absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#') continue;
    const size_t comma = text.rfind(',');
    if (comma == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(manifest, ":", number, ": expected 'path,label_index', got '", text, "'"));
    }
    absl::string_view path = absl::StripAsciiWhitespace(text.substr(0, comma));
    int64_t label = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text.substr(comma + 1)), &label) || label < 0) {
      if (number == 1) continue;  // a header line
      return absl::InvalidArgumentError(absl::StrCat(
          manifest, ":", number, ": label_index must be an integer >= 0, got '", text.substr(comma + 1), "'"));
    }
    std::filesystem::path resolved(std::string{path});
    if (resolved.is_relative()) resolved = base / resolved;
    items.push_back(Item{resolved.string(), label});
  }
  return items;
}

std::string BudgetText(const v1::AppliedBudget& budget) {
  std::string text = budget.full_attention() ? std::string("full attention")
                                             : absl::StrCat("expert_count=", budget.expert_count(),
                                                            " expert_width=", budget.expert_width());
  if (!budget.preset().empty()) absl::StrAppend(&text, " (preset ", budget.preset(), ")");
  return text;
}

// "most_accurate" for BUDGET_REASON_MOST_ACCURATE: the server's metric label of the reason.
std::string ReasonText(v1::BudgetReason reason) {
  return absl::AsciiStrToLower(absl::StripPrefix(v1::BudgetReason_Name(reason), "BUDGET_REASON_"));
}

// Why the budget applied and the queue wait plus compute the server predicted for it (when it predicted one).
std::string BudgetReasonText(const v1::AppliedBudget& budget) {
  std::string text = absl::StrCat("budget reason ", ReasonText(budget.reason()));
  if (budget.predicted_us() > 0) {
    absl::StrAppend(&text, absl::StrFormat(", predicted %.2f ms", static_cast<double>(budget.predicted_us()) / 1000));
  }
  return text;
}

std::string TimingText(const v1::Timing& timing, absl::Duration client_latency) {
  return absl::StrFormat("queue_delay=%dus compute=%dus server_total=%dus batch_size=%d client=%.2fms",
                         timing.queue_delay_us(), timing.compute_us(), timing.total_us(), timing.batch_size(),
                         absl::ToDoubleMilliseconds(client_latency));
}

// The full report of one image.
void PrintDetailed(const std::string& path, const Outcome& outcome) {
  const v1::ClassifyResponse& response = outcome.response;
  std::cout << path << ": model " << response.model() << " version " << response.model_version() << ", " << BudgetText(response.budget()) << ", "
            << BudgetReasonText(response.budget()) << ", " << response.token_count() << " tokens";
  if (response.input_token_count() > response.token_count()) {
    std::cout << " (truncated from " << response.input_token_count() << ")";
  }
  std::cout << "\n";
  std::cout << "  timing: " << TimingText(response.timing(), outcome.latency) << "\n";
  for (const v1::ClassScore& score : response.classes()) {
    std::cout << absl::StrFormat("  %8.4f  %s (%d)\n", score.score(), score.label(), score.index());
  }
  for (const v1::LayerStatistics& layer : response.statistics()) {
    std::cout << absl::StrFormat(
        "  layer %d: load_imbalance=%.3f routing_entropy=%.3f pruned_key_fraction=%.3f expert_overlap_fraction=%.3f"
        " queries_per_expert=[%s]\n",
        layer.layer(), layer.load_imbalance(), layer.routing_entropy(), layer.pruned_key_fraction(),
        layer.expert_overlap_fraction(), absl::StrJoin(layer.queries_per_expert(), " ", [](std::string* out, float v) {
          absl::StrAppend(out, absl::StrFormat("%.1f", v));
        }));
  }
}

// `sent`: the server answered `status` (or the call failed on the way); otherwise the client found the problem
// before sending anything, and says so.
void PrintFailure(const std::string& path, const absl::Status& status, bool sent = true) {
  if (!sent) {
    std::cerr << path << ": NOT SENT (client-side error): " << status.message() << "\n";
    return;
  }
  std::cerr << path << ": FAILED " << absl::StatusCodeToString(status.code()) << ": " << status.message();
  // gRPC's own words when the deadline passed before the server answered (the server's own errors say more).
  if (status.code() == absl::StatusCode::kDeadlineExceeded && status.message() == "Deadline Exceeded") {
    std::cerr << " (the call's deadline, --deadline_ms, passed before the server answered)";
  }
  std::cerr << "\n";
}

int ListModels(const MitaClient& client, absl::Duration deadline) {
  absl::StatusOr<v1::ListModelsResponse> models = client.ListModels(deadline);
  if (!models.ok()) {
    PrintFailure("ListModels", models.status());
    return 1;
  }
  for (const v1::ModelMetadata& model : models->models()) {
    const v1::Knobs& knobs = model.knobs();
    std::cout << model.name() << " version " << model.version() << " (" << model.architecture() << ", on "
              << model.device() << " in "
              << model.weights_dtype() << "): " << model.labels_size() << " labels, "
              << model.layers() << " layers, " << model.heads() << " heads, embed_dim " << model.embed_dim();
    // Image models have a fixed token count; a document's is its own length (tokens_per_input is 0 then).
    if (model.tokens_per_input() > 0) {
      std::cout << ", " << model.tokens_per_input() << " tokens per input\n";
    } else {
      std::cout << ", tokens per input: the document's length\n";
    }
    if (model.input_kind() == v1::INPUT_KIND_IMAGE) {
      const v1::ImageLimits& image = model.image_limits();
      std::cout << "  input: image " << image.width() << "x" << image.height() << "x" << image.channels()
                << ", at most " << image.max_width() << "x" << image.max_height()
                << " pixels decoded (larger JPEGs decode scaled down, up to 8x per side) and "
                << image.max_encoded_bytes() << " bytes\n";
    } else if (model.input_kind() == v1::INPUT_KIND_DOCUMENT) {
      const v1::DocumentLimits& document = model.document_limits();
      std::cout << "  input: document (UTF-8 text or token ids), at most " << document.max_tokens()
                << " tokens, tokenizer " << document.tokenizer() << ", vocabulary " << document.vocabulary_size()
                << "\n";
    }
    const std::string counts =
        knobs.allowed_expert_counts_size() > 0
            ? absl::StrCat("one of ", absl::StrJoin(knobs.allowed_expert_counts(), ", "))
            : absl::StrCat(knobs.min_expert_count(), "..", knobs.max_expert_count());
    std::cout << "  expert_count: " << counts << "; expert_width: " << knobs.min_expert_width() << ".." << knobs.max_expert_width()
              << "; default: "
              << (knobs.default_full_attention()
                      ? std::string("full attention")
                      : absl::StrCat(knobs.default_budget().expert_count(), "/", knobs.default_budget().expert_width()))
              << "; full attention: " << (knobs.full_attention_supported() ? "yes" : "no") << "\n";
    for (const v1::NamedBudget& preset : knobs.presets()) {
      if (preset.full_attention()) {
        std::cout << "  preset " << preset.name() << ": full attention\n";
        continue;
      }
      std::cout << "  preset " << preset.name() << ": expert_count=" << preset.budget().expert_count()
                << " expert_width=" << preset.budget().expert_width() << "\n";
    }
    // The budgets a latency target chooses from (--budget_floor takes their names), most accurate first.
    if (knobs.accuracy_order_size() > 0) std::cout << "  accuracy order (latency targets, most accurate first):\n";
    for (const v1::DeclaredBudget& declared : knobs.accuracy_order()) {
      std::cout << "    " << declared.name() << ": "
                << (declared.full_attention() ? std::string("full attention")
                                              : absl::StrCat("expert_count=", declared.budget().expert_count(),
                                                             " expert_width=", declared.budget().expert_width()));
      if (declared.accuracy() >= 0) {
        std::cout << absl::StrFormat(", held-out accuracy %.4f", declared.accuracy());
      } else {
        std::cout << ", ranked by compute (no declared accuracy)";
      }
      if (declared.predicted_ms() > 0) {
        std::cout << absl::StrFormat(", predicted %.3f ms for %d tokens", declared.predicted_ms(),
                                     model.cost_profile().reference_tokens());
      }
      std::cout << "\n";
    }
  }
  return 0;
}

enum class InputKind { kImage, kText, kTokenIds };

// Classifies the file at `path` as `kind`: reads it, builds its request and sends it. Errors: reading or parsing
// the file, building the request (then `*sent` is false: nothing was sent), or the RPC's status (`*sent` true).
absl::StatusOr<v1::ClassifyResponse> ClassifyFile(const MitaClient& client, const std::string& path, InputKind kind,
                                                  const ClassifyOptions& options, absl::Duration* latency,
                                                  bool* sent) {
  *sent = false;
  absl::StatusOr<std::string> bytes = mita::client::ReadFileBytes(path);
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<v1::ClassifyRequest> request = absl::UnknownError("no input");
  switch (kind) {
    case InputKind::kImage:
      request = mita::client::BuildClassifyRequest(*std::move(bytes), options);
      break;
    case InputKind::kText:
      request = mita::client::BuildTextRequest(*std::move(bytes), options);
      break;
    case InputKind::kTokenIds: {
      absl::StatusOr<std::vector<int64_t>> ids = mita::client::ParseTokenIds(*bytes);
      if (!ids.ok()) return ids.status();
      request = mita::client::BuildTokenIdsRequest(*ids, options);
      break;
    }
  }
  if (!request.ok()) return request.status();
  *sent = true;
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::ClassifyResponse> response = client.ClassifyRaw(*request, options.deadline);
  *latency = absl::Now() - start;
  return response;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Classifies images and documents with a MiTA Serve server.\n"
      "  mita-client [flags] image.png ...\n  mita-client --model=DOCUMENT_MODEL [flags] document.txt ...\n"
      "  mita-client --manifest=FILE [--concurrency=N] [flags]\n"
      "  mita-client --list");
  // --help lists the flags of this file (Abseil would look for a file named after the binary).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "/client_main.cc") || absl::EndsWith(file, "/connection_flags.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  std::vector<std::string> files(positional.begin() + 1, positional.end());

  const int64_t deadline_ms = absl::GetFlag(FLAGS_deadline_ms);
  if (deadline_ms < 0) {
    std::cerr << "--deadline_ms must be >= 0\n";
    return 2;
  }
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  if (concurrency < 1) {
    std::cerr << "--concurrency must be >= 1\n";
    return 2;
  }
  ClassifyOptions options;
  options.model = absl::GetFlag(FLAGS_model);
  if (absl::GetFlag(FLAGS_expert_count) != 0) options.expert_count = absl::GetFlag(FLAGS_expert_count);
  if (absl::GetFlag(FLAGS_expert_width) != 0) options.expert_width = absl::GetFlag(FLAGS_expert_width);
  options.preset = absl::GetFlag(FLAGS_preset);
  options.full_attention = absl::GetFlag(FLAGS_full_attention);
  options.latency_target_ms = absl::GetFlag(FLAGS_latency_target_ms);
  options.budget_floor = absl::GetFlag(FLAGS_budget_floor);
  if (options.latency_target_ms.has_value() && *options.latency_target_ms < 0) {
    std::cerr << "flag --latency_target_ms: " << *options.latency_target_ms
              << " is out of range: allowed >= 0 (0 means --deadline_ms)\n";
    return 2;
  }
  options.top_n = absl::GetFlag(FLAGS_top_n);
  options.deadline = deadline_ms == 0 ? absl::InfiniteDuration() : absl::Milliseconds(deadline_ms);
  options.return_statistics = absl::GetFlag(FLAGS_statistics);
  options.truncate = absl::GetFlag(FLAGS_truncate);
  const std::string input = absl::GetFlag(FLAGS_input);
  if (input != "auto" && input != "image" && input != "text" && input != "token_ids") {
    std::cerr << "--input must be auto, image, text or token_ids, got '" << input << "'\n";
    return 2;
  }
  if (absl::StatusOr<v1::ClassifyRequest> check = mita::client::BuildClassifyRequest("", options); !check.ok()) {
    std::cerr << check.status().message() << "\n";
    return 2;
  }

  absl::StatusOr<mita::client::ConnectionOptions> connection = mita::client::ConnectionOptionsFromFlags();
  if (!connection.ok()) {
    std::cerr << connection.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<std::unique_ptr<MitaClient>> connected = MitaClient::Connect(*connection);
  if (!connected.ok()) {
    std::cerr << connected.status().message() << "\n";
    return 2;
  }
  std::unique_ptr<MitaClient> client = *std::move(connected);
  if (absl::GetFlag(FLAGS_list)) return ListModels(*client, options.deadline);

  std::vector<Item> items;
  for (const std::string& file : files) items.push_back(Item{file, -1});
  const std::string manifest = absl::GetFlag(FLAGS_manifest);
  const bool evaluating = !manifest.empty();
  if (evaluating) {
    absl::StatusOr<std::vector<Item>> listed = ReadManifest(manifest);
    if (!listed.ok()) {
      std::cerr << listed.status().message() << "\n";
      return 2;
    }
    items.insert(items.end(), listed->begin(), listed->end());
  }
  if (items.empty()) {
    std::cerr << "nothing to classify: give image or document files, --manifest or --list (see --help)\n";
    return 2;
  }
  InputKind kind = InputKind::kImage;
  if (input == "text") {
    kind = InputKind::kText;
  } else if (input == "token_ids") {
    kind = InputKind::kTokenIds;
  } else if (input == "auto") {
    // The lookup is the client's own step, not a call the user timed: a tiny --deadline_ms is for Classify.
    absl::StatusOr<v1::ModelMetadata> metadata =
        client->GetModel(options.model, std::max(options.deadline, absl::Seconds(10)));
    if (!metadata.ok()) {
      PrintFailure(absl::StrCat("GetModel ", options.model), metadata.status());
      return 1;
    }
    if (metadata->input_kind() == v1::INPUT_KIND_DOCUMENT) kind = InputKind::kText;
  }
  const char* noun = kind == InputKind::kImage ? "images" : "documents";

  std::vector<Outcome> outcomes(items.size());
  std::atomic<size_t> next{0};
  std::mutex print_mu;
  const bool detailed = !evaluating || !absl::GetFlag(FLAGS_quiet);
  auto worker = [&] {
    for (size_t i = next++; i < items.size(); i = next++) {
      Outcome& outcome = outcomes[i];
      absl::StatusOr<v1::ClassifyResponse> response =
          ClassifyFile(*client, items[i].path, kind, options, &outcome.latency, &outcome.sent);
      if (response.ok()) {
        outcome.response = *std::move(response);
      } else {
        outcome.status = response.status();
      }
      std::lock_guard<std::mutex> lock(print_mu);
      if (!outcome.status.ok()) {
        PrintFailure(items[i].path, outcome.status, outcome.sent);
      } else if (detailed) {
        PrintDetailed(items[i].path, outcome);
      }
    }
  };
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (int t = 0; t < std::min<int>(concurrency, static_cast<int>(items.size())); ++t) threads.emplace_back(worker);
  for (std::thread& thread : threads) thread.join();
  const absl::Duration wall = absl::Now() - start;

  int64_t failed = 0, not_sent = 0, succeeded = 0, labelled = 0, correct = 0;
  double queue_us = 0, compute_us = 0;
  std::vector<double> latencies_ms;
  for (size_t i = 0; i < items.size(); ++i) {
    const Outcome& outcome = outcomes[i];
    if (!outcome.status.ok()) {
      ++failed;
      if (!outcome.sent) ++not_sent;
      continue;
    }
    ++succeeded;
    latencies_ms.push_back(absl::ToDoubleMilliseconds(outcome.latency));
    queue_us += static_cast<double>(outcome.response.timing().queue_delay_us());
    compute_us += static_cast<double>(outcome.response.timing().compute_us());
    if (items[i].label >= 0) {
      ++labelled;
      if (outcome.response.classes_size() > 0 && outcome.response.classes(0).index() == items[i].label) ++correct;
    }
  }
  if (evaluating) {
    const double n = std::max<double>(1, static_cast<double>(succeeded));
    std::cout << absl::StrFormat("%s: %d (%d failed", noun, items.size(), failed)
              << (not_sent > 0 ? absl::StrFormat(", %d of them not sent: client-side errors", not_sent) : "") << ")\n";
    if (labelled > 0) {
      std::cout << absl::StrFormat("accuracy (top-1): %.4f (%d of %d)\n",
                                   static_cast<double>(correct) / static_cast<double>(labelled), correct, labelled);
    }
    std::cout << absl::StrFormat("client latency: p50 %.2f ms, p95 %.2f ms, p99 %.2f ms\n",
                                 mita::Percentile(latencies_ms, 50), mita::Percentile(latencies_ms, 95),
                                 mita::Percentile(latencies_ms, 99));
    std::cout << absl::StrFormat("server: mean queue delay %.3f ms, mean compute %.3f ms\n", queue_us / n / 1000.0,
                                 compute_us / n / 1000.0);
    std::cout << absl::StrFormat("throughput: %.1f %s/s (%d in %.2f s, concurrency %d)\n",
                                 static_cast<double>(succeeded) / std::max(1e-9, absl::ToDoubleSeconds(wall)), noun,
                                 succeeded, absl::ToDoubleSeconds(wall), concurrency);
  }
  return failed > 0 ? 1 : 0;
}
