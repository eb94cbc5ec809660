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


def expert_keys(scores: torch.Tensor, width: int) -> torch.Tensor:
    """The `width` key indices of each row of `scores` [..., N] with the largest values, ties broken toward the
    lower key index: the set the first `width` entries of a stable descending sort give, the kernels' rule
    (docs/design.md section 2.2; torch.topk alone promises no tie order). Returns int64 [..., min(width, N)] in
    increasing index order; O(N) per row beyond torch.topk; no autograd."""
    with torch.no_grad():
        width = min(width, scores.shape[-1])
        threshold = scores.topk(width, dim=-1).values[..., -1:]
        above = scores > threshold
        equal = scores == threshold
        # Of the keys equal to the k-th value, the lowest indices take the places the keys above it leave.
        room = width - above.sum(dim=-1, keepdim=True)
        chosen = above | (equal & (equal.cumsum(dim=-1) <= room))
        return chosen.nonzero()[:, -1].reshape(*scores.shape[:-1], width)


def full_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v for q, k, v: [B, H, N, d]; PyTorch's fused scaled_dot_product_attention (O(N)
    memory) where this torch has it (2.0 and later), else the explicit [N, N] product."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v)
    return torch.softmax((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1) @ v


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
    keys = expert_keys(scores, width)  # [B, H, M, k], the kernels' tie rule
    # A tensor source, not the scalar True: TorchScript's tracer has no scatter_ with a bool scalar.
    expert_mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, keys, torch.ones_like(
        keys, dtype=torch.bool))
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

    def __init__(self, dim, mlp_hidden, eps, attention, dropout=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = attention
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc1", nn.Linear(dim, mlp_hidden))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("fc2", nn.Linear(mlp_hidden, dim))
        # Residual dropout: training only (identity in eval mode and in the C++ forward), no weights.
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, budget):
        x = x + self.dropout(self.attn(self.norm1(x), budget))
        return x + self.dropout(self.mlp(self.norm2(x)))


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
#   logits = head(pool(norm(x)))   pool: the mean over the N tokens, or attention pooling (AttentionPooling)
# A budget (m, k) is applied as (min(m, N), min(k, N)), as the server's ApplyDocumentBudget does.


class DocumentAttention(nn.Module):
    """qkv -> per-head MiTA (sequence landmarks) or full attention -> proj. `attention` computes MiTA from
    (q, k, v, landmarks, expert width): the dense twin mita_attention by default, or a drop-in with the same
    result (tools/mita_sparse.py sparse_mita_attention, for training on long windows)."""

    def __init__(self, dim, heads, attention=None):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attention = attention or mita_attention

    def forward(self, x, budget):
        b, n, c = x.shape
        d = c // self.heads
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if budget is None:
            out = full_attention(q, k, v)
        else:
            expert_count, expert_width = min(budget[0], n), min(budget[1], n)
            out = self.attention(q, k, v, sequence_landmarks(q, expert_count), expert_width)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


def position_buckets(positions: torch.Tensor, buckets: int) -> torch.Tensor:
    """Logarithmic position bucket of each token position n >= 0 (counted from the document's start):
    min(floor(log2(n + 1)), buckets - 1), so bucket 0 is the first token, bucket 1 the next two, bucket 16 tokens
    65,535 - 131,069. Integer arithmetic (the bit length of n + 1, less one), as the C++ forward computes it."""
    value = positions + 1
    bucket = torch.zeros_like(positions)
    for shift in range(1, 63):
        if buckets <= shift:
            break
        bucket += (value >> shift > 0).long()
    return bucket.clamp(max=buckets - 1)


class AttentionPooling(nn.Module):
    """Multi-head attention pooling over a document's tokens: head p scores token n as
    s[n, p] = x_n . score.weight[p] + score.bias[p] + position_bias[p, bucket(n)] (position_buckets above; no
    position term when buckets is 0), takes softmax over the tokens, and averages its channel group
    (channels p C/P .. (p + 1) C/P - 1) with those weights. x: [B, N, C], positions: [B, N] int64 -> [B, C]."""

    def __init__(self, dim, heads, buckets):
        super().__init__()
        self.heads = heads
        self.score = nn.Linear(dim, heads)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)
        self.position_bias = nn.Parameter(torch.zeros(heads, buckets)) if buckets > 0 else None

    def forward(self, x, positions):
        b, n, c = x.shape
        scores = self.score(x)  # [B, N, P]
        if self.position_bias is not None:
            scores = scores + self.position_bias.t()[position_buckets(positions, self.position_bias.shape[1])]
        weights = torch.softmax(scores, dim=1)  # over the tokens
        grouped = x.reshape(b, n, self.heads, c // self.heads)
        return (weights.unsqueeze(-1) * grouped).sum(dim=1).reshape(b, c)


class MitaDocument(nn.Module):
    """MiTA long-document classifier. forward(ids [B, N] int64, budget (m, k) or None for full, start [B] int64:
    the position of each row's first token in its document, default 0) -> [B, classes]. `attention`: see
    DocumentAttention; `dropout`: on the embedded tokens and the blocks' residual branches, training only.
    config.json "pooling": {"type": "mean"} (the default when absent) or {"type": "attention", "heads": P,
    "position_buckets": B} (AttentionPooling)."""

    def __init__(self, cfg, attention=None, dropout=0.0):
        super().__init__()
        dim = cfg["embed_dim"]
        kernel = cfg["position_encoding"]["kernel_size"]
        self.token_embedding = nn.Embedding(cfg["vocab_size"], dim)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        self.position_conv = nn.Conv1d(dim, dim, kernel, padding=kernel // 2, groups=dim)
        eps = cfg["layer_norm_eps"]
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            [Block(dim, cfg["mlp_hidden_dim"], eps, DocumentAttention(dim, cfg["num_heads"], attention), dropout)
             for _ in range(cfg["depth"])])
        self.norm = nn.LayerNorm(dim, eps=eps)
        pooling = cfg.get("pooling", {"type": "mean"})
        self.pool = (AttentionPooling(dim, pooling["heads"], pooling.get("position_buckets", 0))
                     if pooling["type"] == "attention" else None)
        self.head = nn.Linear(dim, cfg["num_classes"])

    def features(self, ids, budget, start=None):
        x = self.token_embedding(ids)
        x = self.dropout(x + self.position_conv(x.transpose(1, 2)).transpose(1, 2))
        for block in self.blocks:
            x = block(x, budget)
        x = self.norm(x)
        if self.pool is None:
            return x.mean(1)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        if start is not None:
            positions = positions + start.view(-1, 1)
        return self.pool(x, positions.expand(ids.shape[0], -1))

    def forward(self, ids, budget, start=None):
        return self.head(self.features(ids, budget, start))


def document_config(vocab_size, num_classes, tokenizer="bytes", embed_dim=128, depth=2, num_heads=4,
                    mlp_hidden_dim=256, kernel_size=9, max_tokens=65536, pooling=None):
    """config.json of a document package (the embedded model's sizes by default). pooling: None for the mean, or
    a "pooling" object such as {"type": "attention", "heads": 4, "position_buckets": 17}."""
    cfg = {
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
    if pooling is not None:
        cfg["pooling"] = pooling
    return cfg
