"""Reference logits from the PyTorch twin (tools/mita_reference.py), for the C++ classifier tests.

Two commands (run with the Debian python, /usr/bin/python3, which has torch):

  make-package --out DIR [--seed S] [--no-dwc] [--noise X]
      Writes a randomly initialised MiTA-ViT package (config.json, model.safetensors, labels.txt) with the
      configuration of tools/train_image.py. Every parameter gets Gaussian noise of scale X (default 0.1) on top
      of the PyTorch initialisation, so that parameters initialised to constants (LayerNorm weight 1 and bias 0,
      cls_token 0) still test their names and placement.

  logits --package DIR --images FILE --budgets FILE --out FILE
      images: raw little-endian float32 [B, in_channels, image_size, image_size] (model inputs, already
      normalised); budgets: JSON list of B entries, each {"expert_count": m, "expert_width": k} or
      {"full_attention": true}; out: raw little-endian float32 logits [B, num_classes]. Every item runs alone
      with its own budget (the twin takes one budget per forward), so the C++ batched forward with mixed budgets
      is compared against independent single-item runs.
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mita_reference import MitaVit, fashion_mnist_config, load_safetensors, save_safetensors  # noqa: E402


def make_package(args):
    torch.manual_seed(args.seed)
    cfg = fashion_mnist_config()
    cfg["attention"]["depthwise_conv"] = not args.no_dwc
    model = MitaVit(cfg)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * args.noise)
    os.makedirs(args.out, exist_ok=True)
    save_safetensors(model.state_dict(), os.path.join(args.out, "model.safetensors"),
                     {"format": "pt", "made_by": "tools/reference_logits.py make-package", "seed": args.seed})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "labels.txt"), "w") as f:
        f.write("\n".join(f"class {i}" for i in range(cfg["num_classes"])) + "\n")


def compute_logits(args):
    with open(os.path.join(args.package, "config.json")) as f:
        cfg = json.load(f)
    model = MitaVit(cfg)
    model.load_state_dict(load_safetensors(os.path.join(args.package, "model.safetensors")), strict=True)
    model.eval()
    with open(args.budgets) as f:
        budgets = json.load(f)
    side, channels = cfg["image_size"], cfg["in_channels"]
    with open(args.images, "rb") as f:
        raw = bytearray(f.read())
    images = torch.frombuffer(raw, dtype=torch.float32).reshape(-1, channels, side, side)
    if images.shape[0] != len(budgets):
        raise SystemExit(f"{images.shape[0]} images but {len(budgets)} budgets")
    rows = []
    with torch.no_grad():
        for image, budget in zip(images, budgets):
            if budget.get("full_attention"):
                item_budget = None
            else:
                pool_side = math.isqrt(budget["expert_count"])
                assert pool_side * pool_side == budget["expert_count"]
                item_budget = (pool_side, budget["expert_width"])
            rows.append(model(image.unsqueeze(0), item_budget)[0])
    logits = torch.stack(rows).contiguous()
    with open(args.out, "wb") as f:
        f.write(logits.numpy().astype("<f4").tobytes())


def main():
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-package")
    make.add_argument("--out", required=True)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--no-dwc", action="store_true")
    make.add_argument("--noise", type=float, default=0.1)
    run = commands.add_parser("logits")
    run.add_argument("--package", required=True)
    run.add_argument("--images", required=True)
    run.add_argument("--budgets", required=True)
    run.add_argument("--out", required=True)
    run.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.command == "make-package":
        make_package(args)
    else:
        torch.set_num_threads(args.threads)
        compute_logits(args)


if __name__ == "__main__":
    main()
