#!/usr/bin/env bash
# Installs what MiTA Serve needs to build, test, train and run: Debian 12 packages, and the LibTorch that
# cmake/libtorch.cmake builds against. Run as root.
#   MITA_LIBTORCH=pypi (default): the LibTorch inside the PyPI torch wheel (pinned below, with the NVIDIA CUDA
#     runtime wheels it loads), installed with pip --target into /opt/mita/torch-<version>; needs the CUDA
#     toolkit (nvcc) at /usr/local/cuda to configure.
#   MITA_LIBTORCH=debian: Debian's libtorch-dev 1.13 (CPU only) and OpenBLAS.
# docs/libtorch.md has the measurements behind the choice. Unless MITA_PEERS=0 (the container image's build
# stage), also the peers the tests and benchmarks compare against (scripts/install_peers.sh: tritonclient, timm,
# ONNX Runtime in a venv, Triton's perf_analyzer), whose Python torch is the wheel's: the wheel is then installed
# in debian mode too; and the deploy checks' tools (scripts/install_deploy_check.sh: kubernetes-validate, checkov).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
LIBTORCH="${MITA_LIBTORCH:-pypi}"
PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libabsl-dev prometheus-cpp-dev libmicrohttpd-dev nlohmann-json3-dev
  libpng-dev libjpeg62-turbo-dev libsentencepiece-dev sentencepiece linux-doc-6.1
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  openssl
  dataset-fashion-mnist
  python3 python3-numpy python3-torch  # python3-torch: training, and the tests' independent PyTorch reference
  libopenblas0-pthread  # BLAS for python3-torch: training is ~7x slower on the reference BLAS (docs/long_documents.md)
  python3-grpcio python3-protobuf python3-yaml
  python3-h2  # raw HTTP/2 frames in the transport tests (tests/transport_edges_test.py)
  python3-venv python3-dev python3-pip  # the peers' venv; torch.compile's generated C++ includes Python.h
  python3-sklearn xz-utils  # TF-IDF baseline (tools/tfidf_baseline.py); the shipped held-out texts (data/*.xz)
  poppler-utils  # pdftotext: building the TeX Live documentation corpus (tools/build_document_corpus.py)
  clang libclang-rt-dev libomp-dev  # ASan/UBSan test build, libFuzzer targets (scripts/run_sanitizers.sh)
)
case "$LIBTORCH" in
  pypi) ;;
  debian) PACKAGES+=(libtorch-dev libopenblas0-pthread libblas-dev) ;;
  *) echo "MITA_LIBTORCH must be pypi or debian, not '$LIBTORCH'" >&2; exit 2 ;;
esac
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The torch wheel: LibTorch for the build (pypi mode) and the peers' Python torch (unless MITA_PEERS=0).
PEERS="${MITA_PEERS:-1}"
if [ "$LIBTORCH" = pypi ] || [ "$PEERS" = 1 ]; then
  # torch 2.11.0 is built for CUDA 13.0 (the toolkit here) and is the version of the GPU machine's python torch,
  # whose libraries a server built here then uses there (scripts/gpu_artifacts.sh). The NVIDIA wheels are the
  # ones torch 2.11.0 requires (its METADATA), pinned to the versions pip resolves for it; Python-only needs
  # (triton, sympy, ...) are left out: the build uses only the C++ libraries, and the peers' venv adds what
  # Python's torch imports.
  TORCH_VERSION=2.11.0
  TORCH_PREFIX=/opt/mita/torch-$TORCH_VERSION
  WHEELS=(
    torch==$TORCH_VERSION
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85 nvidia-cuda-nvrtc==13.0.88 nvidia-nvjitlink==13.0.88
    nvidia-nvtx==13.0.85 nvidia-cublas==13.1.0.3 nvidia-cufft==12.0.0.61 nvidia-curand==10.4.0.35
    nvidia-cusolver==12.0.4.66 nvidia-cusparse==12.6.3.3 nvidia-cufile==1.15.1.6 nvidia-cudnn-cu13==9.19.0.56
    nvidia-cusparselt-cu13==0.8.0 nvidia-nccl-cu13==2.28.9 nvidia-nvshmem-cu13==3.4.5
  )
  # The list is the install's identity: a changed pin installs afresh (into a new folder, moved in place
  # when complete, so that an interrupted install leaves nothing half-written behind).
  if [ "$(cat "$TORCH_PREFIX/.wheels" 2>/dev/null)" != "${WHEELS[*]}" ]; then
    staging="$TORCH_PREFIX.partial"
    $SUDO rm -rf "$staging"
    $SUDO mkdir -p "$(dirname "$TORCH_PREFIX")"
    $SUDO /usr/bin/python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
      --no-deps --no-compile --no-cache-dir --only-binary=:all: --target "$staging" "${WHEELS[@]}"
    echo "${WHEELS[*]}" | $SUDO tee "$staging/.wheels" > /dev/null
    $SUDO rm -rf "$TORCH_PREFIX"
    $SUDO mv "$staging" "$TORCH_PREFIX"
  fi
fi
# OpenBLAS for the CPU's float GEMMs (kernels/cpu_gemm.h), in both LibTorch modes: the scipy-openblas32 wheel,
# whose BLAS symbols carry a scipy_ prefix, so that it loads beside the wheel's MKL without taking over LibTorch's
# sgemm_. Chosen by measurement (scripts/bench_gemm.py, docs/kernels.md "GEMM rates"). Its own folder, named by
# the pin; moved in place when complete.
OPENBLAS_WHEEL=scipy-openblas32==0.3.31.188.0
OPENBLAS_PREFIX=/opt/mita/openblas-${OPENBLAS_WHEEL#*==}
if [ ! -f "$OPENBLAS_PREFIX/scipy_openblas32/lib/libscipy_openblas.so" ]; then
  staging="$OPENBLAS_PREFIX.partial"
  $SUDO rm -rf "$staging"
  $SUDO mkdir -p "$(dirname "$OPENBLAS_PREFIX")"
  $SUDO /usr/bin/python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --no-deps --no-compile --no-cache-dir --only-binary=:all: --target "$staging" "$OPENBLAS_WHEEL"
  $SUDO rm -rf "$OPENBLAS_PREFIX"
  $SUDO mv "$staging" "$OPENBLAS_PREFIX"
fi
if [ "$PEERS" = 1 ]; then
  bash "$(dirname "$0")/install_peers.sh"
  # The deploy checks' tools (kubernetes-validate, checkov) in their own venv.
  bash "$(dirname "$0")/install_deploy_check.sh"
fi
if [ "$LIBTORCH" = pypi ]; then
  if [ ! -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc > /dev/null; then
    echo "install_deps.sh: no CUDA toolkit (nvcc) found; the torch wheel's CMake config needs one" \
         "(CUDA 13.0 at /usr/local/cuda), or build with MITA_LIBTORCH=debian" >&2
    exit 1
  fi
fi
