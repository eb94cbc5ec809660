#!/usr/bin/env bash
# The planner after a burst (issue 33 item 7): on a fresh mita-server serving MODEL (default linux-doc-mita) with
# default flags, ROUNDS (3) rounds of [one Classify of 65,536 token ids, then 0.1 s later 4 concurrent Classify of
# 32,768 ids]; then one 16,384-id document with a latency target of TARGET_MS (150) every 0.5 s, PROBES (120)
# times. Prints, per probe, the seconds since the burst ended and its outcome (the budget it ran with, or the
# refusal), then how many were refused and when the first was admitted. Before the planner's batch fill faded
# with time, every probe was refused (docs/serving.md "Latency targets").
# Usage: scripts/replay_planner_burst.sh [BUILD_DIR]   (default build/). Environment: MODEL, ROUNDS, PROBES,
# TARGET_MS, PORT (default 0: any free port). About 90 s with the defaults on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_server.sh
BUILD="${1:-build}"
MODEL="${MODEL:-linux-doc-mita}"
ROUNDS="${ROUNDS:-3}"
PROBES="${PROBES:-120}"
TARGET_MS="${TARGET_MS:-150}"
PORT="${PORT:-0}"
export OMP_WAIT_POLICY=passive
start_bench_work

# Token ids 3 .. 999 (inside every embedded document model's vocabulary).
for tokens in 65536 32768 16384; do
  awk -v n="$tokens" 'BEGIN { for (i = 0; i < n; ++i) print 3 + (i * 7919) % 997 }' > "$work/ids-$tokens.txt"
done
for _ in 1 2 3 4; do echo "$work/ids-32768.txt,0"; done > "$work/four.csv"

mkdir -p "$work/repository"
cp -r "models/repository/$MODEL" "$work/repository/"
"$BUILD/server/mita-server" --model_repository="$work/repository" --listen="127.0.0.1:$PORT" --metrics_listen= \
  2> "$work/server.log" &
server_pid=$!
port="$(wait_for_server_port "$work/server.log")"
[ -n "$port" ] || { cat "$work/server.log"; exit 1; }
client=("$BUILD/client/mita-client" --server="127.0.0.1:$port" --model="$MODEL" --input=token_ids --deadline_ms=0)
for _ in $(seq 1 600); do
  "${client[@]}" --list > /dev/null 2>&1 && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log"; exit 1; }
  sleep 0.2
done

for round in $(seq 1 "$ROUNDS"); do
  "${client[@]}" "$work/ids-65536.txt" > "$work/long-$round.log" 2>&1 &
  long=$!
  sleep 0.1
  "${client[@]}" --manifest="$work/four.csv" --concurrency=4 --quiet > "$work/four-$round.log" 2>&1
  wait "$long"
done
burst_end="$(date +%s.%N)"
echo "burst: $ROUNDS rounds of 1 x 65,536 + 4 x 32,768 token ids to $MODEL, ended; probes every 0.5 s:"

refused=0
first_admitted=""
for probe in $(seq 1 "$PROBES"); do
  started="$(date +%s.%N)"
  since="$(echo "$started - $burst_end" | bc -l)"
  if out="$("${client[@]}" --latency_target_ms="$TARGET_MS" "$work/ids-16384.txt" 2>&1)"; then
    outcome="$(echo "$out" | grep -o -m1 '\(expert_count=[0-9]* expert_width=[0-9]*\|full attention\)[^,]*, budget reason [a-z_]*' || echo "answered") $(echo "$out" | grep -o -m1 'compute=[0-9]*us')"
    [ -n "$first_admitted" ] || first_admitted="$since"
  else
    outcome="refused: $(echo "$out" | grep -o -m1 'predicted [0-9]* ms.* the latency target leaves [0-9]* ms' || echo "$out" | tail -1)"
    refused=$((refused + 1))
  fi
  printf '%6.2f s  %s\n' "$since" "$outcome"
  sleep "$(echo "0.5 - ($(date +%s.%N) - $started)" | bc -l | awk '{ print ($1 > 0 ? $1 : 0) }')"
done
echo "refused $refused of $PROBES probes with a ${TARGET_MS} ms target; first admitted ${first_admitted:-never} s after the burst"
