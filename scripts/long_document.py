#!/usr/bin/env python3
"""The main job's long real document: the held-out documents of the class with the most held-out text, in corpus
order, concatenated (blank line between) until 72,000 bytes, written to CORPUS/long.txt. With the embedded
SentencePiece tokenizer that is about 19K tokens (3.7 bytes per token here). Prints the class and the size.

Usage: /usr/bin/python3 scripts/long_document.py CORPUS   (a corpus of tools/build_document_corpus.py)
"""
import collections
import os
import sys

corpus = sys.argv[1]
rows = [line.rstrip("\n").split("\t") for line in open(os.path.join(corpus, "heldout.tsv")) if line.strip()]
size = collections.Counter()
for path, label, _ in rows:
    size[label] += os.path.getsize(os.path.join(corpus, path))
label = size.most_common(1)[0][0]
parts, total = [], 0
for path, row_label, _ in rows:
    if row_label == label and total < 72000:
        text = open(os.path.join(corpus, path), encoding="utf-8").read()
        parts.append(text)
        total += len(text.encode("utf-8"))
open(os.path.join(corpus, "long.txt"), "w", encoding="utf-8").write("\n\n".join(parts))
names = open(os.path.join(corpus, "labels.txt")).read().split()
print(f"{names[int(label)]} ({len(parts)} held-out documents, {total} bytes)")
