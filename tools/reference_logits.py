"""Reference logits from the PyTorch twin (tools/mita_reference.py), for the C++ classifier tests.

Four commands (run with the Debian python, /usr/bin/python3, which has torch):

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

  make-document-package --out DIR [--seed S] [--noise X] [--tokenizer bytes] [--max-tokens N] [--num-classes C]
                        [--pooling mean|attention]
      Writes a randomly initialised MiTA long-document package (architecture "mita_document", tokenizer "bytes":
      vocabulary of the 256 byte values; embed dim 32, 2 blocks, 2 heads, MLP 64, position conv kernel 5; mean
      pooling, or attention pooling with 4 heads and 17 position buckets) for tests of the serving side before
      (and besides) the trained model. Noise as for make-package.

  document-logits --package DIR --tokens FILE --lengths FILE --budgets FILE --out FILE
      tokens: raw little-endian int64 [T], the B documents back to back; lengths: JSON list of B token counts
      summing to T; budgets: JSON list of B budgets as above (already applied to each length); out: raw
      little-endian float32 logits [B, num_classes]. Every document runs alone (batch of one).
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mita_reference import (MitaDocument, MitaVit, document_config, fashion_mnist_config,  # noqa: E402
                            load_safetensors, save_safetensors)


def write_random_package(model, cfg, args, command, label_prefix):
    """Adds Gaussian noise of scale args.noise to every parameter of `model` and writes the package
    (model.safetensors, config.json, labels.txt "<label_prefix> i") into args.out."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * args.noise)
    os.makedirs(args.out, exist_ok=True)
    save_safetensors(model.state_dict(), os.path.join(args.out, "model.safetensors"),
                     {"format": "pt", "made_by": f"tools/reference_logits.py {command}", "seed": args.seed})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "labels.txt"), "w") as f:
        f.write("\n".join(f"{label_prefix} {i}" for i in range(cfg["num_classes"])) + "\n")


def load_package_model(package, model_class):
    """(model in eval mode with the package's weights, its config dict) for a package folder."""
    with open(os.path.join(package, "config.json")) as f:
        cfg = json.load(f)
    model = model_class(cfg)
    model.load_state_dict(load_safetensors(os.path.join(package, "model.safetensors")), strict=True)
    model.eval()
    return model, cfg


def write_logits(rows, path):
    """Writes the list of [num_classes] logit rows as raw little-endian float32 [B, num_classes]."""
    logits = torch.stack(rows).contiguous()
    with open(path, "wb") as f:
        f.write(logits.numpy().astype("<f4").tobytes())


def make_package(args):
    torch.manual_seed(args.seed)
    cfg = fashion_mnist_config()
    cfg["attention"]["depthwise_conv"] = not args.no_dwc
    write_random_package(MitaVit(cfg), cfg, args, "make-package", "class")


def compute_logits(args):
    model, cfg = load_package_model(args.package, MitaVit)
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
    write_logits(rows, args.out)


def make_document_package(args):
    torch.manual_seed(args.seed)
    pooling = {"type": "attention", "heads": 4, "position_buckets": 17} if args.pooling == "attention" else None
    cfg = document_config(vocab_size=256, num_classes=args.num_classes, tokenizer=args.tokenizer, embed_dim=32,
                          depth=2, num_heads=2, mlp_hidden_dim=64, kernel_size=5, max_tokens=args.max_tokens,
                          pooling=pooling)
    write_random_package(MitaDocument(cfg), cfg, args, "make-document-package", "topic")


def compute_document_logits(args):
    model, _ = load_package_model(args.package, MitaDocument)
    with open(args.lengths) as f:
        lengths = json.load(f)
    with open(args.budgets) as f:
        budgets = json.load(f)
    with open(args.tokens, "rb") as f:
        tokens = torch.frombuffer(bytearray(f.read()), dtype=torch.int64)
    if len(lengths) != len(budgets) or sum(lengths) != tokens.numel():
        raise SystemExit(f"{len(lengths)} lengths (sum {sum(lengths)}), {len(budgets)} budgets, {tokens.numel()} tokens")
    rows, offset = [], 0
    with torch.no_grad():
        for length, budget in zip(lengths, budgets):
            ids = tokens[offset: offset + length].unsqueeze(0)
            offset += length
            item_budget = None if budget.get("full_attention") else (budget["expert_count"], budget["expert_width"])
            rows.append(model(ids, item_budget)[0])
    write_logits(rows, args.out)


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
    make_document = commands.add_parser("make-document-package")
    make_document.add_argument("--out", required=True)
    make_document.add_argument("--seed", type=int, default=0)
    make_document.add_argument("--noise", type=float, default=0.1)
    make_document.add_argument("--tokenizer", default="bytes", choices=["bytes"])
    make_document.add_argument("--max-tokens", type=int, default=65536)
    make_document.add_argument("--num-classes", type=int, default=4)
    make_document.add_argument("--pooling", default="mean", choices=["mean", "attention"])
    document = commands.add_parser("document-logits")
    document.add_argument("--package", required=True)
    document.add_argument("--tokens", required=True)
    document.add_argument("--lengths", required=True)
    document.add_argument("--budgets", required=True)
    document.add_argument("--out", required=True)
    document.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.command == "make-package":
        make_package(args)
    elif args.command == "make-document-package":
        make_document_package(args)
    elif args.command == "document-logits":
        torch.set_num_threads(args.threads)
        compute_document_logits(args)
    else:
        torch.set_num_threads(args.threads)
        compute_logits(args)


if __name__ == "__main__":
    main()
