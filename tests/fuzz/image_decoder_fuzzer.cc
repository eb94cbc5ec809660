// libFuzzer target: PNG/JPEG decoding (models::DecodeImage) and preprocessing to a 28 x 28 model input
// (models::PreprocessImage). Any input must give a value or an INVALID_ARGUMENT, never a crash, a sanitizer
// report or a decoded image whose buffer disagrees with its declared size.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "models/image_decoder.h"
#include "models/model_config.h"

namespace {

mita::models::VitConfig ModelConfig(int64_t channels) {
  mita::models::VitConfig config;
  config.image_size = 28;
  config.patch_size = 4;
  config.in_channels = channels;
  config.mean.assign(static_cast<size_t>(channels), 0.5f);
  config.std.assign(static_cast<size_t>(channels), 0.25f);
  return config;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  // Both output channel counts, chosen by the input length (the bytes themselves stay the file).
  const int64_t channels = size % 2 == 0 ? 1 : 3;
  // Smaller than the server's 4096 so that each run stays fast; the limit logic is the same.
  mita::models::ImageDecodeLimits limits;
  limits.max_width = 1024;
  limits.max_height = 1024;
  absl::StatusOr<mita::models::DecodedImage> image = mita::models::DecodeImage(bytes, channels, limits);
  if (!image.ok()) {
    if (image.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  if (image->width < 1 || image->height < 1 || image->width > limits.max_width || image->height > limits.max_height ||
      image->channels != channels ||
      static_cast<int64_t>(image->pixels.size()) != image->width * image->height * channels) {
    std::abort();
  }
  absl::StatusOr<at::Tensor> tensor = mita::models::PreprocessImage(*image, ModelConfig(channels));
  if (!tensor.ok() || tensor->dim() != 3 || tensor->size(0) != channels || tensor->size(1) != 28 ||
      tensor->size(2) != 28) {
    std::abort();
  }
  return 0;
}
