"""timm's VisionTransformer (DeiT) with the project's MiTA attention swapped in, for the tests and benchmarks that
compare the C++ forward with timm models (tests/timm_logits_test.py, scripts/bench_peers.py).

  model = timm.create_model("deit_small_patch16_224", pretrained=False)
  swap_mita_attention(model, depthwise_conv=False)   # every block's attn -> MitaAttention (same qkv/proj weights)
  set_budget(model, (5, 25))                         # pool side P (m = P*P landmarks) and expert width k
  set_budget(model, None)                            # full attention (softmax(q k^T / sqrt(d)) v)

MitaAttention is tools/mita_reference.py's Attention (the PyTorch twin of the C++ forward, docs/design.md section
2), with timm's parameter names (attn.qkv, attn.proj, and attn.dwc for the DWC variant), so the model's state
dict is a timm checkpoint that tools/convert_timm_checkpoint.py converts. full_attention="sdpa" makes full
attention PyTorch's fused scaled_dot_product_attention instead of the twin's explicit softmax.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mita_reference import Attention  # noqa: E402


class MitaAttention(Attention):
    """timm's Attention interface (forward(x, attn_mask=None)) over the twin's MiTA attention; the budget is an
    attribute (timm's Block passes none): (pool side P, expert width k), or None for full attention."""

    def __init__(self, dim, heads, depthwise_conv, full_attention="math"):
        super().__init__(dim, heads, depthwise_conv)
        self.budget = None
        self.full_attention = full_attention

    def forward(self, x, attn_mask=None, **unused):
        if self.budget is None and self.full_attention == "sdpa" and self.dwc is None:
            b, n, c = x.shape
            qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
            return self.proj(out.transpose(1, 2).reshape(b, n, c))
        return super().forward(x, self.budget)


def swap_mita_attention(model, depthwise_conv, full_attention="math"):
    """Replaces the attention of every block of a timm VisionTransformer by MitaAttention, keeping its qkv and
    proj weights (a DWC conv, when asked, starts from PyTorch's default initialisation). Returns the model."""
    for block in model.blocks:
        timm_attention = block.attn
        dim = timm_attention.qkv.in_features
        attention = MitaAttention(dim, timm_attention.num_heads, depthwise_conv, full_attention)
        attention.qkv.load_state_dict(timm_attention.qkv.state_dict())
        attention.proj.load_state_dict(timm_attention.proj.state_dict())
        block.attn = attention.to(timm_attention.qkv.weight.dtype)
    return model


def set_budget(model, budget):
    """Sets the budget of every MitaAttention of `model`: (pool side P, expert width k), or None (full)."""
    for module in model.modules():
        if isinstance(module, MitaAttention):
            module.budget = budget


def add_noise(model, scale, seed):
    """Adds N(0, scale^2) noise to every parameter, so that parameters timm initialises to constants (LayerNorm
    weights 1 and biases 0, zero biases) still test their names and placement in the converted package."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return model
