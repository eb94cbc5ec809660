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
  int64_t max_width = 4096;   // pixels
  int64_t max_height = 4096;  // pixels
};

// Decoded 8-bit pixels, row-major, interleaved channels.
struct DecodedImage {
  int64_t width = 0;
  int64_t height = 0;
  int64_t channels = 0;  // 1 (gray) or 3 (RGB)
  std::vector<uint8_t> pixels;  // width * height * channels bytes
};

// Decodes PNG or JPEG bytes (detected by signature) to `channels` (1 or 3) 8-bit channels:
// palette, alpha (composited over white... see image_decoder.cc for the exact rule), 16-bit, grayscale and
// CMYK inputs are converted. EXIF orientation is not applied (documented in the README).
// Errors: INVALID_ARGUMENT for empty input, an unknown format, a declared size over the limits (names the
// limit), or any decoder error or warning (truncated or corrupt data is an error, never a grey-filled image).
absl::StatusOr<DecodedImage> DecodeImage(std::string_view bytes, int64_t channels, const ImageDecodeLimits& limits);

// Converts a decoded image to the model input [C, image_size, image_size] float32: resized when its size
// differs (area averaging when shrinking, bilinear when enlarging), scaled to [0, 1], then normalised with
// the config's per-channel mean and std. Errors: INVALID_ARGUMENT when the channel count differs from the
// config's in_channels.
absl::StatusOr<at::Tensor> PreprocessImage(const DecodedImage& image, const VitConfig& config);

}  // namespace mita::models
