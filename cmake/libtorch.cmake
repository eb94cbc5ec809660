# LibTorch for MiTA Serve (docs/libtorch.md), included by the top-level CMakeLists.txt after the other packages.
#   MITA_LIBTORCH=pypi (default): the LibTorch inside the PyPI torch wheel that scripts/install_deps.sh installs
#     at MITA_TORCH_ROOT (torch 2.11.0 built for CUDA 13.0, MKL; runs without a GPU; its CMake config needs the
#     CUDA toolkit: nvcc, cudart, cuBLAS headers).
#   MITA_LIBTORCH=debian: Debian 12's libtorch-dev 1.13 (CPU only, OpenBLAS).
# Defines the INTERFACE target mita_torch (libraries, include folders, compile flags), MITA_LIBTORCH_LIBRARY_DIR and
# MITA_TORCH_HAS_CUDA.
set(MITA_LIBTORCH pypi CACHE STRING "LibTorch to build against: pypi (the torch wheel at MITA_TORCH_ROOT) or debian")
set_property(CACHE MITA_LIBTORCH PROPERTY STRINGS pypi debian)
set(MITA_TORCH_ROOT /opt/mita/torch-2.11.0/torch CACHE PATH
  "The torch package folder of the wheel, holding lib/, include/ and share/cmake/ (MITA_LIBTORCH=pypi)")

if(MITA_LIBTORCH STREQUAL "pypi")
  if(NOT EXISTS "${MITA_TORCH_ROOT}/share/cmake/Torch/TorchConfig.cmake")
    message(FATAL_ERROR "MITA_TORCH_ROOT=${MITA_TORCH_ROOT} holds no share/cmake/Torch/TorchConfig.cmake: run "
      "scripts/install_deps.sh, set MITA_TORCH_ROOT to a torch package folder (python3 -c 'import os, torch; "
      "print(os.path.dirname(torch.__file__))'), or configure with -DMITA_LIBTORCH=debian")
  endif()
  set(MITA_LIBTORCH_LIBRARY_DIR "${MITA_TORCH_ROOT}/lib")
  # The wheel's CUDA config adds -gencode flags for eleven architectures to every CUDA source unless told
  # (it ignores CMAKE_CUDA_ARCHITECTURES); the project's CUDA code is built for CMAKE_CUDA_ARCHITECTURES.
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT TORCH_CUDA_ARCH_LIST)
    set(TORCH_CUDA_ARCH_LIST 9.0)
    if(CMAKE_CUDA_ARCHITECTURES)  # 90;80 -> 9.0;8.0
      list(TRANSFORM CMAKE_CUDA_ARCHITECTURES REPLACE "^([0-9]+)([0-9][a-z]?)(-real|-virtual)?$" "\\1.\\2"
        OUTPUT_VARIABLE TORCH_CUDA_ARCH_LIST)
    endif()
  endif()
  # Searched first during find_package(Torch) alone: the package folder itself, not torch.utils.cmake_prefix_path
  # (its share/cmake), because TorchConfig.cmake's find_package(Caffe2) and find_library(c10) look in the system
  # folders before their own hints and, with libtorch-dev installed, took Debian's Caffe2 config and libc10.so.
  # Not left on CMAKE_PREFIX_PATH: the folder also holds protoc and the headers of protobuf 3.13 (linked into
  # libtorch_cpu.so, hidden), which FindProtobuf would otherwise take over Debian's protobuf 3.21.
  set(saved_prefix_path "${CMAKE_PREFIX_PATH}")
  list(PREPEND CMAKE_PREFIX_PATH "${MITA_TORCH_ROOT}")
  find_package(Torch REQUIRED)
  set(CMAKE_PREFIX_PATH "${saved_prefix_path}")
elseif(MITA_LIBTORCH STREQUAL "debian")
  set(MITA_LIBTORCH_LIBRARY_DIR /usr/lib/x86_64-linux-gnu)
  find_package(Torch REQUIRED)
else()
  message(FATAL_ERROR "MITA_LIBTORCH must be pypi or debian, not '${MITA_LIBTORCH}'")
endif()

# Both LibTorchs may be installed on one machine: every torch library must come from the chosen one (the wheel's
# config, found through its share/cmake alone, linked Debian's libc10.so 1.13 beside its own).
file(REAL_PATH "${MITA_LIBTORCH_LIBRARY_DIR}" expected_directory)
foreach(library IN LISTS TORCH_LIBRARIES)
  if(TARGET ${library})
    get_target_property(location ${library} IMPORTED_LOCATION_RELEASE)
    if(NOT location)
      get_target_property(location ${library} IMPORTED_LOCATION)
    endif()
    if(NOT location)
      continue()
    endif()
    set(library "${location}")
  endif()
  get_filename_component(name "${library}" NAME)
  get_filename_component(directory "${library}" DIRECTORY)
  if(IS_DIRECTORY "${directory}")
    file(REAL_PATH "${directory}" directory)
  endif()
  if(name MATCHES "^lib(torch|c10)" AND NOT directory STREQUAL expected_directory)
    message(FATAL_ERROR "MITA_LIBTORCH=${MITA_LIBTORCH} expects LibTorch in ${expected_directory}, but "
      "find_package(Torch) chose ${library} (Torch_DIR=${Torch_DIR})")
  endif()
endforeach()

# The wheel's include folder also holds headers of the libraries it links in privately (protobuf 3.13 under
# google/, pybind11): the project's targets see a copy of that folder made of links to everything else, so
# that a file including both LibTorch and gRPC/protobuf headers gets Debian's protobuf.
set(torch_include_dirs ${TORCH_INCLUDE_DIRS})
if(MITA_LIBTORCH STREQUAL "pypi")
  set(filtered "${CMAKE_BINARY_DIR}/libtorch-include")
  file(REMOVE_RECURSE "${filtered}")
  file(MAKE_DIRECTORY "${filtered}")
  file(GLOB entries RELATIVE "${MITA_TORCH_ROOT}/include" "${MITA_TORCH_ROOT}/include/*")
  foreach(entry IN LISTS entries)
    if(NOT entry MATCHES "^(google|pybind11)$")
      file(CREATE_LINK "${MITA_TORCH_ROOT}/include/${entry}" "${filtered}/${entry}" SYMBOLIC)
    endif()
  endforeach()
  list(TRANSFORM torch_include_dirs REPLACE "^${MITA_TORCH_ROOT}/include" "${filtered}")
  foreach(target IN ITEMS torch torch_cpu torch_cuda c10 c10_cuda)
    if(TARGET ${target})
      get_target_property(directories ${target} INTERFACE_INCLUDE_DIRECTORIES)
      if(directories)
        list(TRANSFORM directories REPLACE "^${MITA_TORCH_ROOT}/include" "${filtered}")
        set_target_properties(${target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${directories}")
      endif()
    endif()
  endforeach()
endif()
# Whether this LibTorch has CUDA (the wheel's has, Debian's has not): kernels/ then compiles its CUDA parts (fused
# attention, device checks, the caching allocator's memory statistics) with MITA_TORCH_HAS_CUDA.
set(MITA_TORCH_HAS_CUDA OFF)
if(TARGET c10_cuda)
  set(MITA_TORCH_HAS_CUDA ON)
endif()
message(STATUS "LibTorch: ${MITA_LIBTORCH}, version ${Torch_VERSION}, libraries in ${MITA_LIBTORCH_LIBRARY_DIR}, "
  "CUDA ${MITA_TORCH_HAS_CUDA}")

# The BLAS of the CPU MiTA kernel, which calls sgemm_/dgemm_ itself: the one LibTorch uses, so that one BLAS
# and one thread setting serve the process. The wheel's libtorch_cpu.so links MKL in and exports its sgemm_ and
# dgemm_ (checked here), and binds its own calls to the first sgemm_ the process has: a system BLAS linked or
# preloaded ahead of it would take over LibTorch's matrix products too, so none is linked. Debian's LibTorch
# uses the system BLAS (OpenBLAS), which the kernel links too.
if(MITA_LIBTORCH STREQUAL "pypi")
  execute_process(COMMAND "${CMAKE_NM}" -D --defined-only "${MITA_LIBTORCH_LIBRARY_DIR}/libtorch_cpu.so"
    OUTPUT_VARIABLE exported RESULT_VARIABLE nm_status)
  if(NOT nm_status EQUAL 0 OR NOT exported MATCHES " T sgemm_\n" OR NOT exported MATCHES " T dgemm_\n")
    message(FATAL_ERROR "${MITA_LIBTORCH_LIBRARY_DIR}/libtorch_cpu.so exports no sgemm_/dgemm_ (MKL): the CPU "
      "kernel needs a BLAS; build with -DMITA_LIBTORCH=debian")
  endif()
  set(MITA_BLAS_LIBRARIES "")
else()
  find_package(BLAS REQUIRED)
  set(MITA_BLAS_LIBRARIES BLAS::BLAS)
endif()
# The OpenBLAS that runs the CPU's float GEMMs (kernels/blas_library.h), loaded at run time from this path: the
# scipy-openblas32 wheel that scripts/install_deps.sh installs (its symbols carry a scipy_ prefix, so it never
# takes over LibTorch's sgemm_). Empty, or a path that does not exist: the GEMMs run on LibTorch's BLAS.
set(MITA_OPENBLAS_LIBRARY /opt/mita/openblas-0.3.31.188.0/scipy_openblas32/lib/libscipy_openblas.so CACHE FILEPATH
  "OpenBLAS (scipy-openblas32) for the CPU's float GEMMs; empty: LibTorch's BLAS")
if(MITA_OPENBLAS_LIBRARY AND NOT EXISTS "${MITA_OPENBLAS_LIBRARY}")
  message(WARNING "MITA_OPENBLAS_LIBRARY (${MITA_OPENBLAS_LIBRARY}) does not exist: the CPU's float GEMMs will run on "
    "LibTorch's BLAS (run scripts/install_deps.sh)")
  set(MITA_OPENBLAS_LIBRARY "")
endif()
message(STATUS "OpenBLAS for the CPU's float GEMMs: ${MITA_OPENBLAS_LIBRARY}")
# One OpenMP runtime: the wheel ships its own libgomp.so.1 (the one its LibTorch and MKL use, found first through
# the binaries' RUNPATH), older than GCC 12's (up to GOMP_5.0, OMP_5.0); the project's OpenMP code links it too, so
# that a construct it lacks fails at link time rather than at start-up. (Clang builds keep LLVM's libomp.)
# (FindOpenMP keeps a library it finds in its cache variable.)
if(MITA_LIBTORCH STREQUAL "pypi" AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  set(OpenMP_gomp_LIBRARY "${MITA_LIBTORCH_LIBRARY_DIR}/libgomp.so.1" CACHE FILEPATH
    "libgomp of the torch wheel (cmake/libtorch.cmake)" FORCE)
elseif(OpenMP_gomp_LIBRARY MATCHES "/torch/lib/libgomp")
  unset(OpenMP_gomp_LIBRARY CACHE)
endif()

# The wheel's MKL target points its link folders at an empty MKL_ROOT (/lib/intel64, ...), which would end up in
# every binary's RUNPATH.
if(TARGET caffe2::mkl AND NOT MKL_ROOT)
  set_property(TARGET caffe2::mkl PROPERTY INTERFACE_LINK_DIRECTORIES "")
endif()

# Torch's exported targets carry its compile flags; keep them off unrelated targets.
add_library(mita_torch INTERFACE)
target_link_libraries(mita_torch INTERFACE ${TORCH_LIBRARIES})
target_include_directories(mita_torch SYSTEM INTERFACE ${torch_include_dirs})
# The wheel's libtorch.so and libtorch_cpu.so export copies of libstdc++ functions that their build linked in
# statically (std::filesystem, string streams, ...; 185 of them also in Debian's libstdc++.so.6). An executable
# that loads libtorch before libstdc++.so.6 binds its own calls to those copies, and there
# std::filesystem::remove_all called through a null pointer (models_test crashed at exit). libstdc++.so.6 as
# every executable's first needed library makes such calls, LibTorch's own included, bind to libstdc++.so.6.
if(MITA_LIBTORCH STREQUAL "pypi")
  target_link_options(mita_torch INTERFACE "LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
endif()
