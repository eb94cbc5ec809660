// Image decoding (PNG, JPEG) and preprocessing tests.
#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <png.h>
#include <jpeglib.h>

#include <ATen/core/Tensor.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/image_decoder.h"
#include "models/model_config.h"
#include "tests/test_util.h"
#include "tools/fashion_mnist.h"

namespace mita::models {
namespace {

using ::testing::HasSubstr;
using test_util::AppendBigEndian32;
using test_util::PngChunk;

// ----- helpers -----

// Deterministic pseudo-random bytes (an LCG), so compressed data is large and not trivially repetitive.
std::vector<uint8_t> NoisePixels(size_t count, uint32_t seed = 1) {
  std::vector<uint8_t> pixels(count);
  for (auto& pixel : pixels) {
    seed = seed * 1664525u + 1013904223u;
    pixel = static_cast<uint8_t>(seed >> 24);
  }
  return pixels;
}

// A smooth gradient (JPEG reproduces it closely); values stay below 256 up to 32 x 16 x 3.
std::vector<uint8_t> GradientPixels(int64_t width, int64_t height, int64_t channels) {
  std::vector<uint8_t> pixels(width * height * channels);
  for (int64_t y = 0; y < height; ++y) {
    for (int64_t x = 0; x < width; ++x) {
      for (int64_t c = 0; c < channels; ++c) {
        pixels[(y * width + x) * channels + c] = static_cast<uint8_t>(10 + 3 * x + 4 * y + 25 * c);
      }
    }
  }
  return pixels;
}

void PngWriteToString(png_structp png, png_bytep data, size_t length) {
  static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), length);
}
void PngFlushNothing(png_structp) {}

// Writes a PNG with libpng's classic API (palette and 16-bit inputs, which EncodePng does not produce).
// rows: raw PNG row bytes (already packed / big-endian as the format requires).
std::string WritePngRaw(int width, int height, int bit_depth, int color_type, const std::vector<std::string>& rows,
                        const std::vector<png_color>& palette = {}, const std::vector<png_byte>& transparency = {},
                        int interlace = PNG_INTERLACE_NONE) {
  std::string out;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    ADD_FAILURE() << "libpng write failed";
    return "";
  }
  png_set_write_fn(png, &out, PngWriteToString, PngFlushNothing);
  png_set_IHDR(png, info, width, height, bit_depth, color_type, interlace, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (!palette.empty()) png_set_PLTE(png, info, palette.data(), static_cast<int>(palette.size()));
  if (!transparency.empty()) {
    png_set_tRNS(png, info, transparency.data(), static_cast<int>(transparency.size()), nullptr);
  }
  png_write_info(png, info);
  std::vector<png_bytep> row_pointers;
  for (const std::string& row : rows) row_pointers.push_back(reinterpret_cast<png_bytep>(const_cast<char*>(row.data())));
  png_write_image(png, row_pointers.data());  // handles the Adam7 passes when interlaced
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return out;
}

// Writes a CMYK JPEG with libjpeg (which adds the Adobe APP14 marker and stores the samples as given).
std::string WriteCmykJpeg(int width, int height, const std::vector<uint8_t>& cmyk) {
  jpeg_compress_struct info;
  jpeg_error_mgr error;
  info.err = jpeg_std_error(&error);
  jpeg_create_compress(&info);
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&info, &buffer, &size);
  info.image_width = width;
  info.image_height = height;
  info.input_components = 4;
  info.in_color_space = JCS_CMYK;
  jpeg_set_defaults(&info);
  jpeg_set_colorspace(&info, JCS_CMYK);
  jpeg_set_quality(&info, 100, TRUE);
  jpeg_start_compress(&info, TRUE);
  while (info.next_scanline < info.image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(cmyk.data() + info.next_scanline * width * 4);
    jpeg_write_scanlines(&info, &row, 1);
  }
  jpeg_finish_compress(&info);
  jpeg_destroy_compress(&info);
  std::string out(reinterpret_cast<const char*>(buffer), size);
  free(buffer);
  return out;
}

DecodedImage Decode(const std::string& bytes, int64_t channels, ImageDecodeLimits limits = {}) {
  absl::StatusOr<DecodedImage> image = DecodeImage(bytes, channels, limits);
  EXPECT_TRUE(image.ok()) << image.status();
  return image.ok() ? *image : DecodedImage{};
}

void ExpectInvalid(const std::string& bytes, const std::string& message_part, int64_t channels = 1,
                   ImageDecodeLimits limits = {}) {
  absl::StatusOr<DecodedImage> image = DecodeImage(bytes, channels, limits);
  ASSERT_FALSE(image.ok());
  EXPECT_EQ(image.status().code(), absl::StatusCode::kInvalidArgument) << image.status();
  EXPECT_THAT(std::string(image.status().message()), HasSubstr(message_part));
}

uint8_t OverBlack(int value, int alpha) { return static_cast<uint8_t>(std::lround(value * alpha / 255.0)); }
uint8_t Luma(int red, int green, int blue) {
  return static_cast<uint8_t>(std::lround(0.299 * red + 0.587 * green + 0.114 * blue));
}

// ----- PNG -----

TEST(DecodePngTest, GrayRoundTripsAndReplicatesToRgb) {
  const std::vector<uint8_t> pixels = NoisePixels(7 * 5);
  absl::StatusOr<std::string> png = datasets::EncodePng(pixels, 7, 5, 1);
  ASSERT_TRUE(png.ok()) << png.status();
  DecodedImage gray = Decode(*png, 1);
  EXPECT_EQ(gray.width, 7);
  EXPECT_EQ(gray.height, 5);
  EXPECT_EQ(gray.channels, 1);
  EXPECT_EQ(gray.pixels, pixels);
  DecodedImage rgb = Decode(*png, 3);
  ASSERT_EQ(rgb.pixels.size(), pixels.size() * 3);
  for (size_t i = 0; i < pixels.size(); ++i) {
    for (int c = 0; c < 3; ++c) EXPECT_EQ(rgb.pixels[i * 3 + c], pixels[i]);
  }
}

TEST(DecodePngTest, RgbRoundTripsAndGrayIsBt601Luma) {
  // red, green, blue, white, a mixed colour, black
  const std::vector<uint8_t> pixels = {255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 255, 10, 200, 90, 0, 0, 0};
  absl::StatusOr<std::string> png = datasets::EncodePng(pixels, 3, 2, 3);
  ASSERT_TRUE(png.ok()) << png.status();
  EXPECT_EQ(Decode(*png, 3).pixels, pixels);
  // 0.299 * 255 = 76.2, 0.587 * 255 = 149.7, 0.114 * 255 = 29.1; 0.299*10 + 0.587*200 + 0.114*90 = 130.65.
  EXPECT_EQ(Decode(*png, 1).pixels, (std::vector<uint8_t>{76, 150, 29, 255, 131, 0}));
}

TEST(DecodePngTest, RgbaIsCompositedOverBlack) {
  const std::vector<uint8_t> pixels = {200, 100, 50, 255,  // opaque: unchanged
                                       200, 100, 50, 0,    // transparent: black
                                       200, 100, 50, 128,  // half: c * 128 / 255
                                       255, 255, 255, 64};
  absl::StatusOr<std::string> png = datasets::EncodePng(pixels, 2, 2, 4);
  ASSERT_TRUE(png.ok()) << png.status();
  const std::vector<uint8_t> expected_rgb = {200, 100, 50, 0, 0, 0, 100, 50, 25, 64, 64, 64};
  EXPECT_EQ(Decode(*png, 3).pixels, expected_rgb);
  EXPECT_EQ(OverBlack(200, 128), 100);  // the hand values above follow the documented rule
  EXPECT_EQ(Decode(*png, 1).pixels,
            (std::vector<uint8_t>{Luma(200, 100, 50), 0, Luma(100, 50, 25), 64}));
}

TEST(DecodePngTest, GrayAlphaIsCompositedOverBlack) {
  const std::vector<uint8_t> pixels = {90, 255, 90, 0, 90, 128, 255, 1};
  absl::StatusOr<std::string> png = datasets::EncodePng(pixels, 4, 1, 2);
  ASSERT_TRUE(png.ok()) << png.status();
  const std::vector<uint8_t> expected = {90, 0, OverBlack(90, 128), OverBlack(255, 1)};
  EXPECT_EQ(expected, (std::vector<uint8_t>{90, 0, 45, 1}));
  EXPECT_EQ(Decode(*png, 1).pixels, expected);
  DecodedImage rgb = Decode(*png, 3);
  ASSERT_EQ(rgb.pixels.size(), 12u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(rgb.pixels[i * 3 + 1], expected[i]);
}

TEST(DecodePngTest, PaletteWithTransparencyIsExpanded) {
  const std::vector<png_color> palette = {{0, 0, 0}, {255, 0, 0}, {10, 20, 30}, {100, 200, 250}};
  const std::vector<png_byte> transparency = {255, 255, 255, 0};  // entry 3 fully transparent
  // 2-bit indices, 4 pixels per byte: row 0 = 0 1 2 3, row 1 = 3 2 1 0.
  const std::vector<std::string> rows = {std::string(1, static_cast<char>(0b00011011)),
                                         std::string(1, static_cast<char>(0b11100100))};
  const std::string png = WritePngRaw(4, 2, 2, PNG_COLOR_TYPE_PALETTE, rows, palette, transparency);
  const std::vector<uint8_t> expected_rgb = {0, 0, 0, 255, 0, 0, 10, 20, 30, 0, 0, 0,
                                             0, 0, 0, 10, 20, 30, 255, 0, 0, 0, 0, 0};
  EXPECT_EQ(Decode(png, 3).pixels, expected_rgb);
  EXPECT_EQ(Decode(png, 1).pixels,
            (std::vector<uint8_t>{0, 76, Luma(10, 20, 30), 0, 0, Luma(10, 20, 30), 76, 0}));
}

TEST(DecodePngTest, SixteenBitIsScaledWithRounding) {
  // 16-bit gray, big-endian samples: v8 = round(v16 * 255 / 65535) = round(v16 / 257).
  const std::vector<uint16_t> samples = {0, 65535, 257 * 100, 1000, 32896, 65000};
  std::string row;
  for (uint16_t sample : samples) {
    row.push_back(static_cast<char>(sample >> 8));
    row.push_back(static_cast<char>(sample & 0xFF));
  }
  const std::string png = WritePngRaw(6, 1, 16, PNG_COLOR_TYPE_GRAY, {row});
  EXPECT_EQ(Decode(png, 1).pixels, (std::vector<uint8_t>{0, 255, 100, 4, 128, 253}));

  // 16-bit RGB: one pixel (65535, 0, 25700) -> (255, 0, 100).
  std::string rgb_row;
  for (uint16_t sample : {uint16_t{65535}, uint16_t{0}, uint16_t{25700}}) {
    rgb_row.push_back(static_cast<char>(sample >> 8));
    rgb_row.push_back(static_cast<char>(sample & 0xFF));
  }
  const std::string rgb_png = WritePngRaw(1, 1, 16, PNG_COLOR_TYPE_RGB, {rgb_row});
  EXPECT_EQ(Decode(rgb_png, 3).pixels, (std::vector<uint8_t>{255, 0, 100}));
}

TEST(DecodePngTest, InterlacedIsDeinterlaced) {
  const std::vector<uint8_t> pixels = NoisePixels(13 * 11 * 3, 5);
  std::vector<std::string> rows;
  for (int y = 0; y < 11; ++y) rows.emplace_back(reinterpret_cast<const char*>(pixels.data()) + y * 13 * 3, 13 * 3);
  const std::string png = WritePngRaw(13, 11, 8, PNG_COLOR_TYPE_RGB, rows, {}, {}, PNG_INTERLACE_ADAM7);
  EXPECT_EQ(Decode(png, 3).pixels, pixels);
}

TEST(DecodePngTest, LowBitDepthGrayIsExpanded) {
  // 1-bit gray: 0 -> 0, 1 -> 255.
  const std::string png = WritePngRaw(8, 1, 1, PNG_COLOR_TYPE_GRAY, {std::string(1, static_cast<char>(0b10100001))});
  EXPECT_EQ(Decode(png, 1).pixels, (std::vector<uint8_t>{255, 0, 255, 0, 0, 0, 0, 255}));
}

TEST(DecodePngTest, TruncatedIsInvalid) {
  absl::StatusOr<std::string> png = datasets::EncodePng(NoisePixels(32 * 32), 32, 32, 1);
  ASSERT_TRUE(png.ok());
  ExpectInvalid(png->substr(0, png->size() / 2), "invalid PNG");
  ExpectInvalid(png->substr(0, 30), "invalid PNG");
  // Only the IEND chunk missing: the pixels are all there, but the file is still cut short.
  ExpectInvalid(png->substr(0, png->size() - 12), "invalid PNG");
}

TEST(DecodePngTest, CorruptDataIsInvalid) {
  absl::StatusOr<std::string> png = datasets::EncodePng(NoisePixels(32 * 32), 32, 32, 1);
  ASSERT_TRUE(png.ok());
  std::string corrupt = *png;
  const size_t idat = corrupt.find("IDAT");
  ASSERT_NE(idat, std::string::npos);
  corrupt[idat + 40] = static_cast<char>(corrupt[idat + 40] ^ 0x5A);  // the CRC no longer matches
  ExpectInvalid(corrupt, "invalid PNG");
  std::string bad_header = *png;
  bad_header[23] = static_cast<char>(bad_header[23] ^ 0x01);  // IHDR height 32 -> 33: CRC error on a critical chunk
  ExpectInvalid(bad_header, "invalid PNG");
}

TEST(DecodePngTest, DeclaredSizeOverTheLimitIsRejectedBeforeDecoding) {
  // Signature + IHDR declaring 100000 x 100000 8-bit gray + IEND: no pixel data at all. Allocating the
  // declared 10^10 bytes would fail; the limit check rejects the header first.
  std::string png = "\x89PNG\r\n\x1a\n";
  std::string ihdr;
  AppendBigEndian32(ihdr, 100000);
  AppendBigEndian32(ihdr, 100000);
  ihdr += std::string("\x08\x00\x00\x00\x00", 5);  // bit depth 8, gray, deflate, filter 0, no interlace
  png += PngChunk("IHDR", ihdr);
  png += PngChunk("IEND", "");
  ExpectInvalid(png, "declares 100000x100000 pixels, over the limit of 4096x4096");

  // The limits are the caller's: a 10 x 5 image passes 10 x 5 and fails 9 x 5.
  absl::StatusOr<std::string> small = datasets::EncodePng(NoisePixels(50), 10, 5, 1);
  ASSERT_TRUE(small.ok());
  EXPECT_TRUE(DecodeImage(*small, 1, {10, 5}).ok());
  ExpectInvalid(*small, "over the limit of 9x5", 1, {9, 5});
  ExpectInvalid(*small, "over the limit of 10x4", 1, {10, 4});
}

// ----- JPEG -----

TEST(DecodeJpegTest, GrayDecodesWithinTolerance) {
  const std::vector<uint8_t> pixels = GradientPixels(24, 16, 1);
  absl::StatusOr<std::string> jpeg = datasets::EncodeJpeg(pixels, 24, 16, 1, 95);
  ASSERT_TRUE(jpeg.ok()) << jpeg.status();
  DecodedImage image = Decode(*jpeg, 1);
  ASSERT_EQ(image.width, 24);
  ASSERT_EQ(image.height, 16);
  ASSERT_EQ(image.pixels.size(), pixels.size());
  for (size_t i = 0; i < pixels.size(); ++i) EXPECT_NEAR(image.pixels[i], pixels[i], 3) << "pixel " << i;
  DecodedImage rgb = Decode(*jpeg, 3);
  for (size_t i = 0; i < pixels.size(); ++i) EXPECT_EQ(rgb.pixels[i * 3], image.pixels[i]);
}

TEST(DecodeJpegTest, RgbDecodesWithinToleranceAndGrayIsLuma) {
  const std::vector<uint8_t> pixels = GradientPixels(32, 16, 3);
  absl::StatusOr<std::string> jpeg = datasets::EncodeJpeg(pixels, 32, 16, 3, 95);
  ASSERT_TRUE(jpeg.ok()) << jpeg.status();
  DecodedImage rgb = Decode(*jpeg, 3);
  ASSERT_EQ(rgb.pixels.size(), pixels.size());
  double total_error = 0;
  for (size_t i = 0; i < pixels.size(); ++i) {
    EXPECT_NEAR(rgb.pixels[i], pixels[i], 8) << "sample " << i;
    total_error += std::abs(rgb.pixels[i] - pixels[i]);
  }
  EXPECT_LT(total_error / pixels.size(), 2.0);
  DecodedImage gray = Decode(*jpeg, 1);
  ASSERT_EQ(gray.pixels.size(), pixels.size() / 3);
  for (size_t i = 0; i < gray.pixels.size(); ++i) {
    EXPECT_NEAR(gray.pixels[i], Luma(pixels[i * 3], pixels[i * 3 + 1], pixels[i * 3 + 2]), 3) << "pixel " << i;
  }
}

TEST(DecodeJpegTest, AdobeCmykIsConvertedWithTheInvertedConvention) {
  // Adobe (inverted) CMYK stores 255 - ink: (255, 0, 0, 255) = no cyan, full magenta and yellow, no black = red.
  std::vector<uint8_t> cmyk;
  for (int i = 0; i < 16 * 16; ++i) {
    if (i < 128) {
      cmyk.insert(cmyk.end(), {255, 0, 0, 255});  // red
    } else {
      cmyk.insert(cmyk.end(), {255, 255, 255, 128});  // no ink but half black: gray 128
    }
  }
  const std::string jpeg = WriteCmykJpeg(16, 16, cmyk);
  ASSERT_FALSE(jpeg.empty());
  DecodedImage rgb = Decode(jpeg, 3);
  ASSERT_EQ(rgb.pixels.size(), 16u * 16 * 3);
  EXPECT_NEAR(rgb.pixels[0], 255, 3);
  EXPECT_NEAR(rgb.pixels[1], 0, 3);
  EXPECT_NEAR(rgb.pixels[2], 0, 3);
  const size_t last = (16 * 16 - 1) * 3;
  for (int c = 0; c < 3; ++c) EXPECT_NEAR(rgb.pixels[last + c], 128, 3);
  DecodedImage gray = Decode(jpeg, 1);
  EXPECT_NEAR(gray.pixels[0], 76, 3);
}

TEST(DecodeJpegTest, TruncatedIsInvalid) {
  absl::StatusOr<std::string> jpeg = datasets::EncodeJpeg(NoisePixels(64 * 64 * 3), 64, 64, 3, 90);
  ASSERT_TRUE(jpeg.ok());
  // libjpeg alone would fill the missing rows with grey and only warn "Premature end of JPEG file".
  ExpectInvalid(jpeg->substr(0, jpeg->size() * 6 / 10), "Premature end of JPEG file");
  ExpectInvalid(jpeg->substr(0, jpeg->size() - 2), "invalid JPEG");  // only the EOI marker missing
  ExpectInvalid(jpeg->substr(0, 100), "invalid JPEG");                // inside the headers
}

TEST(DecodeJpegTest, CorruptDataIsInvalid) {
  absl::StatusOr<std::string> jpeg = datasets::EncodeJpeg(NoisePixels(64 * 64 * 3), 64, 64, 3, 90);
  ASSERT_TRUE(jpeg.ok());
  // A restart marker in the middle of the entropy-coded data, where none belongs.
  std::string corrupt = *jpeg;
  const size_t middle = corrupt.size() / 2;
  corrupt[middle] = static_cast<char>(0xFF);
  corrupt[middle + 1] = static_cast<char>(0xD3);
  ExpectInvalid(corrupt, "invalid JPEG");
  // A damaged quantisation table marker.
  std::string bad_marker = *jpeg;
  const size_t dqt = bad_marker.find("\xFF\xDB");
  ASSERT_NE(dqt, std::string::npos);
  bad_marker[dqt + 2] = static_cast<char>(0xFF);  // segment length > file
  bad_marker[dqt + 3] = static_cast<char>(0xFF);
  ExpectInvalid(bad_marker, "invalid JPEG");
}

TEST(DecodeJpegTest, DeclaredSizeOverTheLimitIsRejectedBeforeDecoding) {
  // A valid 8 x 8 JPEG whose SOF0 is patched to declare 65000 x 65000 (JPEG sizes are 16-bit, at most 65500 for
  // libjpeg, so 100000 x 100000 cannot be declared). The scan data cannot fill it; the limit rejects it first.
  absl::StatusOr<std::string> jpeg = datasets::EncodeJpeg(NoisePixels(64), 8, 8, 1, 90);
  ASSERT_TRUE(jpeg.ok());
  std::string patched = *jpeg;
  const size_t sof = patched.find("\xFF\xC0");
  ASSERT_NE(sof, std::string::npos);
  // FFC0, length (2), precision (1), height (2), width (2)
  for (size_t at : {sof + 5, sof + 7}) {
    patched[at] = static_cast<char>(65000 >> 8);
    patched[at + 1] = static_cast<char>(65000 & 0xFF);
  }
  ExpectInvalid(patched, "declares 65000x65000 pixels, over the limit of 4096x4096");
}

VitConfig PreprocessConfig(int64_t channels);  // below, with the preprocessing tests

// A camera-sized image: smooth shapes plus noise, deterministic.
std::vector<uint8_t> PhotoPixels(int64_t width, int64_t height) {
  std::vector<uint8_t> pixels(static_cast<size_t>(width * height));
  uint32_t state = 12345;
  for (int64_t y = 0; y < height; ++y) {
    for (int64_t x = 0; x < width; ++x) {
      state = state * 1664525u + 1013904223u;
      const double noise = static_cast<double>(state >> 24) / 255.0 * 40.0 - 20.0;
      const double value = 128.0 + 70.0 * std::sin(x / 97.0) * std::cos(y / 131.0) + noise;
      pixels[static_cast<size_t>(y * width + x)] = static_cast<uint8_t>(std::clamp(value, 0.0, 255.0));
    }
  }
  return pixels;
}

// Before 2026-12-02 a 6000x4000 photo was refused (over the 4096 limit); it is now decoded at the smallest DCT
// scale that keeps 4x the model's input (1/8 here: 750x500), and the model input made from it matches the one
// made from the full-size decode.
TEST(DecodeJpegTest, LargeJpegDecodesAtReducedDctScaleCloseToTheFullDecode) {
  constexpr int64_t kWidth = 6000, kHeight = 4000;
  absl::StatusOr<std::string> jpeg = datasets::EncodeJpeg(PhotoPixels(kWidth, kHeight), kWidth, kHeight, 1, 90);
  ASSERT_TRUE(jpeg.ok()) << jpeg.status();
  const VitConfig config = PreprocessConfig(1);
  ImageDecodeLimits limits;  // 4096 x 4096
  limits.target_width = config.image_size;
  limits.target_height = config.image_size;
  absl::StatusOr<ImageDecodePlan> plan = PlanImageDecode(*jpeg, 1, limits);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->format, ImageDecodePlan::Format::kJpeg);
  EXPECT_EQ(plan->declared_width, kWidth);
  EXPECT_EQ(plan->declared_height, kHeight);
  EXPECT_EQ(plan->scale_eighths, 1);
  EXPECT_EQ(plan->decoded_width, 750);
  EXPECT_EQ(plan->decoded_height, 500);
  EXPECT_EQ(plan->working_bytes, 750 * 500 * (4 + 6) + (1 << 20));
  const DecodedImage scaled = Decode(*jpeg, 1, limits);
  EXPECT_EQ(scaled.width, 750);
  EXPECT_EQ(scaled.height, 500);

  // The reference: the whole image decoded, then area-averaged by the same preprocessing.
  ImageDecodeLimits whole;
  whole.max_width = kWidth;
  whole.max_height = kHeight;
  const DecodedImage full = Decode(*jpeg, 1, whole);
  ASSERT_EQ(full.width, kWidth);
  absl::StatusOr<at::Tensor> from_scaled = PreprocessImage(scaled, config);
  absl::StatusOr<at::Tensor> from_full = PreprocessImage(full, config);
  ASSERT_TRUE(from_scaled.ok() && from_full.ok());
  // In pixel levels (0..255).
  const at::Tensor difference = from_scaled->sub(*from_full).abs().mul(config.std[0] * 255.0);
  const double largest = difference.max().item<double>();
  const double mean = difference.mean().item<double>();
  std::printf("1/8-scale against full decode: largest difference %.3f, mean %.3f levels of 255\n", largest, mean);
  EXPECT_LT(largest, 3.0);
  EXPECT_LT(mean, 1.0);
}

TEST(DecodeJpegTest, ScaleKeepsFourTimesTheTargetAndSmallImagesWhole) {
  ImageDecodeLimits limits;
  limits.target_width = 28;
  limits.target_height = 28;
  for (const auto& [side, eighths] : std::vector<std::pair<int64_t, int>>{{64, 8}, {112, 8}, {224, 4}, {900, 1}}) {
    absl::StatusOr<std::string> jpeg = datasets::EncodeJpeg(NoisePixels(side * side), side, side, 1, 90);
    ASSERT_TRUE(jpeg.ok());
    absl::StatusOr<ImageDecodePlan> plan = PlanImageDecode(*jpeg, 1, limits);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->scale_eighths, eighths) << side;
    EXPECT_GE(plan->decoded_width, std::min<int64_t>(side, 4 * 28)) << side;
    EXPECT_EQ(Decode(*jpeg, 1, limits).width, plan->decoded_width) << side;
  }
  // Without a target: whole, and over the limit it is scaled down to fit (not refused).
  absl::StatusOr<std::string> jpeg = datasets::EncodeJpeg(NoisePixels(300 * 200), 300, 200, 1, 90);
  ASSERT_TRUE(jpeg.ok());
  ImageDecodeLimits small;
  small.max_width = 100;
  small.max_height = 100;
  absl::StatusOr<ImageDecodePlan> plan = PlanImageDecode(*jpeg, 1, small);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->scale_eighths, 2);  // 300 * 2/8 = 75 <= 100; 3/8 would be 113
  EXPECT_EQ(plan->decoded_width, 75);
  EXPECT_EQ(plan->decoded_height, 50);
  EXPECT_EQ(PlanImageDecode(*jpeg, 1, {}).value().scale_eighths, 8);
}

TEST(PlanImageDecodeTest, PngPlanComesFromItsHeader) {
  absl::StatusOr<std::string> png = datasets::EncodePng(NoisePixels(32 * 32), 32, 32, 1);
  ASSERT_TRUE(png.ok());
  // IHDR width and height at bytes 16..23, patched to 4096 x 2048: planned without decoding a pixel.
  std::string patched = *png;
  for (const auto& [at, value] : std::vector<std::pair<size_t, uint32_t>>{{16, 4096}, {20, 2048}}) {
    for (int i = 0; i < 4; ++i) patched[at + i] = static_cast<char>((value >> (24 - 8 * i)) & 0xFF);
  }
  absl::StatusOr<ImageDecodePlan> plan = PlanImageDecode(patched, 3, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->format, ImageDecodePlan::Format::kPng);
  EXPECT_EQ(plan->decoded_width, 4096);
  EXPECT_EQ(plan->decoded_height, 2048);
  EXPECT_EQ(plan->working_bytes, int64_t{4096} * 2048 * (4 + 6 * 3) + (1 << 20));
  ImageDecodeLimits limits;
  limits.max_width = 1000;
  absl::StatusOr<ImageDecodePlan> refused = PlanImageDecode(patched, 3, limits);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("declares 4096x2048 pixels, over the limit"));
  EXPECT_EQ(PlanImageDecode("GIF89a", 1, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

// ----- neither -----

TEST(DecodeImageTest, EmptyInputIsInvalid) { ExpectInvalid("", "empty input"); }

TEST(DecodeImageTest, UnknownFormatIsInvalid) {
  ExpectInvalid("GIF89a\x01\x00\x01\x00", "unknown format");
  ExpectInvalid("\x89PN", "unknown format");  // too short for the PNG signature
  ExpectInvalid(std::string("\xFF\xD8", 2), "unknown format");
}

TEST(DecodeImageTest, RequestedChannelsMustBeOneOrThree) {
  absl::StatusOr<std::string> png = datasets::EncodePng(NoisePixels(4), 2, 2, 1);
  ASSERT_TRUE(png.ok());
  ExpectInvalid(*png, "requested channels 2", 2);
}

TEST(DecodeImageTest, FashionMnistImageRoundTripsThroughPng) {
  absl::StatusOr<datasets::FashionMnist> data = datasets::ReadFashionMnist("t10k");
  if (!data.ok()) MITA_MISSING_DEPENDENCY("Fashion-MNIST not installed: " << data.status());
  EXPECT_EQ(data->count, 10000);
  const std::vector<uint8_t> first(data->pixels.begin(), data->pixels.begin() + 28 * 28);
  absl::StatusOr<std::string> png = datasets::EncodePng(first, 28, 28, 1);
  ASSERT_TRUE(png.ok());
  EXPECT_EQ(Decode(*png, 1).pixels, first);
}

// ----- preprocessing -----

VitConfig PreprocessConfig(int64_t channels) {
  VitConfig config;
  config.architecture = "mita_vit";
  config.image_size = 28;
  config.patch_size = 4;
  config.in_channels = channels;
  if (channels == 1) {
    config.mean = {0.286f};
    config.std = {0.353f};
  } else {
    config.mean = {0.485f, 0.456f, 0.406f};
    config.std = {0.229f, 0.224f, 0.225f};
  }
  return config;
}

float Normalise(double value, float mean, float std) {
  return static_cast<float>((value / 255.0 - mean) / std);
}

DecodedImage MakeImage(int64_t width, int64_t height, int64_t channels, std::vector<uint8_t> pixels) {
  DecodedImage image;
  image.width = width;
  image.height = height;
  image.channels = channels;
  image.pixels = std::move(pixels);
  return image;
}

void ExpectTensorNear(const at::Tensor& actual, const std::vector<float>& expected, double tolerance) {
  const at::Tensor flat = actual.contiguous();
  ASSERT_EQ(flat.numel(), static_cast<int64_t>(expected.size()));
  const float* data = flat.data_ptr<float>();
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_NEAR(data[i], expected[i], tolerance) << "index " << i;
}

TEST(PreprocessImageTest, SameSizeIsOnlyNormalised) {
  const VitConfig config = PreprocessConfig(1);
  const std::vector<uint8_t> pixels = NoisePixels(28 * 28);
  absl::StatusOr<at::Tensor> tensor = PreprocessImage(MakeImage(28, 28, 1, pixels), config);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  EXPECT_EQ(tensor->sizes(), at::IntArrayRef({1, 28, 28}));
  EXPECT_EQ(tensor->scalar_type(), at::kFloat);
  std::vector<float> expected;
  for (uint8_t pixel : pixels) expected.push_back(Normalise(pixel, 0.286f, 0.353f));
  ExpectTensorNear(*tensor, expected, 1e-5);
}

TEST(PreprocessImageTest, ShrinkingAveragesAreas) {
  // 56 x 56 -> 28 x 28: each output pixel is the mean of a 2 x 2 block.
  const VitConfig config = PreprocessConfig(1);
  const std::vector<uint8_t> pixels = NoisePixels(56 * 56, 7);
  absl::StatusOr<at::Tensor> tensor = PreprocessImage(MakeImage(56, 56, 1, pixels), config);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  std::vector<float> expected;
  for (int y = 0; y < 28; ++y) {
    for (int x = 0; x < 28; ++x) {
      const double mean = (pixels[(2 * y) * 56 + 2 * x] + pixels[(2 * y) * 56 + 2 * x + 1] +
                           pixels[(2 * y + 1) * 56 + 2 * x] + pixels[(2 * y + 1) * 56 + 2 * x + 1]) / 4.0;
      expected.push_back(Normalise(mean, 0.286f, 0.353f));
    }
  }
  ExpectTensorNear(*tensor, expected, 1e-5);
}

// Bilinear weights with align_corners = false (half-pixel centres), clamped at the borders.
std::vector<std::pair<int, double>> BilinearTaps(int output_index, int input_size, int output_size) {
  double source = (output_index + 0.5) * input_size / output_size - 0.5;
  if (source < 0) source = 0;
  const int low = static_cast<int>(std::floor(source));
  const int high = std::min(low + 1, input_size - 1);
  const double weight = source - low;
  return {{low, 1 - weight}, {high, weight}};
}

TEST(PreprocessImageTest, EnlargingIsBilinear) {
  // 14 x 14 -> 28 x 28.
  const VitConfig config = PreprocessConfig(1);
  const std::vector<uint8_t> pixels = NoisePixels(14 * 14, 3);
  absl::StatusOr<at::Tensor> tensor = PreprocessImage(MakeImage(14, 14, 1, pixels), config);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  std::vector<float> expected;
  for (int y = 0; y < 28; ++y) {
    for (int x = 0; x < 28; ++x) {
      double value = 0;
      for (auto [row, row_weight] : BilinearTaps(y, 14, 28)) {
        for (auto [column, column_weight] : BilinearTaps(x, 14, 28)) {
          value += row_weight * column_weight * pixels[row * 14 + column];
        }
      }
      expected.push_back(Normalise(value, 0.286f, 0.353f));
    }
  }
  ExpectTensorNear(*tensor, expected, 1e-4);
}

TEST(PreprocessImageTest, WideImageShrinksWidthAndEnlargesHeight) {
  // 56 wide x 7 high: width averaged in pairs to 28, then height enlarged bilinearly 7 -> 28.
  const VitConfig config = PreprocessConfig(1);
  const std::vector<uint8_t> pixels = NoisePixels(56 * 7, 11);
  absl::StatusOr<at::Tensor> tensor = PreprocessImage(MakeImage(56, 7, 1, pixels), config);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  std::vector<float> expected;
  for (int y = 0; y < 28; ++y) {
    for (int x = 0; x < 28; ++x) {
      double value = 0;
      for (auto [row, weight] : BilinearTaps(y, 7, 28)) {
        value += weight * (pixels[row * 56 + 2 * x] + pixels[row * 56 + 2 * x + 1]) / 2.0;
      }
      expected.push_back(Normalise(value, 0.286f, 0.353f));
    }
  }
  ExpectTensorNear(*tensor, expected, 1e-4);
}

TEST(PreprocessImageTest, RgbUsesPerChannelStatistics) {
  const VitConfig config = PreprocessConfig(3);
  std::vector<uint8_t> pixels;
  for (int i = 0; i < 28 * 28; ++i) pixels.insert(pixels.end(), {255, 128, 0});
  absl::StatusOr<at::Tensor> tensor = PreprocessImage(MakeImage(28, 28, 3, pixels), config);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  EXPECT_EQ(tensor->sizes(), at::IntArrayRef({3, 28, 28}));
  EXPECT_NEAR((*tensor)[0][5][5].item<float>(), (1.0 - 0.485) / 0.229, 1e-5);
  EXPECT_NEAR((*tensor)[1][5][5].item<float>(), (128 / 255.0 - 0.456) / 0.224, 1e-5);
  EXPECT_NEAR((*tensor)[2][5][5].item<float>(), (0 - 0.406) / 0.225, 1e-5);
}

TEST(PreprocessImageTest, ChannelMismatchIsInvalid) {
  absl::StatusOr<at::Tensor> tensor =
      PreprocessImage(MakeImage(28, 28, 3, std::vector<uint8_t>(28 * 28 * 3)), PreprocessConfig(1));
  ASSERT_FALSE(tensor.ok());
  EXPECT_EQ(tensor.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(tensor.status().message()), HasSubstr("3 channels, the model expects 1"));
  absl::StatusOr<at::Tensor> short_buffer =
      PreprocessImage(MakeImage(28, 28, 1, std::vector<uint8_t>(10)), PreprocessConfig(1));
  EXPECT_EQ(short_buffer.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mita::models
