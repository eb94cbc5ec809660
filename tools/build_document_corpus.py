"""Builds the long-document corpus from the Linux kernel documentation (Debian package linux-doc-6.1).

Usage (what models/repository/linux-doc-mita was trained on):
  /usr/bin/python3 tools/build_document_corpus.py --out build/linux-doc-corpus

Documents: every gzipped .rst/.txt file under /usr/share/doc/linux-doc-6.1/Documentation/<folder>/..., labelled
by <folder> (the top-level folder); translations/ and files directly under Documentation/ are left out, as are
files under 256 bytes. Classes: the folders with at least --min-documents documents; a folder with more than
--max-documents keeps the first --max-documents in SHA-256("keep:" + path) order (devicetree alone has 1,876
files, most of them short binding descriptions). Split: a document is held out when the first byte of SHA-256(its
path relative to Documentation/) is below 256 * --heldout-fraction, so the split does not depend on the file
listing order or on the other files. Deterministic: the same package gives the same corpus.

Writes to --out:
  labels.txt                   one class (folder name) per line, sorted
  train.tsv, heldout.tsv       text_file <TAB> label_index <TAB> source path, one document per line
  texts/{train,heldout}/N.txt  the decoded UTF-8 text of each document (invalid bytes replaced by U+FFFD)
  tokenizer.model/.vocab       SentencePiece unigram model trained on the training texts (spm_train, Debian
                               package sentencepiece), unless --vocab-size 0
  train.ids, heldout.ids       one line of token ids per document (spm_encode of the whole document, newlines
                               included, as the C++ SentencePiece tokenizer encodes it)
"""
import argparse
import gzip
import hashlib
import os
import subprocess
import sys

ROOT = "/usr/share/doc/linux-doc-6.1/Documentation"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--root", default=ROOT)
    parser.add_argument("--min-documents", type=int, default=40)
    parser.add_argument("--max-documents", type=int, default=300)
    parser.add_argument("--heldout-fraction", type=float, default=0.2)
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()
    if not os.path.isdir(args.root):
        sys.exit(f"{args.root} not found: install the Debian package linux-doc-6.1")

    by_folder = {}
    for directory, folders, files in os.walk(args.root):
        folders.sort()
        relative_directory = os.path.relpath(directory, args.root)
        if relative_directory == ".":
            continue
        top = relative_directory.split(os.sep)[0]
        if top == "translations":
            continue
        for name in sorted(files):
            if not (name.endswith(".rst.gz") or name.endswith(".txt.gz") or name.endswith(".rst")
                    or name.endswith(".txt")):
                continue
            path = os.path.join(directory, name)
            with (gzip.open(path, "rb") if name.endswith(".gz") else open(path, "rb")) as f:
                raw = f.read()
            if len(raw) < 256:
                continue
            relative = os.path.relpath(path, args.root)
            keep_order = hashlib.sha256(("keep:" + relative).encode()).digest()
            by_folder.setdefault(top, []).append((keep_order, relative, raw))

    labels = sorted(f for f, documents in by_folder.items() if len(documents) >= args.min_documents)
    os.makedirs(os.path.join(args.out, "texts", "train"), exist_ok=True)
    os.makedirs(os.path.join(args.out, "texts", "heldout"), exist_ok=True)
    rows = {"train": [], "heldout": []}
    threshold = int(256 * args.heldout_fraction)
    for label_index, label in enumerate(labels):
        documents = sorted(by_folder[label])[: args.max_documents]
        for _, relative, raw in sorted(documents, key=lambda document: document[1]):
            split = "heldout" if hashlib.sha256(relative.encode()).digest()[0] < threshold else "train"
            text = raw.decode("utf-8", errors="replace")
            file_name = os.path.join("texts", split, f"{len(rows[split]):05d}.txt")
            with open(os.path.join(args.out, file_name), "w", encoding="utf-8") as f:
                f.write(text)
            rows[split].append((file_name, label_index, relative, text))
    with open(os.path.join(args.out, "labels.txt"), "w") as f:
        f.write("\n".join(labels) + "\n")
    for split, split_rows in rows.items():
        with open(os.path.join(args.out, f"{split}.tsv"), "w") as f:
            for file_name, label_index, relative, _ in split_rows:
                f.write(f"{file_name}\t{label_index}\t{relative}\n")
    for label_index, label in enumerate(labels):
        counts = [sum(1 for row in rows[s] if row[1] == label_index) for s in ("train", "heldout")]
        print(f"{label:16s} train {counts[0]:4d} held-out {counts[1]:4d}")
    print(f"{len(labels)} classes, {len(rows['train'])} training and {len(rows['heldout'])} held-out documents")

    if args.vocab_size > 0:
        # spm_train reads one sentence per line: the training texts' lines (long lines are skipped by spm_train).
        lines_file = os.path.join(args.out, "spm_training_lines.txt")
        with open(lines_file, "w", encoding="utf-8") as f:
            for _, _, _, text in rows["train"]:
                for line in text.splitlines():
                    if line.strip():
                        f.write(line + "\n")
        prefix = os.path.join(args.out, "tokenizer")
        subprocess.run(["spm_train", f"--input={lines_file}", f"--model_prefix={prefix}",
                        f"--vocab_size={args.vocab_size}", "--model_type=unigram", "--character_coverage=0.9995",
                        "--input_sentence_size=300000", "--shuffle_input_sentence=true", "--seed_sentencepiece_size=200000",
                        "--num_threads=1", "--minloglevel=1"], check=True)
        os.remove(lines_file)
        # spm_encode encodes line by line; a document is passed as one line with its newlines as spaces, which
        # is what the normaliser (nmt_nfkc) does with them when the C++ tokenizer encodes the whole text.
        for split, split_rows in rows.items():
            joined = "".join(text.replace("\r", " ").replace("\n", " ") + "\n" for _, _, _, text in split_rows)
            result = subprocess.run(["spm_encode", f"--model={prefix}.model", "--output_format=id"],
                                    input=joined.encode("utf-8"), stdout=subprocess.PIPE, check=True)
            lines = result.stdout.decode().split("\n")[: len(split_rows)]
            assert len(lines) == len(split_rows), (len(lines), len(split_rows))
            with open(os.path.join(args.out, f"{split}.ids"), "w") as f:
                f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
