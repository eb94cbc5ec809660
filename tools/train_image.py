"""Trains the image models on Fashion-MNIST and writes their packages.

1. The embedded default image model (MiTA-ViT with DWC, N = 50 tokens), trained with MiTA at random budgets.
   Reproduces models/repository/fashion-mnist-vit:
     /usr/bin/python3 tools/train_image.py --out models/repository/fashion-mnist-vit --epochs 8
   (about 40 minutes on 2 idle cores; test accuracy printed at the end: 0.8823)
2. --architecture timm_vit: a timm VisionTransformer (timm.create_model, timm's own parameter names) at DeiT's
   token count, a 14 x 14 patch grid + class token (N = 197: patch 2 on 28 x 28), trained with full attention
   only (timm's own attention); the checkpoint ({"model": state_dict}, written after every epoch) is converted by
   tools/convert_timm_checkpoint.py with --full_attention_default into a package whose presets are MiTA budgets.
   The first half of models/repository/timm-vit-fashion-mnist (commands and figures: docs/image_model.md, "A timm
   ViT trained with full attention"):
     cd tools && /opt/mita/peers/bin/python train_image.py --architecture timm_vit --epochs 30 --max_minutes 84 \
         --shift 1 --checkpoint ../build/timm-vit-fashion-mnist-full4.pth --out ../build/timm-vit-fashion-mnist-full4
3. --mita_finetune: continues a timm_vit checkpoint (--init_checkpoint) with the project's MiTA attention swapped
   into its blocks (tools/timm_mita.py, the PyTorch twin; same parameter names), every step at a random budget
   of --finetune_budgets, for --max_minutes; the checkpoint stays a timm checkpoint. The second half of
   timm-vit-fashion-mnist: --mita_finetune --init_checkpoint ../build/timm-vit-fashion-mnist-full4.pth --epochs 2
   --max_minutes 19 --lr 5e-4 --shift 1 --checkpoint ../build/timm-vit-fashion-mnist-mita4.pth --out
   ../build/timm-vit-fashion-mnist-mita4, copied into models/repository/timm-vit-fashion-mnist, then mita-eval
   --write_accuracy_order (docs/image_model.md).
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
# Fashion-MNIST's pixel mean and standard deviation (training split), the packages' normalisation.
MEAN, STD = 0.2860, 0.3530
# The timm ViT's shape: 0.32 M parameters (1.3 MB in float32), N = 197 tokens.
TIMM_VIT = {"img_size": 28, "patch_size": 2, "in_chans": 1, "num_classes": 10, "embed_dim": 96, "depth": 4,
            "num_heads": 3, "mlp_ratio": 2.0}
# The timm ViT package's MiTA presets beside the converter's "mita" (m = 25, k = 64: --pool_size 5 --kv_topk 8).
TIMM_VIT_PRESETS = {"fast": "9x16", "accurate": "49x128"}
# MiTA budgets (pool side P, so m = P * P landmarks on the 14 x 14 grid; expert width k) for the fine-tune.
FINETUNE_BUDGETS = [(2, 8), (2, 16), (3, 16), (3, 32), (4, 32), (4, 64), (5, 25), (5, 64), (6, 96), (7, 128)]


def read_idx(name):
    with gzip.open(os.path.join(DATA, name), "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_split(split):
    """(images [n, 1, 28, 28] float32 normalised as the server does, labels int64) of "train" or "t10k"."""
    x = torch.from_numpy(read_idx(f"{split}-images-idx3-ubyte.gz").copy()).float().div(255).sub(MEAN).div(STD)
    y = torch.from_numpy(read_idx(f"{split}-labels-idx1-ubyte.gz").astype(np.int64))
    return x.unsqueeze(1), y


def augment(x, shift=2):
    """Random shift by up to `shift` pixels (pad + crop, one shift per batch) and random horizontal flip per image."""
    x = F.pad(x, (shift,) * 4, value=(0 - MEAN) / STD)
    dx, dy = random.randint(0, 2 * shift), random.randint(0, 2 * shift)
    x = x[:, :, dy: dy + 28, dx: dx + 28]
    flip = torch.rand(len(x)) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def accuracy(forward, test_x, test_y):
    """Top-1 accuracy of forward(images) -> logits on the test split, in batches of 250."""
    with torch.no_grad():
        correct = sum((forward(test_x[i: i + 250]).argmax(-1) == test_y[i: i + 250]).sum().item()
                      for i in range(0, len(test_x), 250))
    return correct / len(test_x)


def timm_vit(img_size=28):
    """The timm VisionTransformer of TIMM_VIT, built by timm.create_model (random initialisation); img_size other
    than 28 gives the same model family at (img_size / 2)^2 + 1 tokens (for timing)."""
    import timm
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **dict(TIMM_VIT, img_size=img_size))


def train(args, model, step_forward, eval_forward, train_x, train_y, test_x, test_y, warmup, on_epoch=None):
    """AdamW (weight decay 0.05) with linear warmup over `warmup` steps and a cosine decay, label smoothing 0.1,
    augment(); step_forward(images, step) -> logits in training, eval_forward(images) -> logits for the test
    accuracy (the first 2,000 test images after each epoch, all 10,000 at the end). The cosine runs over --epochs,
    or with --max_minutes over whichever of the steps and the wall time is further along (so that a busy machine
    still ends the schedule, in fewer steps); training stops where it ends. on_epoch(epoch) runs after each
    epoch and at the end (checkpoints)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps_per_epoch = math.ceil(len(train_x) / args.batch)
    total = max(1, args.epochs * steps_per_epoch)
    began = time.monotonic()

    def progress(s):
        elapsed = (time.monotonic() - began) / (60 * args.max_minutes) if args.max_minutes else 0.0
        return min(1.0, max(s / total, elapsed))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * progress(s))))
    done = 0
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(train_x))
        start, seen, correct, loss_sum = time.time(), 0, 0, 0.0
        for step in range(steps_per_epoch):
            idx = order[step * args.batch: (step + 1) * args.batch]
            x, y = augment(train_x[idx], args.shift), train_y[idx]
            logits = step_forward(x, step)
            loss = F.cross_entropy(logits, y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            done += 1
            seen += len(y)
            correct += (logits.argmax(-1) == y).sum().item()
            loss_sum += loss.item() * len(y)
            if done % 100 == 0:
                print(f"  step {done}: loss {loss_sum / seen:.4f}, lr {schedule.get_last_lr()[0]:.2e}, "
                      f"{(time.monotonic() - began) / 60:.1f} min", flush=True)
            if progress(done) >= 1.0:
                break
        model.eval()
        print(f"epoch {epoch + 1}/{args.epochs}: loss {loss_sum / seen:.4f} train acc {correct / seen:.4f} "
              f"test acc ({args.eval_label}, first 2000) {accuracy(eval_forward, test_x[:2000], test_y[:2000]):.4f} "
              f"({time.time() - start:.0f} s, {seen} images)", flush=True)
        if on_epoch:
            on_epoch(epoch)
        if progress(done) >= 1.0:
            break
    print(f"done: {done} steps ({done / steps_per_epoch:.2f} epochs) in {(time.monotonic() - began) / 60:.1f} minutes; "
          f"test acc ({args.eval_label}, all {len(test_x)}) {accuracy(eval_forward, test_x, test_y):.4f}", flush=True)


def train_mita_vit(args, data):
    """The embedded MiTA-ViT: half of the steps at the default budget, half at a random one."""
    cfg = fashion_mnist_config()
    model = MitaVit(cfg)
    if args.init:
        model.load_state_dict(load_safetensors(os.path.join(args.init, "model.safetensors")))
    default = cfg["attention"]["default_budget"]
    default_budget = (int(math.isqrt(default["expert_count"])), default["expert_width"])
    budgets = [(2, 8), (3, 16), (4, 32), (3, 8), (2, 16), (4, 16), (3, 32)]
    args.eval_label = "default budget"
    train(args, model, lambda x, step: model(x, default_budget if step % 2 == 0 else random.choice(budgets)),
          lambda x: model(x, default_budget), *data, warmup=1 if args.init else math.ceil(len(data[0]) / args.batch) // 2)
    os.makedirs(args.out, exist_ok=True)
    save_safetensors(model.state_dict(), os.path.join(args.out, "model.safetensors"),
                     {"format": "pt", "trained_by": "tools/train_image.py"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    write_labels(args.out)


def train_timm_vit(args, data):
    """The timm ViT: full attention (timm's own) from scratch, or --mita_finetune of --init_checkpoint."""
    from timm_mita import set_budget, swap_mita_attention
    model = timm_vit(args.img_size)
    if args.init_checkpoint:
        model.load_state_dict(torch.load(args.init_checkpoint, map_location="cpu")["model"])
    if args.mita_finetune:
        swap_mita_attention(model, depthwise_conv=False, full_attention="sdpa")
        budgets = [tuple(int(v) for v in item.split("x")) for item in args.finetune_budgets.split(",")]

        def step_forward(x, step):
            set_budget(model, random.choice(budgets))
            return model(x)

        def eval_forward(x):
            set_budget(model, budgets[len(budgets) // 2])
            return model(x)
        args.eval_label = f"MiTA P={budgets[len(budgets) // 2][0]} k={budgets[len(budgets) // 2][1]}"
        warmup = 1
    else:
        step_forward, eval_forward = (lambda x, step: model(x)), model
        args.eval_label = "full attention"
        warmup = 100

    def save(epoch):
        torch.save({"model": model.state_dict(), "epoch": epoch + 1, "timm_vit": dict(TIMM_VIT, img_size=args.img_size),
                    "mita_finetune": args.mita_finetune}, args.checkpoint)
    if args.epochs == 0:  # the random initialisation as a package (timing at other token counts)
        save(-1)
    else:
        train(args, model, step_forward, eval_forward, *data, warmup=warmup, on_epoch=save)
    if args.out:
        convert_package(args.checkpoint, args.out)


def convert_package(checkpoint, out):
    """Converts the timm_vit checkpoint with tools/convert_timm_checkpoint.py: full attention by default, the
    MiTA presets of TIMM_VIT_PRESETS, Fashion-MNIST's normalisation and labels."""
    import convert_timm_checkpoint as converter
    labels = os.path.join(out, "labels.txt")
    os.makedirs(out, exist_ok=True)
    write_labels(out)
    converter.main(["--checkpoint", checkpoint, "--out", out, "--num_heads", str(TIMM_VIT["num_heads"]),
                    "--full_attention_default", "--mean", str(MEAN), "--std", str(STD), "--labels", labels,
                    "--pool_size", "5", "--kv_topk", "8",
                    *[flag for name, budget in TIMM_VIT_PRESETS.items() for flag in ("--preset", f"{name}={budget}")]])


def write_labels(out):
    with open(os.path.join(out, "labels.txt"), "w") as f:
        f.write("\n".join(LABELS) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--architecture", choices=["mita_vit", "timm_vit"], default="mita_vit")
    parser.add_argument("--out", help="package folder to write (timm_vit: converted from --checkpoint)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--shift", type=int, default=2, help="augmentation: random shift of up to this many pixels")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--limit", type=int, default=0, help="train on the first N images only (smoke test)")
    parser.add_argument("--max_minutes", type=float, default=0,
                        help="end the cosine schedule (and training) within this wall time")
    parser.add_argument("--init", help="mita_vit: start from this package's model.safetensors (continued training)")
    parser.add_argument("--checkpoint", help="timm_vit: the checkpoint written after every epoch")
    parser.add_argument("--img_size", type=int, default=28,
                        help="timm_vit: input side (28: N = 197; 56: 785; 112: 3,137); with --epochs 0 only")
    parser.add_argument("--init_checkpoint", help="timm_vit: start from this checkpoint")
    parser.add_argument("--mita_finetune", action="store_true", help="timm_vit: train with MiTA attention")
    parser.add_argument("--finetune_budgets", default=",".join(f"{p}x{k}" for p, k in FINETUNE_BUDGETS),
                        help="PxK,... (pool side P, m = P * P; expert width k), one drawn per step")
    args = parser.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    torch.set_num_threads(args.threads)
    train_x, train_y = load_split("train")
    if args.limit:
        train_x, train_y = train_x[: args.limit], train_y[: args.limit]
    data = (train_x, train_y, *load_split("t10k"))
    if args.architecture == "timm_vit":
        if not args.checkpoint:
            parser.error("--architecture timm_vit needs --checkpoint")
        if args.img_size != 28 and args.epochs:
            parser.error("--img_size other than 28 (Fashion-MNIST's) only with --epochs 0 (a random package)")
        train_timm_vit(args, data)
    else:
        if not args.out:
            parser.error("--out is required")
        train_mita_vit(args, data)


if __name__ == "__main__":
    main()
