// The C interface of the SentencePiece module (models/sentencepiece_adapter.h) lets no C++ exception out of the
// module, and a failed load frees what it allocated.
//
// Shown with a real exception: this test loads the module the way models/tokenizer.cc must not, with a plain
// dlopen (no RTLD_DEEPBIND, no link-map namespace of its own), into a process that uses libprotobuf. Debian's
// libsentencepiece then binds its bundled protobuf-lite (3.14) references to libprotobuf.so.32 (3.21), whose
// version check throws google::protobuf::FatalException when the first ModelProto is made. Before the module
// caught exceptions, that exception unwound through the C interface into the caller (and leaked the
// processor: LeakSanitizer found it in the sanitizer build). Its own binary, because after this load the
// process's libsentencepiece stays bound that way, and broken.
#include <dlfcn.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include <google/protobuf/stubs/common.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/sentencepiece_adapter.h"

#ifndef MITA_SENTENCEPIECE_MODULE
#error "MITA_SENTENCEPIECE_MODULE (the module's path) is set by tests/CMakeLists.txt"
#endif

namespace {

using ::testing::HasSubstr;

std::string SourceDirectory() {
  const char* directory = std::getenv("MITA_SOURCE_DIR");
  return directory != nullptr ? directory : ".";
}

TEST(SentencePieceModuleTest, LibraryExceptionsBecomeErrorsAtTheCInterface) {
  // Uses libprotobuf, so that it is in the process's global scope before the module is loaded.
  GOOGLE_PROTOBUF_VERIFY_VERSION;
  void* module = dlopen(MITA_SENTENCEPIECE_MODULE, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(module, nullptr) << dlerror();
  auto* get_api = reinterpret_cast<void (*)(MitaSentencePieceApi*)>(dlsym(module, "mita_sentencepiece_get_api"));
  ASSERT_NE(get_api, nullptr) << dlerror();
  MitaSentencePieceApi api{};
  get_api(&api);

  const std::string path = SourceDirectory() + "/models/repository/linux-doc-mita/tokenizer.model";
  std::ifstream file(path, std::ios::binary);
  ASSERT_TRUE(file.good()) << "cannot read " << path;
  const std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());

  void* processor = nullptr;
  char error[512] = {0};
  // An exception escaping here fails the test (GoogleTest reports it thrown in the test body).
  const int result = api.load(bytes.data(), bytes.size(), &processor, error, sizeof(error));
  if (result == 0) {
    api.destroy(processor);
    GTEST_SKIP() << "the model loaded: libsentencepiece's protobuf and libprotobuf " << GOOGLE_PROTOBUF_VERSION
                 << " are compatible here, so there is no exception to turn into an error";
  }
  EXPECT_EQ(processor, nullptr);
  EXPECT_THAT(std::string(error), HasSubstr("loading the model: "));
  EXPECT_THAT(std::string(error), HasSubstr("Protocol Buffer"));
  // No second load: after the failed version check the mixed protobuf state is broken for good (a second
  // load was seen to crash inside libprotobuf), which is why models/tokenizer.cc isolates the module.
}

}  // namespace
