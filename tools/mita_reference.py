"""MiTA attention and the MiTA-ViT classifier in PyTorch, for training and checkpoint conversion.

This is the training-side twin of the C++ serving code (kernels/ and models/). It follows
docs/design.md section 2 exactly, including the details trained checkpoints depend on:
  * image landmarks pool the q tokens 0 .. N-2 (cls included, last patch dropped) on a sqrt(N-1) grid
    with adaptive 2-D average pooling (windows [floor(i*S/P), ceil((i+1)*S/P)));
  * routed expert scores S = l k^T and the routing gate G = l q^T carry no scale;
  * compressed (shared-expert) logits are q . l * s * s, routed logits q . k * s, one softmax over both.
Parameter names follow timm's VisionTransformer so the safetensors files load in the C++ server.
"""
import json
import math
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F


def image_landmarks(q: torch.Tensor, pool_side: int) -> torch.Tensor:
    """q: [B, H, N, d] with N - 1 a square; returns landmarks [B, H, P*P, d]."""
    b, h, n, d = q.shape
    side = int(round(math.sqrt(n - 1)))
    assert side * side == n - 1, f"N - 1 = {n - 1} is not a square"
    grid = q[:, :, : n - 1, :].reshape(b * h, side, side, d).permute(0, 3, 1, 2)
    pooled = F.adaptive_avg_pool2d(grid, pool_side)  # [B*H, d, P, P]
    return pooled.permute(0, 2, 3, 1).reshape(b, h, pool_side * pool_side, d)


def sequence_landmarks(q: torch.Tensor, expert_count: int) -> torch.Tensor:
    """q: [B, H, N, d]; adaptive 1-D average pooling over all N tokens -> [B, H, M, d]."""
    b, h, n, d = q.shape
    pooled = F.adaptive_avg_pool1d(q.reshape(b * h, n, d).transpose(1, 2), expert_count)
    return pooled.transpose(1, 2).reshape(b, h, expert_count, d)


def mita_attention(q, k, v, landmarks, expert_width: int):
    """q, k, v: [B, H, N, d]; landmarks: [B, H, M, d] -> output [B, H, N, d].

    Written densely for training speed at small N: the routed keys of each query are kept as a mask over
    all N keys, so the one softmax over the M compressed + k routed logits is a masked softmax over
    M + N logits (masked entries get -inf and weight 0). Same result as gathering the k keys.
    """
    d = q.shape[-1]
    scale = d ** -0.5
    n = k.shape[2]
    width = min(expert_width, n)
    scores = landmarks @ k.transpose(-1, -2)  # [B, H, M, N], no scale
    # torch.topk does not promise the kernels' tie rule (higher score, then lower index); exact float ties
    # between keys of trained weights are rare, and the C++ tests use their own float64 loop for ties.
    expert_keys = scores.topk(width, dim=-1).indices  # [B, H, M, k]
    # A tensor source, not the scalar True: TorchScript's tracer has no scatter_ with a bool scalar.
    expert_mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, expert_keys, torch.ones_like(
        expert_keys, dtype=torch.bool))
    shared = torch.softmax(scores * scale, dim=-1) @ v  # [B, H, M, d]
    gate = landmarks @ q.transpose(-1, -2)  # [B, H, M, N], no scale
    expert_of_query = gate.argmax(dim=2)  # [B, H, N]
    query_mask = torch.gather(expert_mask, 2, expert_of_query.unsqueeze(-1).expand(-1, -1, -1, n))  # [B,H,N,N]
    compressed_logits = (q @ landmarks.transpose(-1, -2)) * scale * scale  # [B, H, N, M]
    routed_logits = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~query_mask, float("-inf"))
    weights = torch.softmax(torch.cat([compressed_logits, routed_logits], dim=-1), dim=-1)
    m = landmarks.shape[2]
    return weights[..., :m] @ shared + weights[..., m:] @ v


def fashion_mnist_config():
    """config.json of the embedded default model (models/repository/fashion-mnist-vit)."""
    return {
        "architecture": "mita_vit",
        "task": "image_classification",
        "image_size": 28, "patch_size": 4, "in_channels": 1,
        "embed_dim": 96, "depth": 4, "num_heads": 4, "mlp_hidden_dim": 192,
        "layer_norm_eps": 1e-6, "num_classes": 10,
        "normalization": {"mean": [0.2860], "std": [0.3530]},
        "attention": {
            "type": "mita", "depthwise_conv": True,
            "default_budget": {"expert_count": 9, "expert_width": 16},
            "presets": {"fast": {"expert_count": 4, "expert_width": 8},
                        "balanced": {"expert_count": 9, "expert_width": 16},
                        "accurate": {"expert_count": 16, "expert_width": 32}},
        },
    }


class Attention(nn.Module):
    def __init__(self, dim, heads, dwc):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dwc = nn.Conv2d(dim, dim, 3, padding=1, groups=dim) if dwc else None

    def forward(self, x, budget):
        b, n, c = x.shape
        d = c // self.heads
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if budget is None:
            out = torch.softmax((q @ k.transpose(-1, -2)) * d ** -0.5, dim=-1) @ v
        else:
            pool_side, width = budget
            out = mita_attention(q, k, v, image_landmarks(q, pool_side), width)
        out = out.transpose(1, 2).reshape(b, n, c)
        if self.dwc is not None:
            side = int(round(math.sqrt(n - 1)))
            v_grid = v[:, :, 1:, :].transpose(1, 2).reshape(b, side, side, c).permute(0, 3, 1, 2)
            local = self.dwc(v_grid).permute(0, 2, 3, 1).reshape(b, n - 1, c)
            out = torch.cat([out[:, :1], out[:, 1:] + local], dim=1)
        return self.proj(out)


class Block(nn.Module):
    """Pre-norm Transformer block (timm names: norm1, attn, norm2, mlp.fc1, mlp.fc2) around `attention`."""

    def __init__(self, dim, mlp_hidden, eps, attention):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = attention
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc1", nn.Linear(dim, mlp_hidden))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("fc2", nn.Linear(mlp_hidden, dim))

    def forward(self, x, budget):
        x = x + self.attn(self.norm1(x), budget)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, channels, dim, patch):
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class MitaVit(nn.Module):
    """timm-named ViT with MiTA attention. budget = (pool_side P, expert_width k) or None for full."""

    def __init__(self, cfg):
        super().__init__()
        dim, grid = cfg["embed_dim"], cfg["image_size"] // cfg["patch_size"]
        self.patch_embed = PatchEmbed(cfg["in_channels"], dim, cfg["patch_size"])
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, grid * grid + 1, dim) * 0.02)
        hidden = cfg["mlp_hidden_dim"]
        eps = cfg["layer_norm_eps"]
        dwc = cfg["attention"]["depthwise_conv"]
        self.blocks = nn.ModuleList(
            [Block(dim, hidden, eps, Attention(dim, cfg["num_heads"], dwc)) for _ in range(cfg["depth"])])
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.head = nn.Linear(dim, cfg["num_classes"])

    def forward(self, images, budget):
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x, budget)
        return self.head(self.norm(x)[:, 0])


def save_safetensors(tensors: dict, path: str, metadata: dict = None):
    """Writes a safetensors file (8-byte little-endian header length, JSON header, raw data)."""
    dtype_names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        data = t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        header[name] = {"dtype": dtype_names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = {str(key): str(value) for key, value in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def load_safetensors(path: str) -> dict:
    """Reads a safetensors file written by save_safetensors (F32, F16, BF16, F64) into CPU tensors."""
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    with open(path, "rb") as f:
        raw = f.read()
    (header_size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + header_size])
    data = raw[8 + header_size:]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = dtypes[entry["dtype"]]
        if end > begin:
            flat = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype)
        else:
            flat = torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(entry["shape"]).clone()
    return tensors


# ----- Long-document classifier (config.json "architecture": "mita_document") -----
#
# Twin of models/document_classifier.{h,cc}. Forward for one document of N token ids:
#   x = token_embedding[ids]                                   [N, C]
#   x = x + position_conv(x)    depthwise 1-D conv over the sequence (kernel K odd, zero padding K // 2, bias):
#                               a convolutional position encoding (CPVT, Chu et al. 2021) that is defined at any N
#   depth x [x + attn(norm1(x)); x + mlp(norm2(x))]    attn: qkv -> MiTA per head with sequence landmarks
#                                                      (adaptive 1-D average pooling of q) or full attention
#   logits = head(mean over the N tokens of norm(x))
# A budget (m, k) is applied as (min(m, N), min(k, N)), as the server's ApplyDocumentBudget does.


class DocumentAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, budget):
        b, n, c = x.shape
        d = c // self.heads
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if budget is None:
            out = torch.softmax((q @ k.transpose(-1, -2)) * d ** -0.5, dim=-1) @ v
        else:
            expert_count, expert_width = min(budget[0], n), min(budget[1], n)
            out = mita_attention(q, k, v, sequence_landmarks(q, expert_count), expert_width)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class MitaDocument(nn.Module):
    """MiTA long-document classifier. forward(ids [B, N] int64, budget (m, k) or None for full) -> [B, classes]."""

    def __init__(self, cfg):
        super().__init__()
        dim = cfg["embed_dim"]
        kernel = cfg["position_encoding"]["kernel_size"]
        self.token_embedding = nn.Embedding(cfg["vocab_size"], dim)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        self.position_conv = nn.Conv1d(dim, dim, kernel, padding=kernel // 2, groups=dim)
        eps = cfg["layer_norm_eps"]
        self.blocks = nn.ModuleList(
            [Block(dim, cfg["mlp_hidden_dim"], eps, DocumentAttention(dim, cfg["num_heads"]))
             for _ in range(cfg["depth"])])
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.head = nn.Linear(dim, cfg["num_classes"])

    def features(self, ids, budget):
        x = self.token_embedding(ids)
        x = x + self.position_conv(x.transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x = block(x, budget)
        return self.norm(x).mean(1)

    def forward(self, ids, budget):
        return self.head(self.features(ids, budget))


def document_config(vocab_size, num_classes, tokenizer="bytes", embed_dim=128, depth=2, num_heads=4,
                    mlp_hidden_dim=256, kernel_size=9, max_tokens=65536):
    """config.json of a document package (the embedded model's sizes by default)."""
    return {
        "architecture": "mita_document",
        "task": "document_classification",
        "vocab_size": vocab_size, "embed_dim": embed_dim, "depth": depth, "num_heads": num_heads,
        "mlp_hidden_dim": mlp_hidden_dim, "layer_norm_eps": 1e-6, "num_classes": num_classes,
        "max_tokens": max_tokens,
        "tokenizer": tokenizer,
        "position_encoding": {"type": "convolution", "kernel_size": kernel_size},
        "attention": {
            "type": "mita",
            "default_budget": {"expert_count": 16, "expert_width": 64},
            "presets": {"fast": {"expert_count": 8, "expert_width": 32},
                        "balanced": {"expert_count": 16, "expert_width": 64},
                        "accurate": {"expert_count": 32, "expert_width": 128},
                        "exact": {"full_attention": True}},
            "max_expert_count": 256,
            "max_expert_width": 1024,
        },
    }
