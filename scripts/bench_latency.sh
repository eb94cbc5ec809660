#!/usr/bin/env bash
# Latency targets under load (issue 18): goodput, deadline misses, rejections and the applied budget of three
# policies at 0.5x, 1x, 2x and 4x the measured capacity, for images (fashion-mnist-vit) and documents
# (DOCUMENT_MODEL, default linux-doc-mita). Per kind:
#   1. mita-server serving that kind's model alone, with --deadline_admission=false (its cost model calibrated
#      at start-up and saved; the second server loads the same profile); the idle p50 (closed loop, concurrency 1) and the capacity
#      (closed loop, concurrency CAPACITY_CONCURRENCY, answers/s) at the default budget; the deadline of every
#      later call is DEADLINE_FACTOR x that idle p50 (rounded up to a ms);
#   2. open loop, Poisson arrivals at each load x capacity for SECONDS_EACH s, each call with that deadline:
#        fixed      default budget, server --deadline_admission=false (it queues whatever arrives)
#        admission  default budget, server --deadline_admission=true (a call predicted to miss is answered at once)
#        adaptive   budget auto (a latency target of the call's deadline), --deadline_admission=true
#      (fixed runs on the first server, admission and adaptive alternate on a second one);
#   3. one markdown table: load, policy, goodput/s (OK answers within their deadline per second), miss %
#      (DEADLINE_EXCEEDED at or after the deadline and late OK answers, over calls sent), rejected %
#      (RESOURCE_EXHAUSTED, UNAVAILABLE and DEADLINE_EXCEEDED before the deadline, over calls sent), mean expert count m and width k of the OK MiTA answers, full % (OK answers that ran full
#      attention), and goodput over the fixed policy's at the same load.
# Images: the first 64 Fashion-MNIST test images (mita-export-images). Documents: Linux kernel documentation
# (linux-doc-6.1, as scripts/bench_short_beside_long.sh) re-encoded with the document model's tokenizer and cut
# into DOCUMENTS documents of DOCUMENT_TOKENS tokens each (needs spm_encode/spm_decode).
# A server without --deadline_admission or --cost_profile (before the planner) is started without them: the
# three policies then differ only in the budget they send.
# Usage: scripts/bench_latency.sh [BUILD_DIR]   (default build/). Environment: SECONDS_EACH (measured seconds
# per run, default 15), LOADS (default "0.5 1 2 4"), KINDS (default "images documents"), DEADLINE_FACTOR
# (default 4), CAPACITY_SECONDS (default 8), CAPACITY_CONCURRENCY (default 32), DOCUMENT_MODEL, DOCUMENTS
# (default 16), DOCUMENT_TOKENS (default 1000), PORT (gRPC port, default 0: any free one), SERVER_FLAGS (more
# mita-server flags), LOCK_FILE (when set, each kind's runs hold `flock -x` on it), LOGS (a folder to keep
# every mita-bench report and server log in), CLIENT_NICE (mita-bench's nice value, default 0; negative needs
# root). About 7 minutes with the defaults on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_server.sh
BUILD="${1:-build}"
SECONDS_EACH="${SECONDS_EACH:-15}"
LOADS="${LOADS:-0.5 1 2 4}"
KINDS="${KINDS:-images documents}"
DEADLINE_FACTOR="${DEADLINE_FACTOR:-4}"
CAPACITY_SECONDS="${CAPACITY_SECONDS:-8}"
CAPACITY_CONCURRENCY="${CAPACITY_CONCURRENCY:-32}"
DOCUMENT_MODEL="${DOCUMENT_MODEL:-linux-doc-mita}"
DOCUMENTS="${DOCUMENTS:-16}"
DOCUMENT_TOKENS="${DOCUMENT_TOKENS:-1000}"
PORT="${PORT:-0}"
SERVER_FLAGS="${SERVER_FLAGS:-}"
LOCK_FILE="${LOCK_FILE:-}"
LOGS="${LOGS:-}"
CLIENT_NICE="${CLIENT_NICE:-0}"
IMAGE_MODEL=fashion-mnist-vit
export OMP_WAIT_POLICY=passive
work="$(mktemp -d)"
server_pid=""
stop_server() {  # and keeps its log as server-N.log
  if [ -n "$server_pid" ]; then
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
    cp "$work/server.log" "$work/server-$servers.log"
  fi
}
finish() {
  stop_server
  if [ -n "$LOGS" ]; then
    mkdir -p "$LOGS"
    cp "$work"/*.log "$LOGS"/ 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap finish EXIT

# Inputs.
for kind in $KINDS; do
  case "$kind" in
    images)
      "$BUILD/tools/mita-export-images" --split=t10k --count=64 --out="$work/images" > /dev/null
      for f in "$work"/images/*.png; do echo "image,$f,$IMAGE_MODEL"; done > "$work/images.csv"
      ;;
    documents)
      find /usr/share/doc/linux-doc-6.1/Documentation -name '*.rst*' | sort | sed -n '1,400p' |
        while read -r f; do case "$f" in *.gz) zcat "$f" ;; *) cat "$f" ;; esac; done > "$work/corpus.txt"
      spm_encode --model="models/repository/$DOCUMENT_MODEL/tokenizer.model" --output_format=id \
        < "$work/corpus.txt" | tr ' ' '\n' | grep -v '^$' > "$work/ids.txt"
      : > "$work/documents.csv"
      for i in $(seq 0 $((DOCUMENTS - 1))); do
        sed -n "$((i * DOCUMENT_TOKENS + 1)),$(((i + 1) * DOCUMENT_TOKENS))p" "$work/ids.txt" | tr '\n' ' ' |
          spm_decode --model="models/repository/$DOCUMENT_MODEL/tokenizer.model" --input_format=id \
          > "$work/doc_$i.txt"
        echo "document,$work/doc_$i.txt,$DOCUMENT_MODEL" >> "$work/documents.csv"
      done
      ;;
    *) echo "KINDS: unknown kind '$kind' (images, documents)" >&2; exit 2 ;;
  esac
done

admission_flag=1 profile_flag=1
server_help="$("$BUILD/server/mita-server" --help 2>&1 || true)"
grep -q -- '--deadline_admission' <<< "$server_help" || admission_flag=0
grep -q -- '--cost_profile' <<< "$server_help" || profile_flag=0
echo "machine: $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg); $(git log -1 --format='%h %s' | cut -c1-80)"
[ "$admission_flag" = 1 ] || echo "note: this mita-server has no --deadline_admission; every policy runs without it"

start_server() {  # MODEL ADMISSION(true|false): a server of MODEL alone
  local model="$1" flags=()
  # A copy (the server reads no package through a link out of its repository).
  if [ ! -d "$work/repository-$model" ]; then
    mkdir -p "$work/repository-$model"
    cp -r "models/repository/$model" "$work/repository-$model/"
  fi
  if [ "$admission_flag" = 1 ]; then flags+=("--deadline_admission=$2"); fi
  if [ "$profile_flag" = 1 ]; then
    # Calibrated once per model, loaded by its later servers: every policy plans with the same cost model.
    if [ -f "$work/cost-$model" ]; then
      flags+=("--cost_profile=$work/cost-$model")
    else
      flags+=("--save_cost_profile=$work/cost-$model")
    fi
  fi
  # shellcheck disable=SC2086
  "$BUILD/server/mita-server" --model_repository="$work/repository-$model" --listen="127.0.0.1:$PORT" \
    --metrics_listen= "${flags[@]}" $SERVER_FLAGS 2> "$work/server.log" &
  servers=$((${servers:-0} + 1))
  server_pid=$!
  port="$(wait_for_server_port "$work/server.log")"
  [ -n "$port" ] || { cat "$work/server.log"; exit 1; }
  # The server answers once its models are loaded (and, with the planner, calibrated).
  for _ in $(seq 1 600); do
    "$BUILD/client/mita-client" --server="127.0.0.1:$port" --list > /dev/null 2>&1 && return 0
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log"; exit 1; }
    sleep 0.2
  done
  echo "mita-server did not answer" >&2
  exit 1
}
bench() {  # LOG_NAME MITA_BENCH_FLAGS... -> the run's log in $work/LOG_NAME.log
  local name="$1"
  shift
  nice -n "$CLIENT_NICE" "$BUILD/client/mita-bench" --server="127.0.0.1:$port" --label="$name" "$@" > "$work/$name.log"
}
result() {  # LOG_NAME KEY -> the value of KEY in the log's RESULT line
  awk -v key="$2" '/^RESULT/ {for (i = 2; i <= NF; i++) {split($i, kv, "="); if (kv[1] == key) print kv[2]}}' \
    "$work/$1.log"
}

run() {  # POLICY LOAD: one open-loop run of $kind at LOAD x $capacity, each call with $deadline_ms
  local policy="$1" load="$2" budget=default rate warmup
  if [ "$policy" = adaptive ]; then budget=auto; fi
  rate="$(awk -v c="$capacity" -v l="$load" 'BEGIN {printf "%.2f", c * l}')"
  warmup="$(awk -v r="$rate" 'BEGIN {w = int(r); print (w < 5 ? 5 : w)}')"  # about a second of the same load
  bench "$kind-$policy-$load" --manifest="$manifest" --mode=open --rate="$rate" --requests=0 \
    --duration_s="$SECONDS_EACH" --warmup_requests="$warmup" --deadlines_ms="$deadline_ms" --budgets="$budget"
}

for kind in $KINDS; do
  if [ -n "$LOCK_FILE" ]; then
    exec 9> "$LOCK_FILE"
    lock_start=$SECONDS
    flock -x 9
    echo "($LOCK_FILE held after $((SECONDS - lock_start)) s of waiting)"
  fi
  kind_start=$SECONDS
  manifest="$work/$kind.csv"
  model=$IMAGE_MODEL
  if [ "$kind" = documents ]; then model=$DOCUMENT_MODEL; fi
  start_server "$model" false
  calibration="$(sed -n "s/.*\(cost model of .*\)/\1/p" "$work/server.log" | head -1)"
  bench "$kind-idle" --manifest="$manifest" --mode=closed --concurrency=1 --requests=0 --duration_s=3 \
    --warmup_requests=10 --deadlines_ms=60000
  idle_p50="$(result "$kind-idle" p50_ms)"
  bench "$kind-capacity" --manifest="$manifest" --mode=closed --concurrency="$CAPACITY_CONCURRENCY" --requests=0 \
    --duration_s="$CAPACITY_SECONDS" --warmup_requests="$CAPACITY_CONCURRENCY" --deadlines_ms=60000
  capacity="$(result "$kind-capacity" ok_throughput)"
  deadline_ms="$(awk -v p="$idle_p50" -v f="$DEADLINE_FACTOR" 'BEGIN {d = p * f; r = int(d); if (r < d) r++; print (r < 1 ? 1 : r)}')"
  echo
  echo "### $kind: capacity $capacity answers/s at the default budget (closed loop, concurrency" \
    "$CAPACITY_CONCURRENCY, $CAPACITY_SECONDS s); idle p50 $idle_p50 ms; deadline $DEADLINE_FACTOR x idle p50 =" \
    "$deadline_ms ms; $SECONDS_EACH s per run"
  if [ -n "$calibration" ]; then echo "$model: $calibration"; fi
  for load in $LOADS; do run fixed "$load"; done
  stop_server
  start_server "$model" true
  for load in $LOADS; do
    run admission "$load"
    run adaptive "$load"
  done
  stop_server
  if [ -n "$LOCK_FILE" ]; then flock -u 9; fi
  echo "($kind: $((SECONDS - kind_start)) s; load average $(cut -d' ' -f1-3 /proc/loadavg))"
  echo
  echo "| load | offered /s | policy | goodput /s | miss % | rejected % | mean m | mean k | full % | goodput / fixed |"
  echo "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"
  for load in $LOADS; do
    fixed_goodput="$(result "$kind-fixed-$load" goodput)"
    for policy in fixed admission adaptive; do
      name="$kind-$policy-$load"
      awk -v load="$load" -v capacity="$capacity" -v policy="$policy" -v fixed="$fixed_goodput" '
        /^RESULT/ {
          for (i = 2; i <= NF; i++) {split($i, kv, "="); v[kv[1]] = kv[2]}
          ratio = fixed > 0 ? sprintf("%.2f", v["goodput"] / fixed) : "-"
          printf "| %sx | %.0f | %s | %.1f | %.2f | %.2f | %.2f | %.2f | %.1f | %s |\n", load, load * capacity,
            policy, v["goodput"], 100 * v["miss_rate"], 100 * v["reject_rate"], v["mean_m"], v["mean_k"],
            100 * v["full_fraction"], ratio
        }' "$work/$name.log"
    done
  done
  echo
  echo "budget reasons of the OK answers (adaptive):"
  for load in $LOADS; do
    echo "  ${load}x: $(grep -o 'reason_[a-z_]*=[0-9]*' "$work/$kind-adaptive-$load.log" | grep -v '=0$' |
      sed 's/^reason_//' | tr '\n' ' ')"
  done
done
echo
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg); $SECONDS s in all"
