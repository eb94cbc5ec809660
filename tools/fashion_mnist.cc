// Fashion-MNIST IDX reader (zlib) and PNG (libpng) / JPEG (libjpeg) encoders (see fashion_mnist.h).
#include "tools/fashion_mnist.h"

#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <png.h>
#include <jpeglib.h>
#include <zlib.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace mita::datasets {
namespace {

// Reads a whole gzip file. NOT_FOUND when it cannot be opened, INVALID_ARGUMENT when it is not valid gzip.
absl::StatusOr<std::string> ReadGzipFile(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    const int read = gzread(file, buffer, sizeof(buffer));
    if (read < 0) {
      int code = 0;
      const std::string message = gzerror(file, &code);
      gzclose(file);
      return absl::InvalidArgumentError(absl::StrCat(path, ": gzip error: ", message));
    }
    if (read == 0) break;
    contents.append(buffer, static_cast<size_t>(read));
  }
  gzclose(file);
  return contents;
}

uint32_t ReadBigEndian32(const std::string& bytes, size_t offset) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data() + offset);
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// Parses an IDX file of unsigned bytes (type 0x08) with `dimensions` dimensions; returns the sizes and the data.
absl::StatusOr<std::vector<uint32_t>> ParseIdxHeader(const std::string& bytes, int dimensions, const std::string& path) {
  const size_t header_size = 4 + 4 * static_cast<size_t>(dimensions);
  if (bytes.size() < header_size) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": shorter than its IDX header"));
  }
  const uint32_t magic = ReadBigEndian32(bytes, 0);
  const uint32_t expected_magic = 0x00000800u | static_cast<uint32_t>(dimensions);
  if (magic != expected_magic) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": IDX magic number ", magic, ", expected ", expected_magic, " (unsigned bytes, ",
                     dimensions, " dimensions)"));
  }
  std::vector<uint32_t> sizes;
  uint64_t total = 1;
  for (int i = 0; i < dimensions; ++i) {
    sizes.push_back(ReadBigEndian32(bytes, 4 + 4 * i));
    total *= sizes.back();
  }
  if (bytes.size() - header_size != total) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": holds ", bytes.size() - header_size,
                                                   " data bytes, the header declares ", total));
  }
  return sizes;
}

}  // namespace

std::string FashionMnistDirectory() {
  const char* directory = std::getenv("MITA_FASHION_MNIST_DIR");
  return directory != nullptr && directory[0] != '\0' ? directory : kFashionMnistDirectory;
}

absl::StatusOr<FashionMnist> ReadFashionMnist(const std::string& split, const std::string& given_directory) {
  const std::string directory = given_directory.empty() ? FashionMnistDirectory() : given_directory;
  if (split != "train" && split != "t10k") {
    return absl::InvalidArgumentError(absl::StrCat("split \"", split, "\" must be \"train\" or \"t10k\""));
  }
  const std::string images_path = absl::StrCat(directory, "/", split, "-images-idx3-ubyte.gz");
  const std::string labels_path = absl::StrCat(directory, "/", split, "-labels-idx1-ubyte.gz");
  absl::StatusOr<std::string> images = ReadGzipFile(images_path);
  if (!images.ok()) return images.status();
  absl::StatusOr<std::string> labels = ReadGzipFile(labels_path);
  if (!labels.ok()) return labels.status();
  absl::StatusOr<std::vector<uint32_t>> image_sizes = ParseIdxHeader(*images, 3, images_path);
  if (!image_sizes.ok()) return image_sizes.status();
  absl::StatusOr<std::vector<uint32_t>> label_sizes = ParseIdxHeader(*labels, 1, labels_path);
  if (!label_sizes.ok()) return label_sizes.status();
  if ((*image_sizes)[0] != (*label_sizes)[0]) {
    return absl::InvalidArgumentError(absl::StrCat(images_path, " holds ", (*image_sizes)[0], " images but ",
                                                   labels_path, " holds ", (*label_sizes)[0], " labels"));
  }
  FashionMnist data;
  data.count = (*image_sizes)[0];
  data.rows = (*image_sizes)[1];
  data.columns = (*image_sizes)[2];
  data.pixels.assign(images->begin() + 16, images->end());
  data.labels.assign(labels->begin() + 8, labels->end());
  for (uint8_t label : data.labels) {
    if (label > 9) return absl::InvalidArgumentError(absl::StrCat(labels_path, ": label ", label, " is not in 0..9"));
  }
  return data;
}

absl::StatusOr<std::string> EncodePng(const std::vector<uint8_t>& pixels, int64_t width, int64_t height,
                                      int64_t channels) {
  if (width <= 0 || height <= 0 || width > (1 << 20) || height > (1 << 20) || channels < 1 || channels > 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("EncodePng: invalid size ", width, "x", height, "x", channels, " (channels 1 to 4)"));
  }
  if (static_cast<int64_t>(pixels.size()) != width * height * channels) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePng: ", pixels.size(), " bytes do not match ", width, "x",
                                                   height, "x", channels));
  }
  png_image image;
  std::memset(&image, 0, sizeof(image));
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(width);
  image.height = static_cast<png_uint_32>(height);
  static constexpr png_uint_32 kFormats[] = {PNG_FORMAT_GRAY, PNG_FORMAT_GA, PNG_FORMAT_RGB, PNG_FORMAT_RGBA};
  image.format = kFormats[channels - 1];
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&image, nullptr, &size, /*convert_to_8_bit=*/0, pixels.data(), 0, nullptr)) {
    std::string message = image.message;
    png_image_free(&image);
    return absl::InternalError(absl::StrCat("EncodePng: ", message));
  }
  std::string result(size, '\0');
  if (!png_image_write_to_memory(&image, result.data(), &size, 0, pixels.data(), 0, nullptr)) {
    std::string message = image.message;
    png_image_free(&image);
    return absl::InternalError(absl::StrCat("EncodePng: ", message));
  }
  result.resize(size);
  return result;
}

namespace {

struct JpegEncodeError {
  jpeg_error_mgr base;  // first member
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void JpegEncodeErrorExit(j_common_ptr info) {
  auto* error = reinterpret_cast<JpegEncodeError*>(info->err);
  (*info->err->format_message)(info, error->message);
  longjmp(error->jump, 1);
}

// Only trivially destructible locals between setjmp and longjmp.
bool CompressJpeg(jpeg_compress_struct& info, JpegEncodeError& error, const uint8_t* pixels, int64_t width,
                  int64_t height, int64_t channels, int quality, unsigned char** buffer, unsigned long* size) {
  if (setjmp(error.jump)) return false;
  jpeg_create_compress(&info);
  jpeg_mem_dest(&info, buffer, size);
  info.image_width = static_cast<JDIMENSION>(width);
  info.image_height = static_cast<JDIMENSION>(height);
  info.input_components = static_cast<int>(channels);
  info.in_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&info);
  jpeg_set_quality(&info, quality, TRUE);
  jpeg_start_compress(&info, TRUE);
  const size_t row_bytes = static_cast<size_t>(width * channels);
  while (info.next_scanline < info.image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(pixels + static_cast<size_t>(info.next_scanline) * row_bytes);
    jpeg_write_scanlines(&info, &row, 1);
  }
  jpeg_finish_compress(&info);
  return true;
}

}  // namespace

absl::StatusOr<std::string> EncodeJpeg(const std::vector<uint8_t>& pixels, int64_t width, int64_t height,
                                       int64_t channels, int quality) {
  if (width <= 0 || height <= 0 || width > 65500 || height > 65500 || (channels != 1 && channels != 3)) {
    return absl::InvalidArgumentError(
        absl::StrCat("EncodeJpeg: invalid size ", width, "x", height, "x", channels, " (channels 1 or 3)"));
  }
  if (quality < 1 || quality > 100) {
    return absl::InvalidArgumentError(absl::StrCat("EncodeJpeg: quality ", quality, " is outside [1, 100]"));
  }
  if (static_cast<int64_t>(pixels.size()) != width * height * channels) {
    return absl::InvalidArgumentError(absl::StrCat("EncodeJpeg: ", pixels.size(), " bytes do not match ", width,
                                                   "x", height, "x", channels));
  }
  jpeg_compress_struct info;
  JpegEncodeError error;
  std::memset(&info, 0, sizeof(info));
  std::memset(&error, 0, sizeof(error));
  info.err = jpeg_std_error(&error.base);
  error.base.error_exit = JpegEncodeErrorExit;
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  const bool ok = CompressJpeg(info, error, pixels.data(), width, height, channels, quality, &buffer, &size);
  jpeg_destroy_compress(&info);
  std::string result;
  if (ok) result.assign(reinterpret_cast<const char*>(buffer), size);
  std::free(buffer);
  if (!ok) return absl::InternalError(absl::StrCat("EncodeJpeg: ", error.message));
  return result;
}

const std::vector<std::string>& FashionMnistLabels() {
  static const auto* const kLabels = new std::vector<std::string>{
      "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};
  return *kLabels;
}

}  // namespace mita::datasets
