// mita-bench: load and soak tool for a MiTA Serve server (mita.v1.MitaService/Classify).
//
//   mita-bench --server=HOST:PORT --manifest=inputs.csv --mode=closed --concurrency=16 --requests=5000
//   mita-bench --server=HOST:PORT --manifest=inputs.csv --mode=open --rate=400 --duration_s=30
//
// Load: closed loop (--concurrency calls always in flight; a new one starts when one ends) or open loop
// (calls start at --rate per second with exponential inter-arrival times, whatever the answers; at most
// --max_in_flight at once, further arrivals are counted as "not sent"). Each call draws, with a seeded
// generator, an input from the manifest, a budget from --budgets and a deadline from --deadlines_ms.
//
// Inputs (--manifest, CSV, paths relative to the manifest's folder, '#' comments and empty lines skipped):
//   kind,path[,model]      kind is image (PNG/JPEG bytes) or document (UTF-8 text file; --truncate cuts one over
//                          the model's maximum tokens); model overrides --model for that line (e.g. a document
//                          model next to an image model)
//   path,label_index       the manifest mita-export-images writes (images; the label is ignored)
//
// Report (stdout): throughput (answers/s and OK/s), client latency p50/p95/p99 of OK calls (and of all
// calls), mean server batch size, counts per gRPC status code, OK answers per server (the peer that answered: with
// --server listing replicas and --load_balancing=round_robin, how evenly calls spread) and each error message with
// its count; against the deadlines: goodput (OK answers
// within their call's deadline per second of the measured window), the deadline-miss rate (calls without an
// answer by their deadline: DEADLINE_EXCEEDED at or after it, and OK answers later than it, over the measured
// calls sent) and the rejection rate (RESOURCE_EXHAUSTED, UNAVAILABLE, and DEADLINE_EXCEEDED answered before the
// deadline, i.e. refused by the server's deadline admission, over the same); the mean applied budget of OK
// answers (expert count and width over those that ran MiTA, the fraction that ran full attention) and their count
// by budget reason, and the p50 client latency of the DEADLINE_EXCEEDED answers; with
// --server_pid, the server's resident memory (VmRSS from /proc/PID/status) after the warm-up, at the end, its
// maximum, and the growth. The last line is "RESULT key=value ..." for scripts (new keys are appended: scripts
// read some by position). Exit status 0 when the run completed with at least one OK answer (errors are counted,
// not fatal), 1 when no call was answered OK (an unreachable server, or every call refused), 2 for bad flags or
// inputs.
//
// One thread drives everything through a gRPC CompletionQueue (the async API), so the tool itself uses
// little CPU next to the server.
#include <grpcpp/client_context.h>
#include <grpcpp/completion_queue.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "base/percentile.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/percentile.h"
#include "client/connection_flags.h"
#include "client/mita_client.h"

ABSL_FLAG(std::string, model, "fashion-mnist-vit", "Model of manifest lines that name none.");
ABSL_FLAG(std::string, manifest, "", "CSV of inputs: 'kind,path[,model]' or 'path,label_index' lines.");
ABSL_FLAG(std::string, mode, "closed", "closed (fixed concurrency) or open (fixed arrival rate).");
ABSL_FLAG(int32_t, concurrency, 16, "Closed loop: calls in flight at once.");
ABSL_FLAG(double, rate, 100, "Open loop: call arrivals per second (Poisson).");
ABSL_FLAG(int32_t, max_in_flight, 4096, "Open loop: most calls in flight; later arrivals are counted as not sent.");
ABSL_FLAG(int64_t, requests, 2000, "Measured calls (after the warm-up); 0: use --duration_s.");
ABSL_FLAG(double, duration_s, 0, "Measured time, seconds, when --requests=0.");
ABSL_FLAG(int64_t, warmup_requests, 100, "Calls before measuring (same load, not counted).");
ABSL_FLAG(std::string, budgets, "default",
          "Comma list the budget of each call is drawn from: default, full, a preset name, MxK (expert count x "
          "expert width, e.g. 9x16), target:MS[:FLOOR] (a latency target of MS ms, never below the budget FLOOR "
          "of the model's accuracy order) or auto[:FLOOR] (a latency target of the call's deadline). Repeat an "
          "entry to weight it.");
ABSL_FLAG(std::string, deadlines_ms, "10000", "Comma list the deadline of each call is drawn from, ms (0: none).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the input, budget, deadline and arrival draws.");
ABSL_FLAG(int32_t, server_pid, 0, "Server process id: report its resident memory (VmRSS) over the run.");
ABSL_FLAG(double, rss_interval_s, 1.0, "With --server_pid: seconds between resident-memory samples.");
ABSL_FLAG(bool, truncate, false,
          "Documents: set document.truncate, so that a document longer than the model's maximum tokens is classified "
          "on its first tokens instead of refused.");
ABSL_FLAG(std::string, label, "", "Name of this run, printed in the report and the RESULT line.");

namespace {

namespace v1 = mita::v1;
using mita::client::ConnectionOptions;

struct Input {
  std::string model;
  std::string bytes;
  bool document = false;
};

// Reads the manifest (formats in the file comment) and the files it names.
absl::StatusOr<std::vector<Input>> ReadInputs(const std::string& manifest, const std::string& default_model) {
  std::ifstream file(manifest);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open manifest '", manifest, "'"));
  const std::filesystem::path base = std::filesystem::path(manifest).parent_path();
  std::vector<Input> inputs;
  std::string line;
  for (int number = 1; std::getline(file, line); ++number) {
    absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#') continue;
    std::vector<std::string> fields = absl::StrSplit(text, ',');
    for (std::string& field : fields) field = std::string(absl::StripAsciiWhitespace(field));
    Input input;
    input.model = default_model;
    std::string path;
    if (fields[0] == "image" || fields[0] == "document") {
      if (fields.size() < 2 || fields.size() > 3) {
        return absl::InvalidArgumentError(absl::StrCat(manifest, ":", number, ": expected 'kind,path[,model]'"));
      }
      input.document = fields[0] == "document";
      path = fields[1];
      if (fields.size() == 3 && !fields[2].empty()) input.model = fields[2];
    } else if (fields.size() == 2) {
      int64_t label = 0;
      if (!absl::SimpleAtoi(fields[1], &label)) {
        if (number == 1) continue;  // a header line
        return absl::InvalidArgumentError(absl::StrCat(manifest, ":", number, ": expected 'path,label_index'"));
      }
      path = fields[0];
    } else {
      if (number == 1) continue;  // a header line such as "kind,path,model"
      return absl::InvalidArgumentError(
          absl::StrCat(manifest, ":", number, ": expected 'kind,path[,model]' or 'path,label_index'"));
    }
    std::filesystem::path resolved(path);
    if (resolved.is_relative()) resolved = base / resolved;
    absl::StatusOr<std::string> bytes = mita::client::ReadFileBytes(resolved.string());
    if (!bytes.ok()) return bytes.status();
    input.bytes = *std::move(bytes);
    inputs.push_back(std::move(input));
  }
  if (inputs.empty()) return absl::InvalidArgumentError(absl::StrCat("manifest '", manifest, "' lists no input"));
  return inputs;
}

// Parses --budgets into request budgets (unset = default).
absl::StatusOr<std::vector<v1::Budget>> ParseBudgets(const std::string& list) {
  std::vector<v1::Budget> budgets;
  for (absl::string_view entry : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    v1::Budget budget;
    std::vector<std::string> parts = absl::StrSplit(entry, 'x');
    int64_t count = 0, width = 0;
    const std::vector<std::string> target = absl::StrSplit(entry, ':');
    if (target[0] == "target" || target[0] == "auto") {
      // target:MS[:FLOOR] or auto[:FLOOR] (target 0: the call's deadline).
      const bool automatic = target[0] == "auto";
      const size_t floor_at = automatic ? 1 : 2;
      int64_t ms = 0;
      if (target.size() > floor_at + 1 || (!automatic && (target.size() < 2 || !absl::SimpleAtoi(target[1], &ms) ||
                                                           ms < 0))) {
        return absl::InvalidArgumentError(absl::StrCat("--budgets: '", entry,
                                                       "' is not target:MS[:FLOOR] (MS an integer >= 0) or "
                                                       "auto[:FLOOR]"));
      }
      v1::LatencyTarget* latency_target = budget.mutable_latency_target();
      latency_target->set_target_ms(ms);
      if (target.size() == floor_at + 1) latency_target->set_floor(target[floor_at]);
    } else if (entry == "default") {
      // unset
    } else if (entry == "full") {
      budget.mutable_full_attention();
    } else if (parts.size() == 2 && absl::SimpleAtoi(parts[0], &count) && absl::SimpleAtoi(parts[1], &width)) {
      budget.mutable_experts()->set_expert_count(count);
      budget.mutable_experts()->set_expert_width(width);
    } else {
      budget.set_preset(std::string(entry));
    }
    budgets.push_back(budget);
  }
  if (budgets.empty()) return absl::InvalidArgumentError("--budgets is empty");
  return budgets;
}

absl::StatusOr<std::vector<int64_t>> ParseDeadlines(const std::string& list) {
  std::vector<int64_t> deadlines;
  for (absl::string_view entry : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    int64_t ms = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(entry), &ms) || ms < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--deadlines_ms: '", entry, "' is not a number of ms >= 0"));
    }
    deadlines.push_back(ms);
  }
  if (deadlines.empty()) return absl::InvalidArgumentError("--deadlines_ms is empty");
  return deadlines;
}

// VmRSS of `pid` in KiB, or -1 when it cannot be read.
int64_t ResidentKib(int pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (!absl::StartsWith(line, "VmRSS:")) continue;
    int64_t kib = 0;
    std::vector<std::string> parts = absl::StrSplit(line.substr(6), ' ', absl::SkipWhitespace());
    if (!parts.empty() && absl::SimpleAtoi(parts[0], &kib)) return kib;
  }
  return -1;
}

struct Call {
  grpc::ClientContext context;
  v1::ClassifyResponse response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::ClassifyResponse>> reader;
  absl::Time start;
  int64_t deadline_ms = 0;  // 0: none
  bool measured = false;
};

// What the measured answers came to against their deadlines, and the budgets the OK ones ran with.
struct DeadlineTally {
  int64_t ok_in_time = 0;       // OK within the call's deadline (or without one)
  int64_t ok_late = 0;          // OK, but later than the call's deadline
  int64_t deadline_exceeded = 0;  // all of them, refused or out of time
  int64_t refused = 0;            // DEADLINE_EXCEEDED answered before the call's deadline: refused at admission
  int64_t rejected = 0;           // RESOURCE_EXHAUSTED or UNAVAILABLE, and the refused
  int64_t mita_answers = 0;     // OK answers that ran MiTA (their knobs are summed below)
  int64_t full_answers = 0;     // OK answers that ran full attention
  double expert_count_sum = 0;
  double expert_width_sum = 0;
  std::map<int, int64_t> reasons;  // OK answers by v1::BudgetReason
  // Client latency of the DEADLINE_EXCEEDED answers: near 0 when the server refused at admission, near the
  // deadline when the call ran out of time.
  std::vector<double> deadline_exceeded_ms;

  void Add(const Call& call, double latency_ms) {
    const grpc::StatusCode code = call.status.error_code();
    if (code == grpc::StatusCode::DEADLINE_EXCEEDED) {
      ++deadline_exceeded;
      deadline_exceeded_ms.push_back(latency_ms);
      // The client's own deadline cannot fire before the deadline: an earlier answer is the server's refusal.
      if (call.deadline_ms > 0 && latency_ms < static_cast<double>(call.deadline_ms)) {
        ++refused;
        ++rejected;
      }
    }
    if (code == grpc::StatusCode::RESOURCE_EXHAUSTED || code == grpc::StatusCode::UNAVAILABLE) ++rejected;
    if (!call.status.ok()) return;
    if (call.deadline_ms > 0 && latency_ms > static_cast<double>(call.deadline_ms)) {
      ++ok_late;
    } else {
      ++ok_in_time;
    }
    const v1::AppliedBudget& budget = call.response.budget();
    if (budget.full_attention()) {
      ++full_answers;
    } else {
      ++mita_answers;
      expert_count_sum += static_cast<double>(budget.expert_count());
      expert_width_sum += static_cast<double>(budget.expert_width());
    }
    ++reasons[budget.reason()];
  }
};

// "most_accurate" for BUDGET_REASON_MOST_ACCURATE (the server's metric label of the reason).
std::string ReasonName(int reason) {
  std::string name = v1::BudgetReason_Name(static_cast<v1::BudgetReason>(reason));
  if (name.empty()) name = absl::StrCat("BUDGET_REASON_", reason);
  return absl::AsciiStrToLower(absl::StripPrefix(name, "BUDGET_REASON_"));
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Load and soak tool for MiTA Serve.\n"
      "  mita-bench --server=HOST:PORT --manifest=FILE [--mode=closed --concurrency=N | --mode=open --rate=R]\n"
      "             [--requests=N | --requests=0 --duration_s=S] [--budgets=...] [--deadlines_ms=...]");
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "/bench_main.cc") || absl::EndsWith(file, "/connection_flags.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::ParseCommandLine(argc, argv);

  auto fail = [](const std::string& message) {
    std::cerr << "mita-bench: " << message << "\n";
    return 2;
  };
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "closed" && mode != "open") return fail("--mode must be closed or open");
  const bool open_loop = mode == "open";
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  const double rate = absl::GetFlag(FLAGS_rate);
  const int max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  if (!open_loop && concurrency < 1) return fail("--concurrency must be >= 1");
  if (open_loop && !(rate > 0)) return fail("--rate must be > 0");
  if (max_in_flight < 1) return fail("--max_in_flight must be >= 1");
  const int64_t requests = absl::GetFlag(FLAGS_requests);
  const double duration_s = absl::GetFlag(FLAGS_duration_s);
  const int64_t warmup = absl::GetFlag(FLAGS_warmup_requests);
  if (requests < 0 || warmup < 0) return fail("--requests and --warmup_requests must be >= 0");
  if (requests == 0 && !(duration_s > 0)) return fail("set --requests > 0 or --duration_s > 0");
  const std::string manifest = absl::GetFlag(FLAGS_manifest);
  if (manifest.empty()) return fail("--manifest is required");
  absl::StatusOr<std::vector<Input>> inputs = ReadInputs(manifest, absl::GetFlag(FLAGS_model));
  if (!inputs.ok()) return fail(std::string(inputs.status().message()));
  absl::StatusOr<std::vector<v1::Budget>> budgets = ParseBudgets(absl::GetFlag(FLAGS_budgets));
  if (!budgets.ok()) return fail(std::string(budgets.status().message()));
  absl::StatusOr<std::vector<int64_t>> deadlines = ParseDeadlines(absl::GetFlag(FLAGS_deadlines_ms));
  if (!deadlines.ok()) return fail(std::string(deadlines.status().message()));
  absl::StatusOr<ConnectionOptions> connection = mita::client::ConnectionOptionsFromFlags();
  if (!connection.ok()) return fail(std::string(connection.status().message()));
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = mita::client::CreateChannel(*connection);
  if (!channel.ok()) return fail(std::string(channel.status().message()));
  std::unique_ptr<v1::MitaService::Stub> stub = v1::MitaService::NewStub(*channel);
  const int server_pid = absl::GetFlag(FLAGS_server_pid);
  const absl::Duration rss_interval = absl::Seconds(absl::GetFlag(FLAGS_rss_interval_s));

  std::mt19937_64 random(absl::GetFlag(FLAGS_seed));
  std::uniform_int_distribution<size_t> pick_input(0, inputs->size() - 1);
  std::uniform_int_distribution<size_t> pick_budget(0, budgets->size() - 1);
  std::uniform_int_distribution<size_t> pick_deadline(0, deadlines->size() - 1);
  std::exponential_distribution<double> inter_arrival(open_loop ? rate : 1.0);

  // Requests are built once per (input, budget) pair on demand and reused.
  std::map<std::pair<size_t, size_t>, v1::ClassifyRequest> request_cache;
  auto request_for = [&](size_t input, size_t budget) -> const v1::ClassifyRequest& {
    auto [it, inserted] = request_cache.try_emplace({input, budget});
    if (inserted) {
      const Input& in = (*inputs)[input];
      v1::ClassifyRequest& request = it->second;
      request.set_model(in.model);
      if (in.document) {
        request.mutable_document()->set_text(in.bytes);
        if (absl::GetFlag(FLAGS_truncate)) request.mutable_document()->set_truncate(true);
      } else {
        request.set_image(in.bytes);
      }
      *request.mutable_budget() = (*budgets)[budget];
    }
    return it->second;
  };

  grpc::CompletionQueue queue;
  int64_t started = 0, in_flight = 0, not_sent = 0;
  bool measuring = warmup == 0;
  absl::Time measure_start = absl::Now();
  absl::Time measure_end = absl::InfiniteFuture();
  if (measuring && requests == 0) measure_end = measure_start + absl::Seconds(duration_s);
  int64_t measured_started = 0;
  std::map<grpc::StatusCode, int64_t> codes;
  // Measured answers by the server (peer address) that gave them, and errors by code and message.
  std::map<std::string, int64_t> answers_by_server;
  std::map<std::string, int64_t> errors_by_message;
  std::vector<double> ok_latencies_ms, all_latencies_ms;
  double batch_size_sum = 0;
  DeadlineTally tally;
  int64_t rss_start = -1, rss_max = -1, rss_end = -1;
  absl::Time next_rss = absl::InfinitePast();
  absl::Time next_arrival = absl::Now();

  auto measured_done = [&] {
    return measuring && (requests > 0 ? measured_started >= requests : absl::Now() >= measure_end);
  };
  auto start_call = [&] {
    auto* call = new Call();
    const size_t input = pick_input(random);
    const size_t budget = pick_budget(random);
    const int64_t deadline_ms = (*deadlines)[pick_deadline(random)];
    if (deadline_ms > 0) {
      call->context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
    }
    mita::client::AddBearerToken(connection->bearer_token, &call->context);
    call->measured = measuring;
    call->deadline_ms = deadline_ms;
    call->start = absl::Now();
    call->reader = stub->AsyncClassify(&call->context, request_for(input, budget), &queue);
    call->reader->Finish(&call->response, &call->status, call);
    ++started;
    ++in_flight;
    if (measuring) ++measured_started;
    if (!measuring && started >= warmup) {
      // The warm-up calls are all sent: calls sent from now on are measured.
      measuring = true;
      measure_start = absl::Now();
      if (requests == 0) measure_end = measure_start + absl::Seconds(duration_s);
    }
  };
  auto sample_rss = [&](bool force) {
    if (server_pid <= 0) return;
    const absl::Time now = absl::Now();
    if (!force && now < next_rss) return;
    next_rss = now + rss_interval;
    const int64_t kib = ResidentKib(server_pid);
    if (kib < 0) return;
    if (measuring && rss_start < 0) rss_start = kib;
    rss_max = std::max(rss_max, kib);
    rss_end = kib;
  };

  if (!open_loop) {
    for (int i = 0; i < concurrency && !measured_done(); ++i) start_call();
  }
  while (true) {
    const bool sending = !measured_done();
    if (!sending && in_flight == 0) break;
    absl::Time wake = absl::Now() + absl::Milliseconds(50);
    if (open_loop && sending) wake = std::min(wake, next_arrival);
    void* tag = nullptr;
    bool ok = false;
    const grpc::CompletionQueue::NextStatus next = queue.AsyncNext(&tag, &ok, absl::ToChronoTime(wake));
    if (next == grpc::CompletionQueue::SHUTDOWN) break;
    if (next == grpc::CompletionQueue::GOT_EVENT) {
      std::unique_ptr<Call> call(static_cast<Call*>(tag));
      --in_flight;
      if (call->measured) {
        const double latency_ms = absl::ToDoubleMilliseconds(absl::Now() - call->start);
        ++codes[call->status.error_code()];
        if (call->status.ok()) {
          ++answers_by_server[call->context.peer()];
        } else {
          ++errors_by_message[absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(
                                               call->status.error_code())),
                                           ": ", call->status.error_message())];
        }
        all_latencies_ms.push_back(latency_ms);
        tally.Add(*call, latency_ms);
        if (call->status.ok()) {
          ok_latencies_ms.push_back(latency_ms);
          batch_size_sum += call->response.timing().batch_size();
        }
      }
      if (!open_loop && !measured_done()) start_call();
    }
    if (open_loop) {
      for (absl::Time now = absl::Now(); !measured_done() && now >= next_arrival; now = absl::Now()) {
        next_arrival += absl::Seconds(inter_arrival(random));
        if (in_flight >= max_in_flight) {
          if (measuring) ++not_sent, ++measured_started;
          continue;
        }
        start_call();
      }
    }
    sample_rss(false);
  }
  const absl::Duration wall = absl::Now() - measure_start;
  sample_rss(true);

  const std::string label = absl::GetFlag(FLAGS_label);
  const double seconds = std::max(1e-9, absl::ToDoubleSeconds(wall));
  const int64_t answered = static_cast<int64_t>(all_latencies_ms.size());
  const int64_t ok_count = static_cast<int64_t>(ok_latencies_ms.size());
  const double mean_batch = ok_count > 0 ? batch_size_sum / static_cast<double>(ok_count) : 0;
  std::vector<double> ok_sorted = ok_latencies_ms, all_sorted = all_latencies_ms;
  const double p50 = mita::Percentile(ok_sorted, 50), p95 = mita::Percentile(ok_sorted, 95);
  const double p99 = mita::Percentile(ok_sorted, 99);
  std::cout << absl::StrFormat(
      "mita-bench%s: %s loop, %s, %d inputs, budgets %s, deadlines %s ms\n",
      label.empty() ? "" : absl::StrCat(" [", label, "]"), mode,
      open_loop ? absl::StrFormat("rate %.1f/s", rate) : absl::StrFormat("concurrency %d", concurrency), inputs->size(),
      absl::GetFlag(FLAGS_budgets), absl::GetFlag(FLAGS_deadlines_ms));
  std::cout << absl::StrFormat("completed %d calls in %.2f s (after %d warm-up calls): %.1f completions/s, %.1f OK/s\n",
                               answered, seconds, warmup, static_cast<double>(answered) / seconds,
                               static_cast<double>(ok_count) / seconds);
  std::cout << absl::StrFormat("latency of OK calls: p50 %.2f ms, p95 %.2f ms, p99 %.2f ms; all calls: p99 %.2f ms\n",
                               p50, p95, p99, mita::Percentile(all_sorted, 99));
  std::cout << absl::StrFormat("mean server batch size of OK calls: %.2f\n", mean_batch);
  std::string code_text;
  for (const auto& [code, count] : codes) {
    absl::StrAppend(&code_text, code_text.empty() ? "" : ", ",
                    absl::StatusCodeToString(static_cast<absl::StatusCode>(code)), " ", count);
  }
  if (not_sent > 0) absl::StrAppend(&code_text, ", not sent (over --max_in_flight) ", not_sent);
  std::cout << "status codes: " << (code_text.empty() ? "none" : code_text) << "\n";
  std::string server_text, server_keys;
  for (const auto& [server, count] : answers_by_server) {
    absl::StrAppend(&server_text, server_text.empty() ? "" : ", ", server, " ", count,
                    absl::StrFormat(" (%.1f%%)", ok_count > 0 ? 100.0 * count / static_cast<double>(ok_count) : 0));
    absl::StrAppend(&server_keys, server_keys.empty() ? "" : ";", server, "=", count);
  }
  std::cout << "OK answers by server: " << (server_text.empty() ? "none" : server_text) << "\n";
  for (const auto& [message, count] : errors_by_message) std::cout << "error " << count << "x " << message << "\n";
  // Rates over the measured calls sent (all answered: the run waits for every call in flight).
  const double sent = std::max<double>(1, static_cast<double>(answered));
  const double goodput = static_cast<double>(tally.ok_in_time) / seconds;
  const double miss_rate = static_cast<double>(tally.deadline_exceeded - tally.refused + tally.ok_late) / sent;
  const double reject_rate = static_cast<double>(tally.rejected) / sent;
  const double mean_m =
      tally.mita_answers > 0 ? tally.expert_count_sum / static_cast<double>(tally.mita_answers) : 0;
  const double mean_k =
      tally.mita_answers > 0 ? tally.expert_width_sum / static_cast<double>(tally.mita_answers) : 0;
  const double full_fraction =
      ok_count > 0 ? static_cast<double>(tally.full_answers) / static_cast<double>(ok_count) : 0;
  std::cout << absl::StrFormat(
      "deadlines: goodput %.1f OK answers within their deadline/s; missed %.2f%% (DEADLINE_EXCEEDED at or after "
      "the deadline %d; OK but late %d), rejected %.2f%% (RESOURCE_EXHAUSTED or UNAVAILABLE %d; DEADLINE_EXCEEDED "
      "before the deadline, refused at admission, %d) of %d calls sent; DEADLINE_EXCEEDED answered after p50 "
      "%.2f ms\n",
      goodput, 100 * miss_rate, tally.deadline_exceeded - tally.refused, tally.ok_late, 100 * reject_rate,
      tally.rejected - tally.refused, tally.refused, answered, mita::Percentile(tally.deadline_exceeded_ms, 50));
  std::string reason_text, reason_keys;
  for (int reason = v1::BudgetReason_MIN; reason <= v1::BudgetReason_MAX; ++reason) {
    if (!v1::BudgetReason_IsValid(reason)) continue;
    const int64_t count = tally.reasons.count(reason) > 0 ? tally.reasons.at(reason) : 0;
    absl::StrAppend(&reason_text, reason_text.empty() ? "" : ", ", ReasonName(reason), " ", count);
    absl::StrAppend(&reason_keys, " reason_", ReasonName(reason), "=", count);
  }
  std::cout << absl::StrFormat(
      "applied budget of OK answers: mean expert_count %.2f, mean expert_width %.2f (of %d MiTA answers), full "
      "attention %.2f%%; by reason: %s\n",
      mean_m, mean_k, tally.mita_answers, 100 * full_fraction, reason_text);
  std::string rss_text;
  if (server_pid > 0 && rss_start >= 0) {
    std::cout << absl::StrFormat(
        "server VmRSS (pid %d): %.1f MiB after warm-up, %.1f MiB at the end, max %.1f MiB; growth %+.1f MiB "
        "(%+.2f%%)\n",
        server_pid, rss_start / 1024.0, rss_end / 1024.0, rss_max / 1024.0, (rss_end - rss_start) / 1024.0,
        100.0 * static_cast<double>(rss_end - rss_start) / static_cast<double>(rss_start));
    rss_text = absl::StrFormat(" rss_start_kib=%d rss_end_kib=%d rss_max_kib=%d", rss_start, rss_end, rss_max);
  }
  std::cout << absl::StrFormat(
      "RESULT label=%s answered=%d ok=%d seconds=%.3f throughput=%.2f ok_throughput=%.2f "
      "p50_ms=%.3f p95_ms=%.3f p99_ms=%.3f mean_batch=%.3f%s goodput=%.2f miss_rate=%.5f reject_rate=%.5f "
      "mean_m=%.3f mean_k=%.3f full_fraction=%.5f%s deadline_exceeded_p50_ms=%.3f refused=%d servers=%s\n",
      label.empty() ? "-" : label, answered, ok_count, seconds, static_cast<double>(answered) / seconds,
      static_cast<double>(ok_count) / seconds, p50, p95, p99, mean_batch, rss_text, goodput, miss_rate, reject_rate,
      mean_m, mean_k, full_fraction, reason_keys, mita::Percentile(tally.deadline_exceeded_ms, 50), tally.refused,
      server_keys.empty() ? "-" : server_keys);
  if (ok_count == 0 && answered + not_sent > 0) {
    std::cerr << "mita-bench: no call was answered OK (status codes: " << code_text << ")"
              << (errors_by_message.empty() ? "" : absl::StrCat("; first error: ", errors_by_message.begin()->first))
              << "\n";
    return 1;
  }
  return 0;
}
