// libFuzzer target: request validation of mita.v1.MitaService/Classify. The input is a serialized
// ClassifyRequest (protobuf wire format); it takes the mita.v1 front end's path after gRPC has parsed it (the
// message size guard of mita-server, the translation to the neutral request, the real InferenceEngine with
// every package of the repository: the embedded image model fashion-mnist-vit and document model linux-doc-mita,
// their batchers and models, the answer and its wording), without the gRPC transport. Every request must
// get OK or a user-error code (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED), never INTERNAL/UNKNOWN, a crash
// or a sanitizer report; an OK answer must be well-formed: as many classes as the request's top_n asked for
// (0 means 5, capped at the model's label count, mita.proto), distinct indices below the answering model's label
// count, scores in [0, 1] and not increasing.
//
// The model repository is $MITA_MODEL_REPOSITORY, else the source tree's models/repository. Documents are
// capped at 2,048 tokens (max_batch_tokens) so that one input runs in well under a second under ASan; longer
// ones exercise the over-the-limit and truncation paths instead.
#include <grpcpp/server_context.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "server/engine/inference_engine.h"
#include "server/engine/model_registry.h"
#include "server/frontend/grpc_status.h"
#include "server/frontend/message_limits.h"
#include "server/frontend/mita_v1_service.h"
#include "server/metrics/metrics.h"

namespace {

struct Fixture {
  std::unique_ptr<mita::server::ModelRegistry> registry;
  std::unique_ptr<mita::server::ServerMetrics> metrics;
  std::unique_ptr<mita::server::MessageSizeGuard> message_size;
  std::unique_ptr<mita::server::InferenceEngine> engine;
};

Fixture* fixture = nullptr;

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "classify_request_fuzzer: %s\n", message.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  const char* repository = std::getenv("MITA_MODEL_REPOSITORY");
  const std::string path = repository != nullptr && *repository ? repository : MITA_SOURCE_DIR "/models/repository";
  fixture = new Fixture;
  absl::StatusOr<std::unique_ptr<mita::server::ModelRegistry>> registry =
      mita::server::ModelRegistry::LoadFromDirectory(path);
  if (!registry.ok()) Die(registry.status().ToString());
  fixture->registry = *std::move(registry);
  fixture->metrics =
      std::make_unique<mita::server::ServerMetrics>(mita::server::MetricsModelInfos(*fixture->registry));
  mita::server::EngineOptions options;
  options.batching.max_queue_delay = absl::ZeroDuration();
  options.batching.max_batch_tokens = 2048;
  // A 64 KiB message limit keeps each run fast; the checks are the same as at 4 MiB.
  mita::server::MessageSizeLimits limits;
  limits.max_receive_bytes = int64_t{64} << 10;
  options.max_encoded_image_bytes = limits.max_receive_bytes;
  fixture->message_size = std::make_unique<mita::server::MessageSizeGuard>(limits, fixture->metrics->registry().get());
  absl::StatusOr<std::unique_ptr<mita::server::InferenceEngine>> engine =
      mita::server::InferenceEngine::Create(fixture->registry.get(), fixture->metrics.get(), options);
  if (!engine.ok()) Die(engine.status().ToString());
  fixture->engine = *std::move(engine);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mita::v1::ClassifyRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;  // gRPC would reject it before us
  // The front end's path (server/frontend/mita_v1_service.cc ClassifyReactor), waiting for the answer.
  mita::v1::ClassifyResponse response;
  absl::Status answer = fixture->message_size->CheckRequest(request);
  absl::StatusOr<mita::server::InferenceRequest> neutral =
      answer.ok() ? mita::server::ToInferenceRequest(request) : answer;
  if (!neutral.ok()) {
    answer = neutral.status();
  } else {
    absl::Notification done;
    std::unique_ptr<mita::server::InferenceCall> call = fixture->engine->Submit(
        *std::move(neutral), [&](absl::StatusOr<mita::server::InferenceResult> result) {
          answer = result.status();
          if (result.ok()) response = mita::server::ToClassifyResponse(*result);
          done.Notify();
        });
    done.WaitForNotification();
  }
  const grpc::Status status = mita::server::ToGrpcStatus(mita::server::WordForMitaV1(answer));
  switch (status.error_code()) {
    case grpc::StatusCode::OK: {
      const absl::StatusOr<const mita::models::ModelPackage*> package = fixture->registry->Lookup(response.model());
      if (!package.ok()) Die("OK naming an unknown model '" + response.model() + "'");
      const int64_t label_count = static_cast<int64_t>((*package)->classifier->description().labels.size());
      // The contract of ClassifyRequest.top_n, written out here rather than taken from the server's code.
      if (request.top_n() < 0 || request.top_n() > label_count) {
        Die("OK for top_n " + std::to_string(request.top_n()) + " of a model with " + std::to_string(label_count) +
            " labels");
      }
      const int64_t expected_classes = request.top_n() == 0 ? std::min<int64_t>(5, label_count) : request.top_n();
      if (response.classes_size() != expected_classes) {
        Die("OK with " + std::to_string(response.classes_size()) + " classes for top_n " +
            std::to_string(request.top_n()) + " (expected " + std::to_string(expected_classes) + ")");
      }
      std::vector<bool> seen(static_cast<size_t>(label_count), false);
      for (int i = 0; i < response.classes_size(); ++i) {
        const mita::v1::ClassScore& score = response.classes(i);
        if (!(score.score() >= 0 && score.score() <= 1) || score.index() < 0 || score.index() >= label_count) {
          Die("OK with a score or index out of range");
        }
        if (seen[static_cast<size_t>(score.index())]) Die("OK with a class twice");
        seen[static_cast<size_t>(score.index())] = true;
        if (i > 0 && score.score() > response.classes(i - 1).score()) Die("OK with classes not in score order");
      }
      break;
    }
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      if (status.error_message().empty()) Die("an error without a message");
      break;
    default:
      Die("unexpected code " + std::to_string(status.error_code()) + ": " + status.error_message());
  }
  return 0;
}
