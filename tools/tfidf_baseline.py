"""TF-IDF + logistic regression over each document's whole text: the baseline beside the MiTA document model.

Usage (corpus from tools/build_document_corpus.py, with its tokenizer's .ids files for the length buckets):
  /usr/bin/python3 tools/tfidf_baseline.py --corpus build/texlive-doc-corpus

Features: scikit-learn's TfidfVectorizer over word unigrams and bigrams (lowercased, sublinear term frequency,
terms in at least 2 training documents, at most --max-features of them) fitted on the training split; classifier:
LogisticRegression (multinomial, L2, C = --c) on those features. Prints held-out accuracy overall and per length
bucket, the buckets being the document's token count under the corpus tokenizer cut to --max-tokens (the
tokens the document model classifies), in the table format of mita-eval-documents --buckets. Training and
prediction time are printed too (the whole held-out split, one process).
"""
import argparse
import os
import time

BUCKETS = [(0, 4096, "under 4K"), (4096, 16384, "4K-16K"), (16384, 32768, "16K-32K"), (32768, 1 << 62, "32K-64K")]


def read_split(corpus, split):
    texts, labels = [], []
    with open(os.path.join(corpus, f"{split}.tsv")) as f:
        for line in f:
            if not line.strip():
                continue
            file_name, label, _ = line.rstrip("\n").split("\t")
            with open(os.path.join(corpus, file_name), encoding="utf-8") as text:
                texts.append(text.read())
            labels.append(int(label))
    lengths = None
    ids_file = os.path.join(corpus, f"{split}.ids")
    if os.path.exists(ids_file):
        with open(ids_file) as f:
            lengths = [len(line.split()) for line in f.read().split("\n")[: len(labels)]]
    return texts, labels, lengths


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--max-features", type=int, default=200000)
    parser.add_argument("--c", type=float, default=20.0, help="inverse L2 regularisation strength")
    parser.add_argument("--max-tokens", type=int, default=65536, help="the document model's max_tokens (buckets)")
    args = parser.parse_args()
    import numpy
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    train_texts, train_labels, _ = read_split(args.corpus, "train")
    heldout_texts, heldout_labels, heldout_lengths = read_split(args.corpus, "heldout")
    start = time.time()
    vectorizer = TfidfVectorizer(lowercase=True, ngram_range=(1, 2), min_df=2, max_features=args.max_features,
                                 sublinear_tf=True, dtype=numpy.float32)
    features = vectorizer.fit_transform(train_texts)
    classifier = LogisticRegression(C=args.c, max_iter=2000)
    classifier.fit(features, train_labels)
    trained = time.time() - start
    start = time.time()
    predicted = classifier.predict(vectorizer.transform(heldout_texts))
    predicting = time.time() - start
    correct = [int(p == y) for p, y in zip(predicted, heldout_labels)]
    print(f"TF-IDF + logistic regression: {len(train_texts)} training, {len(heldout_texts)} held-out documents, "
          f"{features.shape[1]} features; training {trained:.1f} s, predicting the held-out split {predicting:.1f} s "
          f"({1000 * predicting / max(1, len(heldout_texts)):.1f} ms per document)")
    print(f"held-out accuracy {sum(correct) / len(correct):.4f} ({sum(correct)} / {len(correct)})")
    if heldout_lengths is not None:
        print("| bucket (tokens) | documents | accuracy | correct |\n|---|---|---|---|")
        for low, high, name in BUCKETS:
            members = [c for c, n in zip(correct, heldout_lengths) if low <= min(n, args.max_tokens) < high]
            if members:
                print(f"| {name} | {len(members)} | {sum(members) / len(members):.4f} | {sum(members)} / {len(members)} |")


if __name__ == "__main__":
    main()
