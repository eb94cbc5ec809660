// Where tensors live and in what precision: device and dtype names as the server's flags spell them, whether a
// device can be used in this process, and a CUDA device's memory as LibTorch's caching allocator counts it.
//
// This header has no gRPC, proto or model knowledge.
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mita::kernels {

// "cpu" or "cuda:N" (N a device index in [0, 127], no sign or leading zeros).
// Errors: INVALID_ARGUMENT "'gpu' is not a device: use cpu or cuda:N (N = 0, 1, ...)".
absl::StatusOr<c10::Device> ParseDevice(absl::string_view text);
// The name ParseDevice reads: "cpu", "cuda:0".
std::string DeviceName(const c10::Device& device);

// The floating-point dtypes a model's weights can have: "float32" or "bfloat16".
// Errors: INVALID_ARGUMENT "'fp16' is not a weights dtype: use float32 or bfloat16".
absl::StatusOr<at::ScalarType> ParseWeightsDtype(absl::string_view text);
// "float32", "bfloat16", "float64", ... (c10's name for others).
std::string DtypeName(at::ScalarType type);

// Whether this CPU has bfloat16 dot-product instructions (AVX512-BF16 or AMX-BF16), with which LibTorch's oneDNN
// runs bfloat16 GEMMs faster than float32 ones; without them LibTorch computes bfloat16 in scalar loops.
bool CpuHasBfloat16DotProducts();

// Whether a model's weights and activations may be `dtype` on `device`: float32 anywhere; bfloat16 on a CUDA
// device, or on a CPU with CpuHasBfloat16DotProducts (the dense layers then run through oneDNN in bfloat16 and the
// CPU attention kernels in float32 on widened copies). Errors: INVALID_ARGUMENT for another dtype ("weights dtype
// float16 is not supported: use float32 or bfloat16"); FAILED_PRECONDITION for bfloat16 on a CPU without those
// instructions ("bfloat16 on the CPU needs AVX512-BF16 or AMX-BF16, which this CPU lacks: ...").
absl::Status CheckWeightsDtypeOnDevice(at::ScalarType dtype, const c10::Device& device);

// Whether tensors can be placed on `device` in this process: OK for the CPU. For cuda:N, FAILED_PRECONDITION when
// the build's LibTorch has no CUDA (Debian's), when no CUDA device is visible ("cuda:0: no CUDA device is visible
// to this process (CUDA_VISIBLE_DEVICES is unset)"), or when N is not below the visible count; the message also
// says what CUDA support the build has (CudaBuildSummary). INVALID_ARGUMENT for another device type.
absl::Status CheckDeviceUsable(const c10::Device& device);

// CUDA devices this process sees (0 without LibTorch CUDA, a driver or a device; never an error).
int VisibleCudaDevices();

// What CUDA support is compiled in, for logs and errors: "CUDA MiTA kernel for sm_90 (CUDA 13.0), LibTorch with
// CUDA" (the kernel part comes from kernels/mita_attention_cuda.cu itself, so it says that object is linked);
// "no CUDA MiTA kernel, LibTorch without CUDA" when neither is.
std::string CudaBuildSummary();

// Bytes of a CUDA device's memory held by LibTorch's caching allocator (c10::cuda::CUDACachingAllocator): in
// tensors (allocated) and taken from the driver, cached included (reserved); peak_allocated since start; and the
// device's whole memory (total: cudaMemGetInfo; 0 in a build without the CUDA MiTA kernel).
struct DeviceMemory {
  int64_t allocated_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t peak_allocated_bytes = 0;
  int64_t total_bytes = 0;
};
// The caching allocator's counts for `device` (a CUDA device; initialises LibTorch's CUDA if nothing has yet).
// Errors: FAILED_PRECONDITION without LibTorch CUDA; INVALID_ARGUMENT for a CPU device; INTERNAL when the
// allocator fails (e.g. an index beyond the visible devices).
absl::StatusOr<DeviceMemory> CudaMemory(const c10::Device& device);

// Waits until `device` has run all work queued on it (for timing); nothing on the CPU.
// Errors: INTERNAL when the device reports an error.
absl::Status SynchronizeDevice(const c10::Device& device);

// Limits LibTorch's caching allocator on `device` (a CUDA device) to `fraction` of the device's memory: an
// allocation beyond it fails as out of memory (c10::OutOfMemoryError). Errors: as CudaMemory; INVALID_ARGUMENT
// for a fraction outside (0, 1].
absl::Status LimitCudaMemory(const c10::Device& device, double fraction);

}  // namespace mita::kernels
