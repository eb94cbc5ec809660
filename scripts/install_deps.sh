#!/usr/bin/env bash
# Installs every Debian 12 package MiTA Serve needs to build, test, train and run. Run as root.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libtorch-dev libopenblas0-pthread libblas-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libabsl-dev prometheus-cpp-dev nlohmann-json3-dev
  libpng-dev libjpeg62-turbo-dev libsentencepiece-dev sentencepiece linux-doc-6.1
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  openssl
  dataset-fashion-mnist
  python3 python3-numpy python3-torch
  python3-grpcio python3-protobuf python3-yaml
  clang libclang-rt-dev libomp-dev  # ASan/UBSan test build, libFuzzer targets (scripts/run_sanitizers.sh)
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
