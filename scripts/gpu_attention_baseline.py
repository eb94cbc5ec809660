#!/usr/bin/env python3
"""Full-attention baseline for the CUDA MiTA timing of scripts/gpu_check.sh, on the same GPU in the same run.

Times torch.nn.functional.scaled_dot_product_attention (PyTorch picks its fastest kernel: FlashAttention for
bfloat16, the memory-efficient kernel for float32) on q, k, v of shape [1, H, N, d] at the sizes that
tests/cuda/mita_cuda_check.cc times (H = 8, d = 64, N = 4K / 16K / 64K), median of 10 runs after one warm-up,
timed with CUDA events. FLOPs counted as 4 N^2 d per head (QK^T and PV). Prints a markdown table with
columns: dtype | N | d | H | ms | TFLOP/s.

Usage: python3 scripts/gpu_attention_baseline.py   (needs PyTorch with CUDA; exits 77 without a GPU)
"""
import sys

import torch


def time_attention(dtype: torch.dtype, tokens: int, heads: int, head_dim: int) -> float:
    """Median milliseconds of one full-attention forward over [1, heads, tokens, head_dim] inputs."""
    generator = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(1, heads, tokens, head_dim, device="cuda", dtype=dtype, generator=generator)
               for _ in range(3))
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with torch.inference_mode():
        for run in range(11):
            start.record()
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
            stop.record()
            stop.synchronize()
            if run > 0:  # run 0 warms up
                times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_attention_baseline: no CUDA device: skipped")
        return 77
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    print("\n| dtype | N | d | H | ms | TFLOP/s |\n|---|---:|---:|---:|---:|---:|")
    heads, head_dim = 8, 64
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        for tokens in (4096, 16384, 65536):
            milliseconds = time_attention(dtype, tokens, heads, head_dim)
            flops = 4.0 * tokens * tokens * head_dim * heads
            print(f"| {name} | {tokens} | {head_dim} | {heads} | {milliseconds:.3f} | "
                  f"{flops / (milliseconds * 1e-3) / 1e12:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
