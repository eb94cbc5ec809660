"""Trains a MiTA document classifier package on a corpus from tools/build_document_corpus.py.

Usage (reproduces models/repository/texlive-doc-mita, the main job's document model, in two stages: the first
model's 256-token recipe, then long windows from its weights; commands, time and figures in
docs/long_documents.md "Model and training"):
  OMP_WAIT_POLICY=passive /opt/mita/peers/bin/python tools/train_document.py --corpus build/texlive-doc-corpus \
      --out models/repository/texlive-doc-mita --init FIRST_STAGE_PACKAGE --seed 1 --max-minutes 50

What a step is: --batch training documents, each cut to a window of at most --window tokens (a document that
short is taken whole); with probability --start-rate the window is the document's beginning, otherwise it
starts at a random token. Windows of equal length share one forward. MiTA runs through the sparse training
attention (tools/mita_sparse.py: O(N (m + k) d) per head), so windows of thousands of tokens fit a step; full
attention (PyTorch's scaled_dot_product_attention) runs every --full-every-th step on windows of at most
--full-window tokens. The other steps draw a budget from TRAIN_BUDGETS (the declared presets among them), so the
same weights serve every budget and full attention. The model pools with attention (--pooling attention, heads
and logarithmic position buckets: tools/mita_reference.py AttentionPooling; the window's tokens carry their
position in the document) or with the mean (--pooling mean, the earlier packages).

--validation-fraction F holds out the training documents of a fraction F of the source groups (a CTAN package, as
the corpus builder groups them for its held-out split, read from the corpus' source column) and evaluates whole
documents (cut to max_tokens) at the default budget on them every --checkpoint-every steps, writing the package of
the best one so far; with F = 0 (the default) the package is rewritten at every checkpoint. The held-out split is
never read. --resume continues a run from its --state file (model, optimizer, schedule, random state), written at
every checkpoint, so a run stopped by --max-minutes or killed can go on. --init starts from a package's weights (the
same sizes; attention pooling's scores start at zero, so a mean-pooling package starts as it was).
"""
import argparse
import hashlib
import json
import math
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F

from build_document_corpus import texlive_group
from mita_reference import MitaDocument, document_config, load_safetensors, mita_attention, save_safetensors
from mita_sparse import sparse_mita_attention

# Budgets of the MiTA steps: the presets (fast, default/balanced, accurate) and others around them.
TRAIN_BUDGETS = [(4, 16), (8, 32), (16, 64), (32, 128), (16, 32), (64, 64), (8, 128), (32, 32)]


def source_group(source):
    """The group of a document's source column: for the TeX Live documentation (`package:relative/path.pdf`) the
    corpus builder's own grouping (build_document_corpus.texlive_group, the unit its held-out split never cuts); a
    source without that form (JSON lines) is its own group."""
    if ":" not in source:
        return source
    return texlive_group(source.split(":", 1)[1])


def read_split(corpus, split):
    """(ids, labels, groups) of a corpus split (groups: source_group of each document's source)."""
    with open(os.path.join(corpus, f"{split}.tsv")) as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    with open(os.path.join(corpus, f"{split}.ids")) as f:
        lines = f.read().split("\n")[: len(rows)]
    ids, labels, groups = [], [], []
    for row, line in zip(rows, lines):
        tokens = torch.tensor([int(t) for t in line.split()], dtype=torch.long)
        if tokens.numel() == 0:
            continue
        ids.append(tokens)
        labels.append(int(row[1]))
        groups.append(source_group(row[2] if len(row) > 2 else row[0]))
    return ids, torch.tensor(labels), groups


def forward_documents(model, documents, budget, starts=None):
    """Logits for a list of 1-D id tensors (and each one's first position in its document): documents of the
    same length share one batched forward."""
    by_length = {}
    for position, document in enumerate(documents):
        by_length.setdefault(document.numel(), []).append(position)
    rows = [None] * len(documents)
    for positions in by_length.values():
        start = None if starts is None else torch.tensor([starts[p] for p in positions])
        logits = model(torch.stack([documents[p] for p in positions]), budget, start)
        for j, p in enumerate(positions):
            rows[p] = logits[j]
    return torch.stack(rows)


def evaluate(model, ids, labels, budget, max_tokens):
    """Accuracy on whole documents (their first max_tokens tokens), one document per forward."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for document, label in zip(ids, labels):
            logits = model(document[:max_tokens].unsqueeze(0), budget)
            correct += int(logits.argmax(-1).item() == label.item())
    model.train()
    return correct / max(1, len(ids))


def write_package(model, cfg, corpus, out, step):
    os.makedirs(out, exist_ok=True)
    save_safetensors(model.state_dict(), os.path.join(out, "model.safetensors.tmp"),
                     {"format": "pt", "trained_by": "tools/train_document.py", "step": step})
    os.replace(os.path.join(out, "model.safetensors.tmp"), os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    shutil.copyfile(os.path.join(corpus, "labels.txt"), os.path.join(out, "labels.txt"))
    shutil.copyfile(os.path.join(corpus, "tokenizer.model"), os.path.join(out, "tokenizer.model"))


def window(document, length, start_rate):
    """(window, its first position): the whole document when it has at most `length` tokens, else `length`
    tokens from the beginning (probability start_rate) or from a random position."""
    n = document.numel()
    if n <= length:
        return document, 0
    offset = 0 if random.random() < start_rate else random.randrange(n - length + 1)
    return document[offset: offset + length], offset


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=32, help="documents per step (with --min-window: the most)")
    parser.add_argument("--window", type=int, default=8192, help="longest training window, tokens")
    parser.add_argument("--min-window", type=int, default=256,
                        help="each step draws its window length log-uniformly from [--min-window, --window] and takes "
                             "--tokens-per-step / length documents (at most --batch); 0: every window --window long, "
                             "--batch documents")
    parser.add_argument("--tokens-per-step", type=int, default=24576)
    parser.add_argument("--start-rate", type=float, default=0.5, help="share of windows at a document's start")
    parser.add_argument("--full-every", type=int, default=8, help="every N-th step runs full attention (0: never)")
    parser.add_argument("--full-window", type=int, default=4096, help="longest window of a full-attention step")
    parser.add_argument("--attention", choices=["sparse", "dense"], default="sparse",
                        help="MiTA for training: sparse (tools/mita_sparse.py) or the dense twin (N^2 memory)")
    parser.add_argument("--pooling", choices=["attention", "mean"], default="attention")
    parser.add_argument("--pool-heads", type=int, default=4)
    parser.add_argument("--position-buckets", type=int, default=17, help="attention pooling's position buckets")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--token-dropout", type=float, default=0.1,
                        help="training only: share of window tokens dropped (a regulariser)")
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="training only: dropout on the embedded tokens and the blocks' residual branches")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=250)
    parser.add_argument("--max-minutes", type=float, default=88, help="stop (after a checkpoint) past this time")
    parser.add_argument("--validation-fraction", type=float, default=0.0)
    parser.add_argument("--init", help="start from this package's weights (same sizes; a mean-pooling package "
                        "starts attention pooling at its zero-initialised scores, i.e. at the mean)")
    parser.add_argument("--state", help="resumable training state (default: OUT/../<name>.state.pt, not packaged)")
    parser.add_argument("--resume", action="store_true", help="continue from --state")
    parser.add_argument("--embed-dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--mlp-hidden-dim", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=65536)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    state_path = args.state or os.path.join(os.path.dirname(os.path.abspath(args.out)),
                                            os.path.basename(os.path.abspath(args.out)) + ".state.pt")
    with open(os.path.join(args.corpus, "labels.txt")) as f:
        labels = [line.strip() for line in f if line.strip()]
    train_ids, train_labels, groups = read_split(args.corpus, "train")
    validation = [i for i, g in enumerate(groups)
                  if int(hashlib.sha256(("validation:" + g).encode()).hexdigest()[:8], 16) < args.validation_fraction
                  * 2 ** 32]
    validation_set = set(validation)
    training = [i for i in range(len(train_ids)) if i not in validation_set]
    with open(os.path.join(args.corpus, "tokenizer.vocab"), encoding="utf-8") as f:
        vocab_size = sum(1 for line in f if line.strip())
    pooling = None if args.pooling == "mean" else {"type": "attention", "heads": args.pool_heads,
                                                     "position_buckets": args.position_buckets}
    cfg = document_config(vocab_size=vocab_size, num_classes=len(labels), tokenizer="sentencepiece",
                          embed_dim=args.embed_dim, depth=args.depth, num_heads=args.heads,
                          mlp_hidden_dim=args.mlp_hidden_dim, kernel_size=9, max_tokens=args.max_tokens,
                          pooling=pooling)
    model = MitaDocument(cfg, attention=sparse_mita_attention if args.attention == "sparse" else mita_attention,
                         dropout=args.dropout)
    if args.init:
        weights = load_safetensors(os.path.join(args.init, "model.safetensors"))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or any(not name.startswith("pool.") for name in missing):
            raise SystemExit(f"--init {args.init}: the package does not fit these sizes (missing {missing}, "
                             f"unexpected {unexpected})")
        print(f"initialised from {args.init} (new: {', '.join(missing) or 'nothing'})", flush=True)
    print(f"{len(training)} training and {len(validation)} validation documents ({len(set(groups))} groups), "
          f"{len(labels)} classes, {sum(p.numel() for p in model.parameters())} parameters", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    default = cfg["attention"]["default_budget"]
    default_budget = (default["expert_count"], default["expert_width"])
    first_step, best, elapsed_before = 1, -1.0, 0.0
    if args.resume:
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        random.setstate(state["python_random"])
        torch.set_rng_state(state["torch_random"])
        first_step, best, elapsed_before = state["step"] + 1, state["best"], state["elapsed"]
        print(f"resumed at step {first_step} ({elapsed_before:.0f} s before)", flush=True)
    start = time.time() - elapsed_before
    loss_sum, correct, seen, tokens_seen = 0.0, 0, 0, 0
    for step in range(first_step, args.steps + 1):
        full = args.full_every > 0 and step % args.full_every == 0
        budget = None if full else random.choice(TRAIN_BUDGETS)
        length = args.full_window if full else args.window
        batch = args.batch
        if args.min_window > 0:
            length = min(length, round(math.exp(random.uniform(math.log(args.min_window), math.log(args.window)))))
            batch = max(1, min(args.batch, args.tokens_per_step // length))
        picks = [random.choice(training) for _ in range(batch)]
        windows = [window(train_ids[p], length, args.start_rate) for p in picks]
        documents = [w for w, _ in windows]
        if args.token_dropout > 0:
            documents = [d[torch.rand(d.numel()) >= args.token_dropout] if d.numel() > 64 else d for d in documents]
        y = train_labels[picks]
        logits = forward_documents(model, documents, budget, [offset for _, offset in windows])
        loss = F.cross_entropy(logits, y, label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_sum += loss.item() * len(y)
        correct += (logits.argmax(-1) == y).sum().item()
        seen += len(y)
        tokens_seen += sum(d.numel() for d in documents)
        out_of_time = time.time() - start > args.max_minutes * 60
        if step % args.checkpoint_every == 0 or step == args.steps or out_of_time:
            message = (f"step {step}/{args.steps}: loss {loss_sum / seen:.4f} train acc {correct / seen:.4f} "
                       f"({tokens_seen / seen:.0f} tokens per window)")
            if validation:
                accuracy = evaluate(model, [train_ids[i] for i in validation], train_labels[validation],
                                    default_budget, args.max_tokens)
                message += f" validation acc (whole documents, default budget) {accuracy:.4f}"
                if accuracy > best:
                    best = accuracy
                    write_package(model, cfg, args.corpus, args.out, step)
                    message += " (best: package written)"
            else:
                write_package(model, cfg, args.corpus, args.out, step)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "schedule": schedule.state_dict(), "python_random": random.getstate(),
                        "torch_random": torch.get_rng_state(), "step": step, "best": best,
                        "elapsed": time.time() - start}, state_path + ".tmp")
            os.replace(state_path + ".tmp", state_path)
            print(f"{message} ({time.time() - start:.0f} s)", flush=True)
            loss_sum, correct, seen, tokens_seen = 0.0, 0, 0, 0
        if out_of_time:
            print(f"stopped at step {step}: --max-minutes {args.max_minutes} reached (--resume goes on)", flush=True)
            break


if __name__ == "__main__":
    main()
