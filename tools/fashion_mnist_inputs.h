// Fashion-MNIST test images as model inputs, for the tools and tests that run the image model in process
// (mita-eval, mita-batching-bench, models_test). Header-only: tools/fashion_mnist.h stays free of LibTorch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "models/image_decoder.h"
#include "models/model_config.h"
#include "tools/fashion_mnist.h"

namespace mita::datasets {

// The first min(count, data.count) images of `data`, each as the server has it after decoding a PNG (8-bit gray)
// and preprocessed for `config`'s model by models::PreprocessImage: [in_channels, image_size, image_size] float32.
// Errors: those of PreprocessImage (INVALID_ARGUMENT when the model does not take 1-channel images).
inline absl::StatusOr<std::vector<at::Tensor>> PreprocessedImages(const FashionMnist& data,
                                                                  const models::VitConfig& config, int64_t count) {
  const int64_t pixels_per_image = data.rows * data.columns;
  std::vector<at::Tensor> images;
  images.reserve(std::max<int64_t>(0, std::min(count, data.count)));
  for (int64_t i = 0; i < count && i < data.count; ++i) {
    models::DecodedImage image;
    image.width = data.columns;
    image.height = data.rows;
    image.channels = 1;
    image.pixels.assign(data.pixels.begin() + i * pixels_per_image, data.pixels.begin() + (i + 1) * pixels_per_image);
    absl::StatusOr<at::Tensor> tensor = models::PreprocessImage(image, config);
    if (!tensor.ok()) return tensor.status();
    images.push_back(*std::move(tensor));
  }
  return images;
}

}  // namespace mita::datasets
