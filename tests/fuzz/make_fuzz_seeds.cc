// Writes the seed corpus of the fuzzers (tests/fuzz/corpus/<fuzzer>/): small valid inputs of each kind, from
// which libFuzzer mutates (not tokenizer_fuzzer's: corpus/tokenizer/ holds three text files committed as they
// are). Run once by hand (the files are committed):
//   build-asan/tests/fuzz/make_fuzz_seeds tests/fuzz/corpus
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "mita/v1/mita.pb.h"
#include "tools/fashion_mnist.h"

namespace {

bool Write(const std::string& path, const std::string& bytes) {
  std::ofstream file(path, std::ios::binary);
  file << bytes;
  if (!file.good()) std::fprintf(stderr, "cannot write %s\n", path.c_str());
  return file.good();
}

std::vector<uint8_t> Gradient(int width, int height, int channels) {
  std::vector<uint8_t> pixels(static_cast<size_t>(width * height * channels));
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>((i * 37) % 256);
  return pixels;
}

// A safetensors file: 8-byte little-endian header length, JSON header, data.
std::string Safetensors(const std::string& header, const std::string& data) {
  std::string out;
  uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((length >> (8 * i)) & 0xff));
  return out + header + data;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_fuzz_seeds CORPUS_DIR (writes CORPUS_DIR/<fuzzer>/...)\n");
    return 2;
  }
  const std::string root = argv[1];
  bool ok = true;

  // Images: PNG of every channel layout, baseline JPEG gray and RGB; small so that each run is fast.
  std::vector<std::string> images;
  for (int channels : {1, 2, 3, 4}) {
    absl::StatusOr<std::string> png = mita::datasets::EncodePng(Gradient(7, 5, channels), 7, 5, channels);
    if (!png.ok()) return 1;
    ok &= Write(root + "/image_decoder/png_" + std::to_string(channels) + "ch", *png);
    images.push_back(*png);
  }
  for (int channels : {1, 3}) {
    absl::StatusOr<std::string> jpeg = mita::datasets::EncodeJpeg(Gradient(16, 8, channels), 16, 8, channels, 90);
    if (!jpeg.ok()) return 1;
    ok &= Write(root + "/image_decoder/jpeg_" + std::to_string(channels) + "ch", *jpeg);
    images.push_back(*jpeg);
  }

  // safetensors: one F32 tensor; every dtype with metadata; an empty tensor.
  std::string f32(24, '\0');
  ok &= Write(root + "/safetensors/f32",
              Safetensors(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})", f32));
  ok &= Write(root + "/safetensors/dtypes",
              Safetensors(R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"BF16","shape":[1,1],"data_offsets":[4,6]},)"
                          R"("c":{"dtype":"F64","shape":[1],"data_offsets":[6,14]}})",
                          std::string("\x00\x3c\x00\xc0\x80\x3f\x00\x00\x00\x00\x00\x00\xf0\x3f", 14)));
  ok &= Write(root + "/safetensors/empty", Safetensors(R"({"e":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]}})", ""));

  // config.json: the embedded model's shape, an RGB model with a full-attention preset.
  ok &= Write(root + "/model_config/gray",
              R"({"architecture":"mita_vit","task":"image_classification","image_size":28,"patch_size":4,)"
              R"("in_channels":1,"embed_dim":96,"depth":4,"num_heads":4,"mlp_hidden_dim":192,"layer_norm_eps":1e-06,)"
              R"("num_classes":10,"normalization":{"mean":[0.286],"std":[0.353]},"attention":{"type":"mita",)"
              R"("depthwise_conv":true,"default_budget":{"expert_count":9,"expert_width":16},"presets":{"fast":)"
              R"({"expert_count":4,"expert_width":8},"accurate":{"expert_count":16,"expert_width":32}}}})");
  ok &= Write(root + "/model_config/rgb",
              R"({"architecture":"mita_vit","image_size":32,"patch_size":8,"in_channels":3,"embed_dim":12,)"
              R"("depth":1,"num_heads":3,"mlp_hidden_dim":8,"num_classes":2,"max_image_side":64,)"
              R"("normalization":{"mean":[0.5,0.5,0.5],"std":[0.25,0.25,0.25]},"attention":{"type":"mita",)"
              R"("default_budget":{"expert_count":4,"expert_width":17},"presets":{"full":{"full_attention":true}}}})");

  // Classify requests for the embedded image model: default, preset, explicit experts, full attention, a document
  // (which the image model refuses)...
  auto request = [&](const std::string& name, const std::string& image, auto&& edit) {
    mita::v1::ClassifyRequest r;
    r.set_model("fashion-mnist-vit");
    r.set_image(image);
    edit(r);
    ok &= Write(root + "/classify_request/" + name, r.SerializeAsString());
  };
  request("default", images[0], [](mita::v1::ClassifyRequest&) {});
  request("preset", images[2], [](mita::v1::ClassifyRequest& r) {
    r.mutable_budget()->set_preset("fast");
    r.set_top_n(3);
  });
  request("experts", images[4], [](mita::v1::ClassifyRequest& r) {
    r.mutable_budget()->mutable_experts()->set_expert_count(16);
    r.mutable_budget()->mutable_experts()->set_expert_width(32);
    r.set_return_statistics(true);
  });
  request("full_attention", images[5], [](mita::v1::ClassifyRequest& r) {
    r.mutable_budget()->mutable_full_attention();
    r.set_top_n(10);
  });
  request("document", "", [](mita::v1::ClassifyRequest& r) { r.mutable_document()->set_text("a short document"); });
  request("token_ids", "", [](mita::v1::ClassifyRequest& r) {
    for (int64_t id : {101, 2023, 2003, 102}) r.mutable_document()->mutable_token_ids()->add_ids(id);
  });
  // ... and for the embedded document model: text, token ids, truncation, budgets.
  auto document = [&](const std::string& name, auto&& edit) {
    mita::v1::ClassifyRequest r;
    r.set_model("linux-doc-mita");
    edit(r);
    ok &= Write(root + "/classify_request/" + name, r.SerializeAsString());
  };
  document("document_model_text", [](mita::v1::ClassifyRequest& r) {
    r.mutable_document()->set_text(
        "The page allocator hands out physical pages; the slab allocator carves them into objects. "
        "See Documentation/mm for the zones, the buddy system and memory hotplug. \xc3\xa9\xe2\x82\xac");
    r.set_top_n(3);
  });
  document("document_model_token_ids", [](mita::v1::ClassifyRequest& r) {
    for (int64_t id : {5, 17, 300, 4095, 0, 42, 42, 42}) r.mutable_document()->mutable_token_ids()->add_ids(id);
    r.mutable_budget()->set_preset("fast");
    r.set_return_statistics(true);
  });
  document("document_model_truncate", [](mita::v1::ClassifyRequest& r) {
    std::string text;
    for (int i = 0; i < 400; ++i) text += "interrupt handler registers a threaded irq with request_threaded_irq; ";
    r.mutable_document()->set_text(text);
    r.mutable_document()->set_truncate(true);
    r.mutable_budget()->mutable_experts()->set_expert_count(8);
    r.mutable_budget()->mutable_experts()->set_expert_width(32);
  });
  document("document_model_full_attention", [](mita::v1::ClassifyRequest& r) {
    r.mutable_document()->set_text("USB gadget drivers and the configfs interface.");
    r.mutable_budget()->mutable_full_attention();
  });
  return ok ? 0 : 1;
}
