"""Trains the embedded default image model (MiTA-ViT with DWC) on Fashion-MNIST and writes its package.

Usage (reproduces models/repository/fashion-mnist-vit):
  /usr/bin/python3 tools/train_image.py --out models/repository/fashion-mnist-vit --epochs 8
(about 40 minutes on 2 idle cores; test accuracy printed per epoch, 0.8823 after the last one)
Data: Debian package dataset-fashion-mnist (/usr/share/datasets/fashion-mnist).
"""
import argparse
import gzip
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.nn.functional as F

from mita_reference import MitaVit, fashion_mnist_config, load_safetensors, save_safetensors

LABELS = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
          "Ankle boot"]
DATA = "/usr/share/datasets/fashion-mnist"


def read_idx(name):
    with gzip.open(os.path.join(DATA, name), "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--limit", type=int, default=0, help="train on the first N images only (smoke test)")
    parser.add_argument("--init", help="start from this package's model.safetensors (continued training)")
    args = parser.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    torch.set_num_threads(args.threads)
    cfg = fashion_mnist_config()
    mean, std = cfg["normalization"]["mean"][0], cfg["normalization"]["std"][0]
    train_x = torch.from_numpy(read_idx("train-images-idx3-ubyte.gz").copy()).float().div(255).sub(mean).div(std)
    train_y = torch.from_numpy(read_idx("train-labels-idx1-ubyte.gz").astype(np.int64))
    test_x = torch.from_numpy(read_idx("t10k-images-idx3-ubyte.gz").copy()).float().div(255).sub(mean).div(std)
    test_y = torch.from_numpy(read_idx("t10k-labels-idx1-ubyte.gz").astype(np.int64))
    if args.limit:
        train_x, train_y = train_x[: args.limit], train_y[: args.limit]
    train_x, test_x = train_x.unsqueeze(1), test_x.unsqueeze(1)
    model = MitaVit(cfg)
    if args.init:
        model.load_state_dict(load_safetensors(os.path.join(args.init, "model.safetensors")))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps_per_epoch = math.ceil(len(train_x) / args.batch)
    total = max(1, args.epochs * steps_per_epoch)
    warmup = 1 if args.init else steps_per_epoch // 2
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    default = cfg["attention"]["default_budget"]
    default_budget = (int(math.isqrt(default["expert_count"])), default["expert_width"])
    # Half of the steps at the default budget, half at a random one, so every declared budget works.
    budgets = [(2, 8), (3, 16), (4, 32), (3, 8), (2, 16), (4, 16), (3, 32)]
    pad_value = (0 - mean) / std
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(train_x))
        start, seen, correct, loss_sum = time.time(), 0, 0, 0.0
        for step in range(steps_per_epoch):
            idx = order[step * args.batch: (step + 1) * args.batch]
            x, y = train_x[idx], train_y[idx]
            # augmentation: random shift by up to 2 pixels (pad + crop) and horizontal flip
            x = F.pad(x, (2, 2, 2, 2), value=pad_value)
            dx, dy = random.randint(0, 4), random.randint(0, 4)
            x = x[:, :, dy: dy + 28, dx: dx + 28]
            flip = torch.rand(len(x)) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
            budget = default_budget if step % 2 == 0 else random.choice(budgets)
            logits = model(x, budget)
            loss = F.cross_entropy(logits, y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            seen += len(y)
            correct += (logits.argmax(-1) == y).sum().item()
            loss_sum += loss.item() * len(y)
        model.eval()
        with torch.no_grad():
            test_correct = sum((model(test_x[i: i + 250], default_budget).argmax(-1) == test_y[i: i + 250]).sum().item()
                               for i in range(0, len(test_x), 250))
        print(f"epoch {epoch + 1}/{args.epochs}: loss {loss_sum / seen:.4f} train acc {correct / seen:.4f} "
              f"test acc (default budget) {test_correct / len(test_x):.4f} ({time.time() - start:.0f} s)",
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    save_safetensors(model.state_dict(), os.path.join(args.out, "model.safetensors"),
                     {"format": "pt", "trained_by": "tools/train_image.py"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "labels.txt"), "w") as f:
        f.write("\n".join(LABELS) + "\n")


if __name__ == "__main__":
    main()
