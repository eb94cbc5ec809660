#!/usr/bin/env bash
# Serving benchmark with mita-bench, in one run on this machine:
#   1. dynamic batching vs. max batch size 1: the same closed-loop load (concurrency 16, a mix of budgets) on a
#      server with --max_batch_size=16 and on one with --max_batch_size=1; prints the throughput ratio.
#   2. soak: >= 20,000 requests (mixed budgets and deadlines) on one server while sampling its resident memory
#      (VmRSS); prints the growth.
#   3. a short open-loop run (fixed arrival rate) on the same server.
# Usage: scripts/bench_serving.sh [BUILD_DIR]   (default build/; needs mita-server, mita-bench and
# mita-export-images built). Environment: REQUESTS (ratio runs, default 3000), SOAK_REQUESTS (default 20000),
# OPEN_RATE (default 300/s), OPEN_SECONDS (default 10).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD="${1:-build}"
REQUESTS="${REQUESTS:-3000}"
SOAK_REQUESTS="${SOAK_REQUESTS:-20000}"
OPEN_RATE="${OPEN_RATE:-300}"
OPEN_SECONDS="${OPEN_SECONDS:-10}"
export OMP_WAIT_POLICY=passive
work="$(mktemp -d)"
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then kill -TERM "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

"$BUILD/tools/mita-export-images" --split=t10k --count=200 --out="$work/images" >/dev/null
# The bench manifest: "kind,path[,model]" lines (documents can join once a document model exists).
sed 's/^\([^,]*\),.*/image,\1/' "$work/images/manifest.csv" > "$work/inputs.csv"

# Starts mita-server with the given flags; sets server_pid and port.
start_server() {
  "$BUILD/server/mita-server" --model_repository=models/repository --listen=127.0.0.1:0 --metrics_listen= "$@" \
    2> "$work/server.log" &
  server_pid=$!
  for _ in $(seq 1 600); do
    port="$(sed -n 's/.*serving gRPC.* (port \([0-9]*\);.*/\1/p' "$work/server.log")"
    [ -n "$port" ] && return 0
    sleep 0.1
  done
  echo "server did not start:"; cat "$work/server.log"; exit 1
}
stop_server() {
  kill -TERM "$server_pid"; wait "$server_pid"; server_pid=""
  tail -n 1 "$work/server.log"
}
bench() {
  "$BUILD/client/mita-bench" --server="127.0.0.1:$port" --manifest="$work/inputs.csv" "$@"
}

BUDGETS="default,fast,accurate,9x16"
echo "== 1. dynamic batching vs. max batch size 1 (closed loop, concurrency 16, $REQUESTS requests each)"
declare -A throughput
for batch in 16 1; do
  start_server --max_batch_size="$batch" --max_queue_delay_ms=2
  bench --mode=closed --concurrency=16 --requests="$REQUESTS" --warmup_requests=200 --budgets="$BUDGETS" \
    --label="max_batch_size=$batch" | tee "$work/bench_$batch.txt"
  throughput[$batch]="$(sed -n 's/^RESULT .* ok_throughput=\([0-9.]*\) .*/\1/p' "$work/bench_$batch.txt")"
  stop_server
done
awk -v a="${throughput[16]}" -v b="${throughput[1]}" \
  'BEGIN { printf "batching ratio: %.1f / %.1f OK/s = %.2fx\n", a, b, a / b }'

echo "== 2. soak: $SOAK_REQUESTS requests, mixed budgets and deadlines, resident memory of the server"
start_server --max_batch_size=16 --max_queue_delay_ms=2
bench --mode=closed --concurrency=16 --requests="$SOAK_REQUESTS" --warmup_requests=500 \
  --budgets="$BUDGETS,full" --deadlines_ms=50,1000,10000 --server_pid="$server_pid" --rss_interval_s=1 --label=soak

echo "== 3. open loop: $OPEN_RATE requests/s for $OPEN_SECONDS s"
bench --mode=open --rate="$OPEN_RATE" --requests=0 --duration_s="$OPEN_SECONDS" --warmup_requests=100 \
  --budgets="$BUDGETS" --deadlines_ms=100,1000 --server_pid="$server_pid" --label=open
stop_server
