// Image decoding (libpng, libjpeg-turbo) and preprocessing to a model's input tensor.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "models/model_config.h"

namespace mita::models {

// Limits checked against the declared size before any pixel buffer is allocated.
struct ImageDecodeLimits {
  // Largest decoded width and height, pixels: a PNG's declared size; a JPEG may declare up to 8x more on each
  // axis and is then decoded at a reduced DCT scale that fits.
  int64_t max_width = 4096;
  int64_t max_height = 4096;
  // The size the decoded image is resized to (the model's input), pixels; 0: none. A JPEG is decoded at the
  // smallest DCT scale (1/8 .. 8/8) that keeps each axis at least kJpegOversampling times this (or whole).
  int64_t target_width = 0;
  int64_t target_height = 0;
};

// How far above the model's input size a JPEG is decoded before area averaging: 4x keeps the averaging windows
// spanning 4+ decoded pixels, so DCT scaling and area averaging of the full image agree closely
// (tests/image_decoder_test.cc measures the difference).
inline constexpr int64_t kJpegOversampling = 4;

// How an image will be decoded, found from its header alone (no pixel is decoded).
struct ImageDecodePlan {
  enum class Format { kPng, kJpeg };
  Format format = Format::kPng;
  int64_t declared_width = 0;   // pixels, as the header says; 0 when a PNG header could not be read
  int64_t declared_height = 0;
  int64_t decoded_width = 0;    // pixels, after JPEG DCT scaling
  int64_t decoded_height = 0;
  int scale_eighths = 8;        // JPEG: decoded at scale_eighths / 8 of its declared size
  // Upper estimate of the peak memory of DecodeImage + PreprocessImage, bytes: decoded pixels x (4 + 6 x
  // channels) (decoder samples of up to 4 components, the converted pixels, their planar copy and the float
  // tensor) + 1 MiB of decoder state.
  int64_t working_bytes = 0;
};

// Reads the header of PNG or JPEG `bytes` and plans their decoding to `channels` (1 or 3) under `limits`.
// Errors: as DecodeImage for an empty input, an unknown format, bad `channels`, a declared size over the limits
// (even at 1/8 scale for a JPEG) or a JPEG header libjpeg refuses.
absl::StatusOr<ImageDecodePlan> PlanImageDecode(std::string_view bytes, int64_t channels,
                                                const ImageDecodeLimits& limits);

// Decoded 8-bit pixels, row-major, interleaved channels.
struct DecodedImage {
  int64_t width = 0;
  int64_t height = 0;
  int64_t channels = 0;  // 1 (gray) or 3 (RGB)
  std::vector<uint8_t> pixels;  // width * height * channels bytes
};

// Decodes PNG or JPEG bytes (detected by signature) to `channels` (1 or 3) 8-bit channels. Palette, sub-8-bit
// and 16-bit samples (rounded to 8 bits), alpha (composited over BLACK, the Fashion-MNIST background),
// grayscale (replicated to RGB), RGB (to gray by ITU-R BT.601 luma) and CMYK/YCCK JPEG (Adobe inverted
// convention) inputs are converted; image_decoder.cc documents each rule. A JPEG is decoded at the DCT scale
// PlanImageDecode chooses (DecodedImage has the decoded size). No colour management or gamma
// correction; EXIF orientation is not applied (documented in the README). The declared width x height is
// checked against `limits` before any pixel buffer is allocated (for PNG straight from the IHDR bytes).
// Every libpng/libjpeg warning is an error. Against decompression bombs: PNG ancillary chunks other than tRNS
// are skipped without being inflated, and a JPEG with more than 500 scans is rejected.
// Errors: INVALID_ARGUMENT carrying a RequestField::kImage problem (models/request_error.h) for empty input, an
// unknown format, `channels` not 1 or 3, a declared size over the limits (the detail gives the size and the
// limits), a JPEG of more than 500 scans, or any decoder error or warning (truncated or corrupt data is an
// error, never a grey-filled image); RESOURCE_EXHAUSTED when a decoder cannot be created.
absl::StatusOr<DecodedImage> DecodeImage(std::string_view bytes, int64_t channels, const ImageDecodeLimits& limits);

// Converts a decoded image to the model input [C, image_size, image_size] float32 (C = in_channels), CPU.
// Each axis longer than image_size is shrunk by area averaging (at::adaptive_avg_pool2d: exact box means for
// integer ratios, windows [floor(i*L/T), ceil((i+1)*L/T)) otherwise); each shorter axis is then enlarged
// bilinearly (at::upsample_bilinear2d, align_corners = false: half-pixel centres, as PIL and OpenCV). A
// non-square image is stretched, not cropped. Then x = (pixel / 255 - mean[c]) / std[c].
// Errors: INVALID_ARGUMENT (a kImage problem) when the channel count differs from the config's in_channels or the
// pixel buffer does not hold width x height x channels bytes; INTERNAL if ATen fails.
absl::StatusOr<at::Tensor> PreprocessImage(const DecodedImage& image, const VitConfig& config);

}  // namespace mita::models
