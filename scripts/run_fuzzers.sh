#!/usr/bin/env bash
# Runs each libFuzzer target of tests/fuzz for a bounded time (MITA_FUZZ_SECONDS, default 60 s each) from its
# committed seed corpus (tests/fuzz/corpus/<fuzzer>/). It builds the fuzzers, with ASan + UBSan, in ./build-asan
# (the folder scripts/run_sanitizers.sh uses; CI runs this script from scripts/run_tests.sh, not the sanitizers').
# New inputs libFuzzer finds go to a scratch corpus under the build folder, not into the repository. A crash,
# timeout, out-of-memory or sanitizer report fails the script; the input that caused it is saved as
# build-asan/fuzz-artifacts/<fuzzer>-crash-... (reproduce: build-asan/tests/fuzz/<fuzzer> THAT_FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${MITA_SANITIZER_BUILD_DIR:-build-asan}
SECONDS_EACH=${MITA_FUZZ_SECONDS:-60}
FUZZERS=(image_decoder_fuzzer safetensors_fuzzer model_config_fuzzer tokenizer_fuzzer classify_request_fuzzer)
if [ -n "${MITA_FUZZERS:-}" ]; then read -r -a FUZZERS <<<"$MITA_FUZZERS"; fi

# Same sanitizer options as the test run (see scripts/run_sanitizers.sh).
export ASAN_OPTIONS="detect_leaks=1:detect_odr_violation=0:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$PWD/tests/sanitizers/lsan.supp:print_suppressions=0"
export OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1

# Build the fuzzers (clang, ASan + UBSan, libFuzzer) unless scripts/run_sanitizers.sh already did: only the
# fuzzer targets and the libraries they need.
missing=0
for fuzzer in "${FUZZERS[@]}"; do [ -x "$BUILD_DIR/tests/fuzz/$fuzzer" ] || missing=1; done
if [ "$missing" = 1 ]; then
  CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=None \
    -DCMAKE_CXX_FLAGS="-O1 -gline-tables-only" -DCMAKE_C_FLAGS="-O1 -gline-tables-only" \
    -DMITA_SANITIZE=address,undefined -DMITA_BUILD_FUZZERS=ON -DMITA_CUDA=OFF
  cmake --build "$BUILD_DIR" -j "$(nproc)" --target "${FUZZERS[@]}"
fi
# classify_request_fuzzer serves both embedded models, from a copy of the repository (the registry refuses
# symlinks that leave the repository; the SentencePiece module of the document model loads under ASan through
# dlmopen, models/tokenizer.cc).
export MITA_MODEL_REPOSITORY="$PWD/$BUILD_DIR/fuzz-repository"
rm -rf "$MITA_MODEL_REPOSITORY" && mkdir -p "$MITA_MODEL_REPOSITORY"
cp -r models/repository/fashion-mnist-vit models/repository/linux-doc-mita "$MITA_MODEL_REPOSITORY/"

artifacts="$BUILD_DIR/fuzz-artifacts"
mkdir -p "$artifacts"
status=0
failed=()
for fuzzer in "${FUZZERS[@]}"; do
  binary="$BUILD_DIR/tests/fuzz/$fuzzer"
  seeds="tests/fuzz/corpus/${fuzzer%_fuzzer}"
  work="$BUILD_DIR/fuzz-corpus/${fuzzer%_fuzzer}"
  mkdir -p "$work"
  echo "== $fuzzer: ${SECONDS_EACH} s from $seeds"
  # -timeout: one input over 10 s is a hang; -rss_limit_mb: a decompression bomb shows up as an OOM.
  if "$binary" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
       -print_final_stats=1 -artifact_prefix="$artifacts/$fuzzer-" "$work" "$seeds" >"$artifacts/$fuzzer.log" 2>&1; then
    grep -E "^stat::number_of_executed_units|^stat::new_units_added|^#[0-9]+.*DONE" "$artifacts/$fuzzer.log" || true
  else
    status=1
    failed+=("$fuzzer")
    echo "FAILED: $fuzzer (log: $artifacts/$fuzzer.log)" >&2
    tail -n 60 "$artifacts/$fuzzer.log" >&2
  fi
done
if [ "$status" -eq 0 ]; then
  echo "all ${#FUZZERS[@]} fuzzers ran ${SECONDS_EACH} s each without a failure"
else
  echo "fuzzers FAILED: ${failed[*]} (crash inputs in $artifacts/)" >&2
fi
exit "$status"
