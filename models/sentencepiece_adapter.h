// SentencePiece behind a C interface in a separately loaded module (libmita_sentencepiece.so).
//
// Why: Debian's libsentencepiece.so.0 (0.1.97) carries its own copy of protobuf-lite and exports its 1,600
// protobuf symbols. Linked into a process that also loads libprotobuf.so.32 (LibTorch, gRPC), the two copies
// interpose each other and the process crashes in a static initialiser (measured: SIGSEGV in
// ReflectionOps::FindInitializationErrors before main). So the library is never linked into our binaries:
// sentencepiece_module.cc wraps it in a MODULE library that models/tokenizer.cc loads with
// dlopen(RTLD_LOCAL | RTLD_DEEPBIND), which keeps sentencepiece's symbols out of the global scope and binds its
// own references to its own copy. Sanitizer and fuzzer builds, whose runtime refuses RTLD_DEEPBIND, build the
// module uninstrumented and load it with dlmopen(LM_ID_NEWLM) into a link-map namespace of its own (its own
// libc and libstdc++ too; see models/tokenizer.cc). (The module also keeps sentencepiece_processor.h, whose
// `namespace absl { using std::string_view; }` collides with Debian Abseil's absl::string_view class, out of
// every translation unit that includes Abseil.)
//
// Because the two sides may not share a C++ runtime or a heap, the interface is plain C and:
// - no C++ exception crosses it in either direction (the module catches everything and returns an error; the
//   ids callback must not throw);
// - no ownership of memory crosses it: each side frees only what it allocated (the processor handle is freed
//   by `destroy`, in the module; `ids` is valid only during the callback; `error` is the caller's buffer).
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

// Receives the ids of one Encode call (count entries, valid only during the call). Must not throw.
typedef void (*MitaSentencePieceIdsCallback)(void* context, const int* ids, size_t count);

// The module's entry points (all return 0 on success, else write a NUL-terminated message into `error`).
struct MitaSentencePieceApi {
  // Parses a serialized SentencePiece ModelProto; *processor receives an opaque handle.
  int (*load)(const char* model_bytes, size_t model_size, void** processor, char* error, size_t error_capacity);
  // Encodes text (thread-safe); calls `callback` once with the ids.
  int (*encode)(const void* processor, const char* text, size_t text_size, MitaSentencePieceIdsCallback callback,
                void* context, char* error, size_t error_capacity);
  int64_t (*vocab_size)(const void* processor);
  void (*destroy)(void* processor);
};

// The module's only exported symbol: fills *api.
void mita_sentencepiece_get_api(MitaSentencePieceApi* api);

}  // extern "C"
