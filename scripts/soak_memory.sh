#!/usr/bin/env bash
# Memory soak of mita-server (issue 32): valid traffic of every embedded model and input size plus the wire
# mutation fuzzer at fixed rates, for MINUTES, while the server's resident memory is sampled every 10 s.
#
#   scripts/soak_memory.sh [BUILD_DIR]        (default build; run it at nice 19 on a shared machine)
#
# Loads (open loop, all at once, each under nice 19 like the server):
#   images     mita-bench, IMAGE_RATE/s: 200 Fashion-MNIST test PNGs (28x28) and generated PNGs of 256x256,
#              1024x1024, 2048x2048 (gray) and 1024x768 (RGB) for fashion-mnist-vit; budgets default, fast,
#              accurate, 9x16 and full attention
#   documents  mita-bench, DOCUMENT_RATE/s: texts of about 1, 4 and 12 KB (held-out TeX Live documentation and
#              the Linux kernel's) for both document models; budgets default, fast, accurate, and full attention
#              for one call in seven
#   long       mita-bench --truncate, LONG_RATE/s: texts of about 40 KB, 160 KB and 400 KB (the last cut to the
#              models' 65,536 tokens) for both document models; budgets default, fast, accurate
#   fuzz       scripts/wire_fuzz.py, FUZZ_RATE/s: mutated requests of every method, some compressed, gzip bombs
#              and oversized messages among them
# Output (OUT, a temporary folder unless set): rss.csv (seconds since the loads started, VmRSS MiB, the heap's
# kept-free MiB and returned MiB from /metrics), the logs and reports of every part, and on stdout the curve
# (one line a minute) and the verdict: the RSS after the first minute, the largest and smallest RSS of the
# last 10 minutes and their ratio to the first minute's, their mean against the 10 minutes before, and their
# least-squares trend. "flat": the last 10 minutes' maximum is within 1.5x of the first minute's RSS and their
# mean at most 5% over the 10 minutes before (the heap's returns make a sawtooth, so a trend over 10 minutes
# says little). Exit 0 when flat and the fuzzer saw no INTERNAL or UNKNOWN. `scripts/soak_memory.sh --analyze OUT`
# prints the curve and verdict of an earlier run's OUT again.
# Environment: MINUTES (30), IMAGE_RATE (10), DOCUMENT_RATE (2), LONG_RATE (0.1), FUZZ_RATE (5), OUT, and
# SERVER_FLAGS (added to the server's flags).
set -euo pipefail
build=${1:-build}
[ "$build" = "--analyze" ] && build=build
source_dir=$(cd "$(dirname "$0")/.." && pwd)
minutes=${MINUTES:-30}
image_rate=${IMAGE_RATE:-10}
document_rate=${DOCUMENT_RATE:-2}
long_rate=${LONG_RATE:-0.1}
fuzz_rate=${FUZZ_RATE:-5}
out=${OUT:-$(mktemp -d /tmp/soak_memory.XXXXXX)}
mkdir -p "$out"
python=/usr/bin/python3
seconds=$((minutes * 60))

# The curve and the verdict from rss.csv: analyze RSS_CSV FUZZ_EXIT_STATUS.
analyze() {
  "$python" - "$1" "$2" <<'EOF'
import csv, sys
rows = [(float(r["seconds"]), float(r["rss_mib"]), r["kept_free_mib"], r["returned_mib"])
        for r in csv.DictReader(open(sys.argv[1]))]
print("| minute | VmRSS MiB | heap kept free MiB | returned so far MiB |\n|---:|---:|---:|---:|")
for t, rss, kept, returned in rows:
    if int(t) % 60 < 10:
        print(f"| {t / 60:.0f} | {rss:.1f} | {kept} | {returned} |")
level = next(rss for t, rss, _, _ in rows if t >= 60)
end = rows[-1][0]
last = [(t, rss) for t, rss, _, _ in rows if t >= end - 600]
before = [rss for t, rss, _, _ in rows if end - 1200 <= t < end - 600] or [level]
mean_last, mean_before = sum(r for _, r in last) / len(last), sum(before) / len(before)
mean_t = sum(t for t, _ in last) / len(last)
slope = sum((t - mean_t) * (r - mean_last) for t, r in last) / max(1e-9, sum((t - mean_t) ** 2 for t, _ in last)) * 60
high, low = max(r for _, r in last), min(r for _, r in last)
flat = high <= 1.5 * level and mean_last <= 1.05 * mean_before
print(f"soak: RSS after the first minute {level:.1f} MiB; last 10 minutes: {low:.1f}-{high:.1f} MiB "
      f"({low / level:.2f}x-{high / level:.2f}x of it), mean {mean_last:.1f} MiB against {mean_before:.1f} MiB in the "
      f"10 minutes before ({(mean_last / mean_before - 1) * 100:+.1f}%), least-squares trend {slope:+.2f} MiB/min: "
      f"{'flat' if flat else 'NOT flat'}; fuzzer exit status {sys.argv[2]}")
sys.exit(0 if flat and sys.argv[2] == "0" else 1)
EOF
}
if [ "${1:-}" = "--analyze" ]; then analyze "$2/rss.csv" 0; exit $?; fi
pids=()
server_pid=
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then kill -TERM "$server_pid"; wait "$server_pid" || true; fi
}
trap cleanup EXIT

echo "soak: output in $out"
"$build/tools/mita-export-images" --count=200 --out="$out/images" > /dev/null
"$python" - "$out" "$source_dir" <<'EOF'
# Larger images (PNG written here: zlib and struct) and documents of several sizes, with the manifests.
import glob, gzip, json, lzma, os, random, struct, sys, zlib
out, source = sys.argv[1], sys.argv[2]
rng = random.Random(1)

def png(path, width, height, channels):
    rows = bytearray()
    for y in range(height):
        rows.append(0)
        row = bytes(((x * 255 // width + y * 255 // height) // 2 + rng.randrange(16)) % 256
                    for x in range(width)) if channels == 1 else \
            bytes(((x + c * y) * 255 // (width + height) + rng.randrange(16)) % 256
                  for x in range(width) for c in range(channels))
        rows += row
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    color = 0 if channels == 1 else 2
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)) +
                chunk(b"IDAT", zlib.compress(bytes(rows), 6)) + chunk(b"IEND", b""))
    return path

images = [os.path.join(out, "images", p) for p in sorted(os.listdir(os.path.join(out, "images"))) if p.endswith(".png")]
big = [png(os.path.join(out, f"image_{w}x{h}x{c}.png"), w, h, c)
       for w, h, c in ((256, 256, 1), (1024, 1024, 1), (2048, 2048, 1), (1024, 768, 3))]
with open(os.path.join(out, "images.csv"), "w") as f:
    for p in images + big * 10:  # the large ones are about a sixth of the image calls
        f.write(f"image,{p},fashion-mnist-vit\n")

texts = [json.loads(line)["text"] for line in lzma.open(os.path.join(source, "data", "texlive-doc-heldout.jsonl.xz"), "rt")]
linux = []
for p in sorted(glob.glob("/usr/share/doc/linux-doc-6.1/Documentation/**/*.rst.gz", recursive=True))[:400]:
    linux.append(gzip.open(p, "rt", errors="replace").read())
pool = "\n\n".join(texts[:200] + linux)

def document(name, size):
    start = rng.randrange(max(1, len(pool) - size))
    path = os.path.join(out, f"{name}.txt")
    with open(path, "w") as f:
        f.write(pool[start:start + size])
    return path

with open(os.path.join(out, "documents.csv"), "w") as f:
    for model in ("linux-doc-mita", "texlive-doc-mita"):
        for i, size in enumerate((1000, 1000, 4000, 4000, 12000)):
            f.write(f"document,{document(f'{model}_short_{i}', size)},{model}\n")
with open(os.path.join(out, "long.csv"), "w") as f:
    for model in ("linux-doc-mita", "texlive-doc-mita"):
        for i, size in enumerate((40000, 160000, 400000)):
            f.write(f"document,{document(f'{model}_long_{i}', size)},{model}\n")
EOF

# The server, on free ports.
# shellcheck disable=SC2086
nice -n 19 "$build/server/mita-server" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
  --model_repository="$source_dir/models/repository" ${SERVER_FLAGS:-} 2> "$out/server.log" &
server_pid=$!
port= ; metrics_port=
for _ in $(seq 1 1200); do
  line=$(grep -m1 "serving gRPC" "$out/server.log" || true)
  if [ -n "$line" ]; then
    port=$(sed -n 's/.*serving gRPC on [^ ]* (port \([0-9]*\);.*/\1/p' <<< "$line")
    metrics_port=$(sed -n 's/.*metrics on [^ ]* (port \([0-9]*\)).*/\1/p' <<< "$line")
    break
  fi
  kill -0 "$server_pid" 2>/dev/null || { cat "$out/server.log"; echo "soak: mita-server exited"; exit 1; }
  sleep 0.1
done
[ -n "$port" ] || { cat "$out/server.log"; echo "soak: mita-server did not start"; exit 1; }
echo "soak: server pid $server_pid, port $port, metrics port $metrics_port; idle VmRSS $(awk '/VmRSS/ {printf "%.1f MiB", $2 / 1024}' /proc/$server_pid/status)"

bench=(nice -n 19 "$build/client/mita-bench" --server="127.0.0.1:$port" --mode=open --requests=0
       --duration_s="$seconds" --warmup_requests=0 --deadlines_ms=0,30000 --max_in_flight=256)
"${bench[@]}" --manifest="$out/images.csv" --rate="$image_rate" --budgets=default,fast,accurate,9x16,full \
  --seed=1 --label=images > "$out/images.report" 2>&1 &
pids+=($!)
"${bench[@]}" --manifest="$out/documents.csv" --rate="$document_rate" \
  --budgets=default,fast,accurate,default,fast,accurate,full --seed=2 --label=documents > "$out/documents.report" 2>&1 &
pids+=($!)
"${bench[@]}" --manifest="$out/long.csv" --rate="$long_rate" --budgets=default,fast,accurate --truncate \
  --seed=3 --label=long > "$out/long.report" 2>&1 &
pids+=($!)
nice -n 19 "$python" "$source_dir/scripts/wire_fuzz.py" --server="127.0.0.1:$port" --rate="$fuzz_rate" \
  --duration_s="$seconds" --stubs="$build/client/python" --images="$out/images" \
  --documents="$out/linux-doc-mita_short_2.txt,$out/texlive-doc-mita_short_4.txt,$out/linux-doc-mita_long_0.txt" \
  > "$out/fuzz.report" 2>&1 &
fuzz_pid=$!
pids+=($fuzz_pid)

# Resident memory every 10 s, with the heap's own figures.
echo "seconds,rss_mib,kept_free_mib,returned_mib" > "$out/rss.csv"
start=$(date +%s)
while :; do
  now=$(( $(date +%s) - start ))
  rss=$(awk '/VmRSS/ {printf "%.1f", $2 / 1024}' "/proc/$server_pid/status")
  heap=$(curl -s --max-time 5 "http://127.0.0.1:$metrics_port/metrics" 2>/dev/null |
         awk '/^mita_heap_kept_free_bytes / {k = $2 / 1048576} /^mita_heap_returned_bytes_total / {r = $2 / 1048576}
              END {printf "%.1f,%.1f", k, r}')
  echo "$now,$rss,$heap" >> "$out/rss.csv"
  [ "$now" -ge "$seconds" ] && break
  sleep 10
done
fuzz_status=0
for p in "${pids[@]}"; do
  if [ "$p" = "$fuzz_pid" ]; then wait "$p" || fuzz_status=$?; else wait "$p" || true; fi
done
pids=()
kill -TERM "$server_pid"; wait "$server_pid" || true; server_pid=

for part in images documents long; do echo "soak: $part: $(grep -m1 '^RESULT' "$out/$part.report" || tail -1 "$out/$part.report")"; done
echo "soak: fuzz: $(tail -1 "$out/fuzz.report")"
echo "soak: server: $(tail -1 "$out/server.log")"
analyze "$out/rss.csv" "$fuzz_status"
