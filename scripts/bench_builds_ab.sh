#!/usr/bin/env bash
# Serving A/B of two mita-server builds on one model repository, in one run on this machine. For each build in
# turn (ROUNDS rounds, the order swapped every other round, so that a shared machine's load hits both alike) it
# starts the server, then for each model sends 64 Fashion-MNIST test PNGs with mita-bench --mode=closed:
#   idle       concurrency 1 for LOAD_SECONDS s: the p50 latency, end to end;
#   capacity   concurrency 32 for LOAD_SECONDS + 2 s: answers/s, and the server's CPU time per answer (/proc/PID/stat).
# A model named A+B alternates the requests of models A and B (two lanes at work).
# Usage: scripts/bench_builds_ab.sh BEFORE_SERVER AFTER_SERVER REPOSITORY MODEL... (the servers: mita-server
# launchers, each with its mita-server-core beside it). Environment: ROUNDS (default 2), LOAD_SECONDS (default 4), BUILD
# (mita-bench, mita-client and mita-export-images; default build). The servers start with an environment cleared of
# OMP_WAIT_POLICY and GOMP_SPINCOUNT, so that each launcher sets its own; the line of each result names them.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_server.sh
if [ $# -lt 4 ]; then
  sed -n '2,11p' "$0" >&2
  exit 2
fi
before="$1" after="$2" repository="$3"
shift 3
models=("$@")
BUILD="${BUILD:-build}"
ROUNDS="${ROUNDS:-2}"
LOAD_SECONDS="${LOAD_SECONDS:-4}"
start_bench_work
"$BUILD/tools/mita-export-images" --split=t10k --count=64 --out="$work/images" >/dev/null
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
field() { sed -n "s/.* $1=\([0-9.]*\).*/\1/p" "$2" | head -1; }
echo "uptime at the start: $(uptime)"
for round in $(seq 1 "$ROUNDS"); do
  order=(before after)
  [ $((round % 2)) -eq 0 ] && order=(after before)
  for variant in "${order[@]}"; do
    server="$before"
    [ "$variant" = after ] && server="$after"
    env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT "$server" --model_repository="$repository" --listen=127.0.0.1:0 \
      --metrics_listen= 2> "$work/server.log" &
    server_pid=$!
    port="$(wait_for_server_port "$work/server.log" 1200)"
    if [ -z "$port" ]; then
      echo "the $variant server did not start:" >&2
      tail -5 "$work/server.log" >&2
      exit 1
    fi
    settings="$(tr '\0' '\n' < "/proc/$server_pid/environ" | grep -E '^(OMP_WAIT_POLICY|GOMP_SPINCOUNT)=' \
      | tr '\n' ' ')"
    for model in "${models[@]}"; do
      : > "$work/manifest.csv"
      for image in "$work"/images/t10k-*.png; do
        for one in ${model//+/ }; do echo "image,$image,$one" >> "$work/manifest.csv"; done
      done
      "$BUILD/client/mita-bench" --server="127.0.0.1:$port" --manifest="$work/manifest.csv" --mode=closed \
        --concurrency=1 --requests=0 --duration_s="$LOAD_SECONDS" --warmup_requests=10 --deadlines_ms=60000 \
        > "$work/idle.log"
      ticks_before="$(cpu_ticks "$server_pid")"
      "$BUILD/client/mita-bench" --server="127.0.0.1:$port" --manifest="$work/manifest.csv" --mode=closed \
        --concurrency=32 --requests=0 --duration_s="$((LOAD_SECONDS + 2))" --warmup_requests=32 \
        --deadlines_ms=60000 > "$work/capacity.log"
      ticks_after="$(cpu_ticks "$server_pid")"
      answers="$(field ok "$work/capacity.log")"
      cpu_ms=$(( (ticks_after - ticks_before) * 1000 / $(getconf CLK_TCK) ))
      echo "round $round $variant [${settings% }] $model: idle p50 $(field p50_ms "$work/idle.log") ms;" \
        "capacity $(field ok_throughput "$work/capacity.log")/s; server CPU $cpu_ms ms for ${answers:-?} answers"
    done
    kill -TERM "$server_pid"
    wait "$server_pid" || true
    server_pid=""
  done
done
echo "uptime at the end: $(uptime)"
