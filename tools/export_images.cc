// mita-export-images: writes Fashion-MNIST images as PNG files plus a manifest for mita-client.
//
//   mita-export-images --split=t10k --count=200 --out=/tmp/images
// writes /tmp/images/t10k-00000.png ... and /tmp/images/manifest.csv with lines "path,label_index" (absolute paths,
// whatever --out is).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/flags/usage_config.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "tools/fashion_mnist.h"

ABSL_FLAG(std::string, split, "t10k", "Fashion-MNIST split: t10k (test) or train");
ABSL_FLAG(int64_t, count, 200, "number of images to export, from the start of the split");
ABSL_FLAG(std::string, out, "", "output folder (created)");
ABSL_FLAG(std::string, data, mita::datasets::kFashionMnistDirectory, "folder of the gzipped IDX files");

int main(int argc, char** argv) {
  // --help lists the flags of this file (Abseil would look for a file named after the binary).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) { return absl::EndsWith(file, "/export_images.cc"); };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage("Writes Fashion-MNIST images as PNG plus manifest.csv. Flags below.");
  absl::ParseCommandLine(argc, argv);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    std::fprintf(stderr, "--out is required\n");
    return 2;
  }
  auto data = mita::datasets::ReadFashionMnist(absl::GetFlag(FLAGS_split), absl::GetFlag(FLAGS_data));
  if (!data.ok()) {
    std::fprintf(stderr, "%s\n", data.status().ToString().c_str());
    return 1;
  }
  const int64_t count = std::min<int64_t>(absl::GetFlag(FLAGS_count), data->count);
  std::filesystem::create_directories(out);
  std::ofstream manifest(std::filesystem::path(out) / "manifest.csv");
  const int64_t image_bytes = data->rows * data->columns;
  for (int64_t i = 0; i < count; ++i) {
    std::vector<uint8_t> pixels(data->pixels.begin() + i * image_bytes, data->pixels.begin() + (i + 1) * image_bytes);
    auto png = mita::datasets::EncodePng(pixels, data->columns, data->rows, 1);
    if (!png.ok()) {
      std::fprintf(stderr, "%s\n", png.status().ToString().c_str());
      return 1;
    }
    // Absolute in the manifest: readers resolve relative lines against the manifest's own folder, where a path
    // relative to this process's working directory would name the wrong file (--out=images gave images/images/...).
    const std::string path = (std::filesystem::absolute(out) /
                              absl::StrFormat("%s-%05d.png", absl::GetFlag(FLAGS_split), i)).string();
    std::ofstream(path, std::ios::binary) << *png;
    manifest << path << "," << static_cast<int>(data->labels[i]) << "\n";
  }
  std::printf("wrote %lld PNG images and %s\n", static_cast<long long>(count),
              (std::filesystem::path(out) / "manifest.csv").c_str());
  return 0;
}
