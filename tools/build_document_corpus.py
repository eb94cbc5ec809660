"""Builds a document corpus for tools/train_document.py, mita-eval-documents and the main job.

Sources (--source):
  texlive     TeX Live's documentation (what models/repository/texlive-doc-mita was trained on): the PDF manuals
              and articles of the Debian packages in TEXLIVE_PACKAGES, downloaded with `apt-get download` into
              --work/debs (not installed; ~1.9 GB), unpacked with dpkg-deb -x, turned into text with poppler's
              pdftotext (the way the public arXiv classification dataset was made from PDFs) and labelled by the
              package (collection) they come from, e.g. "music" for texlive-music.
  jsonl       JSON lines, one document per line: {"text": ..., "label": ...} (the layout of the public arXiv
              long-document classification dataset, and of the held-out file this tool writes with
              --heldout-jsonl). --train FILE and/or --heldout FILE; with --train alone, documents are held out by
              SHA-256 of their text. "label" is a class name, or an index into --label-names (default for integer
              labels: the arXiv dataset's 11 subject classes, ARXIV_LABELS). --labels FILE fixes the class list
              and order (e.g. a model package's labels.txt, so that label indices match the model's).
  linux-doc   the Linux kernel documentation of Debian linux-doc-6.1 (models/repository/linux-doc-mita).

Usage (the embedded TeX Live model; ~10 minutes on 2 cores after the download):
  /usr/bin/python3 tools/build_document_corpus.py --source texlive --out build/texlive-doc-corpus \
      --heldout-jsonl data/texlive-doc-heldout.jsonl.xz
  /usr/bin/python3 tools/build_document_corpus.py --source jsonl --train arxiv/train.jsonl \
      --heldout arxiv/test.jsonl --out build/arxiv-corpus

TeX Live documents: the PDFs under usr/share/doc/texlive-doc/ of each package; a document is kept when its text
has at least --min-words words, at least half of them alphabetic (font tables and pictures without text are
left out). A CTAN package's documentation folder (texlive-doc/<tree>/<package>/, latex-dev counted as latex)
is one group: the same manual in several languages or versions stays in one split, chosen by SHA-256 of the
group's name, and a group keeps at most --max-per-group documents (biblatex-ms alone has 98 PDFs). Near
duplicates (the same manual shipped twice, e.g. in latex/base and latex-dev/base) are dropped by MinHash over
word 5-grams (estimated Jaccard similarity >= 0.5; the first in path order stays). A class with more than
--max-documents documents keeps the first --max-documents in SHA-256("keep:" + path) order.

Linux documentation: every gzipped .rst/.txt file under Documentation/<folder>/..., labelled by <folder>;
translations/ and files directly under Documentation/ are left out, as are files under 256 bytes; classes with at
least --min-documents documents, at most --max-documents per class (SHA-256("keep:" + path) order); a document is
held out when the first byte of SHA-256(its path) is below 256 * --heldout-fraction.

Every source is deterministic: the same input gives the same corpus. Writes to --out:
  labels.txt                   one class per line
  train.tsv, heldout.tsv       text_file <TAB> label_index <TAB> source, one document per line
  texts/{train,heldout}/N.txt  the UTF-8 text of each document
  tokenizer.model/.vocab       SentencePiece unigram model (--vocab-size pieces, byte fallback: a character
                               outside the vocabulary becomes its UTF-8 bytes, not <unk>) trained on the training
                               texts with spm_train (Debian sentencepiece); --tokenizer FILE uses an existing one,
                               --vocab-size 0 writes none
  train.ids, heldout.ids       one line of token ids per document (spm_encode of the whole document, as the C++
                               SentencePiece tokenizer encodes it)
  lengths.txt                  the token-length distribution of both splits (with a tokenizer)
and, with --heldout-jsonl FILE(.xz), the held-out split as JSON lines {"text", "label", "source"} (xz-compressed
when the name ends in .xz): what the main job classifies, readable back with --source jsonl --heldout FILE.
"""
import argparse
import concurrent.futures
import glob
import gzip
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import zlib

LINUX_ROOT = "/usr/share/doc/linux-doc-6.1/Documentation"
TEXLIVE_PACKAGES = [
    "texlive-bibtex-extra", "texlive-fonts-extra-doc", "texlive-games", "texlive-humanities-doc",
    "texlive-lang-english", "texlive-lang-french", "texlive-lang-german", "texlive-latex-base-doc",
    "texlive-latex-extra-doc", "texlive-latex-recommended-doc", "texlive-luatex", "texlive-metapost-doc",
    "texlive-music", "texlive-pictures-doc", "texlive-plain-generic", "texlive-pstricks-doc",
    "texlive-publishers-doc", "texlive-science-doc",
]
# The public arXiv long-document classification dataset's label indices (He et al., "Long Document
# Classification From Local Word Glimpses via Recurrent Attention Learning", 2019; as distributed with integer
# labels).
ARXIV_LABELS = ["math.AC", "cs.CV", "cs.AI", "cs.SY", "math.GR", "cs.CE", "cs.PL", "cs.IT", "cs.DS", "cs.NE",
                "math.ST"]
BUCKETS = [(0, 4096, "under 4K"), (4096, 16384, "4K-16K"), (16384, 32768, "16K-32K"), (32768, 65536, "32K-64K"),
           (65536, 1 << 62, "over 64K")]


def sha256(text):
    return hashlib.sha256(text.encode("utf-8")).digest()


def is_heldout(key, fraction):
    return sha256(key)[0] < int(256 * fraction)


def clean_text(text):
    """pdftotext output -> text: page breaks become newlines, control characters go, blank runs shrink."""
    text = text.replace("\f", "\n").replace("\r", "\n")
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f\ufffe\uffff]", " ", text)
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


# ---- TeX Live documentation -------------------------------------------------------------------------------

def fetch_texlive(work, packages):
    """Downloads (apt-get download) and unpacks (dpkg-deb -x) the packages; returns {package: unpacked root}."""
    debs = os.path.join(work, "debs")
    os.makedirs(debs, exist_ok=True)
    missing = [p for p in packages if not glob.glob(os.path.join(debs, f"{p}_*.deb"))]
    if missing:
        print(f"apt-get download {' '.join(missing)} (into {debs})", flush=True)
        subprocess.run(["apt-get", "download", *missing], cwd=debs, check=True)
    roots = {}
    for package in packages:
        deb = sorted(glob.glob(os.path.join(debs, f"{package}_*.deb")))[-1]
        root = os.path.join(work, "root", package)
        stamp = os.path.join(root, ".unpacked")
        if not os.path.exists(stamp) or open(stamp).read() != os.path.basename(deb):
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
            with open(stamp, "w") as f:
                f.write(os.path.basename(deb))
        roots[package] = root
    return roots


def pdf_to_text(job):
    """pdftotext of one PDF, cached in the text file next to it in --work/text; returns the cleaned text."""
    pdf, cache = job
    if not os.path.exists(cache):
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        try:
            result = subprocess.run(["pdftotext", "-q", "-enc", "UTF-8", pdf, "-"], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, timeout=120)
            raw = result.stdout if result.returncode == 0 else b""
        except subprocess.TimeoutExpired:
            raw = b""
        with open(cache + ".tmp", "wb") as f:
            f.write(raw)
        os.replace(cache + ".tmp", cache)
    with open(cache, "rb") as f:
        return clean_text(f.read().decode("utf-8", errors="replace"))


def minhash_signatures(texts, hashes=64, shingle=5):
    """MinHash signature [hashes] (numpy uint64) of each text's word 5-grams (None for texts under 5 words)."""
    import numpy as np
    prime = np.uint64((1 << 61) - 1)
    rng = np.random.RandomState(12345)
    a = rng.randint(1, 1 << 30, size=hashes).astype(np.uint64)
    b = rng.randint(0, 1 << 30, size=hashes).astype(np.uint64)
    signatures = []
    for text in texts:
        words = text.lower().split()
        if len(words) < shingle:
            signatures.append(None)
            continue
        grams = {zlib.crc32(" ".join(words[i: i + shingle]).encode("utf-8")) for i in range(len(words) - shingle + 1)}
        values = np.fromiter(grams, dtype=np.uint64)
        signatures.append(((values[None, :] * a[:, None] + b[:, None]) % prime).min(axis=1))
    return signatures


def near_duplicates(texts, threshold=0.5, bands=16):
    """Indices of texts whose estimated Jaccard similarity to an earlier text is >= threshold."""
    signatures = minhash_signatures(texts)
    rows = len(next(s for s in signatures if s is not None)) // bands
    buckets, dropped = {}, set()
    for index, signature in enumerate(signatures):
        if signature is None:
            continue
        candidates = set()
        for band in range(bands):
            key = (band, signature[band * rows: (band + 1) * rows].tobytes())
            candidates.update(buckets.get(key, ()))
            buckets.setdefault(key, []).append(index)
        if any((signatures[c] == signature).mean() >= threshold for c in candidates if c not in dropped):
            dropped.add(index)
    return dropped


def texlive_group(relative):
    """The group of a PDF at `relative` (a path under usr/share/doc/texlive-doc/): its CTAN package's folder
    (`tree/package/.../x.pdf` -> `tree/package`, `latex-dev` read as `latex`; `tree/x.pdf` -> `tree`), the unit a
    package's manuals, translations and examples share and the held-out split never cuts."""
    parts = relative.split(os.sep)
    tree = parts[0].removesuffix("-dev")
    return f"{tree}/{parts[1]}" if len(parts) > 2 else tree


def texlive_documents(args):
    """[(label, group, source, text)] of the TeX Live documentation PDFs that pass the filters."""
    if shutil.which("pdftotext") is None:
        sys.exit("pdftotext not found: install the Debian package poppler-utils")
    roots = fetch_texlive(args.work, args.packages)
    jobs, meta = [], []
    for package, root in roots.items():
        doc_root = os.path.join(root, "usr", "share", "doc", "texlive-doc")
        label = package.removeprefix("texlive-").removesuffix("-doc")
        for directory, folders, files in os.walk(doc_root):
            folders.sort()
            for name in sorted(files):
                if not name.lower().endswith(".pdf"):
                    continue
                path = os.path.join(directory, name)
                relative = os.path.relpath(path, doc_root)
                group = texlive_group(relative)
                jobs.append((path, os.path.join(args.work, "text", package, relative + ".txt")))
                meta.append((label, group, f"{package}:{relative}"))
    print(f"{len(jobs)} PDFs; pdftotext with {args.jobs} processes", flush=True)
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        texts = list(pool.map(pdf_to_text, jobs, chunksize=8))
    kept = []
    for (label, group, source), text in zip(meta, texts):
        words = text.split()
        if len(words) < args.min_words:
            continue
        if sum(1 for w in words if w.isalpha()) < 0.5 * len(words):
            continue
        kept.append((label, group, source, text))
    dropped = near_duplicates([document[3] for document in kept])
    print(f"{len(kept)} PDFs with >= {args.min_words} words of text, {len(dropped)} near duplicates dropped",
          flush=True)
    kept = [document for i, document in enumerate(kept) if i not in dropped]
    by_group = {}
    for document in kept:
        by_group.setdefault(document[1], []).append(document)
    documents = []
    for group, members in sorted(by_group.items()):
        members.sort(key=lambda document: sha256("keep:" + document[2]))
        documents.extend(members[: args.max_per_group])
    return documents


# ---- JSON lines (the arXiv dataset's layout) ---------------------------------------------------------------

def read_jsonl(path):
    opener = lzma.open if path.endswith(".xz") else gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text, label = row["text"], row["label"]
            except (ValueError, KeyError, TypeError) as error:
                sys.exit(f"{path} line {number}: not a JSON object with 'text' and 'label' ({error})")
            if not isinstance(text, str) or not isinstance(label, (str, int)) or isinstance(label, bool):
                sys.exit(f"{path} line {number}: 'text' must be a string and 'label' a string or an integer")
            yield number, text, label, row.get("source", f"{os.path.basename(path)}:{number}")


def jsonl_label_name(label, names, path):
    if isinstance(label, str):
        return label
    if not 0 <= label < len(names):
        sys.exit(f"{path}: label {label} is out of range: allowed [0, {len(names) - 1}] (--label-names)")
    return names[label]


# ---- Linux kernel documentation ----------------------------------------------------------------------------

def linux_documents(args):
    if not os.path.isdir(args.root):
        sys.exit(f"{args.root} not found: install the Debian package linux-doc-6.1")
    documents = []
    for directory, folders, files in os.walk(args.root):
        folders.sort()
        relative_directory = os.path.relpath(directory, args.root)
        if relative_directory == ".":
            continue
        top = relative_directory.split(os.sep)[0]
        if top == "translations":
            continue
        for name in sorted(files):
            if not name.endswith((".rst.gz", ".txt.gz", ".rst", ".txt")):
                continue
            path = os.path.join(directory, name)
            with (gzip.open(path, "rb") if name.endswith(".gz") else open(path, "rb")) as f:
                raw = f.read()
            if len(raw) < 256:
                continue
            relative = os.path.relpath(path, args.root)
            documents.append((top, relative, relative, raw.decode("utf-8", errors="replace")))
    return documents


# ---- corpus ------------------------------------------------------------------------------------------------

def split_and_cap(documents, args):
    """{split: [(label, source, text)]} from (label, group, source, text): classes with >= --min-documents
    documents, at most --max-documents each, held out by SHA-256 of the group."""
    by_label = {}
    for document in documents:
        by_label.setdefault(document[0], []).append(document)
    splits = {"train": [], "heldout": []}
    labels = sorted(label for label, members in by_label.items() if len(members) >= args.min_documents)
    for label in labels:
        members = sorted(by_label[label], key=lambda document: sha256("keep:" + document[2]))[: args.max_documents]
        for _, group, source, text in sorted(members, key=lambda document: document[2]):
            split = "heldout" if is_heldout(group, args.heldout_fraction) else "train"
            splits[split].append((label, source, text))
    return labels, splits


def write_corpus(out, labels, splits):
    index = {label: i for i, label in enumerate(labels)}
    for split, rows in splits.items():
        os.makedirs(os.path.join(out, "texts", split), exist_ok=True)
        with open(os.path.join(out, f"{split}.tsv"), "w") as tsv:
            for n, (label, source, text) in enumerate(rows):
                file_name = os.path.join("texts", split, f"{n:05d}.txt")
                with open(os.path.join(out, file_name), "w", encoding="utf-8") as f:
                    f.write(text)
                tsv.write(f"{file_name}\t{index[label]}\t{source.replace(chr(9), ' ')}\n")
    with open(os.path.join(out, "labels.txt"), "w") as f:
        f.write("\n".join(labels) + "\n")
    for label in labels:
        counts = [sum(1 for row in splits[s] if row[0] == label) for s in ("train", "heldout")]
        print(f"{label:20s} train {counts[0]:5d} held-out {counts[1]:5d}")
    print(f"{len(labels)} classes, {len(splits['train'])} training and {len(splits['heldout'])} held-out documents",
          flush=True)


def write_jsonl(path, rows, max_bytes):
    """The rows as JSON lines; a text over max_bytes (0: no limit) is cut before the whitespace preceding it."""
    opener = lzma.open if path.endswith(".xz") else open
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with opener(path + ".tmp", "wt", encoding="utf-8") as f:
        for label, source, text in rows:
            if max_bytes and len(text.encode("utf-8")) > max_bytes:
                cut = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
                text = cut[: max(cut.rfind(" "), cut.rfind("\n"))].rstrip() + "\n"
            f.write(json.dumps({"text": text, "label": label, "source": source}, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)


def tokenize(out, splits, vocab_size, tokenizer):
    prefix = os.path.join(out, "tokenizer")
    if tokenizer:
        if os.path.abspath(tokenizer) != os.path.abspath(prefix + ".model"):
            shutil.copyfile(tokenizer, prefix + ".model")
        # The vocabulary too, as spm_train writes it (tools/train_document.py sizes the model by it).
        subprocess.run(["spm_export_vocab", f"--model={prefix}.model", f"--output={prefix}.vocab"], check=True)
    else:
        # spm_train reads one sentence per line: the training texts' lines (spm_train skips very long lines).
        lines_file = os.path.join(out, "spm_training_lines.txt")
        with open(lines_file, "w", encoding="utf-8") as f:
            for _, _, text in splits["train"]:
                for line in text.splitlines():
                    if line.strip():
                        f.write(line + "\n")
        subprocess.run(["spm_train", f"--input={lines_file}", f"--model_prefix={prefix}",
                        f"--vocab_size={vocab_size}", "--model_type=unigram", "--character_coverage=0.9995",
                        "--byte_fallback=true", "--input_sentence_size=300000", "--shuffle_input_sentence=true",
                        "--seed_sentencepiece_size=200000", "--num_threads=1", "--minloglevel=1"], check=True)
        os.remove(lines_file)
    # spm_encode encodes line by line; a document is passed as one line with its newlines as spaces, which is
    # what the normaliser (nmt_nfkc) does with them when the C++ tokenizer encodes the whole text.
    lengths = {}
    for split, rows in splits.items():
        joined = "".join(text.replace("\r", " ").replace("\n", " ") + "\n" for _, _, text in rows)
        result = subprocess.run(["spm_encode", f"--model={prefix}.model", "--output_format=id"],
                                input=joined.encode("utf-8"), stdout=subprocess.PIPE, check=True)
        lines = result.stdout.decode().split("\n")[: len(rows)]
        assert len(lines) == len(rows), (len(lines), len(rows))
        with open(os.path.join(out, f"{split}.ids"), "w") as f:
            f.write("\n".join(lines) + "\n")
        lengths[split] = sorted(len(line.split()) for line in lines)
    with open(os.path.join(out, "lengths.txt"), "w") as f:
        for split, values in lengths.items():
            if not values:
                continue
            counts = [sum(1 for v in values if low <= v < high) for low, high, _ in BUCKETS]
            line = (f"{split}: {len(values)} documents, {sum(values)} tokens, median {values[len(values) // 2]}, "
                    f"90th percentile {values[len(values) * 9 // 10]}, max {values[-1]}; " +
                    ", ".join(f"{name} {n}" for (_, _, name), n in zip(BUCKETS, counts)))
            print(line)
            f.write(line + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", choices=["texlive", "jsonl", "linux-doc"], default="linux-doc")
    parser.add_argument("--out", required=True)
    parser.add_argument("--root", default=LINUX_ROOT, help="linux-doc: the Documentation folder")
    parser.add_argument("--work", default="build/texlive-doc", help="texlive: downloads, unpacked packages, texts")
    parser.add_argument("--packages", nargs="+", default=TEXLIVE_PACKAGES, help="texlive: Debian packages")
    parser.add_argument("--jobs", type=int, default=2, help="texlive: pdftotext processes")
    parser.add_argument("--min-words", type=int, default=1000, help="texlive: shortest document kept, words")
    parser.add_argument("--max-per-group", type=int, default=6, help="texlive: documents per CTAN package")
    parser.add_argument("--train", help="jsonl: training documents")
    parser.add_argument("--heldout", help="jsonl: held-out documents")
    parser.add_argument("--labels", help="jsonl: labels.txt fixing the classes and their order")
    parser.add_argument("--label-names", default=",".join(ARXIV_LABELS),
                        help="jsonl: comma-separated class names of integer labels 0, 1, ...")
    parser.add_argument("--min-documents", type=int, default=40, help="smallest class kept")
    parser.add_argument("--max-documents", type=int, default=300, help="largest class (more are left out)")
    parser.add_argument("--heldout-fraction", type=float, default=0.2)
    parser.add_argument("--heldout-jsonl", help="also write the held-out split here as JSON lines (.xz: compressed)")
    parser.add_argument("--heldout-jsonl-max-bytes", type=int, default=400000,
                        help="cut longer texts in --heldout-jsonl (65,536 tokens are ~250 KB here; 0: no cut)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="SentencePiece pieces (0: no tokenizer)")
    parser.add_argument("--tokenizer", help="an existing SentencePiece model instead of training one")
    args = parser.parse_args()

    if args.source == "jsonl":
        if not args.train and not args.heldout:
            sys.exit("--source jsonl needs --train and/or --heldout")
        names = args.label_names.split(",")
        fixed = [line.strip() for line in open(args.labels) if line.strip()] if args.labels else None
        splits = {"train": [], "heldout": []}
        for split, path in (("train", args.train), ("heldout", args.heldout)):
            if not path:
                continue
            for number, text, label, source in read_jsonl(path):
                if not text.strip():
                    continue
                name = jsonl_label_name(label, names, path)
                if fixed is not None and name not in fixed:
                    sys.exit(f"{path} line {number}: label '{name}' is not in {args.labels}")
                target = split
                if split == "train" and not args.heldout and is_heldout(text, args.heldout_fraction):
                    target = "heldout"
                splits[target].append((name, source, text))
        labels = fixed or sorted({row[0] for rows in splits.values() for row in rows})
    else:
        documents = texlive_documents(args) if args.source == "texlive" else linux_documents(args)
        labels, splits = split_and_cap(documents, args)
    write_corpus(args.out, labels, splits)
    if args.heldout_jsonl:
        write_jsonl(args.heldout_jsonl, splits["heldout"], args.heldout_jsonl_max_bytes)
        print(f"wrote {args.heldout_jsonl} ({os.path.getsize(args.heldout_jsonl)} bytes)")
    if args.vocab_size > 0 or args.tokenizer:
        tokenize(args.out, splits, args.vocab_size, args.tokenizer)


if __name__ == "__main__":
    main()
