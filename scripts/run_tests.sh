#!/usr/bin/env bash
# The test command: installs what is needed, builds from scratch in ./build-test, runs every test with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
rm -rf build-test
cmake -S . -B build-test -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build-test -j "$(nproc)"
cd build-test
ctest --output-on-failure --timeout 900
