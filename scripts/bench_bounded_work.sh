#!/usr/bin/env bash
# Bounded work, measured on a real mita-server (issue 14's figures):
#   1. image burst: 16 concurrent 4096x4096 PNGs (gray gradients, 1 request each) sent by mita-client
#      --concurrency=16 to a server with 16 preparation threads; peak resident memory (VmHWM) after start and
#      after the burst, with the default --preparation_memory_bytes (1 GiB) and with it effectively unbounded
#      (64 GiB), alternated ROUNDS times;
#   2. deadline to stop: one 16,384-token document under full attention with a 300 ms deadline; the server's
#      mita_compute_after_caller_left_seconds_total is the time from the deadline passing to its work stopping
#      (the request is alone in its batch, so its share is all of it), and the forward's total compute time.
# Usage: scripts/bench_bounded_work.sh [BUILD_DIR]   (default build/; ROUNDS=2)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_server.sh
BUILD="${1:-build}"
ROUNDS="${ROUNDS:-2}"
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
/usr/bin/python3 - "$work" <<'PYTHON'
import struct, sys, zlib, random
work = sys.argv[1]
def png(width, height, row):
    raw = b"".join(b"\x00" + row(y) for y in range(height))
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
with open(f"{work}/manifest.csv", "w") as manifest:
    for i in range(16):
        base = bytes((x * 255 // 4095 + i * 13) % 256 for x in range(4096))
        open(f"{work}/burst_{i}.png", "wb").write(png(4096, 4096, lambda y: base))
        manifest.write(f"{work}/burst_{i}.png,0\n")
random.seed(1)
open(f"{work}/ids_16k.txt", "w").write(" ".join(str(random.randrange(4096)) for _ in range(16384)))
PYTHON
echo "machine: $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg); PNG size $(stat -c %s "$work/burst_0.png") bytes"

start_server() {  # extra flags...; sets pid and port
  "$BUILD/server/mita-server" --model_repository=models/repository --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
    --max_receive_message_bytes=67108864 "$@" 2> "$work/server.log" &
  pid=$!
  port="$(wait_for_server_port "$work/server.log")"
  metrics_port="$(sed -n 's/.*metrics on .* (port \([0-9]*\)).*/\1/p' "$work/server.log")"
}
stop_server() { kill -TERM "$pid"; wait "$pid" || true; }
rss_mib() { awk '/VmHWM/ {printf "%.0f", $2 / 1024}' "/proc/$pid/status"; }

echo "== image burst: 16 concurrent 4096x4096 PNGs, --preparation_threads=16"
printf '| --preparation_memory_bytes | round | peak RSS after start (MiB) | peak RSS after the burst (MiB) | OK answers |\n|---|---:|---:|---:|---:|\n'
for round in $(seq 1 "$ROUNDS"); do
  for memory in 1073741824 68719476736; do
    start_server --preparation_threads=16 --preparation_memory_bytes="$memory"
    before=$(rss_mib)
    "$BUILD/client/mita-client" --server="127.0.0.1:$port" --model=fashion-mnist-vit --manifest="$work/manifest.csv" \
      --concurrency=16 --deadline_ms=120000 --quiet > "$work/client.log" 2>&1 || true
    after=$(rss_mib)
    ok=$(grep -c ' OK\| ok' "$work/client.log" || true)
    accuracy_line=$(grep -m1 -i "accuracy\|answered" "$work/client.log" || true)
    printf '| %s | %d | %s | %s | %s |\n' "$memory" "$round" "$before" "$after" "${accuracy_line:-see log}"
    stop_server
  done
done

echo "== deadline to stop: 16,384-token document, full attention, 300 ms deadline"
printf '| round | client answer | compute after the deadline passed (s) | log |\n|---:|---|---:|---|\n'
for round in $(seq 1 "$ROUNDS"); do
  start_server --torch_threads=2 --deadline_admission=false  # the request must run for its stop to be measured
  answer=$("$BUILD/client/mita-client" --server="127.0.0.1:$port" --model=linux-doc-mita --input=token_ids \
    --full_attention --deadline_ms=300 "$work/ids_16k.txt" 2>&1 | tail -1 | cut -c1-80 || true)
  sleep 3
  after_left=$(curl -s "127.0.0.1:$metrics_port/metrics" |
    awk '/^mita_compute_after_caller_left_seconds_total\{model="linux-doc-mita"\}/ {print $2}')
  printf '| %d | %s | %s | |\n' "$round" "$answer" "$after_left"
  stop_server
done
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
