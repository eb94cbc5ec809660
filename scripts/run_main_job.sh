#!/usr/bin/env bash
# The main job: build, start mita-server on the embedded models, classify 200 real Fashion-MNIST test images
# (PNG) through mita-client over gRPC at two budgets (+ full attention), classify the held-out Linux kernel
# documents (Debian linux-doc-6.1) with the embedded document model and one long real document (held-out
# documents of one class concatenated, >= 16K tokens) at two budgets and full attention, print accuracy and
# latency, scrape the metrics, stop the server.
# Environment: IMAGES (default 200), DOCUMENTS (held-out documents to classify, default all), PORT (default
# 50051), METRICS_PORT (default 9464).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGES=${IMAGES:-200}
PORT=${PORT:-50051}
METRICS_PORT=${METRICS_PORT:-9464}
mkdir -p build
bash scripts/build.sh > build/main-job-build.log 2>&1 || { tail -50 build/main-job-build.log; exit 1; }
echo "== built (log: build/main-job-build.log)"

work=$(mktemp -d)
./build/tools/mita-export-images --split=t10k --count="$IMAGES" --out="$work/images"

./build/server/mita-server --listen="127.0.0.1:$PORT" --metrics_listen="127.0.0.1:$METRICS_PORT" \
  --model_repository=models/repository --max_batch_size=16 --max_queue_delay_ms=2 > "$work/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 120); do
  ./build/client/mita-client --server="127.0.0.1:$PORT" --list > "$work/models.txt" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { cat "$work/server.log"; exit 1; }
  sleep 0.5
done
echo "== server up, models:"
grep -v '^ ' "$work/models.txt" | sed 's/^/   /'

client=(./build/client/mita-client --server="127.0.0.1:$PORT" --model=fashion-mnist-vit
        --manifest="$work/images/manifest.csv" --concurrency=4 --quiet)
echo "== budget 1: MiTA expert_count=4 expert_width=8 (preset 'fast')"
"${client[@]}" --preset=fast
echo "== budget 2: MiTA expert_count=9 expert_width=16 (model default)"
"${client[@]}" --expert_count=9 --expert_width=16
echo "== full attention, same weights"
"${client[@]}" --full_attention

echo "== one image with attention statistics"
./build/client/mita-client --server="127.0.0.1:$PORT" --model=fashion-mnist-vit --statistics \
  "$work/images/t10k-00000.png"

DOCUMENT_MODEL=linux-doc-mita
echo "== documents: held-out Linux kernel documentation (corpus built by tools/build_document_corpus.py)"
/usr/bin/python3 tools/build_document_corpus.py --out "$work/corpus" --vocab-size 0 > "$work/corpus.log" 2>&1 ||
  { cat "$work/corpus.log"; exit 1; }
# manifest "path,label_index" of the held-out documents (heldout.tsv: text file, label index, source path)
awk -F'\t' -v n="${DOCUMENTS:-0}" 'n == 0 || NR <= n {print $1 "," $2}' "$work/corpus/heldout.tsv" \
  > "$work/corpus/heldout.csv"
docs=(./build/client/mita-client --server="127.0.0.1:$PORT" --model="$DOCUMENT_MODEL"
      --manifest="$work/corpus/heldout.csv" --concurrency=2 --truncate --quiet --deadline_ms=120000)
echo "== documents, model default budget"
"${docs[@]}"
echo "== documents, preset 'fast'"
"${docs[@]}" --preset=fast

# One long real document (scripts/long_document.py: ~19K tokens; full attention on it took 5.7 s on 2 cores in the
# 2026-11-30 run, MiTA under 0.1 s).
/usr/bin/python3 scripts/long_document.py "$work/corpus" > "$work/long.label"
echo "== one long document: $(cat "$work/long.label")"
long=(./build/client/mita-client --server="127.0.0.1:$PORT" --model="$DOCUMENT_MODEL" --truncate --top_n=3
      --deadline_ms=600000 "$work/corpus/long.txt")
"${long[@]}" | tee "$work/long.out"
tokens=$(sed -n 's/.*, \([0-9]*\) tokens.*/\1/p' "$work/long.out" | head -1)
[ "${tokens:-0}" -ge 16384 ] || { echo "the long document has ${tokens:-0} tokens, fewer than 16384"; exit 1; }
"${long[@]}" --preset=fast
"${long[@]}" --full_attention

echo "== metrics scrape (routing and pruning series)"
exec 3<>"/dev/tcp/127.0.0.1/$METRICS_PORT"
printf 'GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n' >&3
# non-zero series only: requests by code, batch sizes, per-layer routing and pruning histograms (sum, count)
grep -E '^mita_(attention_[a-z_]+_(sum|count)|requests_total|rejected_requests_total|batch_size_(sum|count)|(request|batch)_tokens_(sum|count))' <&3 | awk '$NF != 0'
exec 3>&-

kill -TERM $server
wait $server && echo "== server stopped cleanly (exit 0)"
trap 'rm -rf "$work"' EXIT
