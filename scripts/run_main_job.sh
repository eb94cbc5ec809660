#!/usr/bin/env bash
# The main job: build, start mita-server on the embedded default model, classify 200 real Fashion-MNIST test
# images (PNG) through mita-client over gRPC at two budgets, print accuracy and latency, scrape the metrics,
# stop the server.
# Environment: IMAGES (default 200), PORT (default 50051), METRICS_PORT (default 9464).
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
echo "== server up: $(head -1 "$work/models.txt")"

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

echo "== metrics scrape (routing and pruning series)"
exec 3<>"/dev/tcp/127.0.0.1/$METRICS_PORT"
printf 'GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n' >&3
# non-zero series only: requests by code, batch sizes, per-layer routing and pruning histograms (sum, count)
grep -E '^mita_(attention_[a-z_]+_(sum|count)|requests_total|batch_size_(sum|count))' <&3 | awk '$NF != 0'
exec 3>&-

kill -TERM $server
wait $server && echo "== server stopped cleanly (exit 0)"
trap 'rm -rf "$work"' EXIT
