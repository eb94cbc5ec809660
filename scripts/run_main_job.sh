#!/usr/bin/env bash
# The main job: build, start mita-server on the embedded models, classify 200 real Fashion-MNIST test images
# (PNG) through mita-client over gRPC at two budgets (+ full attention) with fashion-mnist-vit, the same images with
# timm-vit-fashion-mnist (a timm ViT trained with full attention, N = 197) at full attention, its default, and at two
# MiTA presets, classify the held-out TeX Live
# documentation (real PDFs' text, none concatenated; data/texlive-doc-heldout.jsonl.xz) with the embedded document
# model at two budgets, all of it and its 32K-64K-token bucket apart (accuracy and latency), and one held-out
# document of 16K-32K tokens at two budgets and full attention, scrape the metrics, stop the server.
# Environment: IMAGES (default 200), DOCUMENTS (held-out documents of the first pass, default all), PORT
# (default 50051), METRICS_PORT (default 9464).
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

DEIT_MODEL=timm-vit-fashion-mnist
deit=(./build/client/mita-client --server="127.0.0.1:$PORT" --model="$DEIT_MODEL"
      --manifest="$work/images/manifest.csv" --concurrency=4 --quiet)
echo "== $DEIT_MODEL (timm ViT trained with full attention, N = 197 tokens): full attention (model default)"
"${deit[@]}"
echo "== $DEIT_MODEL: MiTA expert_count=25 expert_width=64 (preset 'mita'), same weights"
"${deit[@]}" --preset=mita
echo "== $DEIT_MODEL: MiTA expert_count=9 expert_width=16 (preset 'fast'), same weights"
"${deit[@]}" --preset=fast

echo "== one image with attention statistics"
./build/client/mita-client --server="127.0.0.1:$PORT" --model=fashion-mnist-vit --statistics \
  "$work/images/t10k-00000.png"

DOCUMENT_MODEL=texlive-doc-mita
echo "== documents: the held-out TeX Live documentation (data/texlive-doc-heldout.jsonl.xz, real PDFs' text)"
# The shipped held-out split as a corpus folder, token counts from the model's own tokenizer (spm_encode).
/usr/bin/python3 tools/build_document_corpus.py --source jsonl --heldout data/texlive-doc-heldout.jsonl.xz \
  --labels "models/repository/$DOCUMENT_MODEL/labels.txt" --tokenizer "models/repository/$DOCUMENT_MODEL/tokenizer.model" \
  --out "$work/corpus" > "$work/corpus.log" 2>&1 || { cat "$work/corpus.log"; exit 1; }
grep '^heldout:' "$work/corpus.log" | sed 's/^/   /'
# Manifests "path,label_index": every held-out document (or the first DOCUMENTS), the 32K-64K-token bucket
# (documents over 65,536 tokens are cut to it with --truncate), and one document of 16K-32K tokens (the
# shortest of them, so that full attention stays within a few minutes) for full attention.
/usr/bin/python3 - "$work/corpus" "${DOCUMENTS:-0}" > "$work/long.label" <<'PYTHON'
import os, sys
corpus, limit = sys.argv[1], int(sys.argv[2])
rows = [line.rstrip("\n").split("\t") for line in open(os.path.join(corpus, "heldout.tsv")) if line.strip()]
tokens = [len(line.split()) for line in open(os.path.join(corpus, "heldout.ids")).read().split("\n")[: len(rows)]]
names = open(os.path.join(corpus, "labels.txt")).read().split()
with open(os.path.join(corpus, "heldout.csv"), "w") as f:
    f.writelines(f"{path},{label}\n" for path, label, _ in rows[: limit or len(rows)])
bucket = [(row, n) for row, n in zip(rows, tokens) if n >= 32768]
with open(os.path.join(corpus, "bucket64k.csv"), "w") as f:
    f.writelines(f"{row[0]},{row[1]}\n" for row, _ in bucket)
row, n = min(((row, n) for row, n in zip(rows, tokens) if 16384 <= n < 32768), key=lambda pair: pair[1])
with open(os.path.join(corpus, "long.path"), "w") as f:
    f.write(os.path.join(corpus, row[0]))
print(f"{row[2]} ({n} tokens, class {names[int(row[1])]}); the 32K-64K bucket (over 64K cut to 64K with --truncate): {len(bucket)} documents")
PYTHON
docs=(./build/client/mita-client --server="127.0.0.1:$PORT" --model="$DOCUMENT_MODEL" --truncate --quiet
      --concurrency=2 --deadline_ms=600000)
for budget in "default:" "fast:--preset=fast"; do
  name=${budget%%:*} flags=${budget#*:}
  echo "== documents, budget '$name' (${flags:-model default m=16 k=64}): all $(wc -l < "$work/corpus/heldout.csv") held-out documents"
  "${docs[@]}" --manifest="$work/corpus/heldout.csv" $flags
  echo "== documents, budget '$name': the 32K-64K-token bucket, longer documents cut to 64K (accuracy and latency)"
  "${docs[@]}" --manifest="$work/corpus/bucket64k.csv" $flags
done

echo "== one long held-out document: $(cat "$work/long.label")"
long=(./build/client/mita-client --server="127.0.0.1:$PORT" --model="$DOCUMENT_MODEL" --truncate --top_n=3
      --deadline_ms=600000 "$(cat "$work/corpus/long.path")")
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
