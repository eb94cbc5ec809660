#!/usr/bin/env bash
# GPU correctness and timing check of the CUDA MiTA kernel, for a machine with an NVIDIA GPU (sm_90 by default;
# set CUDA_ARCHITECTURES=... for another). Prints everything; copies the logs to $OUT (or build-gpu-check/output).
#   1. builds tests/cuda/mita_cuda_check.cc + kernels/mita_attention_cuda.cu with nvcc alone (no torch) and runs
#      it: float32 and bfloat16 against a float64 loop on odd N, k = N, m = 1, mixed items, ties, fused qkv;
#      then timing at N 4K/16K/64K, H 8, d 64;
#   2. when python3 has torch: configures tests/cuda/CMakeLists.txt (kernels + kernels_test) against that
#      PyTorch (torch.utils.cmake_prefix_path) and runs kernels_test, whose MitaCuda tests compare the CUDA
#      dispatch of MitaAttentionForward with the CPU kernel on CUDA tensors. Skipped (said so) when torch,
#      Abseil or GoogleTest is missing there.
#   1b. compute-sanitizer memcheck over step 1's correctness cases (out-of-bounds and misaligned accesses);
#   1c. when ncu exists: per-kernel GPU times of one configuration (bfloat16, N 64K, m = k = 64);
#   1d. when MITA_CUDA_BASELINE names another version of kernels/mita_attention_cuda.cu: the same check and
#      timing built from it, for a before/after comparison in one run;
#   3. when python3 has torch: full attention (scaled_dot_product_attention) at step 1's timing sizes, the
#      same-run baseline for the MiTA times (scripts/gpu_attention_baseline.py).
# Usage: scripts/gpu_check.sh    (from the repository root; about 2-5 minutes on 16 cores)
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/build-gpu-check/output}"
mkdir -p "$OUT_DIR"
ARCH="${CUDA_ARCHITECTURES:-90}"
NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
status=0

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT_DIR/nvidia-smi.txt"
if [ -z "$NVCC" ]; then echo "no nvcc found: cannot build"; exit 1; fi
"$NVCC" --version | tail -2

echo "== 1. standalone check (nvcc, no torch)"
BUILD=build-gpu-check
mkdir -p "$BUILD"
if "$NVCC" -std=c++17 -O3 -arch="sm_$ARCH" -I. kernels/mita_attention_cuda.cu tests/cuda/mita_cuda_check.cc \
     -o "$BUILD/mita_cuda_check" 2>&1 | tee "$OUT_DIR/nvcc.log"; then
  timeout 300 "$BUILD/mita_cuda_check" 2>&1 | tee "$OUT_DIR/mita_cuda_check.txt"
  rc=${PIPESTATUS[0]}
  echo "mita_cuda_check exit status $rc"
  [ "$rc" -ne 0 ] && status=1
else
  echo "nvcc build failed"; status=1
fi

echo "== 1b. compute-sanitizer memcheck of the correctness cases (no timing)"
SANITIZER="$(command -v compute-sanitizer || true)"
[ -z "$SANITIZER" ] && [ -x "$(dirname "$NVCC")/compute-sanitizer" ] && SANITIZER="$(dirname "$NVCC")/compute-sanitizer"
if [ -n "$SANITIZER" ] && [ -x "$BUILD/mita_cuda_check" ]; then
  timeout 240 "$SANITIZER" --tool memcheck --error-exitcode 3 "$BUILD/mita_cuda_check" --no_time 2>&1 \
    | tee "$OUT_DIR/compute_sanitizer.txt" | tail -4
  rc=${PIPESTATUS[0]}
  echo "compute-sanitizer exit status $rc"
  [ "$rc" -ne 0 ] && status=1
else
  echo "compute-sanitizer or the check binary missing: step 1b skipped"
fi

echo "== 1c. per-kernel times under ncu (bfloat16, N 64K, H 8, d 64, m = k = 64)"
NCU="$(command -v ncu || true)"
if [ -n "$NCU" ] && [ -x "$BUILD/mita_cuda_check" ]; then
  timeout 240 "$NCU" --metrics gpu__time_duration.sum --print-units base --csv "$BUILD/mita_cuda_check" --profile \
    > "$OUT_DIR/ncu_kernels.csv" 2> "$OUT_DIR/ncu_stderr.txt"
  echo "ncu exit status $?"
  python3 - "$OUT_DIR/ncu_kernels.csv" <<'PY'
import collections, csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: sys.exit("no ncu rows")
header, data = rows[0], rows[1:]
name, value = header.index("Kernel Name"), header.index("Metric Value")
times = collections.defaultdict(list)
for r in data:
    kernel = re.findall(r"\w+Kernel", r[name])
    times[kernel[0] if kernel else r[name][:60]].append(float(r[value].replace(",", "")))
print("| kernel | launches | median (us) |\n|---|---:|---:|")
for kernel, values in times.items():
    values.sort()
    print(f"| {kernel} | {len(values)} | {values[len(values) // 2] / 1000:.1f} |")  # ns -> us
PY
else
  echo "ncu or the check binary missing: step 1c skipped"
fi

if [ -n "${MITA_CUDA_BASELINE:-}" ]; then
  echo "== 1d. baseline kernel $MITA_CUDA_BASELINE: the same check and timing, for a same-run comparison"
  if "$NVCC" -std=c++17 -O3 -arch="sm_$ARCH" -I. "$MITA_CUDA_BASELINE" tests/cuda/mita_cuda_check.cc \
       -o "$BUILD/mita_cuda_check_baseline" > "$OUT_DIR/nvcc_baseline.log" 2>&1; then
    timeout 300 "$BUILD/mita_cuda_check_baseline" 2>&1 | tee "$OUT_DIR/baseline_check.txt" | grep -E "^\||correctness"
  else
    echo "baseline build failed"; tail -5 "$OUT_DIR/nvcc_baseline.log"
  fi
fi

echo "== 2. kernels_test against this machine's PyTorch"
TORCH_PREFIX="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)"
if [ -z "$TORCH_PREFIX" ]; then
  echo "python3 has no torch: step 2 skipped"
else
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
  if cmake -S tests/cuda -B "$BUILD/cmake" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
       -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" > "$OUT_DIR/cmake-configure.log" 2>&1; then
    if cmake --build "$BUILD/cmake" -j"$(nproc)" > "$OUT_DIR/cmake-build.log" 2>&1; then
      "$BUILD/cmake/kernels_test" 2>&1 | tee "$OUT_DIR/kernels_test.txt" | grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|MitaCuda"
      rc=${PIPESTATUS[0]}
      echo "kernels_test exit status $rc"
      [ "$rc" -ne 0 ] && status=1
    else
      echo "build against PyTorch failed (last lines):"; tail -20 "$OUT_DIR/cmake-build.log"; status=1
    fi
  else
    echo "configure against PyTorch failed, step 2 skipped (last lines; Abseil/GoogleTest/BLAS missing?):"
    tail -8 "$OUT_DIR/cmake-configure.log"
  fi
fi
echo "== 3. full-attention baseline (PyTorch scaled_dot_product_attention, same sizes as step 1's timing)"
if [ -n "$TORCH_PREFIX" ]; then
  timeout 240 python3 scripts/gpu_attention_baseline.py 2>&1 | tee "$OUT_DIR/attention_baseline.txt"
  echo "baseline exit status ${PIPESTATUS[0]}"
else
  echo "python3 has no torch: step 3 skipped"
fi
echo "== gpu_check status $status"
exit $status
