// Fashion-MNIST reader (Debian package dataset-fashion-mnist: gzipped IDX files) and PNG/JPEG encoders, for
// tools and tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace mita::datasets {

inline constexpr char kFashionMnistDirectory[] = "/usr/share/datasets/fashion-mnist";

// Where ReadFashionMnist looks by default: $MITA_FASHION_MNIST_DIR when set and not empty (a machine without the
// Debian package, e.g. the GPU machine with the files from scripts/gpu_bundle.sh), else kFashionMnistDirectory.
std::string FashionMnistDirectory();

// One split: `count` 28x28 8-bit grayscale images (row-major) and their labels 0..9.
struct FashionMnist {
  int64_t count = 0;
  int64_t rows = 28;
  int64_t columns = 28;
  std::vector<uint8_t> pixels;  // count * rows * columns
  std::vector<uint8_t> labels;  // count
};

// Reads the "train" or "t10k" split from `directory` (empty: FashionMnistDirectory()) (IDX format,
// http://yann.lecun.com/exdb/mnist/).
// Errors: NOT_FOUND when a file is missing, INVALID_ARGUMENT when its magic number or sizes are wrong.
absl::StatusOr<FashionMnist> ReadFashionMnist(const std::string& split,
                                              const std::string& directory = "");

// Encodes 8-bit pixels (row-major, interleaved; channels 1, 2, 3 or 4 = gray, gray+alpha, RGB, RGBA) as PNG
// with libpng. Errors: INVALID_ARGUMENT for a size mismatch.
absl::StatusOr<std::string> EncodePng(const std::vector<uint8_t>& pixels, int64_t width, int64_t height,
                                      int64_t channels);

// Encodes 8-bit gray (1) or RGB (3) pixels as baseline JPEG with libjpeg at `quality` (1..100).
absl::StatusOr<std::string> EncodeJpeg(const std::vector<uint8_t>& pixels, int64_t width, int64_t height,
                                       int64_t channels, int quality = 95);

// Labels of Fashion-MNIST classes 0..9.
const std::vector<std::string>& FashionMnistLabels();

}  // namespace mita::datasets
