#!/usr/bin/env bash
# Tokenization cost before admission: for texts of 1, 4 and 16 MB of known characters (English words) and of a
# character the SentencePiece model does not know (an emoji, no whitespace), one fresh mita-server per text
# (--max_receive_message_bytes=64 MiB), one Classify with truncation; prints the client's latency and the
# server's peak resident memory (VmHWM) against its peak after start-up.
# Usage: scripts/bench_tokenization.sh [BUILD_DIR]   (default build/)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_server.sh
BUILD="${1:-build}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 - "$work" <<'PYTHON'
import sys
work = sys.argv[1]
words = "the scheduler balances interrupts across processors while the driver maps pages ".split()
for megabytes in (1, 4, 16):
    size = megabytes << 20
    line = " ".join(words) + " "
    open(f"{work}/known_{megabytes}.txt", "w").write((line * (size // len(line) + 1))[:size])
    open(f"{work}/unknown_{megabytes}.txt", "w").write("\U0001F600" * (size // 4))
PYTHON
echo "machine: $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"
printf '| text | bytes | client latency (ms) | server peak RSS after start (MiB) | peak RSS after the call (MiB) |\n|---|---:|---:|---:|---:|\n'
for kind in known unknown; do
  for megabytes in 1 4 16; do
    file="$work/${kind}_${megabytes}.txt"
    "$BUILD/server/mita-server" --model_repository=models/repository --listen=127.0.0.1:0 --metrics_listen= \
      --max_receive_message_bytes=67108864 2> "$work/server.log" &
    pid=$!
    port="$(wait_for_server_port "$work/server.log")"
    before=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
    start=$(date +%s%N)
    "$BUILD/client/mita-client" --server="127.0.0.1:$port" --model=linux-doc-mita --input=text --truncate \
      --deadline_ms=600000 "$file" > "$work/client.log" 2>&1 || true
    end=$(date +%s%N)
    after=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
    printf '| %s | %d | %.0f | %.1f | %.1f |\n' "$kind" "$(stat -c %s "$file")" "$(( (end - start) / 1000 ))e-3" \
      "$(echo "$before / 1024" | bc -l)" "$(echo "$after / 1024" | bc -l)"
    kill -TERM "$pid"; wait "$pid" || true
  done
done
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
