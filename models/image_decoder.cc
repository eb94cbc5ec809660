// PNG (libpng, classic API) and JPEG (libjpeg-turbo) decoding and model preprocessing (see image_decoder.h).
//
// Strictness: every libpng or libjpeg warning is an error. A truncated JPEG makes libjpeg warn "Premature end
// of JPEG file" and fill the rest with grey; a PNG with a bad CRC or missing data makes libpng warn or fail;
// both are reported as INVALID_ARGUMENT instead of returning a partly made-up image. The one libpng check that
// is switched off is the sRGB ICC profile check (PNG_SKIP_sRGB_CHECK_PROFILE), which only warns about colour
// metadata many valid files carry and never affects the pixels. Ancillary chunks other than tRNS (text, ICC
// profiles, gamma, ...) are skipped without being decompressed (they do not change the pixels here, and
// compressed text chunks are a decompression bomb: tests/hostile_input_test.cc).
//
// Channel conversion (applied after decoding to 8 bits per sample):
//   * palette and sub-8-bit gray are expanded, tRNS becomes an alpha channel (png_set_expand);
//   * 16-bit samples are scaled to 8 bits with rounding, v8 = round(v16 * 255 / 65535) (png_set_scale_16);
//   * alpha is composited over BLACK: c' = round(c * a / 255). Black because the Fashion-MNIST background is
//     black, so a transparent background means "no object"; a caller that wants white must flatten first;
//   * gray from RGB is the ITU-R BT.601 luma Y = 0.299 R + 0.587 G + 0.114 B, rounded (ITU-R BT.601-7, 2.5.1);
//     a YCbCr JPEG decoded to gray uses its stored Y, which is that same luma (JFIF 1.02 section 7);
//   * gray to RGB replicates the value;
//   * CMYK and YCCK JPEGs (libjpeg converts YCCK to CMYK) follow the Adobe convention: files with an Adobe APP14
//     marker (Photoshop) store inverted samples, so R = C * K / 255; without the marker, R = (255 - C) * (255 - K)
//     / 255 (likewise G from M, B from Y). No ICC colour management and no gamma correction are applied: samples
//     are used as stored.
// EXIF orientation is not applied.
#include "models/image_decoder.h"

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <utility>

#include <png.h>
#include <jpeglib.h>
#include <jerror.h>

#include <ATen/ops/adaptive_avg_pool2d.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/upsample_bilinear2d.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/status_macros.h"
#include "models/request_error.h"

namespace mita::models {
namespace {

constexpr unsigned char kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
constexpr size_t kMessageCapacity = 256;

absl::Status Invalid(absl::string_view message) {
  return InvalidRequest(RequestField::kImage, std::string(message));
}

absl::Status CheckDeclaredSize(absl::string_view format, int64_t width, int64_t height,
                               const ImageDecodeLimits& limits) {
  if (width <= 0 || height <= 0) {
    return Invalid(absl::StrCat(format, " declares an empty image (", width, "x", height, ")"));
  }
  if (width > limits.max_width || height > limits.max_height) {
    return Invalid(absl::StrCat(format, " declares ", width, "x", height, " pixels, over the limit of ",
                                limits.max_width, "x", limits.max_height, " (max width x max height)"));
  }
  return absl::OkStatus();
}

constexpr int64_t kDecoderStateBytes = int64_t{1} << 20;

int64_t WorkingBytes(int64_t width, int64_t height, int64_t channels) {
  return width * height * (4 + 6 * channels) + kDecoderStateBytes;
}

// libjpeg's output size of `side` at scale `eighths` / 8 (jdiv_round_up, jdmaster.c).
int64_t ScaledSide(int64_t side, int eighths) { return (side * eighths + 7) / 8; }

uint8_t RoundToByte(double value) {
  value = value < 0 ? 0 : (value > 255 ? 255 : value);
  return static_cast<uint8_t>(value + 0.5);
}

// BT.601 luma of 8-bit RGB, rounded to nearest.
uint8_t Luma(uint8_t red, uint8_t green, uint8_t blue) {
  return RoundToByte(0.299 * red + 0.587 * green + 0.114 * blue);
}

// c * a / 255 rounded to nearest (alpha compositing over black).
uint8_t OverBlack(uint8_t value, uint8_t alpha) {
  return static_cast<uint8_t>((static_cast<unsigned>(value) * alpha + 127) / 255);
}

// Converts 8-bit samples with `source_channels` (1 gray, 2 gray+alpha, 3 RGB, 4 RGBA) to `channels` (1 or 3).
std::vector<uint8_t> ConvertChannels(const std::vector<uint8_t>& source, int64_t pixel_count, int source_channels,
                                     int64_t channels) {
  std::vector<uint8_t> result(static_cast<size_t>(pixel_count * channels));
  for (int64_t i = 0; i < pixel_count; ++i) {
    const uint8_t* in = source.data() + i * source_channels;
    uint8_t red, green, blue;
    switch (source_channels) {
      case 1: red = green = blue = in[0]; break;
      case 2: red = green = blue = OverBlack(in[0], in[1]); break;
      case 3: red = in[0]; green = in[1]; blue = in[2]; break;
      default:
        red = OverBlack(in[0], in[3]);
        green = OverBlack(in[1], in[3]);
        blue = OverBlack(in[2], in[3]);
        break;
    }
    uint8_t* out = result.data() + i * channels;
    if (channels == 1) {
      // Gray input stays exact (no round trip through the luma weights).
      out[0] = source_channels <= 2 ? red : Luma(red, green, blue);
    } else {
      out[0] = red;
      out[1] = green;
      out[2] = blue;
    }
  }
  return result;
}

// ----- PNG -----

struct PngContext {
  const unsigned char* data = nullptr;
  size_t size = 0;
  size_t position = 0;
  char message[kMessageCapacity] = {};
};

void CopyMessage(char (&target)[kMessageCapacity], const char* prefix, const char* message) {
  std::snprintf(target, kMessageCapacity, "%s%s", prefix, message != nullptr ? message : "(no message)");
}

void PngError(png_structp png, png_const_charp message) {
  auto* context = static_cast<PngContext*>(png_get_error_ptr(png));
  if (context->message[0] == '\0') CopyMessage(context->message, "", message);
  png_longjmp(png, 1);
}

// Warnings are errors (a PNG with missing or damaged data must not decode "successfully").
void PngWarning(png_structp png, png_const_charp message) {
  auto* context = static_cast<PngContext*>(png_get_error_ptr(png));
  if (context->message[0] == '\0') CopyMessage(context->message, "warning treated as error: ", message);
  png_longjmp(png, 1);
}

void PngRead(png_structp png, png_bytep target, size_t length) {
  auto* context = static_cast<PngContext*>(png_get_io_ptr(png));
  if (length > context->size - context->position) {
    png_error(png, "truncated data (the file ends before the image does)");
  }
  std::memcpy(target, context->data + context->position, length);
  context->position += length;
}

// Reads the IHDR width and height straight from the bytes (the first chunk must be IHDR: PNG spec 5.6), so the
// limit is checked before libpng runs at all. Returns false when the bytes are too short to hold them.
bool PeekPngSize(absl::string_view bytes, int64_t& width, int64_t& height) {
  if (bytes.size() < 24 || std::memcmp(bytes.data() + 12, "IHDR", 4) != 0) return false;
  auto read_be32 = [&](size_t at) {
    const auto* p = reinterpret_cast<const unsigned char*>(bytes.data() + at);
    return (int64_t{p[0]} << 24) | (int64_t{p[1]} << 16) | (int64_t{p[2]} << 8) | int64_t{p[3]};
  };
  width = read_be32(16);
  height = read_be32(20);
  return true;
}

// The libpng calls run in functions that hold only trivially destructible locals between setjmp and a possible
// longjmp; every C++ object (pixel buffer, row pointers) belongs to the caller. Each returns false with
// context.message set when libpng reported an error or warning.

// Reads the chunks up to the image data (IHDR gives the declared size). libpng's own size limit is set to ours
// as a second guard.
bool ReadPngHeader(png_structp png, png_infop info, PngContext& context, const ImageDecodeLimits& limits,
                   int64_t& width, int64_t& height) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_read_fn(png, &context, PngRead);
  png_set_option(png, PNG_SKIP_sRGB_CHECK_PROFILE, PNG_OPTION_ON);
  // Skip every ancillary chunk but tRNS unread (libpng's list for num_chunks < 0: all chunks except IHDR, PLTE,
  // tRNS, IDAT and IEND; unknown ones too). None changes our pixels, and libpng would otherwise inflate each
  // zTXt/iTXt/iCCP chunk (up to 8 MB) and keep the text: a decompression bomb (docs/hostile_input.md).
  png_set_keep_unknown_chunks(png, PNG_HANDLE_CHUNK_NEVER, nullptr, -1);
  png_set_user_limits(png, static_cast<png_uint_32>(std::clamp<int64_t>(limits.max_width, 1, PNG_UINT_31_MAX)),
                      static_cast<png_uint_32>(std::clamp<int64_t>(limits.max_height, 1, PNG_UINT_31_MAX)));
  png_read_info(png, info);
  width = png_get_image_width(png, info);
  height = png_get_image_height(png, info);
  return true;
}

// Sets the conversions to 8-bit gray, gray+alpha, RGB or RGBA (libpng allocates its row buffers here, so this
// runs only after the size check).
bool ConfigurePngOutput(png_structp png, png_infop info, int& source_channels, size_t& row_bytes) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_expand(png);  // palette -> RGB, gray below 8 bits -> 8 bits, tRNS -> alpha
  png_set_scale_16(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  source_channels = png_get_channels(png, info);
  row_bytes = png_get_rowbytes(png, info);
  if (png_get_bit_depth(png, info) != 8) png_error(png, "unexpected bit depth after conversion to 8 bits");
  return true;
}

// Reads all rows (de-interlacing) and the chunks after the image data up to IEND.
bool ReadPngRows(png_structp png, png_bytepp rows) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_read_image(png, rows);
  png_read_end(png, nullptr);
  return true;
}

absl::StatusOr<DecodedImage> DecodePng(absl::string_view bytes, int64_t channels, const ImageDecodeLimits& limits) {
  int64_t width = 0, height = 0;
  if (PeekPngSize(bytes, width, height)) {
    if (absl::Status status = CheckDeclaredSize("PNG", width, height, limits); !status.ok()) return status;
  }
  PngContext context;
  context.data = reinterpret_cast<const unsigned char*>(bytes.data());
  context.size = bytes.size();
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &context, PngError, PngWarning);
  if (png == nullptr) return absl::ResourceExhaustedError("cannot create the PNG decoder");
  png_infop info = png_create_info_struct(png);
  if (info == nullptr) {
    png_destroy_read_struct(&png, nullptr, nullptr);
    return absl::ResourceExhaustedError("cannot create the PNG decoder");
  }
  struct Cleanup {
    png_structp* png;
    png_infop* info;
    ~Cleanup() { png_destroy_read_struct(png, info, nullptr); }
  } cleanup{&png, &info};

  if (!ReadPngHeader(png, info, context, limits, width, height)) {
    return Invalid(absl::StrCat("invalid PNG: ", context.message));
  }
  // Checked again on libpng's reading of IHDR (the peek above may have found no IHDR to read).
  if (absl::Status status = CheckDeclaredSize("PNG", width, height, limits); !status.ok()) return status;
  int source_channels = 0;
  size_t row_bytes = 0;
  if (!ConfigurePngOutput(png, info, source_channels, row_bytes)) {
    return Invalid(absl::StrCat("invalid PNG: ", context.message));
  }
  if (source_channels < 1 || source_channels > 4 || row_bytes != static_cast<size_t>(width) * source_channels) {
    return Invalid("invalid PNG: unexpected row layout after conversion to 8 bits");
  }
  std::vector<uint8_t> samples(row_bytes * static_cast<size_t>(height));
  std::vector<png_bytep> rows(static_cast<size_t>(height));
  for (int64_t y = 0; y < height; ++y) rows[y] = samples.data() + y * row_bytes;
  if (!ReadPngRows(png, rows.data())) return Invalid(absl::StrCat("invalid PNG: ", context.message));

  DecodedImage image;
  image.width = width;
  image.height = height;
  image.channels = channels;
  image.pixels = ConvertChannels(samples, width * height, source_channels, channels);
  return image;
}

// ----- JPEG -----

// Largest number of scans of a progressive JPEG. Each scan is another pass over every block of the image, and a
// tiny file can hold hundreds (a CPU decompression bomb); libjpeg-turbo's TurboJPEG API uses the same limit
// (TJFLAG_LIMITSCANS). Encoders write about 10 (jpeg_simple_progression).
constexpr int kMaxJpegScans = 500;

struct JpegErrorManager {
  jpeg_error_mgr base;  // first member: libjpeg passes a jpeg_error_mgr* that we cast back
  jmp_buf jump;
  char message[kMessageCapacity];
  jpeg_progress_mgr progress;  // counts scans (JpegProgressMonitor)
};

// Called by libjpeg while it reads the file: stops a progressive JPEG with more than kMaxJpegScans scans.
void JpegProgressMonitor(j_common_ptr info) {
  if (!info->is_decompressor) return;
  const int scans = reinterpret_cast<j_decompress_ptr>(info)->input_scan_number;
  if (scans <= kMaxJpegScans) return;
  auto* manager = reinterpret_cast<JpegErrorManager*>(info->err);
  if (manager->message[0] == '\0') {
    std::snprintf(manager->message, kMessageCapacity, "more than %d scans (a progressive JPEG has about 10)",
                  kMaxJpegScans);
  }
  longjmp(manager->jump, 1);
}

void JpegErrorExit(j_common_ptr info) {
  auto* manager = reinterpret_cast<JpegErrorManager*>(info->err);
  char text[JMSG_LENGTH_MAX];
  (*info->err->format_message)(info, text);
  if (manager->message[0] == '\0') CopyMessage(manager->message, "", text);
  longjmp(manager->jump, 1);
}

// level < 0: a warning (corrupt or missing data, e.g. "Premature end of JPEG file"): an error here.
// level >= 0: trace messages, ignored.
void JpegEmitMessage(j_common_ptr info, int level) {
  if (level >= 0) return;
  auto* manager = reinterpret_cast<JpegErrorManager*>(info->err);
  char text[JMSG_LENGTH_MAX];
  (*info->err->format_message)(info, text);
  if (manager->message[0] == '\0') CopyMessage(manager->message, "warning treated as error: ", text);
  longjmp(manager->jump, 1);
}

// Reads the markers up to the first scan; chooses the output colour space for `channels`.
bool ReadJpegHeader(jpeg_decompress_struct& info, JpegErrorManager& manager, absl::string_view bytes,
                    int64_t channels) {
  if (setjmp(manager.jump)) return false;
  jpeg_create_decompress(&info);
  manager.progress.progress_monitor = JpegProgressMonitor;
  info.progress = &manager.progress;
  jpeg_mem_src(&info, reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<unsigned long>(bytes.size()));
  jpeg_read_header(&info, TRUE);
  switch (info.jpeg_color_space) {
    case JCS_GRAYSCALE:
      info.out_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
      break;
    case JCS_YCbCr:
      // Gray: the stored Y is the BT.601 luma.
      info.out_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
      break;
    case JCS_CMYK:
    case JCS_YCCK:
      info.out_color_space = JCS_CMYK;
      break;
    default:
      info.out_color_space = JCS_RGB;
      break;
  }
  return true;
}

bool ReadJpegScanlines(jpeg_decompress_struct& info, JpegErrorManager& manager, std::vector<uint8_t>& samples,
                       int& source_channels) {
  if (setjmp(manager.jump)) return false;
  jpeg_start_decompress(&info);
  source_channels = info.output_components;
  const size_t row_bytes = static_cast<size_t>(info.output_width) * info.output_components;
  // Sized by the caller from its plan; the output size (after DCT scaling) must equal it.
  if (samples.size() != row_bytes * info.output_height) ERREXIT(&info, JERR_BAD_BUFFER_MODE);
  while (info.output_scanline < info.output_height) {
    JSAMPROW row = samples.data() + static_cast<size_t>(info.output_scanline) * row_bytes;
    jpeg_read_scanlines(&info, &row, 1);
  }
  jpeg_finish_decompress(&info);
  return true;
}

// A libjpeg decompressor with our error handling; destroyed with the object.
struct JpegDecoder {
  jpeg_decompress_struct info;
  JpegErrorManager manager;
  JpegDecoder() {
    std::memset(&info, 0, sizeof(info));  // so that the cleanup is safe whatever fails
    std::memset(&manager, 0, sizeof(manager));
    info.err = jpeg_std_error(&manager.base);
    manager.base.error_exit = JpegErrorExit;
    manager.base.emit_message = JpegEmitMessage;
  }
  ~JpegDecoder() { jpeg_destroy_decompress(&info); }
  JpegDecoder(const JpegDecoder&) = delete;
  JpegDecoder& operator=(const JpegDecoder&) = delete;
};

// Chooses the DCT scale of a JPEG of `width` x `height`: the smallest that keeps each axis at least
// kJpegOversampling x the target (or whole), then smaller while over the limits. Errors: over the limits even
// at 1/8.
absl::StatusOr<int> ChooseJpegScale(int64_t width, int64_t height, const ImageDecodeLimits& limits) {
  if (width <= 0 || height <= 0) return CheckDeclaredSize("JPEG", width, height, limits);
  int eighths = 8;
  if (limits.target_width > 0 && limits.target_height > 0) {
    const int64_t want_width = std::min(width, kJpegOversampling * limits.target_width);
    const int64_t want_height = std::min(height, kJpegOversampling * limits.target_height);
    while (eighths > 1 && ScaledSide(width, eighths - 1) >= want_width &&
           ScaledSide(height, eighths - 1) >= want_height) {
      --eighths;
    }
  }
  while (eighths > 1 && (ScaledSide(width, eighths) > limits.max_width || ScaledSide(height, eighths) > limits.max_height)) {
    --eighths;
  }
  if (ScaledSide(width, eighths) > limits.max_width || ScaledSide(height, eighths) > limits.max_height) {
    return Invalid(absl::StrCat("JPEG declares ", width, "x", height, " pixels, over the limit of ", limits.max_width,
                                "x", limits.max_height, " (max width x max height) even decoded at 1/8 scale"));
  }
  return eighths;
}

absl::StatusOr<DecodedImage> DecodeJpeg(absl::string_view bytes, int64_t channels, const ImageDecodeLimits& limits) {
  JpegDecoder decoder;
  jpeg_decompress_struct& info = decoder.info;
  JpegErrorManager& manager = decoder.manager;
  if (!ReadJpegHeader(info, manager, bytes, channels)) {
    return Invalid(absl::StrCat("invalid JPEG: ", manager.message));
  }
  ASSIGN_OR_RETURN(const int eighths, ChooseJpegScale(info.image_width, info.image_height, limits));
  info.scale_num = static_cast<unsigned>(eighths);
  info.scale_denom = 8;
  const int64_t width = ScaledSide(info.image_width, eighths);
  const int64_t height = ScaledSide(info.image_height, eighths);
  const int components = info.out_color_space == JCS_GRAYSCALE ? 1 : (info.out_color_space == JCS_CMYK ? 4 : 3);
  std::vector<uint8_t> samples(static_cast<size_t>(width * height * components));
  int source_channels = 0;
  if (!ReadJpegScanlines(info, manager, samples, source_channels)) {
    return Invalid(absl::StrCat("invalid JPEG: ", manager.message));
  }
  if (source_channels != components) return Invalid("invalid JPEG: unexpected component count");

  if (components == 4) {  // CMYK -> RGB (Adobe inverted when the APP14 marker is present)
    const bool inverted = info.saw_Adobe_marker;
    std::vector<uint8_t> rgb(static_cast<size_t>(width * height * 3));
    for (int64_t i = 0; i < width * height; ++i) {
      const uint8_t* in = samples.data() + i * 4;
      const unsigned key = inverted ? in[3] : 255 - in[3];
      for (int c = 0; c < 3; ++c) {
        const unsigned ink = inverted ? in[c] : 255 - in[c];
        rgb[i * 3 + c] = static_cast<uint8_t>((ink * key + 127) / 255);
      }
    }
    samples = std::move(rgb);
    source_channels = 3;
  }
  DecodedImage image;
  image.width = width;
  image.height = height;
  image.channels = channels;
  image.pixels = source_channels == channels ? std::move(samples)
                                             : ConvertChannels(samples, width * height, source_channels, channels);
  return image;
}

bool IsPng(absl::string_view data) { return data.size() >= 8 && std::memcmp(data.data(), kPngSignature, 8) == 0; }

bool IsJpeg(absl::string_view data) {
  return data.size() >= 3 && static_cast<uint8_t>(data[0]) == 0xFF && static_cast<uint8_t>(data[1]) == 0xD8 &&
         static_cast<uint8_t>(data[2]) == 0xFF;
}

absl::Status CheckDecodeArguments(absl::string_view data, int64_t channels) {
  if (channels != 1 && channels != 3) {
    return Invalid(absl::StrCat("requested channels ", channels, " must be 1 (gray) or 3 (RGB)"));
  }
  if (data.empty()) return Invalid("empty input: expected PNG or JPEG bytes");
  if (!IsPng(data) && !IsJpeg(data)) return Invalid("unknown format: expected PNG or JPEG (by signature)");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ImageDecodePlan> PlanImageDecode(std::string_view bytes, int64_t channels,
                                                const ImageDecodeLimits& limits) {
  const absl::string_view data(bytes.data(), bytes.size());
  RETURN_IF_ERROR(CheckDecodeArguments(data, channels));
  ImageDecodePlan plan;
  if (IsPng(data)) {
    plan.format = ImageDecodePlan::Format::kPng;
    if (PeekPngSize(data, plan.declared_width, plan.declared_height)) {
      RETURN_IF_ERROR(CheckDeclaredSize("PNG", plan.declared_width, plan.declared_height, limits));
    }
    // Without a readable IHDR the decoder fails on the header, before allocating pixels.
    plan.decoded_width = plan.declared_width;
    plan.decoded_height = plan.declared_height;
  } else {
    plan.format = ImageDecodePlan::Format::kJpeg;
    JpegDecoder decoder;
    if (!ReadJpegHeader(decoder.info, decoder.manager, data, channels)) {
      return Invalid(absl::StrCat("invalid JPEG: ", decoder.manager.message));
    }
    plan.declared_width = decoder.info.image_width;
    plan.declared_height = decoder.info.image_height;
    ASSIGN_OR_RETURN(plan.scale_eighths, ChooseJpegScale(plan.declared_width, plan.declared_height, limits));
    plan.decoded_width = ScaledSide(plan.declared_width, plan.scale_eighths);
    plan.decoded_height = ScaledSide(plan.declared_height, plan.scale_eighths);
  }
  plan.working_bytes = WorkingBytes(plan.decoded_width, plan.decoded_height, channels);
  return plan;
}

absl::StatusOr<DecodedImage> DecodeImage(std::string_view bytes, int64_t channels, const ImageDecodeLimits& limits) {
  const absl::string_view data(bytes.data(), bytes.size());
  RETURN_IF_ERROR(CheckDecodeArguments(data, channels));
  return IsPng(data) ? DecodePng(data, channels, limits) : DecodeJpeg(data, channels, limits);
}

absl::StatusOr<at::Tensor> PreprocessImage(const DecodedImage& image, const VitConfig& config) {
  if (image.channels != config.in_channels) {
    return Invalid(absl::StrCat("image has ", image.channels, " channels, the model expects ", config.in_channels));
  }
  if (image.width <= 0 || image.height <= 0 ||
      static_cast<int64_t>(image.pixels.size()) != image.width * image.height * image.channels) {
    return Invalid(absl::StrCat("pixel buffer of ", image.pixels.size(), " bytes does not match ", image.width, "x",
                                image.height, "x", image.channels));
  }
  if (static_cast<int64_t>(config.mean.size()) != config.in_channels ||
      static_cast<int64_t>(config.std.size()) != config.in_channels) {
    return Invalid("config normalization mean/std do not have in_channels entries");
  }
  const int64_t side = config.image_size;
  try {
    // [H, W, C] bytes -> [1, C, H, W] float on the 0..255 scale.
    at::Tensor pixels =
        at::from_blob(const_cast<uint8_t*>(image.pixels.data()), {image.height, image.width, image.channels},
                      at::TensorOptions().dtype(at::kByte))
            .permute({2, 0, 1})
            .unsqueeze(0)
            .contiguous()  // planar bytes first, so that only one float copy is made
            .to(at::kFloat);
    // Shrink the axes that are too large by area averaging (exact box averages when the ratio is an integer),
    // then enlarge the rest bilinearly (align_corners = false, the half-pixel convention of PIL and OpenCV).
    const int64_t shrunk_height = std::min(image.height, side);
    const int64_t shrunk_width = std::min(image.width, side);
    if (shrunk_height != image.height || shrunk_width != image.width) {
      pixels = at::adaptive_avg_pool2d(pixels, {shrunk_height, shrunk_width});
    }
    if (shrunk_height != side || shrunk_width != side) {
      pixels = at::upsample_bilinear2d(pixels, {side, side}, /*align_corners=*/false);
    }
    pixels = pixels.squeeze(0);  // [C, side, side]
    // (x / 255 - mean) / std per channel.
    at::Tensor result = at::empty_like(pixels);
    for (int64_t c = 0; c < image.channels; ++c) {
      result.select(0, c).copy_(pixels.select(0, c).div(255.0).sub(config.mean[c]).div(config.std[c]));
    }
    return result;
  } catch (const c10::Error& error) {
    return absl::InternalError(absl::StrCat("image preprocessing failed: ", error.what_without_backtrace()));
  }
}

}  // namespace mita::models
