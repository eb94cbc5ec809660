#include "server/classify_service.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "kernels/aten_errors.h"
#include "kernels/mita_attention.h"
#include "models/document_classifier.h"
#include "models/image_decoder.h"
#include "models/vit_classifier.h"
#include "server/grpc_status.h"

namespace mita::server {

absl::Status BatchFailure(absl::string_view model, const absl::Status& forward) {
  if (absl::IsResourceExhausted(forward)) {
    return absl::ResourceExhaustedError(absl::StrCat("model '", model, "' ran out of memory for this batch (",
                                                     forward.message(), "); retry later or with a smaller budget"));
  }
  return absl::InternalError(absl::StrCat("model '", model, "' failed: ", forward.message()));
}

namespace {

constexpr int64_t kDefaultTopN = 5;

// A request value echoed in an error message: at most 64 bytes of it.
std::string Echo(const std::string& value) {
  constexpr size_t kMax = 64;
  return value.size() > kMax ? absl::StrCat(value.substr(0, kMax), "...") : value;
}

int64_t Microseconds(absl::Duration duration) { return absl::ToInt64Microseconds(duration); }

// Decodes and preprocesses a request's image. Errors: INVALID_ARGUMENT "field image: ..." for anything wrong
// with the bytes (the decoder's own errors, and any exception it throws, since the bytes are user input).
absl::StatusOr<at::Tensor> DecodeAndPreprocess(const std::string& bytes, const models::VitConfig& config) {
  models::ImageDecodeLimits limits;
  limits.max_width = config.max_image_side;
  limits.max_height = config.max_image_side;
  try {
    absl::StatusOr<models::DecodedImage> decoded = models::DecodeImage(bytes, config.in_channels, limits);
    if (!decoded.ok()) {
      const absl::StatusCode code = decoded.status().code();
      return absl::Status(code == absl::StatusCode::kInternal || code == absl::StatusCode::kUnknown
                              ? absl::StatusCode::kInvalidArgument
                              : code,
                          absl::StrCat("field ", decoded.status().message()));
    }
    absl::StatusOr<at::Tensor> image = models::PreprocessImage(*decoded, config);
    if (!image.ok()) {
      return absl::Status(image.status().code(), absl::StrCat("field ", image.status().message()));
    }
    return image;
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("field image: cannot decode: ", e.what()));
  }
}

// DEADLINE_EXCEEDED for a request whose deadline passed after `queued` in the queue.
absl::Status QueuedDeadlineExceeded(absl::Duration queued) {
  return absl::DeadlineExceededError(
      absl::StrCat("the deadline passed after ", Microseconds(queued),
                   " us in the queue, before the request's batch started; it was not run"));
}

absl::Time DeadlineOf(const grpc::ServerContext& context) {
  const std::chrono::system_clock::time_point deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

}  // namespace

// One Classify request, queued in a model's batcher. The handler that submitted it owns `result` and waits
// on it, so every pointer here outlives the task.
struct ClassifyService::Task {
  at::Tensor image;                // image models: [C, H, W] float32, preprocessed
  std::vector<int64_t> token_ids;  // document models: token_count ids in [0, vocab_size)
  models::AttentionBudget budget;  // as applied to this input
  int64_t token_count = 0;         // tokens in the packed batch (image: patches + cls; document: after truncation)
  int64_t input_token_count = 0;   // tokens before truncation
  int64_t compute_unit_count = 0;  // ComputeUnits(token_count, budget)
  int64_t top_n = kDefaultTopN;
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;
  TaskResult* result = nullptr;

  // Batcher units (server/batcher.h).
  int64_t tokens() const { return token_count; }
  int64_t compute_units() const { return compute_unit_count; }
};

// Who decides a queued task's fate: the batch thread moves it from kQueued to kStarted just before running
// it; the handler moves it from kQueued to kAbandoned when its caller gives up (cancel, deadline) after a
// batch thread took it out of the queue. One compare-and-swap each, so work never starts after a give-up.
enum TaskState : int { kQueued = 0, kStarted = 1, kAbandoned = 2 };

// What the batch thread hands back to the waiting handler.
struct ClassifyService::TaskResult {
  std::atomic<int> state{kQueued};
  absl::Status status;
  std::vector<std::pair<int64_t, float>> classes;       // (index, probability), best first
  std::vector<kernels::MitaItemStatistics> statistics;  // per layer; empty under full attention
  absl::Duration queue_delay;
  absl::Duration compute;
  int64_t batch_size = 0;
  absl::Notification done;
};

namespace {

// Resolves a request's budget against a model's default budget and presets; `validate` checks an explicit
// budget against the model's ranges (naming the proto field).
absl::StatusOr<ResolvedBudget> ResolveBudgetAgainst(
    const models::AttentionBudget& default_budget, const std::map<std::string, models::AttentionBudget>& presets,
    const std::function<absl::Status(const models::AttentionBudget&)>& validate, const v1::ClassifyRequest& request) {
  const v1::Budget& budget = request.budget();
  switch (budget.choice_case()) {
    case v1::Budget::CHOICE_NOT_SET:
      return ResolvedBudget{default_budget, "default"};
    case v1::Budget::kPreset: {
      auto it = presets.find(budget.preset());
      // "" (what proto3 clients send for a string they did not fill in) and "default" (the name responses give
      // the default budget) mean the model's default budget, unless the model declares a preset of that name.
      if (it == presets.end() && (budget.preset().empty() || budget.preset() == "default")) {
        return ResolvedBudget{default_budget, "default"};
      }
      if (it == presets.end()) {
        std::vector<std::string> names;
        for (const auto& [name, preset] : presets) names.push_back(name);
        return absl::InvalidArgumentError(
            absl::StrCat("field budget.preset: unknown preset '", Echo(budget.preset()), "'; available: ",
                         names.empty() ? std::string("none (use budget.experts or budget.full_attention)")
                                       : absl::StrJoin(names, ", ")));
      }
      return ResolvedBudget{it->second, it->first};
    }
    case v1::Budget::kExperts: {
      // A knob left at 0 takes the model's default, so a client may set only the expert count or only the
      // expert width. Negative values are errors (`validate` names the field and the range).
      models::AttentionBudget resolved;
      resolved.expert_count = budget.experts().expert_count() == 0 ? default_budget.expert_count
                                                                   : budget.experts().expert_count();
      resolved.expert_width = budget.experts().expert_width() == 0 ? default_budget.expert_width
                                                                   : budget.experts().expert_width();
      if (default_budget.full_attention && (resolved.expert_count == 0 || resolved.expert_width == 0)) {
        return absl::InvalidArgumentError(
            "field budget.experts: the model's default is full attention, so set both expert_count and "
            "expert_width");
      }
      if (absl::Status status = validate(resolved); !status.ok()) {
        // `validate` names the field and the range; keep its code unless it is not a user error code.
        if (status.code() == absl::StatusCode::kInvalidArgument) return status;
        return absl::InvalidArgumentError(status.message());
      }
      return ResolvedBudget{resolved, ""};
    }
    case v1::Budget::kFullAttention: {
      models::AttentionBudget resolved;
      resolved.full_attention = true;
      return ResolvedBudget{resolved, ""};
    }
  }
  return absl::InvalidArgumentError("field budget: unknown budget choice");
}

}  // namespace

absl::StatusOr<ResolvedBudget> ResolveBudget(const models::VitConfig& config, const v1::ClassifyRequest& request) {
  return ResolveBudgetAgainst(
      config.default_budget, config.presets,
      [&config](const models::AttentionBudget& budget) { return models::ValidateBudget(config, budget); }, request);
}

absl::StatusOr<ResolvedBudget> ResolveDocumentBudget(const models::DocumentConfig& config,
                                                     const v1::ClassifyRequest& request) {
  return ResolveBudgetAgainst(
      config.default_budget, config.presets,
      [&config](const models::AttentionBudget& budget) { return models::ValidateDocumentBudget(config, budget); },
      request);
}

absl::StatusOr<TokenizedDocument> TokenizeDocument(const v1::Document& document, const models::Tokenizer* tokenizer,
                                                   const DocumentLimits& limits) {
  std::vector<int64_t> ids;
  std::string field;
  switch (document.content_case()) {
    case v1::Document::CONTENT_NOT_SET:
      return absl::InvalidArgumentError("field document: set document.text or document.token_ids");
    case v1::Document::kText: {
      field = "document.text";
      const std::string& text = document.text();
      if (text.empty()) {
        return absl::InvalidArgumentError(
            "field document.text: the document is empty; a document needs at least 1 token");
      }
      if (absl::Status status = models::ValidateUtf8(text, absl::StrCat("field ", field)); !status.ok()) {
        return absl::InvalidArgumentError(status.message());
      }
      if (tokenizer == nullptr) return absl::InternalError("the model has no tokenizer");
      absl::StatusOr<std::vector<int64_t>> encoded = tokenizer->Encode(text);
      if (!encoded.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("field document.text: ", encoded.status().message()));
      }
      ids = *std::move(encoded);
      if (ids.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("field document.text: the ", text.size(),
                                                       "-byte text has no tokens (tokenizer ", tokenizer->name(),
                                                       "); a document needs at least 1 token"));
      }
      break;
    }
    case v1::Document::kTokenIds: {
      field = "document.token_ids.ids";
      const auto& sent = document.token_ids().ids();
      if (sent.empty()) {
        return absl::InvalidArgumentError(
            "field document.token_ids.ids: the document is empty; a document needs at least 1 token");
      }
      for (int i = 0; i < sent.size(); ++i) {
        if (sent[i] < 0 || sent[i] >= limits.vocab_size) {
          return absl::InvalidArgumentError(absl::StrCat("field document.token_ids.ids[", i, "]: ", sent[i],
                                                         " is out of range: allowed [0, ", limits.vocab_size - 1,
                                                         "]"));
        }
      }
      ids.assign(sent.begin(), sent.end());
      break;
    }
  }
  TokenizedDocument result;
  result.input_tokens = static_cast<int64_t>(ids.size());
  if (result.input_tokens > limits.max_tokens) {
    if (!document.truncate()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "field ", field, ": the document has ", result.input_tokens, " tokens, over the limit of ",
          limits.max_tokens, " tokens (", limits.max_tokens_source, "); set document.truncate to classify its first ",
          limits.max_tokens, " tokens"));
    }
    ids.resize(static_cast<size_t>(limits.max_tokens));
  }
  result.token_ids = std::move(ids);
  return result;
}

absl::StatusOr<int64_t> ResolveTopN(int64_t top_n, int64_t num_classes) {
  const int64_t default_top_n = std::min(kDefaultTopN, num_classes);
  if (top_n == 0) return default_top_n;
  if (top_n < 0 || top_n > num_classes) {
    return absl::InvalidArgumentError(
        absl::StrCat("field top_n: ", top_n, " is out of range [0, ", num_classes, "] (0 means ", default_top_n, ")"));
  }
  return top_n;
}

int64_t ComputeUnits(int64_t tokens, const models::AttentionBudget& budget) {
  const int64_t width = budget.full_attention ? tokens : budget.expert_count + budget.expert_width;
  return tokens * std::max<int64_t>(width, 1);
}

int64_t AttentionLayers(const models::ModelPackage& package) {
  return package.kind == models::ModelKind::kDocument ? package.document_config.depth : package.config.depth;
}

std::vector<ServerMetrics::ModelInfo> MetricsModelInfos(const ModelRegistry& registry) {
  std::vector<ServerMetrics::ModelInfo> infos;
  for (const models::ModelPackage* package : registry.packages()) {
    infos.push_back({package->name, AttentionLayers(*package)});
  }
  return infos;
}

namespace {

// The knobs both model kinds share: the default budget, the named presets, and full attention (always
// supported: the same weights run it).
void SetDefaultBudgetAndPresets(const models::AttentionBudget& default_budget,
                                const std::map<std::string, models::AttentionBudget>& presets, v1::Knobs* knobs) {
  knobs->mutable_default_budget()->set_expert_count(default_budget.expert_count);
  knobs->mutable_default_budget()->set_expert_width(default_budget.expert_width);
  for (const auto& [name, preset] : presets) {
    v1::NamedBudget* named = knobs->add_presets();
    named->set_name(name);
    if (preset.full_attention) {
      named->set_full_attention(true);
    } else {
      named->mutable_budget()->set_expert_count(preset.expert_count);
      named->mutable_budget()->set_expert_width(preset.expert_width);
    }
  }
  knobs->set_full_attention_supported(true);
}

v1::ModelMetadata BuildDocumentMetadata(const models::ModelPackage& package, const ServiceOptions& options) {
  const models::DocumentConfig& config = package.document_config;
  v1::ModelMetadata metadata;
  metadata.set_name(package.name);
  metadata.set_architecture(config.architecture);
  metadata.set_input_kind(v1::INPUT_KIND_DOCUMENT);
  v1::DocumentLimits* limits = metadata.mutable_document_limits();
  limits->set_max_tokens(std::min(config.max_tokens, options.batching.max_batch_tokens));
  limits->set_vocabulary_size(config.vocab_size);
  limits->set_tokenizer(package.tokenizer != nullptr ? package.tokenizer->name() : config.tokenizer);
  for (const std::string& label : package.labels) metadata.add_labels(label);
  v1::Knobs* knobs = metadata.mutable_knobs();
  knobs->set_min_expert_count(1);
  knobs->set_max_expert_count(config.max_expert_count);
  knobs->set_min_expert_width(1);
  knobs->set_max_expert_width(config.max_expert_width);
  SetDefaultBudgetAndPresets(config.default_budget, config.presets, knobs);
  metadata.set_layers(static_cast<int32_t>(config.depth));
  metadata.set_heads(static_cast<int32_t>(config.num_heads));
  metadata.set_embed_dim(static_cast<int32_t>(config.embed_dim));
  metadata.set_tokens_per_input(0);
  return metadata;
}

}  // namespace

v1::ModelMetadata BuildModelMetadata(const models::ModelPackage& package, const ServiceOptions& options) {
  if (package.kind == models::ModelKind::kDocument) return BuildDocumentMetadata(package, options);
  const int64_t max_encoded_image_bytes = options.max_encoded_image_bytes;
  const models::VitConfig& config = package.config;
  v1::ModelMetadata metadata;
  metadata.set_name(package.name);
  metadata.set_architecture(config.architecture);
  metadata.set_input_kind(v1::INPUT_KIND_IMAGE);
  v1::ImageLimits* image = metadata.mutable_image_limits();
  image->set_width(static_cast<int32_t>(config.image_size));
  image->set_height(static_cast<int32_t>(config.image_size));
  image->set_channels(static_cast<int32_t>(config.in_channels));
  image->set_max_width(static_cast<int32_t>(config.max_image_side));
  image->set_max_height(static_cast<int32_t>(config.max_image_side));
  image->set_max_encoded_bytes(max_encoded_image_bytes);
  for (const std::string& label : package.labels) metadata.add_labels(label);
  v1::Knobs* knobs = metadata.mutable_knobs();
  const std::vector<int64_t> counts = models::AllowedExpertCounts(config);
  for (int64_t count : counts) knobs->add_allowed_expert_counts(count);
  if (!counts.empty()) {
    knobs->set_min_expert_count(*std::min_element(counts.begin(), counts.end()));
    knobs->set_max_expert_count(*std::max_element(counts.begin(), counts.end()));
  }
  knobs->set_min_expert_width(1);
  knobs->set_max_expert_width(config.tokens());
  SetDefaultBudgetAndPresets(config.default_budget, config.presets, knobs);
  metadata.set_layers(static_cast<int32_t>(config.depth));
  metadata.set_heads(static_cast<int32_t>(config.num_heads));
  metadata.set_embed_dim(static_cast<int32_t>(config.embed_dim));
  metadata.set_tokens_per_input(config.tokens());
  return metadata;
}

absl::StatusOr<std::unique_ptr<ClassifyService>> ClassifyService::Create(const ModelRegistry* registry,
                                                                         ServerMetrics* metrics, ServiceOptions options,
                                                                         const Clock* clock) {
  if (registry == nullptr || metrics == nullptr || clock == nullptr) {
    return absl::InvalidArgumentError("registry, metrics and clock must be set");
  }
  if (absl::Status status = ValidateBatcherOptions(options.batching); !status.ok()) return status;
  std::unique_ptr<ClassifyService> service(new ClassifyService(registry, metrics, std::move(options), clock));
  service->watcher_ = std::thread([raw = service.get()] { raw->WatchCancellations(); });
  for (const models::ModelPackage* package : registry->packages()) {
    auto slot = std::make_unique<ModelSlot>();
    slot->package = package;
    slot->metrics = metrics->ForModel(package->name);
    if (slot->metrics == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("metrics were not built for model '", package->name, "'"));
    }
    slot->metadata = BuildModelMetadata(*package, service->options_);
    if (package->kind == models::ModelKind::kImage &&
        package->config.tokens() > service->options_.batching.max_batch_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_batch_tokens ", service->options_.batching.max_batch_tokens, " (",
          service->options_.batching.max_batch_tokens_source, ") is smaller than the ", package->config.tokens(),
          " tokens of one input of model '", package->name, "'"));
    }
    const ModelSlot* slot_ptr = slot.get();
    ClassifyService* self = service.get();
    absl::StatusOr<std::unique_ptr<DynamicBatcher<Task>>> batcher = DynamicBatcher<Task>::Create(
        service->options_.batching,
        [self, slot_ptr](Batch<Task> batch) { self->ProcessBatch(*slot_ptr, std::move(batch)); }, clock,
        [metrics](const QueueDepthChange& change) {
          metrics->AddQueueDepth(change.tasks_delta);
          metrics->AddQueueComputeUnits(change.compute_units_delta);
        });
    if (!batcher.ok()) return batcher.status();
    slot->batcher = *std::move(batcher);
    service->slots_.emplace(package->name, std::move(slot));
  }
  return service;
}

ClassifyService::ClassifyService(const ModelRegistry* registry, ServerMetrics* metrics, ServiceOptions options,
                                 const Clock* clock)
    : registry_(registry), metrics_(metrics), options_(std::move(options)), clock_(clock) {}

ClassifyService::~ClassifyService() {
  Shutdown();
  {
    absl::MutexLock lock(&watch_mu_);
    stop_watching_ = true;
    watch_cv_.Signal();
  }
  if (watcher_.joinable()) watcher_.join();
}

void ClassifyService::BeginDrain() {
  draining_.store(true);
  for (auto& [name, slot] : slots_) {
    if (slot->batcher != nullptr) slot->batcher->BeginShutdown();
  }
}

bool ClassifyService::WaitUntilIdle(absl::Time deadline) {
  absl::MutexLock lock(&in_flight_mu_);
  return in_flight_mu_.AwaitWithDeadline(absl::Condition(
                                             +[](int64_t* in_flight) { return *in_flight == 0; }, &in_flight_),
                                         deadline);
}

ClassifyService::AdmissionCounts ClassifyService::admission_counts() const {
  return AdmissionCounts{admitted_.load(), admitted_ok_.load(), admitted_failed_.load()};
}

void ClassifyService::Shutdown() {
  for (auto& [name, slot] : slots_) {
    if (slot->batcher != nullptr) slot->batcher->Shutdown();
  }
}

absl::StatusOr<const ClassifyService::ModelSlot*> ClassifyService::FindSlot(const std::string& name,
                                                                            RpcMethod method) const {
  auto it = slots_.find(name);
  if (it != slots_.end()) return it->second.get();
  // The registry's error says what is wrong with the name (empty, or unknown with the available ones).
  absl::Status status = registry_->Lookup(name).status();
  if (status.ok()) status = absl::InternalError(absl::StrCat("model '", name, "' is registered but not served"));
  metrics_->CountRequest(method, nullptr, status.code());
  return status;
}

grpc::Status ClassifyService::Classify(grpc::ServerContext* context, const v1::ClassifyRequest* request,
                                       v1::ClassifyResponse* response) {
  if (absl::Status auth = Authenticate(*context, RpcMethod::kClassify); !auth.ok()) return ToGrpcStatus(auth);
  absl::StatusOr<v1::ClassifyResponse> result =
      HandleClassify(*request, DeadlineOf(*context), [context] { return context->IsCancelled(); });
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

absl::StatusOr<v1::ClassifyResponse> ClassifyService::HandleClassify(const v1::ClassifyRequest& request,
                                                                     absl::Time deadline,
                                                                     std::function<bool()> cancelled) {
  const absl::Time receipt = clock_->Now();
  {
    absl::MutexLock lock(&in_flight_mu_);
    ++in_flight_;
  }
  struct InFlightGuard {
    ClassifyService* self;
    ~InFlightGuard() {
      absl::MutexLock lock(&self->in_flight_mu_);
      --self->in_flight_;
    }
  } in_flight_guard{this};
  if (draining_.load()) {
    metrics_->CountRequest(RpcMethod::kClassify, nullptr, absl::StatusCode::kUnavailable);
    return absl::UnavailableError("the server is shutting down: no new requests are accepted");
  }
  absl::StatusOr<const ModelSlot*> found = FindSlot(request.model(), RpcMethod::kClassify);
  if (!found.ok()) return found.status();
  const ModelSlot& slot = **found;
  absl::StatusOr<v1::ClassifyResponse> result = absl::UnknownError("not run");
  try {
    // The request size limit applies to every input kind (server/message_limits.h), before any decoding.
    absl::Status size = options_.message_size != nullptr ? options_.message_size->CheckRequest(request)
                                                         : absl::OkStatus();
    result = size.ok() ? DoClassify(slot, request, deadline, std::move(cancelled)) : size;
  } catch (const std::exception& e) {
    // Never crash on a request; an exception here is a server fault.
    result = absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
  }
  const absl::Duration total = clock_->Now() - receipt;
  if (result.ok()) {
    result->mutable_timing()->set_total_us(Microseconds(total));
    if (options_.message_size != nullptr) {
      if (absl::Status size = options_.message_size->CheckResponse(*result); !size.ok()) result = size;
    }
  }
  metrics_->CountRequest(RpcMethod::kClassify, slot.metrics, result.status().code());
  if (!result.ok()) return result.status();
  slot.metrics->ObserveLatency(total);
  return result;
}

absl::Status ClassifyService::PrepareImageTask(const ModelSlot& slot, const v1::ClassifyRequest& request,
                                               absl::Time deadline, Task* task, std::string* preset) const {
  const models::ModelPackage& package = *slot.package;
  const models::VitConfig& config = package.config;
  // Input kind and the cheap checks first, so that a bad request costs no decoding.
  if (request.input_case() != v1::ClassifyRequest::kImage) {
    return absl::InvalidArgumentError(absl::StrCat(
        "field input: model '", package.name, "' takes an image",
        request.input_case() == v1::ClassifyRequest::kDocument ? ", not a document" : " and none was set"));
  }
  const std::string& bytes = request.image();
  if (bytes.empty()) return absl::InvalidArgumentError("field image: empty");
  if (static_cast<int64_t>(bytes.size()) > options_.max_encoded_image_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("field image: ", bytes.size(), " bytes is over the limit of ",
                                                   options_.max_encoded_image_bytes, " bytes"));
  }
  absl::StatusOr<ResolvedBudget> budget = ResolveBudget(config, request);
  if (!budget.ok()) return budget.status();
  absl::StatusOr<int64_t> top_n = ResolveTopN(request.top_n(), config.num_classes);
  if (!top_n.ok()) return top_n.status();
  if (clock_->Now() >= deadline) {
    return absl::DeadlineExceededError("the deadline passed before the request was queued; it was not run");
  }

  // Decode and preprocess here, in the handler thread: bad input fails before it is queued.
  absl::StatusOr<at::Tensor> image = DecodeAndPreprocess(bytes, config);
  if (!image.ok()) return image.status();
  task->image = *std::move(image);
  task->budget = budget->budget;
  task->token_count = config.tokens();
  task->input_token_count = config.tokens();
  task->top_n = *top_n;
  *preset = budget->preset;
  return absl::OkStatus();
}

absl::Status ClassifyService::PrepareDocumentTask(const ModelSlot& slot, const v1::ClassifyRequest& request,
                                                  absl::Time deadline, Task* task, std::string* preset) const {
  const models::ModelPackage& package = *slot.package;
  const models::DocumentConfig& config = package.document_config;
  if (request.input_case() != v1::ClassifyRequest::kDocument) {
    return absl::InvalidArgumentError(absl::StrCat(
        "field input: model '", package.name, "' takes a document (document.text or document.token_ids)",
        request.input_case() == v1::ClassifyRequest::kImage ? ", not an image" : " and none was set"));
  }
  absl::StatusOr<ResolvedBudget> budget = ResolveDocumentBudget(config, request);
  if (!budget.ok()) return budget.status();
  absl::StatusOr<int64_t> top_n = ResolveTopN(request.top_n(), config.num_classes);
  if (!top_n.ok()) return top_n.status();
  if (clock_->Now() >= deadline) {
    return absl::DeadlineExceededError("the deadline passed before the request was queued; it was not run");
  }

  // Validate and tokenize here, in the handler thread: bad input fails before it is queued, and the batch
  // thread only runs the model.
  DocumentLimits limits;
  limits.max_tokens = std::min(config.max_tokens, options_.batching.max_batch_tokens);
  limits.max_tokens_source = config.max_tokens <= options_.batching.max_batch_tokens
                                 ? std::string("the model's max_tokens")
                                 : options_.batching.max_batch_tokens_source;
  limits.vocab_size = config.vocab_size;  // the embedding table; a tokenizer's ids are within it
  absl::StatusOr<TokenizedDocument> document = TokenizeDocument(request.document(), package.tokenizer.get(), limits);
  if (!document.ok()) return document.status();
  task->token_count = static_cast<int64_t>(document->token_ids.size());
  task->input_token_count = document->input_tokens;
  task->token_ids = std::move(document->token_ids);
  // The budget actually applied to a document of this length (m and k at most N); the response echoes it.
  task->budget = models::ApplyDocumentBudget(budget->budget, task->token_count);
  task->top_n = *top_n;
  *preset = budget->preset;
  return absl::OkStatus();
}

absl::StatusOr<v1::ClassifyResponse> ClassifyService::DoClassify(const ModelSlot& slot,
                                                                 const v1::ClassifyRequest& request,
                                                                 absl::Time deadline, std::function<bool()> cancelled) {
  const models::ModelPackage& package = *slot.package;
  TaskResult result;
  auto task = std::make_unique<Task>();
  std::string preset;
  const absl::Status prepared = package.kind == models::ModelKind::kDocument
                                    ? PrepareDocumentTask(slot, request, deadline, task.get(), &preset)
                                    : PrepareImageTask(slot, request, deadline, task.get(), &preset);
  if (!prepared.ok()) return prepared;
  task->compute_unit_count = ComputeUnits(task->token_count, task->budget);
  task->deadline = deadline;
  task->cancelled = cancelled;  // the watcher thread looks at the call too (WaitForResult)
  task->result = &result;
  const models::AttentionBudget applied_budget = task->budget;
  const int64_t token_count = task->token_count;
  const int64_t input_token_count = task->input_token_count;
  uint64_t ticket = 0;
  if (absl::Status status = Admit(slot, &task, &ticket); !status.ok()) return status;
  const absl::Time submitted = absl::Now();
  ++admitted_;
  absl::Status waited = WaitForResult(slot, ticket, deadline, submitted, cancelled, result);
  ++(waited.ok() ? admitted_ok_ : admitted_failed_);
  if (!waited.ok()) return waited;

  v1::ClassifyResponse response;
  response.set_model(package.name);
  for (const auto& [index, score] : result.classes) {
    v1::ClassScore* entry = response.add_classes();
    entry->set_index(static_cast<int32_t>(index));
    if (index >= 0 && index < static_cast<int64_t>(package.labels.size())) {
      entry->set_label(package.labels[static_cast<size_t>(index)]);
    }
    entry->set_score(score);
  }
  v1::AppliedBudget* applied = response.mutable_budget();
  applied->set_full_attention(applied_budget.full_attention);
  if (!applied_budget.full_attention) {
    applied->set_expert_count(applied_budget.expert_count);
    applied->set_expert_width(applied_budget.expert_width);
  }
  applied->set_preset(preset);
  v1::Timing* timing = response.mutable_timing();
  timing->set_queue_delay_us(Microseconds(result.queue_delay));
  timing->set_compute_us(Microseconds(result.compute));
  timing->set_batch_size(static_cast<int32_t>(result.batch_size));
  response.set_token_count(token_count);
  response.set_input_token_count(input_token_count);
  if (request.return_statistics()) {
    for (size_t layer = 0; layer < result.statistics.size(); ++layer) {
      const kernels::MitaItemStatistics& stats = result.statistics[layer];
      v1::LayerStatistics* out = response.add_statistics();
      out->set_layer(static_cast<int32_t>(layer));
      for (double queries : stats.queries_per_expert) out->add_queries_per_expert(static_cast<float>(queries));
      out->set_load_imbalance(static_cast<float>(stats.load_imbalance));
      out->set_routing_entropy(static_cast<float>(stats.routing_entropy));
      out->set_pruned_key_fraction(static_cast<float>(stats.pruned_key_fraction));
      out->set_expert_overlap_fraction(static_cast<float>(stats.expert_overlap_fraction));
    }
  }
  return response;
}

absl::Status ClassifyService::Admit(const ModelSlot& slot, std::unique_ptr<Task>* task, uint64_t* ticket) {
  const Task& admitted = **task;
  const models::AttentionBudget budget = admitted.budget;
  const int64_t tokens = admitted.token_count;
  AdmissionRejection rejection = AdmissionRejection::kNone;
  absl::Status status = slot.batcher->Submit(task, &rejection, ticket);
  if (!status.ok()) {
    slot.metrics->CountRejection(rejection);
    return status;
  }
  // `*task` now belongs to the batcher (and may already be running): use only the copies.
  slot.metrics->ObserveBudget(budget.full_attention, budget.expert_count, budget.expert_width);
  slot.metrics->ObserveRequestTokens(tokens);
  return absl::OkStatus();
}

absl::Status ClassifyService::Authenticate(const grpc::ServerContext& context, RpcMethod method) const {
  if (options_.authenticator == nullptr) return absl::OkStatus();
  absl::Status status = options_.authenticator->Check(context);
  if (!status.ok()) metrics_->CountRequest(method, nullptr, status.code());
  return status;
}

ClassifyService::GiveUpOutcome ClassifyService::GiveUp(const ModelSlot& slot, uint64_t ticket, TaskResult& result) {
  // Still queued: take the task back, which frees its queue slot now (not at batch formation).
  if (std::unique_ptr<Task> back = slot.batcher->Cancel(ticket); back != nullptr) return GiveUpOutcome::kTakenBack;
  // A batch thread holds it. If it has not started it, it never will (it completes it at once).
  int expected = kQueued;
  if (result.state.compare_exchange_strong(expected, kAbandoned)) return GiveUpOutcome::kAbandoned;
  return GiveUpOutcome::kDecided;  // started, or abandoned before: the batch thread answers
}

absl::Status ClassifyService::WaitForResult(const ModelSlot& slot, uint64_t ticket, absl::Time deadline,
                                            absl::Time submitted, const std::function<bool()>& cancelled,
                                            TaskResult& result) {
  // The deadline is watched here, exactly; cancellation by the watcher thread (WatchCancellations).
  Waiter waiter{&slot, ticket, &cancelled, &result, deadline, submitted};
  {
    absl::MutexLock lock(&watch_mu_);
    waiters_.emplace(&result, &waiter);
    if (waiters_.size() == 1) watch_cv_.Signal();
  }
  const bool done = result.done.WaitForNotificationWithDeadline(deadline);
  {
    absl::MutexLock lock(&watch_mu_);
    waiters_.erase(&result);
  }
  if (!done && !result.done.HasBeenNotified()) {
    const absl::Status why = QueuedDeadlineExceeded(absl::Now() - submitted);
    switch (GiveUp(slot, ticket, result)) {
      case GiveUpOutcome::kTakenBack:
        return why;
      case GiveUpOutcome::kAbandoned:
        // The batch thread completes the task without running it; wait for that, since it points at `result`.
        result.done.WaitForNotification();
        return why;
      case GiveUpOutcome::kDecided:
        break;
    }
  }
  result.done.WaitForNotification();
  if (result.status.ok() && cancelled && cancelled()) {
    // The batch had started when the call was cancelled (by its client, its deadline or the server stopping at
    // the drain timeout), so it ran to the end, but gRPC drops the answer: it was not delivered.
    return absl::CancelledError("the call was cancelled while its batch ran; the result was discarded");
  }
  return result.status;
}

void ClassifyService::WatchCancellations() {
  // gRPC's synchronous API has no cancellation callback: look at every waiting call each
  // cancel_check_interval (one thread for all of them; it sleeps while nobody waits).
  constexpr absl::Duration kDeadlineClockSlack = absl::Milliseconds(5);
  absl::MutexLock lock(&watch_mu_);
  while (!stop_watching_) {
    if (waiters_.empty()) {
      watch_cv_.Wait(&watch_mu_);
      continue;
    }
    watch_cv_.WaitWithTimeout(&watch_mu_, options_.cancel_check_interval);
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      Waiter& waiter = *it->second;
      if (!*waiter.cancelled || !(*waiter.cancelled)()) {
        ++it;
        continue;
      }
      // gRPC also cancels a call whose deadline passed, by its own clock, which can run slightly ahead of the
      // wall-clock deadline seen here: a cancel that close to the deadline is the deadline.
      const absl::Time now = absl::Now();
      absl::Status why = now >= waiter.deadline - kDeadlineClockSlack
                             ? QueuedDeadlineExceeded(now - waiter.submitted)
                             : absl::CancelledError("the call was cancelled while queued; it was not run");
      TaskResult& result = *waiter.result;
      const GiveUpOutcome outcome = GiveUp(*waiter.slot, waiter.ticket, result);
      it = waiters_.erase(it);
      if (outcome == GiveUpOutcome::kTakenBack) {
        // The task left the queue and is gone: answer the handler (it waits on `done`).
        result.status = std::move(why);
        result.done.Notify();
      }
      // Abandoned: the batch thread answers "the caller gave up". Started: its result stands.
    }
  }
}

void ClassifyService::ProcessBatch(const ModelSlot& slot, Batch<Task> batch) {
  const absl::Time start = clock_->Now();
  auto complete = [](Task& task, absl::Status status) {
    task.result->status = std::move(status);
    task.result->done.Notify();
  };
  // Skip what nobody waits for any more, and what is already too late.
  std::vector<Task*> runnable;
  runnable.reserve(batch.tasks.size());
  for (size_t i = 0; i < batch.tasks.size(); ++i) {
    Task& task = *batch.tasks[i];
    // The deadline first: gRPC also marks a call whose deadline passed as cancelled.
    if (start >= task.deadline) {
      complete(task, QueuedDeadlineExceeded(start - batch.enqueue_times[i]));
    } else if (task.cancelled && task.cancelled()) {
      complete(task, absl::CancelledError("the call was cancelled before its batch started; it was not run"));
    } else if (int expected = kQueued; !task.result->state.compare_exchange_strong(expected, kStarted)) {
      // The handler gave up (cancel or deadline) after this batch was taken from the queue.
      complete(task, absl::CancelledError("the caller gave up before the request's batch started; it was not run"));
    } else {
      task.result->queue_delay = start - batch.enqueue_times[i];
      runnable.push_back(&task);
    }
  }
  if (runnable.empty()) return;

  const models::ModelPackage& package = *slot.package;
  const int64_t batch_size = static_cast<int64_t>(runnable.size());
  int64_t batch_tokens = 0;
  for (const Task* task : runnable) batch_tokens += task->token_count;
  absl::Status failure;
  try {
    c10::InferenceMode inference_mode;
    std::vector<models::AttentionBudget> budgets;
    int64_t max_top_n = 1;
    budgets.reserve(runnable.size());
    for (Task* task : runnable) {
      budgets.push_back(task->budget);
      max_top_n = std::max(max_top_n, task->top_n);
    }
    // Guard of the drop-before-run guarantee: work started for a caller that had already given up. The
    // state machine above makes this 0; the metric and the tests watch it.
    for (Task* task : runnable) {
      if (task->result->state.load() != kStarted) slot.metrics->CountExecutedAfterCancel();
    }
    absl::StatusOr<models::ClassifierOutput> output = absl::UnknownError("not run");
    if (package.kind == models::ModelKind::kDocument) {
      // A packed batch without padding: the documents' token ids back to back, [T] with T = batch_tokens; the
      // dense layers run on all T tokens at once, attention per document with its own N, m and k.
      at::Tensor token_ids = at::empty({batch_tokens}, at::TensorOptions().dtype(at::kLong));
      int64_t* packed = token_ids.data_ptr<int64_t>();
      std::vector<int64_t> lengths;
      lengths.reserve(runnable.size());
      for (const Task* task : runnable) {
        std::copy(task->token_ids.begin(), task->token_ids.end(), packed);
        packed += task->token_ids.size();
        lengths.push_back(task->token_count);
      }
      output = package.document_model->Forward(token_ids, lengths, budgets, /*want_statistics=*/true);
    } else {
      std::vector<at::Tensor> images;
      images.reserve(runnable.size());
      for (Task* task : runnable) images.push_back(task->image);
      output = package.model->Forward(at::stack(images, 0), budgets, /*want_statistics=*/true);
    }
    if (!output.ok()) {
      failure = BatchFailure(package.name, output.status());
    } else {
      const at::Tensor probabilities = output->logits.to(at::kFloat).softmax(1);
      const auto [values, indices] = probabilities.topk(std::min(max_top_n, probabilities.size(1)), 1);
      const at::Tensor top_values = values.contiguous();
      const at::Tensor top_indices = indices.contiguous();
      const float* value_data = top_values.data_ptr<float>();
      const int64_t* index_data = top_indices.data_ptr<int64_t>();
      const int64_t columns = top_values.size(1);
      const absl::Duration compute = clock_->Now() - start;
      for (int64_t b = 0; b < batch_size; ++b) {
        Task& task = *runnable[static_cast<size_t>(b)];
        TaskResult& result = *task.result;
        for (int64_t j = 0; j < std::min(task.top_n, columns); ++j) {
          result.classes.emplace_back(index_data[b * columns + j], value_data[b * columns + j]);
        }
        if (static_cast<size_t>(b) < output->statistics.size()) {
          result.statistics = std::move(output->statistics[static_cast<size_t>(b)]);
        }
        result.compute = compute;
        result.batch_size = batch_size;
      }
    }
  } catch (...) {
    failure = BatchFailure(package.name, kernels::CurrentExceptionStatus("batch"));
  }

  slot.metrics->ObserveBatchSize(batch_size);
  slot.metrics->ObserveBatchTokens(batch_tokens);
  for (Task* task : runnable) {
    TaskResult& result = *task->result;
    if (failure.ok()) {
      slot.metrics->ObserveQueueDelay(result.queue_delay);
      slot.metrics->ObserveCompute(result.compute);
      for (size_t layer = 0; layer < result.statistics.size(); ++layer) {
        const kernels::MitaItemStatistics& stats = result.statistics[layer];
        slot.metrics->ObserveLayer(static_cast<int64_t>(layer), stats.load_imbalance, stats.routing_entropy,
                                   stats.pruned_key_fraction);
      }
      complete(*task, absl::OkStatus());
    } else {
      complete(*task, failure);
    }
  }
}

grpc::Status ClassifyService::ListModels(grpc::ServerContext* context, const v1::ListModelsRequest* /*request*/,
                                         v1::ListModelsResponse* response) {
  if (absl::Status auth = Authenticate(*context, RpcMethod::kListModels); !auth.ok()) return ToGrpcStatus(auth);
  for (const auto& [name, slot] : slots_) *response->add_models() = slot->metadata;
  absl::Status status = options_.message_size != nullptr ? options_.message_size->CheckResponse(*response)
                                                         : absl::OkStatus();
  metrics_->CountRequest(RpcMethod::kListModels, nullptr, status.code());
  return ToGrpcStatus(status);
}

grpc::Status ClassifyService::GetModel(grpc::ServerContext* context, const v1::GetModelRequest* request,
                                       v1::ModelMetadata* response) {
  if (absl::Status auth = Authenticate(*context, RpcMethod::kGetModel); !auth.ok()) return ToGrpcStatus(auth);
  absl::StatusOr<const ModelSlot*> found = FindSlot(request->name(), RpcMethod::kGetModel);
  if (!found.ok()) return ToGrpcStatus(found.status());
  *response = (*found)->metadata;
  absl::Status status = options_.message_size != nullptr ? options_.message_size->CheckResponse(*response)
                                                         : absl::OkStatus();
  metrics_->CountRequest(RpcMethod::kGetModel, (*found)->metrics, status.code());
  return ToGrpcStatus(status);
}

}  // namespace mita::server
