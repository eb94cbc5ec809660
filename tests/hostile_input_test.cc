// Hostile input: message size limits at 4 MiB +/- 1 byte over loopback (with errors naming the limit and the
// flag), decompression bombs hidden in PNG ancillary chunks, and zero-sized / wrong-rank tensors given to the
// model. The image and safetensors/config faults themselves are in image_decoder_test.cc and models_test.cc;
// the fuzzers are in tests/fuzz.
#include <stdio.h>  // before jpeglib.h, which uses FILE and size_t without declaring them

#include <jpeglib.h>
#include <zlib.h>

#include <algorithm>
#include <csetjmp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <utility>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "kserve/grpc_predict_v2.pb.h"
#include "mita/v1/mita.pb.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/mita_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/image_decoder.h"
#include "models/model_package.h"
#include "prometheus/registry.h"
#include "server/engine/inference_engine.h"
#include "server/engine/model_registry.h"
#include "server/frontend/message_limits.h"
#include "server/frontend/unary_call.h"
#include "server/metrics/metrics.h"
#include "tests/server_test_util.h"
#include "tests/test_util.h"
#include "tools/fashion_mnist.h"

namespace mita::server {
namespace {

using ::testing::HasSubstr;

constexpr char kModel[] = "fashion-mnist-vit";
constexpr int64_t kFourMiB = int64_t{4} << 20;

using test_util::AppendBigEndian32;
using test_util::ExpectStatusParts;
using test_util::MetricValue;
using test_util::PngChunk;
using test_util::RepositoryPath;

// ----- PNG building -----

// Inserts `chunks` right after IHDR (8-byte signature + 25-byte IHDR chunk) of a PNG.
std::string InsertAfterIhdr(const std::string& png, const std::string& chunks) {
  return png.substr(0, 33) + chunks + png.substr(33);
}

// zlib-compressed `size` zero bytes (level 9: about 1000:1).
std::string CompressedZeros(size_t size) {
  const std::string zeros(size, '\0');
  uLongf compressed_size = compressBound(static_cast<uLong>(zeros.size()));
  std::string compressed(compressed_size, '\0');
  EXPECT_EQ(compress2(reinterpret_cast<Bytef*>(compressed.data()), &compressed_size,
                      reinterpret_cast<const Bytef*>(zeros.data()), static_cast<uLong>(zeros.size()), 9),
            Z_OK);
  compressed.resize(compressed_size);
  return compressed;
}

// A Fashion-MNIST-like 28 x 28 gray PNG (a gradient; the model's output does not matter here).
std::string SmallPng() {
  std::vector<uint8_t> pixels(28 * 28);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i % 251);
  absl::StatusOr<std::string> png = datasets::EncodePng(pixels, 28, 28, 1);
  EXPECT_TRUE(png.ok()) << png.status();
  return png.ok() ? *png : std::string();
}

// A valid PNG request for kModel whose protobuf encoding is exactly `target_bytes`: SmallPng() padded with a
// private ancillary chunk ("mtPd"), which decoders skip.
v1::ClassifyRequest RequestOfExactSize(int64_t target_bytes) {
  const std::string png = SmallPng();
  v1::ClassifyRequest request;
  request.set_model(kModel);
  int64_t padding = target_bytes - static_cast<int64_t>(png.size()) - 64;
  for (int attempt = 0; attempt < 4; ++attempt) {
    request.set_image(InsertAfterIhdr(png, PngChunk("mtPd", std::string(static_cast<size_t>(padding), 'p'))));
    const int64_t size = static_cast<int64_t>(request.ByteSizeLong());
    if (size == target_bytes) break;
    padding += target_bytes - size;
  }
  EXPECT_EQ(static_cast<int64_t>(request.ByteSizeLong()), target_bytes);
  return request;
}

// ----- MessageSizeGuard -----

TEST(MessageSizeGuardTest, LimitIsInclusiveAndTheErrorNamesTheLimitAndTheFlag) {
  prometheus::Registry registry;
  MessageSizeGuard guard(MessageSizeLimits{}, &registry);
  EXPECT_TRUE(guard.CheckRequestBytes(kFourMiB - 1).ok());
  EXPECT_TRUE(guard.CheckRequestBytes(kFourMiB).ok());
  ExpectStatusParts(guard.CheckRequestBytes(kFourMiB + 1), absl::StatusCode::kResourceExhausted,
                    {"request message of 4194305 bytes is over the limit of 4194304 bytes",
                     "flag --max_receive_message_bytes"});
  EXPECT_TRUE(guard.CheckResponseBytes(kFourMiB).ok());
  ExpectStatusParts(guard.CheckResponseBytes(kFourMiB + 1), absl::StatusCode::kResourceExhausted,
                    {"response message of 4194305 bytes is over the limit of 4194304 bytes",
                     "flag --max_send_message_bytes"});
  EXPECT_EQ(MetricValue(registry, "mita_oversized_messages_total", {{"direction", "request"}}), 1);
  EXPECT_EQ(MetricValue(registry, "mita_oversized_messages_total", {{"direction", "response"}}), 1);

  // The message check uses the protobuf encoding size.
  v1::ClassifyResponse response;
  response.set_model(std::string(static_cast<size_t>(kFourMiB - 5), 'm'));  // tag 1 + 4-byte length + data
  ASSERT_EQ(static_cast<int64_t>(response.ByteSizeLong()), kFourMiB);
  EXPECT_TRUE(guard.CheckResponse(response).ok());
  response.mutable_model()->push_back('m');
  EXPECT_EQ(guard.CheckResponse(response).code(), absl::StatusCode::kResourceExhausted);
}

// zlib's compress2 (zlib format, "deflate" in gRPC) or a gzip member of `data`.
std::string Compress(const std::string& data, bool gzip) {
  z_stream stream{};
  EXPECT_EQ(deflateInit2(&stream, 9, Z_DEFLATED, gzip ? 15 + 16 : 15, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&stream, data.size()), '\0');
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  stream.avail_in = static_cast<uInt>(data.size());
  stream.next_out = reinterpret_cast<Bytef*>(out.data());
  stream.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&stream, Z_FINISH), Z_STREAM_END);
  out.resize(stream.total_out);
  deflateEnd(&stream);
  return out;
}

std::string Joined(const std::vector<std::string>& pieces) {
  std::string out;
  for (const std::string& piece : pieces) out += piece;
  return out;
}

// Inflation stops one byte past the limit, however far the data would go, and says why; gzip and deflate in any
// split inflate to what was compressed; data that is not of its encoding, cut short or followed by more is named.
TEST(MessageSizeGuardTest, InflationIsBoundedByTheLimitAndBadDataIsNamed) {
  prometheus::Registry registry;
  MessageSizeLimits limits;
  limits.max_receive_bytes = 1 << 20;
  MessageSizeGuard guard(limits, &registry);
  std::string message(300000, '\0');
  for (size_t i = 0; i < message.size(); ++i) message[i] = static_cast<char>((i * 7919) % 251);
  for (const bool gzip : {true, false}) {
    const std::string encoding = gzip ? "gzip" : "deflate";
    SCOPED_TRACE(encoding);
    const std::string compressed = Compress(message, gzip);
    std::vector<std::string> out;
    ASSERT_TRUE(guard.InflateRequest(encoding, {compressed}, &out).ok());
    EXPECT_EQ(Joined(out), message);
    EXPECT_GE(out.size(), 2u) << "pieces of at most 256 KiB";
    // One byte per piece.
    std::vector<std::string> bytes;
    for (char c : compressed) bytes.emplace_back(1, c);
    std::vector<absl::string_view> views(bytes.begin(), bytes.end());
    ASSERT_TRUE(guard.InflateRequest(encoding, views, &out).ok());
    EXPECT_EQ(Joined(out), message);
    // Exactly the limit is served; one byte more is not.
    ASSERT_TRUE(guard.InflateRequest(encoding, {Compress(std::string(1 << 20, 'a'), gzip)}, &out).ok());
    EXPECT_EQ(Joined(out).size(), size_t{1} << 20);
    const std::string over = Compress(std::string((1 << 20) + 1, 'a'), gzip);
    ExpectStatusParts(guard.InflateRequest(encoding, {over}, &out), absl::StatusCode::kResourceExhausted,
                      {"request message inflates to more than 1048576 bytes (" + encoding + "-compressed, " +
                           std::to_string(over.size()) + " bytes on the wire), over the limit of 1048576 bytes",
                       "flag --max_receive_message_bytes"});
    EXPECT_TRUE(out.empty());
    ExpectStatusParts(guard.InflateRequest(encoding, {compressed.substr(0, compressed.size() / 2)}, &out),
                      absl::StatusCode::kInvalidArgument, {"end before the end of the " + encoding + " data"});
    ExpectStatusParts(guard.InflateRequest(encoding, {compressed, "x"}, &out), absl::StatusCode::kInvalidArgument,
                      {"go on after the end of the " + encoding + " data"});
    ExpectStatusParts(guard.InflateRequest(encoding, {"hello world"}, &out), absl::StatusCode::kInvalidArgument,
                      {"the request message is flagged " + encoding + "-compressed (grpc-encoding: " + encoding +
                           "), but its 11 bytes are not " + encoding + " data: "});
  }
  // A bomb: 64 MiB of zeros in about 64 KiB stops at the limit.
  const std::string bomb = Compress(std::string(64 << 20, '\0'), true);
  EXPECT_LT(bomb.size(), 100000u);
  std::vector<std::string> out;
  EXPECT_EQ(guard.InflateRequest("gzip", {bomb}, &out).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(MetricValue(registry, "mita_oversized_messages_total", {{"direction", "request"}}), 3);
  EXPECT_EQ(guard.InflateRequest("br", {bomb}, &out).code(), absl::StatusCode::kUnimplemented);
}

// A deadline beyond what std::chrono::system_clock represents (about 2262) is none: gRPC's own conversion wrapped
// grpc-timeout 2562047H (grpc-go's longest) into the past, so requests were answered DEADLINE_EXCEEDED at once.
TEST(DeadlineTest, DeadlinesBeyondTheClockAreNoneAndNearerOnesExact) {
  EXPECT_EQ(DeadlineFromTimespec(gpr_inf_future(GPR_CLOCK_REALTIME)), absl::InfiniteFuture());
  EXPECT_EQ(DeadlineFromTimespec(gpr_inf_future(GPR_CLOCK_MONOTONIC)), absl::InfiniteFuture());
  for (const gpr_clock_type clock : {GPR_CLOCK_REALTIME, GPR_CLOCK_MONOTONIC}) {
    for (const int64_t hours : {int64_t{2562047}, int64_t{2562048}, int64_t{99999999}}) {
      const gpr_timespec deadline = gpr_time_add(gpr_now(clock), gpr_time_from_seconds(hours * 3600, GPR_TIMESPAN));
      EXPECT_EQ(DeadlineFromTimespec(deadline), absl::InfiniteFuture()) << hours << "H, clock " << clock;
    }
    const absl::Time now = absl::Now();
    const gpr_timespec far = gpr_time_add(gpr_now(clock), gpr_time_from_seconds(int64_t{2000000} * 3600, GPR_TIMESPAN));
    EXPECT_LT(absl::AbsDuration(DeadlineFromTimespec(far) - (now + absl::Hours(2000000))), absl::Seconds(60));
    const gpr_timespec near = gpr_time_add(gpr_now(clock), gpr_time_from_millis(1500, GPR_TIMESPAN));
    EXPECT_LT(absl::AbsDuration(DeadlineFromTimespec(near) - (now + absl::Milliseconds(1500))), absl::Seconds(60));
  }
}

TEST(MessageSizeGuardTest, LimitsOutOfRangeAreRejectedAndTheTransportLimitIsTwice) {
  MessageSizeLimits limits;
  EXPECT_TRUE(ValidateMessageSizeLimits(limits).ok());
  limits.max_receive_bytes = 1023;
  ExpectStatusParts(ValidateMessageSizeLimits(limits), absl::StatusCode::kInvalidArgument,
                    {"flag --max_receive_message_bytes is 1023 bytes: allowed [1024, 1073741824]"});
  limits.max_receive_bytes = kFourMiB;
  limits.max_send_bytes = (int64_t{1} << 30) + 1;
  ExpectStatusParts(ValidateMessageSizeLimits(limits), absl::StatusCode::kInvalidArgument,
                    {"flag --max_send_message_bytes"});
  EXPECT_EQ(TransportLimitBytes(kFourMiB), 2 * kFourMiB);
  EXPECT_EQ(TransportLimitBytes(int64_t{1} << 30), 2147483647);
}

// ----- the service over loopback -----

// A server for the repository's models with the given message limits (as mita-server sets them up).
class LimitedServer : public test_util::InProcessServer {
 public:
  LimitedServer(const ModelRegistry* registry, MessageSizeLimits limits)
      : InProcessServer(registry, Options(std::move(limits))) {
    EXPECT_TRUE(status().ok()) << status();
  }

 private:
  static test_util::InProcessServerOptions Options(MessageSizeLimits limits) {
    test_util::InProcessServerOptions options;
    options.engine.batching.max_queue_delay = absl::ZeroDuration();
    options.engine.max_encoded_image_bytes = limits.max_receive_bytes;
    options.message_limits = std::move(limits);
    return options;
  }
};

class MessageLimitServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<ModelRegistry>> registry = ModelRegistry::LoadFromDirectory(RepositoryPath());
    ASSERT_TRUE(registry.ok()) << registry.status();
    registry_ = registry->release();
  }
  static void TearDownTestSuite() {
    delete registry_;
    registry_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(registry_, nullptr); }
  static ModelRegistry* registry_;
};
ModelRegistry* MessageLimitServiceTest::registry_ = nullptr;

TEST_F(MessageLimitServiceTest, FourMiBRequestIsServedAndOneByteMoreNamesTheLimitAndTheFlag) {
  LimitedServer server(registry_, MessageSizeLimits{});
  for (int64_t size : {kFourMiB - 1, kFourMiB}) {
    absl::StatusOr<v1::ClassifyResponse> response = server.client().ClassifyRaw(RequestOfExactSize(size));
    ASSERT_TRUE(response.ok()) << size << " bytes: " << response.status();
    EXPECT_EQ(response->classes_size(), 5);
  }
  ExpectStatusParts(server.client().ClassifyRaw(RequestOfExactSize(kFourMiB + 1)).status(),
                    absl::StatusCode::kResourceExhausted,
                    {"request message of 4194305 bytes is over the limit of 4194304 bytes",
                     "flag --max_receive_message_bytes"});
  // Up to twice the limit the service answers; beyond it gRPC's transport does (its own message).
  ExpectStatusParts(server.client().ClassifyRaw(RequestOfExactSize(2 * kFourMiB - 16)).status(),
                    absl::StatusCode::kResourceExhausted, {"flag --max_receive_message_bytes"});
  EXPECT_EQ(server.client().ClassifyRaw(RequestOfExactSize(2 * kFourMiB + 16)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(MetricValue(server.registry(), "mita_oversized_messages_total", {{"direction", "request"}}), 2);
  // Refused before it is parsed: the model it names is not read, so the call counts as model "unknown".
  EXPECT_EQ(MetricValue(server.registry(), "mita_requests_total",
                        {{"method", "Classify"}, {"model", "unknown"}, {"code", "RESOURCE_EXHAUSTED"}}),
            2);
  // The server still serves.
  absl::StatusOr<v1::ClassifyResponse> response = server.client().ClassifyRaw(RequestOfExactSize(1000));
  EXPECT_TRUE(response.ok()) << response.status();
}

TEST_F(MessageLimitServiceTest, ResponseOverTheSendLimitNamesTheLimitAndTheFlag) {
  v1::ClassifyRequest request = RequestOfExactSize(1000);
  // All 10 classes and 49 routed experts: with the per-layer statistics of 4 layers the answer takes about
  // 1.1 KB, without them about 0.4 KB (measured first on a server with the default limits).
  request.set_top_n(10);
  request.mutable_budget()->mutable_experts()->set_expert_count(49);
  request.mutable_budget()->mutable_experts()->set_expert_width(50);
  v1::ClassifyRequest with_statistics = request;
  with_statistics.set_return_statistics(true);
  // The send limit lies between the two sizes, at least 32 bytes from each (the timing fields make each vary by
  // a few bytes); at least the smallest allowed limit, 1 KiB.
  MessageSizeLimits limits;
  {
    LimitedServer unlimited(registry_, MessageSizeLimits{});
    absl::StatusOr<v1::ClassifyResponse> small = unlimited.client().ClassifyRaw(request);
    absl::StatusOr<v1::ClassifyResponse> large = unlimited.client().ClassifyRaw(with_statistics);
    ASSERT_TRUE(small.ok() && large.ok()) << small.status() << " " << large.status();
    const int64_t small_bytes = static_cast<int64_t>(small->ByteSizeLong());
    const int64_t large_bytes = static_cast<int64_t>(large->ByteSizeLong());
    limits.max_send_bytes = std::max((small_bytes + large_bytes) / 2, MessageSizeLimits::kMinBytes);
    ASSERT_GT(limits.max_send_bytes - small_bytes, 32);
    ASSERT_GT(large_bytes - limits.max_send_bytes, 32);
  }
  LimitedServer server(registry_, limits);
  EXPECT_TRUE(server.client().ClassifyRaw(request).ok());
  request = with_statistics;
  ExpectStatusParts(server.client().ClassifyRaw(request).status(), absl::StatusCode::kResourceExhausted,
                    {absl::StrCat("over the limit of ", limits.max_send_bytes, " bytes"),
                     "flag --max_send_message_bytes", "return_statistics"});
  EXPECT_EQ(MetricValue(server.registry(), "mita_oversized_messages_total", {{"direction", "response"}}), 1);
  // GetModel's metadata (labels, knobs) fits in 1 KiB for this model.
  EXPECT_TRUE(server.client().GetModel(kModel).ok());
}

// ----- decompression bombs -----

// Peak resident memory of this process (VmHWM), bytes, or -1 when unknown.
int64_t PeakResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "VmHWM:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, " kB");
    int64_t kilobytes = 0;
    if (absl::SimpleAtoi(rest, &kilobytes)) return kilobytes * 1024;
  }
  return -1;
}

// Resets VmHWM to the current resident size (Linux clear_refs "5"). Returns false when not permitted.
bool ResetPeakResident() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  clear_refs.flush();
  return clear_refs.good();
}

// REGRESSION: libpng inflates every zTXt/iTXt chunk (up to 8 MB each) and keeps the text until the decoder
// is destroyed, so a small PNG with many compressed text chunks made the server hold gigabytes (about 1000x the
// request size). The decoder now skips every ancillary chunk it does not use (all but tRNS) without inflating.
TEST(DecompressionBombTest, CompressedTextChunksAreNotInflated) {
  const std::string png = SmallPng();
  // 64 zTXt chunks of 7.5 MB of zeros each: 480 MB if inflated, 0.5 MB on the wire.
  const std::string zeros = CompressedZeros(7'500'000);
  std::string chunks;
  for (int i = 0; i < 64; ++i) {
    chunks += PngChunk("zTXt", std::string("Comment\0\0", 9) + zeros);
  }
  chunks += PngChunk("tEXt", std::string("Title\0bomb", 10));
  const std::string bomb = InsertAfterIhdr(png, chunks);
  ASSERT_LT(bomb.size(), size_t{1} << 20);

  const bool peak_measured = ResetPeakResident();
  const int64_t peak_before = PeakResidentBytes();
  absl::StatusOr<models::DecodedImage> decoded = models::DecodeImage(bomb, 1, models::ImageDecodeLimits{});
  const int64_t peak_after = PeakResidentBytes();
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  absl::StatusOr<models::DecodedImage> plain = models::DecodeImage(png, 1, models::ImageDecodeLimits{});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(decoded->pixels, plain->pixels);
  if (peak_measured && peak_before > 0) {
    EXPECT_LT(peak_after - peak_before, int64_t{64} << 20) << "peak resident memory grew by "
                                                           << (peak_after - peak_before) << " bytes";
  } else {
    ADD_FAILURE() << "cannot reset or read the peak resident size (/proc/self/clear_refs, VmHWM)";
  }
}

// tRNS is the one ancillary chunk that changes pixels; it is still applied.
TEST(DecompressionBombTest, TransparencyIsStillApplied) {
  // 2 x 1 gray 8-bit: values 200 and 100; tRNS makes gray 200 fully transparent (composited over black: 0).
  std::vector<uint8_t> pixels = {200, 100};
  absl::StatusOr<std::string> png = datasets::EncodePng(pixels, 2, 1, 1);
  ASSERT_TRUE(png.ok());
  const std::string with_trns = InsertAfterIhdr(*png, PngChunk("tRNS", std::string("\0\xc8", 2)));
  absl::StatusOr<models::DecodedImage> decoded = models::DecodeImage(with_trns, 1, models::ImageDecodeLimits{});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->pixels, (std::vector<uint8_t>{0, 100}));
}

// A 16 x 16 gray progressive JPEG written with libjpeg: with `many_scans`, a valid scan script of 694 scans
// (DC, then each AC coefficient alone, first at Al = 10 and refined bit by bit down to Al = 0); else the
// standard progression of jpeg_simple_progression (6 scans for gray).
std::string ProgressiveJpeg(bool many_scans) {
  jpeg_compress_struct info;
  jpeg_error_mgr error;
  info.err = jpeg_std_error(&error);
  jpeg_create_compress(&info);
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&info, &buffer, &size);
  info.image_width = 16;
  info.image_height = 16;
  info.input_components = 1;
  info.in_color_space = JCS_GRAYSCALE;
  jpeg_set_defaults(&info);
  std::vector<jpeg_scan_info> scans;
  if (many_scans) {
    scans.push_back(jpeg_scan_info{1, {0}, 0, 0, 0, 0});
    for (int k = 1; k < 64; ++k) {
      scans.push_back(jpeg_scan_info{1, {0}, k, k, 0, 10});
      for (int bit = 10; bit >= 1; --bit) scans.push_back(jpeg_scan_info{1, {0}, k, k, bit, bit - 1});
    }
    info.scan_info = scans.data();
    info.num_scans = static_cast<int>(scans.size());
  } else {
    jpeg_simple_progression(&info);
  }
  jpeg_start_compress(&info, TRUE);
  std::vector<uint8_t> row(16);
  for (int y = 0; y < 16; ++y) {
    for (int x = 0; x < 16; ++x) row[x] = static_cast<uint8_t>((x * 13 + y * 7) % 256);
    JSAMPROW pointer = row.data();
    jpeg_write_scanlines(&info, &pointer, 1);
  }
  jpeg_finish_compress(&info);
  jpeg_destroy_compress(&info);
  std::string bytes(reinterpret_cast<const char*>(buffer), size);
  std::free(buffer);
  return bytes;
}

// REGRESSION: every scan of a progressive JPEG is one more pass over all blocks, so a small file with hundreds
// of scans costs far more to decode than its size suggests. More than 500 scans are now rejected.
TEST(DecompressionBombTest, JpegWithTooManyScansIsRejected) {
  const std::string normal = ProgressiveJpeg(false);
  absl::StatusOr<models::DecodedImage> decoded = models::DecodeImage(normal, 1, models::ImageDecodeLimits{});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->width, 16);
  const std::string bomb = ProgressiveJpeg(true);
  ExpectStatusParts(models::DecodeImage(bomb, 1, models::ImageDecodeLimits{}).status(),
                    absl::StatusCode::kInvalidArgument, {"invalid JPEG: more than 500 scans"});
}

// ----- malformed wire bytes -----

// One unary call of `method` ("/package.Service/Method") with `bytes` as the request message, over a generic
// stub (no client-side serialization). Returns the status and, when OK, the response bytes.
std::pair<grpc::Status, std::string> RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                                             const std::string& bytes, absl::Duration deadline = absl::Seconds(30)) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response, [&](grpc::Status result) {
    status = std::move(result);
    done.Notify();
  });
  done.WaitForNotification();
  std::string out;
  if (status.ok()) {
    std::vector<grpc::Slice> slices;
    (void)response.Dump(&slices);
    for (const grpc::Slice& piece : slices) out.append(reinterpret_cast<const char*>(piece.begin()), piece.size());
  }
  return {status, out};
}

// The malformed kinds protobuf parsing rejects, as the first bytes of a message.
const std::vector<std::pair<std::string, std::string>>& MalformedMessages() {
  static const auto* messages = new std::vector<std::pair<std::string, std::string>>{
      {"truncated varint", std::string("\x28\xff", 2)},              // field 5 (varint), continuation bit, then end
      {"bad length", std::string("\x0a\x10" "abc", 5)},             // field 1, 16 bytes announced, 3 sent
      {"invalid UTF-8 in a string field", std::string("\x0a\x02\xff\xfe", 4)},  // field 1 (string)
      {"unterminated group", std::string("\x0b", 1)},                // field 1 as a start-group tag, no end
      {"field number 0", std::string("\x00\x01", 2)},
  };
  return *messages;
}

class WireTest : public MessageLimitServiceTest {};

// A request that does not parse is INVALID_ARGUMENT saying so, for both services, and counted once with model
// "unknown" (before the callback API's raw methods gRPC answered INTERNAL with an empty message and nothing
// counted it).
TEST_F(WireTest, UnparsableRequestsAreInvalidArgumentAndCounted) {
  test_util::InProcessServerOptions options;
  options.open_inference = true;
  test_util::InProcessServer server(registry_, options);
  ASSERT_TRUE(server.status().ok()) << server.status();
  const std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials());
  const struct {
    const char* method;
    const char* label;
    const char* message_type;
  } methods[] = {{"/mita.v1.MitaService/Classify", "Classify", "mita.v1.ClassifyRequest"},
                 {"/mita.v1.MitaService/GetModel", "GetModel", "mita.v1.GetModelRequest"},
                 {"/inference.GRPCInferenceService/ModelInfer", "ModelInfer", "inference.ModelInferRequest"},
                 {"/inference.GRPCInferenceService/ModelMetadata", "ModelMetadata", "inference.ModelMetadataRequest"},
                 {"/inference.GRPCInferenceService/ModelConfig", "ModelConfig", "inference.ModelConfigRequest"}};
  for (const auto& method : methods) {
    for (const auto& [kind, bytes] : MalformedMessages()) {
      SCOPED_TRACE(absl::StrCat(method.method, ": ", kind));
      const double before = MetricValue(server.registry(), "mita_requests_total",
                                        {{"method", method.label}, {"code", "INVALID_ARGUMENT"}});
      const auto [status, response] = RawCall(channel, method.method, bytes);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
      EXPECT_THAT(status.error_message(),
                  HasSubstr(absl::StrCat("the request could not be parsed as a ", method.message_type, " message (",
                                         bytes.size(), " bytes)")));
      EXPECT_EQ(MetricValue(server.registry(), "mita_requests_total",
                            {{"method", method.label}, {"code", "INVALID_ARGUMENT"}}) - before,
                1);
    }
  }
  EXPECT_EQ(MetricValue(server.registry(), "mita_requests_total",
                        {{"method", "Classify"}, {"model", "unknown"}, {"code", "INVALID_ARGUMENT"}}),
            static_cast<double>(MalformedMessages().size()));
  // The server still serves.
  absl::StatusOr<test_util::TestImages> images = test_util::FashionMnistTestPngs(1);
  ASSERT_TRUE(images.ok());
  client::ClassifyOptions classify;
  classify.model = kModel;
  EXPECT_TRUE(server.client().Classify(images->pngs[0], classify).ok());
}

// Client-side wire mutation, bounded in time: real requests of both services (an image, a document as text and
// as token ids), serialized and then mutated (byte flips, insertions, deletions, truncation; seeded), sent as
// they are. Every answer must be a code a bad request may get, never INTERNAL or UNKNOWN, and the server must
// go on serving. Prints the count of each code.
TEST_F(WireTest, MutatedWireBytesNeverGetAServerFault) {
  test_util::InProcessServerOptions options;
  options.open_inference = true;
  options.engine.batching.max_queue_delay = absl::ZeroDuration();
  test_util::InProcessServer server(registry_, options);
  ASSERT_TRUE(server.status().ok()) << server.status();
  const std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials());
  absl::StatusOr<test_util::TestImages> images = test_util::FashionMnistTestPngs(1);
  ASSERT_TRUE(images.ok());
  std::vector<std::pair<std::string, std::string>> seeds;  // method, serialized request
  {
    v1::ClassifyRequest image;
    image.set_model(kModel);
    image.set_image(images->pngs[0]);
    image.mutable_budget()->mutable_experts()->set_expert_count(4);
    image.set_top_n(3);
    seeds.emplace_back("/mita.v1.MitaService/Classify", image.SerializeAsString());
    v1::ClassifyRequest text;
    text.set_model("linux-doc-mita");
    text.mutable_document()->set_text("The scheduler balances runqueues across processors.");
    text.mutable_budget()->set_preset("fast");
    seeds.emplace_back("/mita.v1.MitaService/Classify", text.SerializeAsString());
    v1::ClassifyRequest ids;
    ids.set_model("linux-doc-mita");
    for (int64_t id : {5, 17, 300, 2, 9}) ids.mutable_document()->mutable_token_ids()->add_ids(id);
    seeds.emplace_back("/mita.v1.MitaService/Classify", ids.SerializeAsString());
    inference::ModelInferRequest infer;
    infer.set_model_name(kModel);
    auto* input = infer.add_inputs();
    input->set_name("image");
    input->set_datatype("BYTES");
    input->add_shape(1);
    input->mutable_contents()->add_bytes_contents(images->pngs[0]);
    (*infer.mutable_parameters())["mita_expert_width"].set_int64_param(8);
    seeds.emplace_back("/inference.GRPCInferenceService/ModelInfer", infer.SerializeAsString());
  }
  std::mt19937 random(20261202);
  std::map<grpc::StatusCode, int> codes;
  const absl::Time end = absl::Now() + absl::Seconds(8);
  int calls = 0;
  while (absl::Now() < end || calls < 200) {
    const auto& [method, seed] = seeds[random() % seeds.size()];
    std::string bytes = seed;
    const int mutations = 1 + static_cast<int>(random() % 4);
    for (int m = 0; m < mutations && !bytes.empty(); ++m) {
      // Mutate near the front most of the time: the tags and lengths live there, not in the image's pixels.
      const size_t at = random() % 2 == 0 ? random() % std::min<size_t>(bytes.size(), 48) : random() % bytes.size();
      switch (random() % 4) {
        case 0:
          bytes[at] = static_cast<char>(bytes[at] ^ (1 << (random() % 8)));
          break;
        case 1:
          bytes.insert(at, 1, static_cast<char>(random()));
          break;
        case 2:
          bytes.erase(at, 1 + random() % 4);
          break;
        default:
          bytes.resize(at);
          break;
      }
    }
    const grpc::Status status = RawCall(channel, method, bytes).first;
    ++codes[status.error_code()];
    ++calls;
    ASSERT_NE(status.error_code(), grpc::StatusCode::INTERNAL) << status.error_message();
    ASSERT_NE(status.error_code(), grpc::StatusCode::UNKNOWN) << status.error_message();
    ASSERT_NE(status.error_code(), grpc::StatusCode::UNAVAILABLE) << "the server stopped answering";
  }
  std::string summary;
  for (const auto& [code, count] : codes) absl::StrAppend(&summary, " ", code, ":", count);
  std::printf("[ info ] %d mutated calls, by gRPC code:%s\n", calls, summary.c_str());
  for (const auto& [code, count] : codes) {
    EXPECT_TRUE(code == grpc::StatusCode::OK || code == grpc::StatusCode::INVALID_ARGUMENT ||
                code == grpc::StatusCode::NOT_FOUND || code == grpc::StatusCode::RESOURCE_EXHAUSTED)
        << "code " << code << " answered " << count << " times";
  }
  EXPECT_GT(codes[grpc::StatusCode::INVALID_ARGUMENT], 0);
  client::ClassifyOptions classify;
  classify.model = kModel;
  EXPECT_TRUE(server.client().Classify(images->pngs[0], classify).ok());
}

// ----- zero-sized and wrong-rank tensors given to the model -----

TEST(HostileTensorTest, ZeroSizedAndWrongRankImagesAreInvalidArgument) {
  absl::StatusOr<std::unique_ptr<models::VitClassifier>> loaded =
      models::LoadVitClassifier(RepositoryPath() + "/" + kModel);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const models::VitClassifier& model = **loaded;
  const std::vector<models::AttentionBudget> one = {model.config().default_budget};
  const std::vector<models::AttentionBudget> none;
  struct Case {
    at::Tensor images;
    const std::vector<models::AttentionBudget>* budgets;
  };
  const std::vector<Case> cases = {
      {at::Tensor(), &one},                   // undefined
      {at::zeros({}), &one},                  // rank 0
      {at::zeros({28}), &one},                // rank 1
      {at::zeros({1, 28, 28}), &one},         // rank 3
      {at::zeros({1, 1, 1, 28, 28}), &one},   // rank 5
      {at::zeros({0, 1, 28, 28}), &none},     // empty batch
      {at::zeros({1, 0, 28, 28}), &one},      // zero channels
      {at::zeros({1, 1, 0, 28}), &one},       // zero height
      {at::zeros({1, 1, 28, 0}), &one},       // zero width
      {at::zeros({1, 3, 28, 28}), &one},      // wrong channels
      {at::zeros({1, 1, 27, 28}), &one},      // wrong side
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.images.defined() ? c.images.sizes().vec() : std::vector<int64_t>{-1});
    absl::StatusOr<models::ClassifierOutput> output = model.Forward(c.images, *c.budgets, false);
    EXPECT_EQ(output.status().code(), absl::StatusCode::kInvalidArgument) << output.status();
    EXPECT_THAT(std::string(output.status().message()), HasSubstr("images"));
  }
}

}  // namespace
}  // namespace mita::server
