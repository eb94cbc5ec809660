"""Trains a MiTA document classifier package on a corpus from tools/build_document_corpus.py.

Usage (reproduces models/repository/texlive-doc-mita, the main job's document model; docs/long_documents.md):
  OMP_WAIT_POLICY=passive /usr/bin/python3 tools/train_document.py --corpus build/texlive-doc-corpus \
      --out models/repository/texlive-doc-mita --steps 3000 --crop 512 --lr 5e-3 --threads 2
and models/repository/linux-doc-mita (the Linux documentation corpus):
  ... --corpus build/linux-doc-corpus --out models/repository/linux-doc-mita --steps 800 --crop 256 --lr 2e-3
The vocabulary size is the corpus tokenizer's (tokenizer.vocab). Documents are cut to a random window of --crop
tokens per step: MiTA and the convolutional position encoding have nothing tied to the trained length, and the
classifier mean-pools over the tokens, so the model runs on documents of up to max_tokens (65,536) at
inference. Each step takes --batch documents; steps cycle through full attention (every 4th step) and MiTA
budgets, so the same weights work at every declared budget and with full attention. The package (config.json, model.safetensors, labels.txt, tokenizer.model) is rewritten
every --checkpoint-every steps, so a run stopped early (or by --max-minutes) still leaves usable weights.
"""
import argparse
import json
import math
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F

from mita_reference import MitaDocument, document_config, save_safetensors

TRAIN_BUDGETS = [(8, 32), (16, 64), (32, 128), (4, 16), (16, 32), (64, 64)]


def read_split(corpus, split):
    with open(os.path.join(corpus, f"{split}.tsv")) as f:
        labels = [int(line.split("\t")[1]) for line in f if line.strip()]
    with open(os.path.join(corpus, f"{split}.ids")) as f:
        ids = [torch.tensor([int(t) for t in line.split()], dtype=torch.long) for line in f.read().split("\n")[: len(labels)]]
    keep = [i for i in range(len(labels)) if ids[i].numel() > 0]
    return [ids[i] for i in keep], torch.tensor([labels[i] for i in keep])


def forward_documents(model, documents, budget):
    """Logits for a list of 1-D id tensors: documents of the same length share one batched forward."""
    by_length = {}
    for position, document in enumerate(documents):
        by_length.setdefault(document.numel(), []).append(position)
    rows = [None] * len(documents)
    for positions in by_length.values():
        logits = model(torch.stack([documents[p] for p in positions]), budget)
        for j, p in enumerate(positions):
            rows[p] = logits[j]
    return torch.stack(rows)


def evaluate(model, ids, labels, budget, tokens):
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(ids), 8):
            batch = [document[:tokens] for document in ids[start: start + 8]]
            correct += (forward_documents(model, batch, budget).argmax(-1) == labels[start: start + 8]).sum().item()
    model.train()
    return correct / len(ids)


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--crop", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--max-minutes", type=float, default=35, help="stop (after a checkpoint) past this time")
    parser.add_argument("--embed-dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--mlp-hidden-dim", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    torch.set_num_threads(args.threads)
    with open(os.path.join(args.corpus, "labels.txt")) as f:
        labels = [line.strip() for line in f if line.strip()]
    train_ids, train_labels = read_split(args.corpus, "train")
    heldout_ids, heldout_labels = read_split(args.corpus, "heldout")
    with open(os.path.join(args.corpus, "tokenizer.vocab"), encoding="utf-8") as f:
        vocab_size = sum(1 for line in f if line.strip())
    cfg = document_config(vocab_size=vocab_size, num_classes=len(labels), tokenizer="sentencepiece",
                          embed_dim=args.embed_dim, depth=args.depth, num_heads=args.heads,
                          mlp_hidden_dim=args.mlp_hidden_dim, kernel_size=9)
    model = MitaDocument(cfg)
    print(f"{len(train_ids)} training, {len(heldout_ids)} held-out documents, {len(labels)} classes, "
          f"{sum(p.numel() for p in model.parameters())} parameters", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    default = cfg["attention"]["default_budget"]
    default_budget = (default["expert_count"], default["expert_width"])
    start = time.time()
    loss_sum, correct, seen = 0.0, 0, 0
    for step in range(1, args.steps + 1):
        picks = [random.randrange(len(train_ids)) for _ in range(args.batch)]
        documents = []
        for p in picks:
            document = train_ids[p]
            offset = random.randrange(max(1, document.numel() - args.crop + 1))
            documents.append(document[offset: offset + args.crop])
        budget = None if step % 4 == 0 else (default_budget if step % 4 == 1 else random.choice(TRAIN_BUDGETS))
        y = train_labels[picks]
        logits = forward_documents(model, documents, budget)
        loss = F.cross_entropy(logits, y, label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_sum += loss.item() * len(y)
        correct += (logits.argmax(-1) == y).sum().item()
        seen += len(y)
        out_of_time = time.time() - start > args.max_minutes * 60
        if step % args.checkpoint_every == 0 or step == args.steps or out_of_time:
            write_package(model, cfg, args.corpus, args.out, step)
            accuracy = evaluate(model, heldout_ids, heldout_labels, default_budget, args.crop)
            print(f"step {step}/{args.steps}: loss {loss_sum / seen:.4f} train acc {correct / seen:.4f} held-out acc "
                  f"(first {args.crop} tokens, default budget) {accuracy:.4f} ({time.time() - start:.0f} s)", flush=True)
            loss_sum, correct, seen = 0.0, 0, 0
        if out_of_time:
            print(f"stopped at step {step}: --max-minutes {args.max_minutes} reached", flush=True)
            break


if __name__ == "__main__":
    main()
