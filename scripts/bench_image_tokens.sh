#!/usr/bin/env bash
# Where MiTA pays on images: the forward time of the timm ViT family of models/repository/timm-vit-fashion-mnist
# (tools/train_image.py TIMM_VIT: dim 96, depth 4, 3 heads, patch 2) at N = 197, 785 and 3,137 tokens (input side
# 28, 56, 112; random weights, converted by tools/convert_timm_checkpoint.py like the trained package), full
# attention against MiTA budgets, batch 1 and 32, with build/tools/mita-forward --time (C++ forward, no gRPC).
# Prints a Markdown table: the median of REPEATS timed forwards (after one warm-up) per row.
# Environment: BUILD (default build), THREADS (default 2), REPEATS (default 5), BUDGETS (default "full 25x64"),
# SIDES (input sides, default "28 56 112").
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
THREADS=${THREADS:-2}
REPEATS=${REPEATS:-5}
BUDGETS=${BUDGETS:-full 25x64}
SIDES=${SIDES:-28 56 112}
PYTHON=${PYTHON:-/opt/mita/peers/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "| N | budget | batch 1: forward (ms) | batch 32: forward (ms) | batch 32: images/s |"
echo "|---|---|---|---|---|"
for side in $SIDES; do
  (cd tools && OMP_WAIT_POLICY=passive "$PYTHON" train_image.py --architecture timm_vit --epochs 0 --img_size "$side" \
     --threads "$THREADS" --checkpoint "$work/random$side.pth" --out "$work/random$side" > "$work/convert.log")
  tokens=$(( (side / 2) * (side / 2) + 1 ))
  for budget in $BUDGETS; do
    row=()
    for batch in 1 32; do
      "$BUILD/tools/mita-forward" --model="$work/random$side" --time --budget="$budget" --batch_size="$batch" \
        --repeats="$REPEATS" --threads="$THREADS" | sed -n 's/^forward_ms=\([0-9.]*\) .*/\1/p' | sort -g > "$work/times"
      row+=("$(awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}' "$work/times")")
    done
    label=$([ "$budget" = full ] && echo "full attention" || echo "MiTA m=${budget%x*} k=${budget#*x}")
    echo "| $tokens | $label | ${row[0]} | ${row[1]} | $(awk -v ms="${row[1]}" 'BEGIN {printf "%.0f", 32000 / ms}') |"
  done
done
