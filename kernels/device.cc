// Devices and dtypes (see device.h). The CUDA parts compile only against a LibTorch with CUDA
// (MITA_TORCH_HAS_CUDA, cmake/libtorch.cmake) and with the project's CUDA kernel (MITA_HAVE_CUDA).
#include "kernels/device.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif

#include <cstdlib>
#include <exception>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "kernels/aten_errors.h"
#ifdef MITA_TORCH_HAS_CUDA
#include <ATen/Context.h>
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif
#ifdef MITA_HAVE_CUDA
#include "kernels/mita_attention_cuda.h"
#endif

namespace mita::kernels {
namespace {

constexpr char kDeviceHelp[] = "use cpu or cuda:N (N = 0, 1, ...)";

// What CUDA_VISIBLE_DEVICES says, for the no-device error.
std::string VisibilityNote() {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr) return "CUDA_VISIBLE_DEVICES is unset";
  return absl::StrCat("CUDA_VISIBLE_DEVICES='", visible, "'");
}

absl::Status CheckCuda(const c10::Device& device) {
  if (!device.is_cuda()) {
    return absl::InvalidArgumentError(absl::StrCat(DeviceName(device), " is not a CUDA device"));
  }
#ifndef MITA_TORCH_HAS_CUDA
  return absl::FailedPreconditionError(
      absl::StrCat(DeviceName(device), ": this build's LibTorch has no CUDA (", CudaBuildSummary(), ")"));
#else
  return absl::OkStatus();
#endif
}

}  // namespace

absl::StatusOr<c10::Device> ParseDevice(absl::string_view text) {
  if (text == "cpu") return c10::Device(c10::kCPU);
  absl::string_view index_text = text;
  if (absl::ConsumePrefix(&index_text, "cuda:") && !index_text.empty() && index_text.size() <= 3 &&
      (index_text == "0" || index_text[0] != '0')) {
    bool digits = true;
    for (char c : index_text) digits = digits && absl::ascii_isdigit(static_cast<unsigned char>(c));
    int index = 0;
    if (digits && absl::SimpleAtoi(index_text, &index) && index <= std::numeric_limits<c10::DeviceIndex>::max()) {
      return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a device: ", kDeviceHelp));
}

std::string DeviceName(const c10::Device& device) {
  if (device.is_cpu()) return "cpu";
  if (device.is_cuda()) return absl::StrCat("cuda:", device.has_index() ? device.index() : 0);
  return device.str();
}

absl::StatusOr<at::ScalarType> ParseWeightsDtype(absl::string_view text) {
  if (text == "float32") return at::kFloat;
  if (text == "bfloat16") return at::kBFloat16;
  return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a weights dtype: use float32 or bfloat16"));
}

std::string DtypeName(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    default:
      return c10::toString(type);
  }
}

int VisibleCudaDevices() {
#ifdef MITA_TORCH_HAS_CUDA
  return static_cast<int>(c10::cuda::device_count());  // noexcept; 0 without a driver or device
#else
  return 0;
#endif
}

bool CpuHasBfloat16DotProducts() {
#if defined(__x86_64__) && defined(__GNUC__)
  // CPUID leaf 7: AVX512-BF16 is subleaf 1's EAX bit 5, AMX-BF16 subleaf 0's EDX bit 22 (Intel SDM vol. 2A,
  // CPUID). Read directly: GCC and Clang name these features differently in __builtin_cpu_supports. AVX512-BF16
  // also needs the OS to save AVX-512 state, which __builtin_cpu_supports("avx512f") checks.
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  const bool amx_bf16 = (edx >> 22) & 1U;
  if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) == 0) return amx_bf16;
  const bool avx512_bf16 = ((eax >> 5) & 1U) && __builtin_cpu_supports("avx512f");
  return avx512_bf16 || amx_bf16;
#else
  return false;
#endif
}

absl::Status CheckWeightsDtypeOnDevice(at::ScalarType dtype, const c10::Device& device) {
  if (dtype != at::kFloat && dtype != at::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights dtype ", DtypeName(dtype), " is not supported: use float32 or bfloat16"));
  }
  if (dtype == at::kBFloat16 && device.is_cpu() && !CpuHasBfloat16DotProducts()) {
    return absl::FailedPreconditionError(
        "bfloat16 on the CPU needs AVX512-BF16 or AMX-BF16, which this CPU lacks: LibTorch would compute it in "
        "scalar loops, far slower than float32 (use float32, or a CUDA device)");
  }
  return absl::OkStatus();
}

absl::Status CheckDeviceUsable(const c10::Device& device) {
  if (device.is_cpu()) return absl::OkStatus();
  if (absl::Status cuda = CheckCuda(device); !cuda.ok()) return cuda;
  const int visible = VisibleCudaDevices();
  const std::string name = DeviceName(device);
  if (visible == 0) {
    return absl::FailedPreconditionError(absl::StrCat(name, ": no CUDA device is visible to this process (",
                                                      VisibilityNote(), "; this build: ", CudaBuildSummary(), ")"));
  }
  if (device.index() >= visible) {
    return absl::FailedPreconditionError(absl::StrCat(name, ": only ", visible, " CUDA device",
                                                      visible == 1 ? " is" : "s are", " visible (cuda:0",
                                                      visible > 1 ? absl::StrCat(" .. cuda:", visible - 1) : "",
                                                      "; ", VisibilityNote(), ")"));
  }
  return absl::OkStatus();
}

std::string CudaBuildSummary() {
#ifdef MITA_HAVE_CUDA
  std::string kernel = absl::StrCat("CUDA MiTA kernel for ", cuda::KernelBuildSummary());
#else
  std::string kernel = "no CUDA MiTA kernel";
#endif
#ifdef MITA_TORCH_HAS_CUDA
  return absl::StrCat(kernel, ", LibTorch with CUDA");
#else
  return absl::StrCat(kernel, ", LibTorch without CUDA");
#endif
}

absl::StatusOr<DeviceMemory> CudaMemory(const c10::Device& device) {
  if (absl::Status cuda = CheckCuda(device); !cuda.ok()) return cuda;
#ifdef MITA_TORCH_HAS_CUDA
  try {
    // The caching allocator knows the devices once LibTorch's CUDA is initialised (the first CUDA tensor does it).
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    const c10::CachingDeviceAllocator::DeviceStats stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    DeviceMemory memory;
    memory.allocated_bytes = stats.allocated_bytes[kAggregate].current;
    memory.reserved_bytes = stats.reserved_bytes[kAggregate].current;
    memory.peak_allocated_bytes = stats.allocated_bytes[kAggregate].peak;
#ifdef MITA_HAVE_CUDA
    // From the kernel library's CUDA runtime: the inline cudaMemGetInfo of LibTorch's headers would make this file
    // link the toolkit's libcudart.so.13 beside the wheel's.
    memory.total_bytes = cuda::DeviceMemoryBytes(device.index());
#endif
    return memory;
  } catch (const std::exception&) {
    return CurrentExceptionStatus(absl::StrCat("memory statistics of ", DeviceName(device)));
  }
#else
  return absl::FailedPreconditionError("unreachable: CheckCuda fails without LibTorch CUDA");
#endif
}

absl::Status SynchronizeDevice(const c10::Device& device) {
  if (device.is_cpu()) return absl::OkStatus();
  if (absl::Status cuda = CheckCuda(device); !cuda.ok()) return cuda;
#ifdef MITA_TORCH_HAS_CUDA
  try {
    // c10's generic guard (its CUDA implementation lives in libc10_cuda): no CUDA runtime call is compiled here,
    // so this file links no CUDA runtime of its own.
    const c10::DeviceGuard guard(device);
    c10::cuda::device_synchronize();
    return absl::OkStatus();
  } catch (const std::exception&) {
    return CurrentExceptionStatus(absl::StrCat("waiting for ", DeviceName(device)));
  }
#else
  return absl::FailedPreconditionError("unreachable: CheckCuda fails without LibTorch CUDA");
#endif
}

absl::Status LimitCudaMemory(const c10::Device& device, double fraction) {
  if (absl::Status cuda = CheckCuda(device); !cuda.ok()) return cuda;
  if (!(fraction > 0 && fraction <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("memory fraction ", fraction, " is outside (0, 1]"));
  }
#ifdef MITA_TORCH_HAS_CUDA
  try {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);  // mita-server limits before any weights are placed
    c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, device.index());
    return absl::OkStatus();
  } catch (const std::exception&) {
    return CurrentExceptionStatus(absl::StrCat("limiting the memory of ", DeviceName(device)));
  }
#else
  return absl::FailedPreconditionError("unreachable: CheckCuda fails without LibTorch CUDA");
#endif
}

}  // namespace mita::kernels
