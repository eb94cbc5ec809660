#!/usr/bin/env bash
# Serving benchmark with mita-bench, in one run on this machine:
#   1. dynamic batching vs. max batch size 1: the same closed-loop load (concurrency 16, a mix of budgets) on a
#      server with --max_batch_size=16 and on one with --max_batch_size=1 (both started, benchmarked in turn,
#      ROUNDS rounds alternating, so that the load of a shared machine hits both alike); prints each round's
#      throughput ratio and their median.
#   2. soak: >= 20,000 requests (mixed budgets and deadlines) on one server while sampling its resident memory
#      (VmRSS); prints the growth.
#   3. a short open-loop run (fixed arrival rate) on the same server.
# Usage: scripts/bench_serving.sh [BUILD_DIR]   (default build/; needs mita-server, mita-bench and
# mita-export-images built). Environment: REQUESTS (each ratio run, default 2000), ROUNDS (default 3),
# SOAK_REQUESTS (default 20000), OPEN_RATE (default 200/s), OPEN_SECONDS (default 10).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_server.sh
BUILD="${1:-build}"
REQUESTS="${REQUESTS:-2000}"
ROUNDS="${ROUNDS:-3}"
TORCH_THREADS="${TORCH_THREADS:-1}"
SOAK_REQUESTS="${SOAK_REQUESTS:-20000}"
OPEN_RATE="${OPEN_RATE:-200}"
OPEN_SECONDS="${OPEN_SECONDS:-10}"
export OMP_WAIT_POLICY=passive
work="$(mktemp -d)"
server_pid=""
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

"$BUILD/tools/mita-export-images" --split=t10k --count=200 --out="$work/images" >/dev/null
# The bench manifest: "kind,path[,model]" lines (documents can join once a document model exists).
sed 's/^\([^,]*\),.*/image,\1/' "$work/images/manifest.csv" > "$work/inputs.csv"

# start_server NAME FLAGS...: starts mita-server (log $work/NAME.log); sets server_pid and port.
start_server() {
  local name="$1"; shift
  "$BUILD/server/mita-server" --model_repository=models/repository --listen=127.0.0.1:0 --metrics_listen= "$@" \
    2> "$work/$name.log" &
  server_pid=$!
  pids+=("$server_pid")
  port="$(wait_for_server_port "$work/$name.log" 1200)"
  [ -n "$port" ] && return 0
  echo "server did not start:"; cat "$work/$name.log"; exit 1
}
# stop_server PID NAME: SIGTERM, wait, print its last log line (the drain summary).
stop_server() {
  kill -TERM "$1"; wait "$1" || true
  tail -n 1 "$work/$2.log"
}
# bench PORT FLAGS...
bench() {
  local port="$1"; shift
  "$BUILD/client/mita-bench" --server="127.0.0.1:$port" --manifest="$work/inputs.csv" "$@"
}

BUDGETS="default,fast,accurate,9x16"
echo "== 1. dynamic batching vs. max batch size 1 (closed loop, concurrency 16, $REQUESTS requests per run, $ROUNDS rounds)"
start_server batch16 --max_batch_size=16 --max_queue_delay_ms=2 --torch_threads="$TORCH_THREADS"; pid16=$server_pid; port16=$port
start_server batch1 --max_batch_size=1 --max_queue_delay_ms=2 --torch_threads="$TORCH_THREADS"; pid1=$server_pid; port1=$port
ratios=()
for round in $(seq 1 "$ROUNDS"); do
  for batch in 16 1; do
    port_var="port$batch"
    bench "${!port_var}" --mode=closed --concurrency=16 --requests="$REQUESTS" --warmup_requests=200 \
      --budgets="$BUDGETS" --seed="$round" --label="round$round max_batch_size=$batch" | tee "$work/bench_$batch.txt"
  done
  a="$(sed -n 's/^RESULT .* ok_throughput=\([0-9.]*\) .*/\1/p' "$work/bench_16.txt")"
  b="$(sed -n 's/^RESULT .* ok_throughput=\([0-9.]*\) .*/\1/p' "$work/bench_1.txt")"
  ratio="$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", a / b }')"
  echo "round $round: batching ratio $a / $b OK/s = ${ratio}x"
  ratios+=("$ratio")
done
echo "batching ratios: ${ratios[*]}; median $(printf '%s\n' "${ratios[@]}" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')x"
stop_server "$pid16" batch16
stop_server "$pid1" batch1

echo "== 2. soak: $SOAK_REQUESTS requests, mixed budgets and deadlines, resident memory of the server"
start_server soak --max_batch_size=16 --max_queue_delay_ms=2 --torch_threads="$TORCH_THREADS"
bench "$port" --mode=closed --concurrency=16 --requests="$SOAK_REQUESTS" --warmup_requests=500 \
  --budgets="$BUDGETS,full" --deadlines_ms=50,1000,10000 --server_pid="$server_pid" --rss_interval_s=1 --label=soak

echo "== 3. open loop: $OPEN_RATE requests/s for $OPEN_SECONDS s"
bench "$port" --mode=open --rate="$OPEN_RATE" --requests=0 --duration_s="$OPEN_SECONDS" --warmup_requests=100 \
  --budgets="$BUDGETS" --deadlines_ms=100,1000 --server_pid="$server_pid" --label=open
stop_server "$server_pid" soak
pids=()
