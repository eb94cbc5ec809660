#!/usr/bin/env bash
# ctest arxiv_layout_test: the arXiv dataset path end to end on a small file made here in the public arXiv
# long-document classification dataset's layout (JSON lines {"text", "label"}, integer labels 0-10 naming the
# 11 subject classes). tools/build_document_corpus.py --source jsonl builds the corpus (checked against the
# test's own label mapping, texts and SHA-256 split), tools/train_document.py trains a small package on it (a few steps, the way the embedded model is trained), and
# mita-eval-documents loads that package with the server's loader, tokenizes with the C++ tokenizer and
# classifies the held-out documents: every class has words of its own, so the trained model must reach at
# least 0.9 at a MiTA budget and with full attention (the majority class scores 1/11). Also the round trip of
# --heldout-jsonl: the written .jsonl.xz read back gives the same held-out split.
# Usage: arxiv_layout_test.sh SOURCE_DIR BUILD_DIR [TRAINING_PYTHON (default: the peers' venv, torch 2.11)]
set -euo pipefail
source_dir=$1
build_dir=$2
python=/usr/bin/python3
training_python=${3:-/opt/mita/peers/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" - "$work" <<'PYTHON'
import json, os, random, sys
work = sys.argv[1]
random.seed(7)
filler = "the of and a to in is we that for this with on by are as be an which it from".split()
def document(label, words):
    own = [f"{chr(97 + label)}{chr(97 + j)}ema" for j in range(12)]  # 12 words only class `label` uses
    return " ".join(random.choice(own) if random.random() < 0.3 else random.choice(filler) for _ in range(words))
for name, per_class in (("train.jsonl", 24), ("test.jsonl", 4)):
    with open(os.path.join(work, name), "w") as f:
        for i in range(per_class):
            for label in range(11):
                f.write(json.dumps({"text": document(label, random.randint(200, 1200)), "label": label}) + "\n")
PYTHON

"$python" "$source_dir/tools/build_document_corpus.py" --source jsonl --train "$work/train.jsonl" \
  --heldout "$work/test.jsonl" --out "$work/corpus" --vocab-size 400 > "$work/corpus.log"

# The corpus against the test's own mapping of the dataset's label indices (ARXIV in the file's order).
"$python" - "$work" <<'PYTHON'
import json, os, sys
work = sys.argv[1]
ARXIV = ["math.AC", "cs.CV", "cs.AI", "cs.SY", "math.GR", "cs.CE", "cs.PL", "cs.IT", "cs.DS", "cs.NE", "math.ST"]
corpus = os.path.join(work, "corpus")
labels = open(os.path.join(corpus, "labels.txt")).read().split()
assert labels == sorted(ARXIV), labels
for split, source in (("train", "train.jsonl"), ("heldout", "test.jsonl")):
    rows = [json.loads(line) for line in open(os.path.join(work, source))]
    index = [line.rstrip("\n").split("\t") for line in open(os.path.join(corpus, f"{split}.tsv"))]
    assert len(index) == len(rows), (split, len(index), len(rows))
    ids = open(os.path.join(corpus, f"{split}.ids")).read().split("\n")[: len(rows)]
    for row, (file_name, label, _), line in zip(rows, index, ids):
        assert labels[int(label)] == ARXIV[row["label"]], (row["label"], label)
        assert open(os.path.join(corpus, file_name), encoding="utf-8").read() == row["text"]
        assert len(line.split()) > 0
print("corpus: labels, texts and ids match the dataset file")
PYTHON

# Training as the embedded model is trained (windows through the sparse training attention, full attention every
# 4th step, attention pooling), at a small size.
OMP_WAIT_POLICY=passive "$training_python" "$source_dir/tools/train_document.py" --corpus "$work/corpus" \
  --out "$work/arxiv-mita" --steps 80 --batch 16 --window 512 --full-every 4 --full-window 256 --lr 5e-3 \
  --embed-dim 32 --heads 2 --mlp-hidden-dim 64 --pool-heads 2 --threads 2 --checkpoint-every 80 > "$work/train.log"
tail -1 "$work/train.log"
grep -q '"type": "attention"' "$work/arxiv-mita/config.json"
grep -qx "cs.AI" "$work/arxiv-mita/labels.txt"

"$build_dir/tools/mita-eval-documents" --model="$work/arxiv-mita" --corpus="$work/corpus" --budgets=4x16 \
  --first_tokens=64 --threads=2 | tee "$work/eval.txt"
# "| MiTA m=4 k=16 | ... | 0.977 (43/44) | ms |": the "all" column is the second last.
for row in "MiTA m=4 k=16" "full attention"; do
  accuracy=$(grep "^| $row" "$work/eval.txt" | head -1 | awk -F'|' '{print $(NF-2)}' | awk '{print $1}')
  "$python" -c "import sys; a = float(sys.argv[1]); sys.exit(0 if a >= 0.9 else 1)" "$accuracy" ||
    { echo "$row: held-out accuracy $accuracy < 0.9"; exit 1; }
done

# --heldout-jsonl round trip: one file, held out by SHA-256 of the text (the test's own computation).
"$python" "$source_dir/tools/build_document_corpus.py" --source jsonl --train "$work/train.jsonl" \
  --out "$work/split" --vocab-size 0 --heldout-jsonl "$work/heldout.jsonl.xz" > /dev/null
"$python" "$source_dir/tools/build_document_corpus.py" --source jsonl --heldout "$work/heldout.jsonl.xz" \
  --labels "$work/split/labels.txt" --out "$work/back" --vocab-size 0 > /dev/null
"$python" - "$work" <<'PYTHON'
import hashlib, json, os, sys
work = sys.argv[1]
rows = [json.loads(line) for line in open(os.path.join(work, "train.jsonl"))]
expected = [row["text"] for row in rows if hashlib.sha256(row["text"].encode()).digest()[0] < 51]
back = [line.split("\t") for line in open(os.path.join(work, "back", "heldout.tsv"))]
texts = [open(os.path.join(work, "back", row[0]), encoding="utf-8").read() for row in back]
assert texts == expected, (len(texts), len(expected))
assert open(os.path.join(work, "back", "labels.txt")).read() == open(os.path.join(work, "split", "labels.txt")).read()
print(f"--heldout-jsonl round trip: {len(texts)} of {len(rows)} documents held out, as SHA-256 says")
PYTHON
echo "arxiv_layout_test: passed"
