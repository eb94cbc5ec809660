#!/usr/bin/env bash
# The test command: installs what is needed, builds from scratch in ./build-test, runs every test with ctest;
# then builds the libFuzzer targets under ASan + UBSan (./build-asan) and runs each for 60 s
# (scripts/run_fuzzers.sh; MITA_SKIP_FUZZERS=1 skips them). The whole suite under ASan + UBSan is
# scripts/run_sanitizers.sh (not run here: about 40 minutes more on a 2-core machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
rm -rf build-test build-asan
cmake -S . -B build-test -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build-test -j "$(nproc)"
# OMP_WAIT_POLICY=passive, as mita-server's launcher and the tools set it for themselves: LibTorch's idle OpenMP
# threads would otherwise spin, and a test binary on a loaded machine waits for its own spinning threads
# (CostCalibrationTest.SweepIsBoundedByItsLimit failed so at nice 19 beside a training run).
(cd build-test && OMP_WAIT_POLICY=passive ctest --output-on-failure --timeout 900)
if [ "${MITA_SKIP_FUZZERS:-0}" != 1 ]; then
  bash scripts/run_fuzzers.sh
fi
