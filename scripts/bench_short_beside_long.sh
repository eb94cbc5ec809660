#!/usr/bin/env bash
# Short requests beside 64K-token documents: latency of an image and of a ~1K-token document (open loop,
# RATE per second each, mita-bench) on an idle server and while two ~64K-token documents are computed
# continuously (closed loop, mita-bench --concurrency=2) on the same document model, with the long-document lane
# (--long_document_tokens=8192, the default) and without it (0), alternated ROUNDS times. Prints p50/p99 and
# the loaded / idle p99 ratio per kind. Texts: Linux kernel documentation (linux-doc-6.1) re-encoded with the
# document model's tokenizer and cut to 1,000 and 64,000 tokens.
# Usage: scripts/bench_short_beside_long.sh [BUILD_DIR]   (default build/; ROUNDS=2 RATE=4 SECONDS_EACH=20)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_server.sh
BUILD="${1:-build}"
ROUNDS="${ROUNDS:-2}"
RATE="${RATE:-4}"
SECONDS_EACH="${SECONDS_EACH:-20}"
MODEL=linux-doc-mita
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
find /usr/share/doc/linux-doc-6.1/Documentation -name '*.rst*' | sort | sed -n '1,400p' |
  while read -r f; do case "$f" in *.gz) zcat "$f" ;; *) cat "$f" ;; esac; done > "$work/corpus.txt"
spm_encode --model="models/repository/$MODEL/tokenizer.model" --output_format=id < "$work/corpus.txt" |
  tr '\n' ' ' > "$work/ids.txt"
for tokens in 1000 64000; do
  tr ' ' '\n' < "$work/ids.txt" | grep -v '^$' | sed -n "1,${tokens}p" | tr '\n' ' ' |
    spm_decode --model="models/repository/$MODEL/tokenizer.model" --input_format=id > "$work/doc_$tokens.txt"
done
"$BUILD/tools/mita-export-images" --count=20 --out="$work/images" > /dev/null
printf 'image,%s\n' "$work"/images/*.png > "$work/short_image.csv"
echo "document,$work/doc_1000.txt,$MODEL" > "$work/short_document.csv"
echo "document,$work/doc_64000.txt,$MODEL" > "$work/long.csv"
echo "machine: $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"

start_server() {
  "$BUILD/server/mita-server" --model_repository=models/repository --listen=127.0.0.1:0 --metrics_listen= "$@" \
    2> "$work/server.log" &
  pid=$!
  port="$(wait_for_server_port "$work/server.log")"
}
short_load() {  # manifest label -> "p50 p99 ok/answered"
  "$BUILD/client/mita-bench" --server="127.0.0.1:$port" --manifest="$1" --mode=open --rate="$RATE" --requests=0 \
    --duration_s="$SECONDS_EACH" --warmup_requests=4 --deadlines_ms=60000 --label="$2" |
    awk '/^RESULT/ {for (i = 2; i <= NF; i++) {split($i, kv, "="); v[kv[1]] = kv[2]}; print v["p50_ms"], v["p99_ms"], v["ok"] "/" v["answered"]}'
}
printf '| lane threshold | round | kind | idle p50 / p99 (ms) | beside 64K docs p50 / p99 (ms) | p99 ratio | long docs answered |\n'
printf '|---|---:|---|---:|---:|---:|---:|\n'
for round in $(seq 1 "$ROUNDS"); do
  for lanes in 8192 0; do
    start_server --long_document_tokens="$lanes"
    declare -A idle
    for kind in image document; do idle[$kind]="$(short_load "$work/short_$kind.csv" "idle-$kind")"; done
    "$BUILD/client/mita-bench" --server="127.0.0.1:$port" --manifest="$work/long.csv" --mode=closed --concurrency=2 \
      --requests=0 --duration_s=$((2 * SECONDS_EACH + 30)) --warmup_requests=0 --deadlines_ms=600000 --label=long \
      > "$work/long.log" 2>&1 &
    long_pid=$!
    sleep 10  # the long documents are computing
    for kind in image document; do
      loaded="$(short_load "$work/short_$kind.csv" "loaded-$kind")"
      read -r idle50 idle99 _ <<< "${idle[$kind]}"
      read -r load50 load99 _ <<< "$loaded"
      printf '| %s | %d | %s | %s / %s | %s / %s | %.1f | |\n' "$lanes" "$round" "$kind" "$idle50" "$idle99" "$load50" \
        "$load99" "$(echo "$load99 / $idle99" | bc -l)"
    done
    wait "$long_pid" || true
    echo "| $lanes | $round | long (64K) | | $(awk '/^RESULT/ {print $2, $3, $8, $10}' "$work/long.log") | | |"
    kill -TERM "$pid"; wait "$pid" || true
  done
done
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
