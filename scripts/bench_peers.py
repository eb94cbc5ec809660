#!/usr/bin/env python3
"""Speed side by side, in one run: our C++ forward against the peers a user would otherwise run (docs/peers.md).

  /opt/mita/peers/bin/python scripts/bench_peers.py [--build build] [--rounds 2]

Images: timm's deit_tiny_patch16_224 and deit_small_patch16_224 (random weights, timm's initialisation) with the
project's MiTA attention swapped in (tools/timm_mita.py), converted by tools/convert_timm_checkpoint.py; 224x224
inputs ~ N(0, 1), the same tensors for every implementation. Batch 1 (latency: median of --latency_repeats
forwards after one warm-up forward) and batch 32 (images/s: 32 / median of --batch_repeats forwards; the batch-1
runs before warmed the implementation):
  cpp_mita        our C++ forward (build/tools/mita-forward --time), MiTA m = 25, k = 25 (the official default)
  eager_mita      PyTorch eager on the same weights, the PyTorch twin's MiTA attention (dense masked form)
  compiled_mita   TorchScript (torch.jit.trace) of eager_mita; with --compile torch.compile (inductor, CPU)
                  instead (its compilation took 502 s for DeiT-Tiny's two batch sizes on this shared machine)
  cpp_full        our C++ forward, full attention, same weights
  cpp_mita_bf16, cpp_full_bf16   the same two with --weights_dtype=bfloat16 (where mita-forward allows it: a CPU
                  with AVX512-BF16 or AMX-BF16; the dense layers in bfloat16 through oneDNN)
  eager_full      PyTorch eager, timm's own model (fused scaled_dot_product_attention), same weights
  onnxruntime     ONNX Runtime (CPU execution provider, graph optimisations on) on that model exported to ONNX
                  (torch.onnx.export, TorchScript-based exporter, opset 17), full attention
Documents: the embedded linux-doc-mita model on 16,384 and 65,536 random token ids:
  cpp_mita        our C++ document forward at its default budget m = 16, k = 64 (build/tools/mita-bench-documents
                  --child: one case in a process, after a 512-token warm-up)
  sdpa_full       the same weights in PyTorch (tools/mita_reference.py MitaDocument) with full attention computed
                  by PyTorch's fused scaled_dot_product_attention (its CPU flash-attention kernel)
Every implementation runs on --threads intra-op threads (torch.set_num_threads, ONNX Runtime intra_op_num_threads with
its default spinning, the C++ tools' --threads). The script starts itself again with OpenMP's wait settings as
mita-server runs (kernels/openmp_wait.h, read from there; an explicit setting is kept), so eager PyTorch and our tools
share libgomp's settings. Rounds alternate the implementations (each round runs all of them, in reverse order every
other round), so a shared machine's load hits all alike; medians over rounds are reported with their ratios to
eager_mita and onnxruntime (images) and sdpa_full (documents; --tokens "" leaves them out).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time


def reexec_with_openmp_wait_settings():
    """Starts this script again with kernels/openmp_wait.h's OMP_WAIT_POLICY and GOMP_SPINCOUNT where unset:
    libgomp reads them once, when PyTorch loads it."""
    header = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "openmp_wait.h")).read()
    wanted = {"OMP_WAIT_POLICY": re.search(r'kOpenMpWaitPolicy\[\] = "(\w+)"', header).group(1),
              "GOMP_SPINCOUNT": re.search(r'kOpenMpSpinCount\[\] = "(\w+)"', header).group(1)}
    unset = {name: value for name, value in wanted.items() if name not in os.environ}
    if unset:
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, **unset))


if __name__ == "__main__":
    reexec_with_openmp_wait_settings()

import numpy as np
import onnxruntime
import timm
import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tools"))
from mita_reference import DocumentAttention, MitaDocument, load_safetensors  # noqa: E402
from timm_mita import set_budget, swap_mita_attention  # noqa: E402
from bench_timing import timed  # noqa: E402

THREADS = 2  # --threads
USE_TORCH_COMPILE = False  # --compile
IMAGE_BUDGET = (5, 25)  # pool side 5 (m = 25), k = 25
DOCUMENT_BUDGET = "16x64"


class ImageCase:
    """One DeiT model in every implementation, for batch sizes 1 and 32."""

    def __init__(self, name, heads, work, build):
        torch.manual_seed(0)
        self.name = name
        self.stock = timm.create_model(name, pretrained=False).eval()
        self.mita = swap_mita_attention(timm.create_model(name, pretrained=False), depthwise_conv=False).eval()
        self.mita.load_state_dict(self.stock.state_dict())
        set_budget(self.mita, IMAGE_BUDGET)
        checkpoint = os.path.join(work, f"{name}.pth")
        torch.save(self.stock.state_dict(), checkpoint)
        self.package = os.path.join(work, name)
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_timm_checkpoint.py"), "--checkpoint",
                        checkpoint, "--out", self.package, "--num_heads", str(heads)], check=True,
                       stdout=subprocess.DEVNULL)
        self.build = build
        self.inputs = {batch: torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(batch))
                       for batch in (1, 32)}
        self.compiled, self.compiled_kind, self.compile_seconds = self.compile()
        onnx_path = os.path.join(work, f"{name}.onnx")
        torch.onnx.export(self.stock, (self.inputs[1],), onnx_path, dynamo=False, opset_version=17,
                          input_names=["images"], output_names=["logits"],
                          dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = THREADS
        options.inter_op_num_threads = 1
        self.onnx = onnxruntime.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
        self.check_agreement()

    def compile(self):
        start = time.perf_counter()
        if USE_TORCH_COMPILE:
            try:
                compiled = torch.compile(self.mita)
                with torch.no_grad():
                    for batch in (1, 32):
                        compiled(self.inputs[batch])
                return compiled, "torch.compile", time.perf_counter() - start
            except Exception as error:  # inductor needs a C++ compiler and Python headers
                print(f"{self.name}: torch.compile failed ({type(error).__name__}: {str(error)[:200]}); TorchScript")
        with torch.no_grad():
            traced = torch.jit.trace(self.mita, self.inputs[1], check_trace=False)
        return traced, "torch.jit.trace", time.perf_counter() - start

    def check_agreement(self):
        """The implementations compute the same model: logits agree (MiTA with MiTA, full with full)."""
        x = self.inputs[1]
        with torch.no_grad():
            eager_mita, eager_full = self.mita(x), self.stock(x)
            compiled = self.compiled(x)
        onnx = torch.from_numpy(self.onnx.run(None, {"images": x.numpy()})[0])
        cpp = {}
        for budget in ("25x25", "full"):
            path = os.path.join(self.package, "inputs.f32")
            x.numpy().astype("<f4").tofile(path)
            subprocess.run([os.path.join(self.build, "tools", "mita-forward"), f"--model={self.package}",
                            f"--images={path}", f"--budgets={budget}", f"--out={path}.logits",
                            f"--threads={THREADS}"], check=True)
            cpp[budget] = torch.from_numpy(np.fromfile(path + ".logits", dtype="<f4").reshape(1, -1))
        differences = {"cpp_mita": (cpp["25x25"] - eager_mita).abs().max().item(),
                       "compiled_mita": (compiled - eager_mita).abs().max().item(),
                       "cpp_full": (cpp["full"] - eager_full).abs().max().item(),
                       "onnxruntime": (onnx - eager_full).abs().max().item()}
        print(f"{self.name}: max |logits - eager| " + ", ".join(f"{k} {v:.1e}" for k, v in differences.items()))
        assert all(value < 1e-3 for value in differences.values()), differences

    def cpp_allows_bfloat16(self):
        """Whether mita-forward runs this model in bfloat16 here (the CPU check is the server's own,
        kernels::CheckWeightsDtypeOnDevice: AVX512-BF16 or AMX-BF16)."""
        return subprocess.run([os.path.join(self.build, "tools", "mita-forward"), f"--model={self.package}", "--time",
                               "--batch_size=1", "--repeats=1", f"--threads={THREADS}", "--weights_dtype=bfloat16"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0

    def cpp(self, batch, budget, repeats, dtype="float32"):
        """mita-forward --time (a fresh process: one warm-up forward at this batch size, then `repeats`)."""
        output = subprocess.run([os.path.join(self.build, "tools", "mita-forward"), f"--model={self.package}",
                                 "--time", f"--batch_size={batch}", f"--budget={budget}", f"--repeats={repeats}",
                                 f"--threads={THREADS}", f"--weights_dtype={dtype}"], check=True,
                                stdout=subprocess.PIPE, text=True).stdout
        return statistics.median(float(line.split()[0].split("=")[1]) / 1000 for line in output.splitlines())

    def run(self, implementation, batch, repeats):
        """Median seconds of one forward of `batch` images (batch 1 after a warm-up forward)."""
        x = self.inputs[batch]
        warm_up = batch == 1
        if implementation == "cpp_mita":
            return self.cpp(batch, "25x25", repeats)
        if implementation == "cpp_full":
            return self.cpp(batch, "full", repeats)
        if implementation == "cpp_mita_bf16":
            return self.cpp(batch, "25x25", repeats, "bfloat16")
        if implementation == "cpp_full_bf16":
            return self.cpp(batch, "full", repeats, "bfloat16")
        if implementation == "onnxruntime":
            feed = {"images": x.numpy()}
            return timed(lambda: self.onnx.run(None, feed), repeats, int(warm_up))
        model = {"eager_mita": self.mita, "compiled_mita": self.compiled, "eager_full": self.stock}[implementation]
        with torch.no_grad():
            return timed(lambda: model(x), repeats, int(warm_up))


class SdpaDocumentAttention(DocumentAttention):
    """The twin's document attention with full attention by PyTorch's fused scaled_dot_product_attention."""

    def forward(self, x, budget):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


def document_model(package):
    cfg = json.load(open(os.path.join(package, "config.json")))
    model = MitaDocument(cfg)
    for block in model.blocks:
        attention = SdpaDocumentAttention(cfg["embed_dim"], cfg["num_heads"])
        block.attn = attention
    model.load_state_dict(load_safetensors(os.path.join(package, "model.safetensors")))
    return model.eval(), cfg


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency_repeats", type=int, default=10)
    parser.add_argument("--batch_repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="torch.compile instead of TorchScript")
    parser.add_argument("--models", default="deit_tiny_patch16_224:3,deit_small_patch16_224:6")
    parser.add_argument("--tokens", default="16384,65536")
    args = parser.parse_args()
    global THREADS, USE_TORCH_COMPILE
    THREADS, USE_TORCH_COMPILE = args.threads, args.compile
    torch.set_num_threads(THREADS)
    print(f"torch {torch.__version__}, timm {timm.__version__}, onnxruntime {onnxruntime.__version__}, "
          f"{THREADS} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '(unset)')}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        cases = [ImageCase(name, int(heads), work, args.build)
                 for name, heads in (item.split(":") for item in args.models.split(","))]
        for case in cases:
            print(f"{case.name}: {case.compiled_kind} took {case.compile_seconds:.0f} s (both batch sizes)")
        implementations = ["cpp_mita", "eager_mita", "compiled_mita", "cpp_full", "eager_full", "onnxruntime"]
        if all(case.cpp_allows_bfloat16() for case in cases):
            implementations += ["cpp_mita_bf16", "cpp_full_bf16"]
        results = {}
        for round_index in range(args.rounds):
            order = implementations if round_index % 2 == 0 else implementations[::-1]
            for case in cases:
                for implementation in order:
                    for batch, repeats in ((1, args.latency_repeats), (32, args.batch_repeats)):
                        seconds = case.run(implementation, batch, repeats)
                        results.setdefault((case.name, implementation, batch), []).append(seconds)
            print(f"image round {round_index + 1} done ({time.perf_counter() - started:.0f} s)", flush=True)
        print("\nimages (224x224, MiTA m=25 k=25; full attention for cpp_full, eager_full, onnxruntime)")
        print(f"{'model':<24} {'implementation':<15} {'batch-1 ms':>10} {'images/s (32)':>13} "
              f"{'x eager_mita (1)':>16} {'x eager_mita (32)':>17} {'x onnxruntime (1)':>17} "
              f"{'x onnxruntime (32)':>18}")
        for case in cases:
            base1 = statistics.median(results[(case.name, "eager_mita", 1)])
            base32 = statistics.median(results[(case.name, "eager_mita", 32)])
            ort1 = statistics.median(results[(case.name, "onnxruntime", 1)])
            ort32 = statistics.median(results[(case.name, "onnxruntime", 32)])
            for implementation in implementations:
                t1 = statistics.median(results[(case.name, implementation, 1)])
                t32 = statistics.median(results[(case.name, implementation, 32)])
                label = case.compiled_kind if implementation == "compiled_mita" else implementation
                print(f"{case.name:<24} {label:<15} {t1 * 1000:>10.1f} {32 / t32:>13.1f} {base1 / t1:>16.2f} "
                      f"{base32 / t32:>17.2f} {ort1 / t1:>17.2f} {ort32 / t32:>18.2f}")
            print(f"{case.name}: rounds (batch-1 ms cpp_mita / eager_mita): " + ", ".join(
                f"{a * 1000:.1f}/{b * 1000:.1f}" for a, b in zip(results[(case.name, 'cpp_mita', 1)],
                                                               results[(case.name, 'eager_mita', 1)])))

        package = os.path.join(ROOT, "models", "repository", "linux-doc-mita")
        model, cfg = document_model(package)
        print("\ndocuments (linux-doc-mita, random token ids)")
        print(f"{'tokens':>7} {'cpp_mita 16x64 s':>17} {'sdpa_full s':>12} {'sdpa_full / cpp_mita':>21}")
        for tokens in (int(t) for t in args.tokens.split(",") if t):
            ids = torch.randint(0, cfg["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(tokens))
            ids_path = os.path.join(work, f"ids{tokens}.bin")
            ids.numpy().astype("<i8").tofile(ids_path)
            full_repeats = 1 if tokens > 32768 else 2
            cpp_times, sdpa_times = [], []
            # Full attention above 32K tokens takes minutes here: in the first round only (the C++ side in every one).
            for round_index in range(args.rounds):
                def cpp():
                    output = subprocess.run(
                        [os.path.join(args.build, "tools", "mita-bench-documents"), "--child", f"--model={package}",
                         f"--ids_file={ids_path}", f"--budget={DOCUMENT_BUDGET}", "--repeats=3", "--full_repeats=1",
                         f"--threads={THREADS}"], check=True, stdout=subprocess.PIPE, text=True).stdout
                    fields = dict(item.split("=") for item in output.split("RESULT")[1].split())
                    return float(fields["median_ms"]) / 1000

                def sdpa():
                    with torch.no_grad():
                        warm = ids[:, :512]
                        model(warm, None)
                        times = []
                        for _ in range(full_repeats):
                            start = time.perf_counter()
                            model(ids, None)
                            times.append(time.perf_counter() - start)
                        return statistics.median(times)

                for run in ((cpp, sdpa) if round_index % 2 == 0 else (sdpa, cpp)):
                    if run is sdpa and tokens > 32768 and round_index > 0:
                        continue
                    (cpp_times if run is cpp else sdpa_times).append(run())
            a, b = statistics.median(cpp_times), statistics.median(sdpa_times)
            print(f"{tokens:>7} {a:>17.3f} {b:>12.3f} {b / a:>21.1f}   (rounds: cpp "
                  f"{', '.join(f'{t:.3f}' for t in cpp_times)}; sdpa {', '.join(f'{t:.2f}' for t in sdpa_times)})",
                  flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
