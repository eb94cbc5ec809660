"""Training-step benchmark of the document model: time and peak memory of one step (forward, backward, optimizer)
on one document of N tokens, for MiTA through the sparse training attention (tools/mita_sparse.py), MiTA through
the dense twin (tools/mita_reference.py mita_attention, [N, N] masks) and full attention through PyTorch's
scaled_dot_product_attention, side by side in one run.

  OMP_WAIT_POLICY=passive /opt/mita/peers/bin/python tools/bench_training.py \\
      --tokens 1024,4096,16384,65536 --budget 16x64 --threads 2

Each case runs in a fresh child process (so that one case's heap does not inflate the next one's peak): a model of
the embedded document model's shape (--embed-dim, --depth, --heads, --mlp-hidden-dim, attention pooling), random
weights and ids; one warm-up step, then --repeats timed steps (a single one when the warm-up took over
--slow-seconds); step time is their median. Peak memory is the child's peak RSS (getrusage ru_maxrss) minus its RSS
just before the first step (libraries, weights and optimizer state). The dense twin is skipped where its
[N, N] tensors alone would exceed --dense-max-gib (about 22 bytes per N^2 per head and layer: masks, logits,
softmax and their gradients); the skip is printed with the estimate. Prints one table, ratios against full
attention of the same N.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(args):
    """In the child: one case, printed as a JSON line."""
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    from mita_reference import MitaDocument, document_config, mita_attention
    from mita_sparse import sparse_mita_attention
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = document_config(8192, 14, embed_dim=args.embed_dim, depth=args.depth, num_heads=args.heads,
                          mlp_hidden_dim=args.mlp_hidden_dim, pooling={"type": "attention", "heads": 4,
                                                                       "position_buckets": 17})
    attention = {"sparse": sparse_mita_attention, "dense": mita_attention, "full": None}[args.case]
    model = MitaDocument(cfg, attention=attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    budget = None if args.case == "full" else tuple(int(x) for x in args.budget.split("x"))
    ids = torch.randint(0, 8192, (1, args.n))
    label = torch.tensor([3])

    def step():
        started = time.perf_counter()
        loss = F.cross_entropy(model(ids, budget), label)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - started

    for parameter in model.parameters():  # the optimizer state exists before the baseline is read
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    baseline = rss_bytes()
    warm_up = step()
    times = [step() for _ in range(1 if warm_up > args.slow_seconds else args.repeats)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": statistics.median(times), "runs": len(times), "peak_bytes": peak - baseline}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,4096,16384,65536")
    parser.add_argument("--budget", default="16x64", help="MiTA budget m x k")
    parser.add_argument("--cases", default="sparse,dense,full")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slow-seconds", type=float, default=20.0)
    parser.add_argument("--dense-max-gib", type=float, default=12.0)
    parser.add_argument("--embed-dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--mlp-hidden-dim", type=int, default=128)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        run_case(args)
        return
    import torch
    print(f"torch {torch.__version__}, {args.threads} threads, one document per step, MiTA budget {args.budget}, "
          f"model C={args.embed_dim} depth={args.depth} heads={args.heads}; load average {os.getloadavg()[0]:.2f}",
          flush=True)
    names = {"sparse": "MiTA, sparse (tools/mita_sparse.py)", "dense": "MiTA, dense twin ([N, N] masks)",
             "full": "full attention (scaled_dot_product_attention)"}
    results = {}
    for n in [int(x) for x in args.tokens.split(",")]:
        for case in args.cases.split(","):
            estimate = 22 * n * n * args.heads * args.depth / 2 ** 30
            if case == "dense" and estimate > args.dense_max_gib:
                results[(n, case)] = f"skipped: its [N, N] tensors need about {estimate:.0f} GiB"
                print(f"N={n} {case}: {results[(n, case)]}", flush=True)
                continue
            command = [sys.executable, os.path.abspath(__file__), "--case", case, "--n", str(n)] + [
                f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()
                if key not in ("case", "n", "tokens", "cases") and value is not None]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                results[(n, case)] = f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr else done.returncode}"
            else:
                results[(n, case)] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"N={n} {case}: {results[(n, case)]}", flush=True)
    print(f"\nload average after the run: {os.getloadavg()[0]:.2f}\n")
    print("| tokens N | attention | step time (s) | runs | x full attention | peak memory above baseline (MiB) |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in [int(x) for x in args.tokens.split(",")]:
        full = results.get((n, "full"))
        for case in args.cases.split(","):
            result = results[(n, case)]
            if isinstance(result, str):
                print(f"| {n} | {names[case]} | {result} | | | |")
                continue
            ratio = f"{full['seconds'] / result['seconds']:.1f}x" if isinstance(full, dict) else "-"
            print(f"| {n} | {names[case]} | {result['seconds']:.3f} | {result['runs']} | {ratio} | "
                  f"{result['peak_bytes'] / 2 ** 20:.0f} |")


if __name__ == "__main__":
    main()
