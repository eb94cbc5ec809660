#!/usr/bin/env bash
# The test command: installs what is needed, builds from scratch in ./build-test, runs every test with ctest;
# then the same tests under ASan + UBSan (scripts/run_sanitizers.sh, ./build-asan) and each fuzzer for 60 s
# (scripts/run_fuzzers.sh). MITA_SKIP_SANITIZERS=1 runs the plain tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
rm -rf build-test
cmake -S . -B build-test -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build-test -j "$(nproc)"
(cd build-test && ctest --output-on-failure --timeout 900)
if [ "${MITA_SKIP_SANITIZERS:-0}" != 1 ]; then
  MITA_SKIP_INSTALL=1 bash scripts/run_sanitizers.sh
  bash scripts/run_fuzzers.sh
fi
