#!/usr/bin/env bash
# Server threads, CPU and latency under many concurrent calls (the gRPC API's cost per waiting call):
#   1. closed loop at concurrency 16 and 256: throughput and p99 (mita-bench);
#   2. 1,000 calls in flight at once (closed loop, queue large enough to hold them): the server's thread count
#      (sampled from /proc/PID/status every 0.2 s, maximum reported) and its CPU time (utime + stime from
#      /proc/PID/stat) per answered call.
# Each server binary given runs the same loads; with two binaries the rounds alternate (A B A B ...), so the
# load of a shared machine hits both alike.
# Usage: scripts/bench_concurrency.sh [SERVER_BINARY ...]   (default build/server/mita-server; mita-bench and
# mita-export-images from BUILD, default build/). Environment: ROUNDS (default 2), REQUESTS (calls per load,
# default 2000), IN_FLIGHT (default 1000).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_server.sh
BUILD="${BUILD:-build}"
ROUNDS="${ROUNDS:-2}"
REQUESTS="${REQUESTS:-2000}"
IN_FLIGHT="${IN_FLIGHT:-1000}"
servers=("$@")
[ ${#servers[@]} -gt 0 ] || servers=("$BUILD/server/mita-server")
export OMP_WAIT_POLICY=passive
start_bench_work

"$BUILD/tools/mita-export-images" --split=t10k --count=200 --out="$work/images" >/dev/null
sed 's/^\([^,]*\),.*/image,\1/' "$work/images/manifest.csv" > "$work/inputs.csv"

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
threads() { awk '/^Threads:/ {print $2}' "/proc/$1/status"; }

run_server() {
  local binary="$1" label="$2"
  "$binary" --model_repository=models/repository --listen=127.0.0.1:0 --metrics_listen= \
    --queue_capacity=$((IN_FLIGHT * 2)) --max_batch_size=16 2> "$work/server.log" &
  server_pid=$!
  local port
  port="$(wait_for_server_port "$work/server.log" 1200)"
  [ -n "$port" ] || { echo "server did not start:"; cat "$work/server.log"; exit 1; }
  local bench=("$BUILD/client/mita-bench" --server="127.0.0.1:$port" --manifest="$work/inputs.csv"
               --deadlines_ms=0 --warmup_requests=50)
  echo "== $label: idle server threads $(threads "$server_pid")"
  for concurrency in 16 256; do
    "${bench[@]}" --concurrency="$concurrency" --requests="$REQUESTS" --label="$label-c$concurrency" |
      grep '^RESULT'
  done
  # 1,000 in flight: sample the thread count while the load runs.
  local start_ticks max_threads=0 sampler
  start_ticks="$(cpu_ticks "$server_pid")"
  ( while kill -0 "$server_pid" 2>/dev/null; do threads "$server_pid"; sleep 0.2; done ) > "$work/threads.txt" &
  sampler=$!
  "${bench[@]}" --concurrency="$IN_FLIGHT" --requests="$((IN_FLIGHT * 4))" --label="$label-c$IN_FLIGHT" |
    grep '^RESULT'
  kill "$sampler" 2>/dev/null || true; wait "$sampler" 2>/dev/null || true
  local ticks=$(( $(cpu_ticks "$server_pid") - start_ticks ))
  max_threads="$(sort -n "$work/threads.txt" | tail -1)"
  local hz; hz="$(getconf CLK_TCK)"
  echo "== $label: $IN_FLIGHT in flight: max server threads $max_threads, server CPU $(awk -v t="$ticks" -v hz="$hz" \
    'BEGIN {printf "%.2f", t / hz}') s for $((IN_FLIGHT * 4 + 50)) calls, threads after the load $(threads "$server_pid")"
  kill -TERM "$server_pid"; wait "$server_pid" || true
  server_pid=""
}

echo "machine: $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$ROUNDS"); do
  for i in "${!servers[@]}"; do
    run_server "${servers[$i]}" "server$((i + 1))-round$round"
  done
done
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
