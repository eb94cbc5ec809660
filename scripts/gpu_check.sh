#!/usr/bin/env bash
# The GPU run, in one go (issue 16): on the GPU machine, from the root of the working tree that travelled with the
# bundle (scripts/gpu_bundle.sh pack, carried as build-gpu-bundle). That machine has NVIDIA's driver, CUDA 13 and
# python3's torch 2.11 (CUDA 13.0), nothing else of ours; the bundle brings the binaries built here against the
# same torch 2.11.0, the Debian libraries they load, and the main job's inputs (docs/libtorch.md).
#   0. machine, torch and bundle; `gpu_bundle.sh check` (every binary resolves against the machine's torch)
#   1. the CUDA MiTA kernel alone: mita_cuda_check (float32 and bfloat16 against a float64 loop, statistics
#      counts; then timing at N 4K/16K/64K); compute-sanitizer, ncu and a baseline kernel when asked (below)
#   2. unit tests on the GPU: device_test (logits of both models on cuda:0 against the CPU, float32 and bfloat16,
#      mixed budgets in one packed batch; a CUDA out of memory answered and the model working on), kernels_test's
#      MitaCuda (the CUDA dispatch against the CPU kernel)
#   3. mita-server on cpu, then cuda:0 in float32 and in bfloat16, with the embedded models: the main job's
#      requests (200 images at 2 budgets and full attention, the 443 held-out documents at 2 budgets, one ~19K
#      token document at 2 budgets and full attention), classes and scores compared with the CPU server's; the
#      GPU memory series of /metrics; a start on a CUDA device that is not there; a CUDA out of memory (one
#      65,536-token document under --cuda_memory_fraction) answered RESOURCE_EXHAUSTED with the server serving on
#   4. timing on cuda:0, float32 and bfloat16: images/s at batch sizes 1 and 64 (mita-batching-bench), one
#      16K / 32K / 64K-token document at two budgets against full attention (mita-bench-documents)
#   5. GPU memory (nvidia-smi)
# Without a visible GPU (the CPU machine, scripts/test_gpu_bundle.sh) the GPU steps say they are skipped and the
# rest runs (step 0, device_test's CPU tests, the CPU server's requests). Logs and results go to $OUT (default
# build-gpu-check/output); `summary.txt` there has the figures.
# Environment: MITA_GPU_CHECK_SANITIZER=1 (compute-sanitizer memcheck of step 1), MITA_GPU_CHECK_NCU=1 (per-kernel
# times), MITA_GPU_CHECK_SDPA=1 (PyTorch's scaled_dot_product_attention at step 1's sizes, python3 with torch),
# MITA_CUDA_BASELINE=FILE (another kernels/mita_attention_cuda.cu, built with nvcc and timed beside),
# MITA_GPU_CHECK_PLACEMENTS (step 3's servers compared with the CPU one; default cuda:0/float32 cuda:0/bfloat16
# with a GPU, none without), PORT (50391; the metrics on PORT + 1).
# Usage: scripts/gpu_check.sh [BUNDLE]   (default build-gpu-bundle; about 6 minutes on an H200 with 16 cores)
# Exit status: 0 when every step that ran passed, 1 otherwise.
set -u
cd "$(dirname "$0")/.."
repo=$PWD
bundle=$(realpath "${1:-build-gpu-bundle}")
OUT_DIR="${OUT:-$repo/build-gpu-check/output}"
mkdir -p "$OUT_DIR"
PORT=${PORT:-50391}
METRICS_PORT=$((PORT + 1))
data=$bundle/data
status=0
summary=$OUT_DIR/summary.txt
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
fail() { say "FAIL: $*"; status=1; }
# A bundle binary with the bundle's environment (an array, so that timeout and & see the process itself: the
# script execs the binary, so $! of `"${run[@]}" mita-server ... &` is the server's pid).
run=("$repo/scripts/gpu_bundle.sh" run "$bundle")
export MITA_SOURCE_DIR=$repo MITA_FASHION_MNIST_DIR=$data/fashion-mnist

echo "== 0. machine, torch, bundle"
gpu=0
if command -v nvidia-smi > /dev/null &&
   nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT_DIR/nvidia-smi.txt" 2>&1; then
  cat "$OUT_DIR/nvidia-smi.txt"
  [ "$(wc -l < "$OUT_DIR/nvidia-smi.txt")" -ge 2 ] && gpu=1
fi
[ $gpu = 1 ] || say "no GPU visible (nvidia-smi): the GPU steps are skipped"
cat "$bundle/MANIFEST"
if ! "$repo/scripts/gpu_bundle.sh" check "$bundle" > "$OUT_DIR/bundle-check.txt" 2>&1; then
  cat "$OUT_DIR/bundle-check.txt"; fail "bundle check"; exit 1
fi
grep -E "^torch libraries|resolved|UNRESOLVED" "$OUT_DIR/bundle-check.txt" | head -3

echo "== 1. the CUDA MiTA kernel alone (mita_cuda_check)"
if [ $gpu = 1 ]; then
  timeout 300 "$bundle/bin/mita_cuda_check" > "$OUT_DIR/mita_cuda_check.txt" 2>&1
  rc=$?
  grep -E "^(float32|bfloat16|correctness|\|)" "$OUT_DIR/mita_cuda_check.txt"
  [ $rc = 0 ] && say "mita_cuda_check: PASS" || fail "mita_cuda_check exit status $rc"
  if [ "${MITA_GPU_CHECK_SANITIZER:-0}" = 1 ] && command -v compute-sanitizer > /dev/null; then
    timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 "$bundle/bin/mita_cuda_check" --no_time \
      > "$OUT_DIR/compute_sanitizer.txt" 2>&1
    rc=$?; tail -2 "$OUT_DIR/compute_sanitizer.txt"
    [ $rc = 0 ] && say "compute-sanitizer memcheck: PASS" || fail "compute-sanitizer exit status $rc"
  fi
  if [ "${MITA_GPU_CHECK_NCU:-0}" = 1 ] && command -v ncu > /dev/null; then
    timeout 240 ncu --metrics gpu__time_duration.sum --print-units base --csv "$bundle/bin/mita_cuda_check" \
      --profile > "$OUT_DIR/ncu_kernels.csv" 2> "$OUT_DIR/ncu_stderr.txt"
    echo "ncu exit status $? (per-kernel times in ncu_kernels.csv)"
  fi
  if [ -n "${MITA_CUDA_BASELINE:-}" ] && command -v nvcc > /dev/null; then
    nvcc -std=c++17 -O3 -arch=sm_90 -I. "$MITA_CUDA_BASELINE" tests/cuda/mita_cuda_check.cc \
      -o "$OUT_DIR/mita_cuda_check_baseline" > "$OUT_DIR/nvcc_baseline.log" 2>&1 &&
      timeout 300 "$OUT_DIR/mita_cuda_check_baseline" 2>&1 | tee "$OUT_DIR/baseline_check.txt" | grep -E "^\||correctness"
  fi
  if [ "${MITA_GPU_CHECK_SDPA:-0}" = 1 ]; then
    timeout 240 python3 scripts/gpu_attention_baseline.py 2>&1 | tee "$OUT_DIR/attention_baseline.txt"
  fi
else
  say "step 1 skipped: no GPU"
fi

echo "== 2. unit tests (device_test; kernels_test MitaCuda)"
# ServerStartTest starts the build's own mita-server path (not in the bundle); step 3 does that here.
timeout 600 "${run[@]}" device_test --gtest_filter='-ServerStartTest.*' > "$OUT_DIR/device_test.txt" 2>&1
rc=$?
grep -E "^\[  FAILED  \] [A-Z]|items: largest|: Failure$" "$OUT_DIR/device_test.txt" | head -40
tests_line() {  # FILE: "N passed, M skipped" from a GoogleTest log
  echo "$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\{0,1\}\./\1/p' "$1") passed," \
       "$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}, listed below:/\1/p' "$1" | head -1) skipped"
}
[ $rc = 0 ] && say "device_test: $(tests_line "$OUT_DIR/device_test.txt")" || fail "device_test exit status $rc"
grep "items: largest" "$OUT_DIR/device_test.txt" >> "$summary"
timeout 300 "${run[@]}" kernels_test --gtest_filter='MitaCuda.*' > "$OUT_DIR/kernels_test.txt" 2>&1
rc=$?
[ $rc = 0 ] && say "kernels_test MitaCuda.*: $(tests_line "$OUT_DIR/kernels_test.txt")" ||
  fail "kernels_test MitaCuda exit status $rc"

echo "== 3. mita-server: the main job's requests on cpu and cuda:0"
client() { "${run[@]}" mita-client --server="127.0.0.1:$PORT" "$@"; }
server=
start_server() {  # NAME FLAGS...: starts mita-server from the bundle and waits until it answers ListModels
  local name=$1; shift
  if client --list > /dev/null 2>&1; then echo "port $PORT is taken by another server (set PORT)"; return 1; fi
  "${run[@]}" mita-server --listen="127.0.0.1:$PORT" --metrics_listen="127.0.0.1:$METRICS_PORT" \
    --model_repository="$repo/models/repository" --max_batch_size=64 --max_queue_delay_ms=2 "$@" \
    > "$OUT_DIR/server-$name.log" 2>&1 &
  server=$!
  for _ in $(seq 1 240); do
    grep -q "serving gRPC" "$OUT_DIR/server-$name.log" && client --list > "$OUT_DIR/models-$name.txt" 2>/dev/null &&
      return 0
    kill -0 "$server" 2>/dev/null || break
    sleep 0.5
  done
  cat "$OUT_DIR/server-$name.log"; return 1
}
stop_server() {
  kill -TERM "$server" 2>/dev/null; wait "$server"; local rc=$?; server=
  [ $rc = 0 ] || fail "server exit status $rc"
}
trap '[ -n "$server" ] && kill "$server" 2>/dev/null' EXIT
scrape() {  # FILE: the server's /metrics
  exec 3<>"/dev/tcp/127.0.0.1/$METRICS_PORT" && printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3 && cat <&3 > "$1"
  exec 3>&-
}
main_job() {  # NAME: the main job's requests, one output file per request set
  local name=$1 images=(--model=fashion-mnist-vit --manifest="$data/images/manifest.csv" --concurrency=16)
  local documents=(--model=linux-doc-mita --manifest="$data/heldout.csv" --concurrency=4 --truncate
                   --deadline_ms=120000)
  client "${images[@]}" --preset=fast > "$OUT_DIR/$name-images-fast.txt" 2>&1
  client "${images[@]}" --expert_count=9 --expert_width=16 > "$OUT_DIR/$name-images-9x16.txt" 2>&1
  client "${images[@]}" --full_attention > "$OUT_DIR/$name-images-full.txt" 2>&1
  client "${documents[@]}" > "$OUT_DIR/$name-documents-default.txt" 2>&1
  client "${documents[@]}" --preset=fast > "$OUT_DIR/$name-documents-fast.txt" 2>&1
  for budget in default fast full; do
    local flags=(--truncate --top_n=3 --deadline_ms=600000)
    [ $budget = fast ] && flags+=(--preset=fast)
    [ $budget = full ] && flags+=(--full_attention)
    client --model=linux-doc-mita "${flags[@]}" "$data/long.txt" > "$OUT_DIR/$name-long-$budget.txt" 2>&1
  done
  local file
  for file in "$OUT_DIR/$name"-{images-fast,images-9x16,images-full,documents-default,documents-fast,long-default,long-fast,long-full}.txt; do
    local summary_line
    summary_line=$(grep -E "^(images|documents): [0-9]+ \(|accuracy|throughput" "$file" | tr '\n' ' ')
    [ -n "$summary_line" ] && echo "  $(basename "$file" .txt): $summary_line"
    grep -q "FAILED" "$file" && fail "$(basename "$file"): $(grep -m1 FAILED "$file")"
  done
  grep -h -A1 "long.txt: model" "$OUT_DIR/$name"-long-*.txt | grep -E "tokens|compute" | sed 's/^/  /'
  return 0
}
compare() {  # REFERENCE NAME KIND: classes and scores of NAME's outputs against REFERENCE's
  python3 - "$OUT_DIR" "$1" "$2" "$3" <<'PYTHON' | tee -a "$summary"
import os, re, sys
out, reference, name, kind = sys.argv[1:]
head = re.compile(r"^(\S.*?): model \S+ version \d+, .*, (\d+) tokens")
score = re.compile(r"^\s+([0-9.]+)\s+.* \((\d+)\)$")
def read(path):
    answers, current = {}, None
    for line in open(path, encoding="utf-8", errors="replace"):
        m = head.match(line)
        if m:
            current = answers.setdefault(m.group(1), [])
            continue
        m = score.match(line)
        if m and current is not None:
            current.append((int(m.group(2)), float(m.group(1))))
    return answers
# The bounds: float32 on the GPU differs from the CPU by float32 rounding (a routing near-tie may move one
# answer), so 99.5% the same top class and every top-5 softmax score within 0.02; bfloat16 carries 8 significant
# bits, so 97% the same top class and a mean score difference within 0.01 (its largest is printed).
agree_needed, score_bound, mean_bound = (0.995, 0.02, 1.0) if kind == "float32" else (0.97, 1.0, 0.01)
failed = False
for requests in ("images-fast", "images-9x16", "images-full", "documents-default", "documents-fast",
                 "long-default", "long-fast", "long-full"):
    suffix = f"-{requests}.txt"
    path, other = os.path.join(out, reference + suffix), os.path.join(out, name + suffix)
    expected, found = read(path), read(other) if os.path.exists(other) else {}
    keys = [k for k in expected if expected[k] and found.get(k)]
    if not keys:
        print(f"{name}{suffix}: nothing to compare"); failed = True; continue
    same = sum(expected[k][0][0] == found[k][0][0] for k in keys)
    differences = []
    for k in keys:
        mine = dict(found[k])
        differences += [abs(p - mine[c]) for c, p in expected[k] if c in mine]
    largest = max(differences) if differences else 0.0
    mean = sum(differences) / max(1, len(differences))
    ok = (same >= agree_needed * len(keys) and largest <= score_bound and mean <= mean_bound and
          len(keys) == len(expected))
    failed |= not ok
    print(f"{name}{suffix[:-4]} vs {reference}: {len(keys)}/{len(expected)} inputs answered, top class the same "
          f"for {same}, largest |score difference| {largest:.4f}, mean {mean:.5f}: {'PASS' if ok else 'FAIL'}")
sys.exit(1 if failed else 0)
PYTHON
}
if start_server cpu --device=cpu; then
  main_job cpu
  stop_server
else
  fail "the CPU server did not start"
fi
# The placements compared with the CPU server: DEVICE/DTYPE words (MITA_GPU_CHECK_PLACEMENTS; e.g. cpu/float32
# on a machine without a GPU, to run the comparison itself).
placements=${MITA_GPU_CHECK_PLACEMENTS:-}
[ -z "$placements" ] && [ $gpu = 1 ] && placements="cuda:0/float32 cuda:0/bfloat16"
for placement in $placements; do
  device=${placement%/*} dtype=${placement#*/} name="${placement%/*}-${placement#*/}"
  name=${name//:/}
  if start_server "$name" --device="$device" --weights_dtype="$dtype"; then
    grep -v '^ ' "$OUT_DIR/models-$name.txt"
    main_job "$name"
    scrape "$OUT_DIR/metrics-$name.txt"
    if [[ $device == cuda:* ]]; then
      grep -E "^mita_gpu_memory_(allocated|reserved)_bytes" "$OUT_DIR/metrics-$name.txt" | sed 's/^/  /' |
        tee -a "$summary"
      grep -q "^mita_gpu_memory_reserved_bytes{device=\"$device\"}" "$OUT_DIR/metrics-$name.txt" ||
        fail "no GPU memory series for $device in /metrics"
    fi
    stop_server
    compare cpu "$name" "$dtype" || fail "$device $dtype answers differ from the CPU server's"
  else
    fail "the $device $dtype server did not start"
  fi
done
if [ $gpu = 1 ]; then
  # A device that is not there: exit status 1 and the flag named.
  count=$(($(wc -l < "$OUT_DIR/nvidia-smi.txt") - 1))
  "${run[@]}" mita-server --model_repository="$repo/models/repository" --listen=127.0.0.1:0 --metrics_listen= \
    --device="cuda:$count" > "$OUT_DIR/server-invisible.log" 2>&1
  rc=$?
  if [ $rc = 1 ] && grep -q "flag --device: cuda:$count: only $count CUDA device" "$OUT_DIR/server-invisible.log"; then
    say "--device=cuda:$count: start-up error as expected: $(grep -o 'error: .*' "$OUT_DIR/server-invisible.log")"
  else
    fail "--device=cuda:$count: exit status $rc, $(tail -1 "$OUT_DIR/server-invisible.log")"
  fi
  # Out of memory on the device: 160 MiB for LibTorch's allocator; one 65,536-token document at m = 256, k = 1024
  # needs more (routing scores alone 128 MiB), an image far less.
  total_mib=$(sed -n 2p "$OUT_DIR/nvidia-smi.txt" | awk -F', ' '{print $3 + 0}')
  fraction=$(awk -v t="$total_mib" 'BEGIN {printf "%.6f", 160 / t}')
  awk 'BEGIN {for (i = 0; i < 65536; ++i) printf "%d\n", (i * 31) % 4096}' > "$OUT_DIR/ids-65536.txt"
  if start_server oom --device=cuda:0 --cuda_memory_fraction="$fraction"; then
    client --model=fashion-mnist-vit "$data/images/t10k-00000.png" > "$OUT_DIR/oom-before.txt" 2>&1
    client --model=linux-doc-mita --input=token_ids --expert_count=256 --expert_width=1024 \
      "$OUT_DIR/ids-65536.txt" > "$OUT_DIR/oom-document.txt" 2>&1
    client --model=fashion-mnist-vit "$data/images/t10k-00000.png" > "$OUT_DIR/oom-after.txt" 2>&1
    rc=$?
    if grep -q "FAILED RESOURCE_EXHAUSTED: model 'linux-doc-mita' ran out of memory on cuda:0" "$OUT_DIR/oom-document.txt" &&
       [ $rc = 0 ]; then
      say "out of memory (--cuda_memory_fraction=$fraction): $(grep -o 'RESOURCE_EXHAUSTED: .\{0,160\}' "$OUT_DIR/oom-document.txt"); the next image: OK"
    else
      fail "out of memory: $(head -c 400 "$OUT_DIR/oom-document.txt"); next image exit status $rc"
    fi
    stop_server
  fi
else
  say "step 3 on cuda:0 skipped: no GPU"
fi

echo "== 4. timing on cuda:0"
if [ $gpu = 1 ]; then
  for dtype in float32 bfloat16; do
    timeout 300 "${run[@]}" mita-batching-bench --model="$repo/models/repository/fashion-mnist-vit" --device=cuda:0 \
      --weights_dtype="$dtype" --batch_sizes=1,64 --benchmark_repetitions=3 --benchmark_min_time=0.3 \
      > "$OUT_DIR/batching-$dtype.txt" 2>&1 || fail "mita-batching-bench $dtype"
    # "per image, median of 3 repetitions: forward A us at batch size 1, B us at 64; ..." -> images/s
    sed -n 's/^per image, median.*forward \([0-9.]*\) us at batch size \([0-9]*\), \([0-9.]*\) us at \([0-9]*\);.*/\1 \2 \3 \4/p' \
      "$OUT_DIR/batching-$dtype.txt" | while read -r small small_size large large_size; do
      awk -v d="$dtype" -v a="$small" -v n="$small_size" -v b="$large" -v m="$large_size" 'BEGIN {
        printf "images/s on cuda:0 (%s, the model forward, budget 9x16): %.0f at batch size %s, %.0f at %s\n",
               d, 1e6 / a, n, 1e6 / b, m }'
    done | tee -a "$summary"
    timeout 600 "${run[@]}" mita-bench-documents --model="$repo/models/repository/linux-doc-mita" --corpus="$data/corpus" \
      --device=cuda:0 --weights_dtype="$dtype" --tokens=16384,32768,65536 --budgets=16x64,64x256 --repeats=5 \
      --full_repeats=3 > "$OUT_DIR/documents-$dtype.txt" 2> "$OUT_DIR/documents-$dtype.log" ||
      fail "mita-bench-documents $dtype: $(tail -2 "$OUT_DIR/documents-$dtype.log")"
    { echo "one document on cuda:0 ($dtype):"; grep -E "^\|" "$OUT_DIR/documents-$dtype.txt"; } | tee -a "$summary"
  done
else
  say "step 4 skipped: no GPU"
fi

echo "== 5. GPU memory"
if [ $gpu = 1 ]; then
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee -a "$summary"
else
  say "step 5 skipped: no GPU"
fi
say "== gpu_check status $status"
exit $status
