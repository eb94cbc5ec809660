"""Converts an official MiTA-DeiT / DeiT PyTorch checkpoint (a timm VisionTransformer state dict) into a
MiTA Serve model package: config.json + model.safetensors + labels.txt.

Usage:
  /usr/bin/python3 tools/convert_timm_checkpoint.py --checkpoint deit_small_mita.pth --out models/repository/deit-s \
      --num_heads 6 --pool_size 5 --kv_topk 5 [--labels imagenet_labels.txt] [--rename old=new ...]

The .pth holds either {"model": state_dict} (the DeiT/MiTA training scripts) or the state dict itself.
Shapes are read from the tensors: embed_dim and patch size from patch_embed.proj.weight, depth from the
block count, the token count from pos_embed, num_classes from head.weight, mlp_hidden_dim from fc1. The
official MiTA constructor squares its arguments (pool_size=5, kv_topk=5 means M=25 landmarks and k=25 keys per
expert, docs/design.md section 2.6), so --pool_size and --kv_topk are given as the official constructor takes
them. A depthwise conv on v ("DWC" variant) is detected from blocks.0.attn.dwc.weight (use --rename if the
checkpoint names it differently, e.g. --rename attn.lepe.=attn.dwc.). Distilled DeiT checkpoints (dist_token)
are rejected: their two leading special tokens do not fit the image landmark rule.

A stock timm DeiT (trained with full attention, no MiTA) converts with --full_attention_default: full attention
is the model's default budget, and the MiTA budget of --pool_size/--kv_topk is its preset "mita" (the same
weights under MiTA, for a client that trades accuracy for speed); --preset NAME=MxK adds more MiTA presets.
tests/timm_logits_test.py converts both kinds; tools/train_image.py --architecture timm_vit converts its
checkpoints through convert_package().
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mita_reference import save_safetensors  # noqa: E402

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def convert(state, num_heads, pool_size, kv_topk, renames, mean, std, full_attention_default=False, presets=()):
    """(config.json dict, float32 state dict) of a timm VisionTransformer state dict; presets: extra (name,
    expert_count, expert_width) MiTA presets."""
    for old, new in renames:
        state = {name.replace(old, new): tensor for name, tensor in state.items()}
    if "dist_token" in state:
        raise ValueError("distilled DeiT checkpoints (dist_token) are not supported")
    dropped = [name for name in state if name.startswith("head_dist")]
    state = {name: tensor.float() for name, tensor in state.items() if name not in dropped}
    patch = state["patch_embed.proj.weight"]
    embed_dim, in_channels, patch_size, _ = patch.shape
    tokens = state["pos_embed"].shape[1]
    grid = int(round(math.sqrt(tokens - 1)))
    if grid * grid != tokens - 1:
        raise ValueError(f"pos_embed has {tokens} tokens; expected a square grid plus one cls token")
    depth = 1 + max(int(name.split(".")[1]) for name in state if name.startswith("blocks."))
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim {embed_dim} is not divisible by --num_heads {num_heads}")
    expert_count, expert_width = pool_size * pool_size, min(kv_topk * kv_topk, tokens)
    if pool_size > grid:
        raise ValueError(f"--pool_size {pool_size} exceeds the patch grid side {grid}")
    config = {
        "architecture": "mita_vit",
        "task": "image_classification",
        "image_size": grid * patch_size, "patch_size": patch_size, "in_channels": in_channels,
        "embed_dim": embed_dim, "depth": depth, "num_heads": num_heads,
        "mlp_hidden_dim": state["blocks.0.mlp.fc1.weight"].shape[0],
        "layer_norm_eps": 1e-6, "num_classes": state["head.weight"].shape[0],
        "normalization": {"mean": mean, "std": std},
        "attention": {
            "type": "mita", "depthwise_conv": "blocks.0.attn.dwc.weight" in state,
            "default_budget": {"expert_count": expert_count, "expert_width": expert_width},
            "presets": {"checkpoint": {"expert_count": expert_count, "expert_width": expert_width}},
        },
    }
    if full_attention_default:
        config["attention"]["default_budget"] = {"full_attention": True}
        config["attention"]["presets"] = {"checkpoint": {"full_attention": True},
                                          "mita": {"expert_count": expert_count, "expert_width": expert_width}}
    for name, count, width in presets:
        if count > tokens - 1 or math.isqrt(count) ** 2 != count:
            raise ValueError(f"--preset {name}: expert_count {count} is not a square of at most {tokens - 1}")
        config["attention"]["presets"][name] = {"expert_count": count, "expert_width": min(width, tokens)}
    return config, state


def parse_preset(text):
    """NAME=MxK -> (name, m, k)."""
    name, budget = text.split("=", 1)
    count, width = budget.split("x")
    return name, int(count), int(width)


def main(argv=None):
    """The command line (sys.argv[1:] unless `argv` is given)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num_heads", type=int, required=True)
    parser.add_argument("--pool_size", type=int, default=5, help="official constructor's pool_size (M = square)")
    parser.add_argument("--kv_topk", type=int, default=5, help="official constructor's kv_topk (k = square)")
    parser.add_argument("--labels", help="text file with one class name per line")
    parser.add_argument("--rename", action="append", default=[], help="OLD=NEW substring rename of tensor names")
    parser.add_argument("--mean", type=float, nargs="+", default=IMAGENET_MEAN)
    parser.add_argument("--std", type=float, nargs="+", default=IMAGENET_STD)
    parser.add_argument("--full_attention_default", action="store_true",
                        help="a checkpoint trained with full attention (stock DeiT): full attention by default")
    parser.add_argument("--preset", action="append", default=[], type=parse_preset,
                        help="NAME=MxK: one more MiTA preset (m = expert_count, a square; k = expert_width)")
    args = parser.parse_args(argv)
    checkpoint = torch.load(args.checkpoint, map_location="cpu")
    state = checkpoint.get("model", checkpoint) if isinstance(checkpoint, dict) else checkpoint.state_dict()
    renames = [tuple(item.split("=", 1)) for item in args.rename]
    config, state = convert(state, args.num_heads, args.pool_size, args.kv_topk, renames, args.mean, args.std,
                            args.full_attention_default, args.preset)
    os.makedirs(args.out, exist_ok=True)
    save_safetensors(state, os.path.join(args.out, "model.safetensors"), {"converted_from": args.checkpoint})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    if args.labels:
        with open(args.labels) as f:
            labels = [line.strip() for line in f if line.strip()]
    else:
        labels = [f"class_{i}" for i in range(config["num_classes"])]
    if len(labels) != config["num_classes"]:
        raise ValueError(f"{len(labels)} labels for {config['num_classes']} classes")
    with open(os.path.join(args.out, "labels.txt"), "w") as f:
        f.write("\n".join(labels) + "\n")
    default = config["attention"]["default_budget"]
    default_text = ("full attention" if default.get("full_attention")
                    else f"m={default['expert_count']} k={default['expert_width']}")
    print(f"wrote {args.out}: {config['depth']} blocks, dim {config['embed_dim']}, N={grid_tokens(config)}, "
          f"default budget {default_text}")


def grid_tokens(config):
    side = config["image_size"] // config["patch_size"]
    return side * side + 1


if __name__ == "__main__":
    main()
