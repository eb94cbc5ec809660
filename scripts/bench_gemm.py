#!/usr/bin/env python3
"""The GEMM rates this CPU reaches, per library and precision, at the shapes the models run (issue 34, item 1).

Run with the peers' Python (torch, onnx, onnxruntime, numpy):

    /opt/mita/peers/bin/python scripts/bench_gemm.py [--threads 2] [--repeats 7] [--quick]

Paths, each C[m, n] = A[m, k] B[k, n] in row-major float32 (bfloat16 where named):
  torch_mkl_fp32     torch.mm (the LibTorch wheel's MKL sgemm: the server's dense layers today)
  torch_bf16         torch.mm in bfloat16 (LibTorch picks oneDNN only where it judges the CPU fit: printed)
  onnxruntime_fp32   ONNX Runtime's MatMul (its MLAS kernels), one-node graph, graph optimisations on
  numpy_openblas     numpy.matmul (the OpenBLAS numpy bundles, scipy-openblas; its version printed)
Correctness: the relative Frobenius error of each product against the float64 product of the same inputs; a path
whose error exceeds 1e-5 (float32) or 2e-2 (bfloat16) is marked WRONG and its rate is not a rate. Each rate is the
median of --repeats timed calls after two untimed ones, in GFLOP/s (2 m n k per product). One path runs all its
shapes before the next starts, after a pause, with OpenMP's and ONNX Runtime's idle threads told not to spin: a
pool still spinning after its own calls would take the cores from the next library's (measured: torch.mm at 3
GFLOP/s on DeiT-Tiny's qkv when the shapes were interleaved).

Shapes (m x k x n): a 2048 cube; DeiT-Tiny (C 192) and DeiT-Small (C 384) at 197 tokens (batch 1) and 6,304 (batch
32): the fused qkv projection (C -> 3C), the MLP (C -> 4C, 4C -> C); the embedded document model (C 64) at 16,384
tokens (qkv, MLP); the CPU kernel's expert-sized GEMMs (blocks of at most 512 rows, d 32 and 64). The machine's
limit is the fastest correct path per precision; docs/kernels.md states its "% of GEMM" against it.
"""
import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch loads its OpenMP runtime
# OpenBLAS's idle workers sleep at once instead of spinning for 2^28 cycles (as in the server: kernels/blas_library.cc).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
import sys
import time

import numpy as np

from bench_timing import timed


def shapes(quick):
    """(label, m, k, n) in the order printed."""
    rows = [("cube 2048", 2048, 2048, 2048)]
    for name, channels in (("DeiT-Tiny", 192), ("DeiT-Small", 384)):
        for tokens, batch in ((197, "b1"), (6304, "b32")):
            rows.append((f"{name} {batch} qkv", tokens, channels, 3 * channels))
            if not quick:
                rows.append((f"{name} {batch} mlp up", tokens, channels, 4 * channels))
                rows.append((f"{name} {batch} mlp down", tokens, 4 * channels, channels))
    rows.append(("document 16K qkv", 16384, 64, 192))
    if not quick:
        rows.append(("document 16K mlp up", 16384, 64, 256))
    rows.append(("kernel expert 512x64x64", 512, 64, 64))
    rows.append(("kernel scores 512x32x512", 512, 32, 512))
    return rows


def relative_error(product, exact):
    return float(np.linalg.norm(product.astype(np.float64) - exact) / max(np.linalg.norm(exact), 1e-300))


class OnnxMatMul:
    """A one-node ONNX graph C = MatMul(A, B) for ONNX Runtime, per shape (B an initializer, as a weight is)."""

    def __init__(self, b, threads):
        import onnx
        import onnxruntime
        from onnx import TensorProto, helper, numpy_helper
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["a", "b"], ["c"])], "matmul",
            [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, b.shape[0]])],
            [helper.make_tensor_value_info("c", TensorProto.FLOAT, [None, b.shape[1]])],
            [numpy_helper.from_array(b, "b")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                                    providers=["CPUExecutionProvider"])

    def __call__(self, a):
        return self.session.run(["c"], {"a": a})[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer shapes (the qkv ones, the cube, the kernel's)")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    bf16_fit = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    print(f"torch {torch.__version__} (MKL {torch.backends.mkl.is_available()}, oneDNN bfloat16 judged fit: "
          f"{bf16_fit}); numpy {np.__version__} ({np.__config__.CONFIG['Build Dependencies']['blas']['name']} "
          f"{np.__config__.CONFIG['Build Dependencies']['blas'].get('version', '?')}); threads {args.threads}; "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    paths = ["torch_mkl_fp32", "torch_bf16", "onnxruntime_fp32", "numpy_openblas"]
    print("| shape (m x k x n) | " + " | ".join(f"{p} GFLOP/s" for p in paths) + " | fastest correct fp32 |")
    print("|---|" + "---|" * (len(paths) + 1))
    generator = np.random.default_rng(1)
    problems = []
    for label, m, k, n in shapes(args.quick):
        # On LibTorch's 64-byte aligned storage, as the models' tensors are: numpy's own buffers are 16-byte
        # aligned, on which the wheel's MKL measured 71 against 136 GFLOP/s (16384 x 64 x 192, 2 threads).
        a = torch.from_numpy(generator.standard_normal((m, k), dtype=np.float32)).clone().numpy()
        b = torch.from_numpy(generator.standard_normal((k, n), dtype=np.float32)).clone().numpy()
        # The float64 reference from LibTorch: numpy's own product would start OpenBLAS's thread pool, whose
        # workers then slowed the torch path (measured: 65 against 166 GFLOP/s on the document model's qkv).
        exact = torch.from_numpy(a).double().mm(torch.from_numpy(b).double()).numpy()
        problems.append((label, m, k, n, a, b, exact))
    cells = {problem[0]: {} for problem in problems}  # label -> path -> (cell text, rate when correct)
    for path in paths:
        time.sleep(1)  # the previous library's threads settle
        for label, m, k, n, a, b, exact in problems:
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            if path == "torch_mkl_fp32":
                run, to_numpy, tolerance = (lambda: torch.mm(ta, tb)), (lambda c: c.numpy()), 1e-5
            elif path == "torch_bf16":
                ta16, tb16 = ta.bfloat16(), tb.bfloat16()
                run, to_numpy, tolerance = (lambda: torch.mm(ta16, tb16)), (lambda c: c.float().numpy()), 2e-2
            elif path == "onnxruntime_fp32":
                onnx = OnnxMatMul(b, args.threads)
                run, to_numpy, tolerance = (lambda: onnx(a)), (lambda c: c), 1e-5
            else:
                run, to_numpy, tolerance = (lambda: a @ b), (lambda c: c), 1e-5
            error = relative_error(to_numpy(run()), exact)
            if path == "torch_bf16" and not bf16_fit and m * n * k > 512 ** 3:
                cells[label][path] = (f"(not run: no oneDNN path, error {error:.1e})", None)  # minutes per call
                continue
            rate = 2.0 * m * n * k / timed(run, args.repeats, warm_ups=2) / 1e9
            ok = error <= tolerance
            cells[label][path] = (f"{rate:.0f}" + ("" if ok else f" WRONG (error {error:.1e})"), rate if ok else None)
    for label, m, k, n, *_ in problems:
        fp32 = {path: cells[label][path][1] for path in paths
                if path != "torch_bf16" and cells[label][path][1] is not None}
        fastest = max(fp32, key=fp32.get) if fp32 else "none"
        ratio = fp32.get(fastest, 0.0) / max(fp32.get("torch_mkl_fp32", 0.0), 1e-9)
        print(f"| {label} ({m} x {k} x {n}) | " + " | ".join(cells[label][path][0] for path in paths) +
              f" | {fastest} ({ratio:.2f}x torch) |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
