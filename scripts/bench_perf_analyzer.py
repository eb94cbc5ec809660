#!/usr/bin/env python3
"""Triton's perf_analyzer and our mita-bench drive the same load against one mita-server, in one run, alternating
(docs/serving.md, "perf_analyzer beside mita-bench").

  /usr/bin/python3 scripts/bench_perf_analyzer.py [--build build] [--rounds 2] [--concurrency 1,4,16,64]

The server: the embedded models, --max_batch_size=16 --max_queue_delay_ms=2 --torch_threads=2. The load: closed
loop at each concurrency, 50 warm-up calls, then perf_analyzer's three measurement windows of --window_ms (its
time_windows mode) and mita-bench for as long; every request at the same budget (m = 16, k = 32 for images;
m = 16, k = 64 for documents):
  images     32 Fashion-MNIST test images (PNG, build/tools/mita-export-images), round robin;
  documents  8 held-out Linux kernel documents (text, tools/build_document_corpus.py's held-out rule), round robin.
perf_analyzer (/opt/mita/perf-analyzer-2.60.0, scripts/install_peers.sh) sends ModelInfer over the Open Inference
Protocol (gRPC, synchronous, one thread per concurrent request; inputs from a JSON file, BYTES as base64 of the
length-prefixed bytes; the budget as --request-parameter); mita-bench sends mita.v1 Classify (one thread, async
completion queue). Each (case, concurrency) runs perf_analyzer then mita-bench in odd rounds, the other way in
even rounds. Prints throughput, p50/p99 latency and the client's own CPU time (user + system, seconds, whole run
including warm-up: both share the server's 2 cores) of both per round, and the medians of the throughput ratios.
"""
import argparse
import base64
import csv
import gzip
import hashlib
import json
import os
import re
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time

PERF_ANALYZER = "/opt/mita/perf-analyzer-2.60.0/perf_analyzer"
DOCUMENTATION = "/usr/share/doc/linux-doc-6.1/Documentation"


def start_server(build, work):
    log = open(os.path.join(work, "server.log"), "w+")
    process = subprocess.Popen(
        [os.path.join(build, "server", "mita-server"), "--model_repository=models/repository",
         "--listen=127.0.0.1:0", "--metrics_listen=", "--max_batch_size=16", "--max_queue_delay_ms=2",
         "--torch_threads=2"], stderr=log, env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    for _ in range(1200):
        log.seek(0)
        match = re.search(r"serving gRPC on \S+ \(port (\d+);", log.read())
        if match:
            return process, int(match.group(1))
        time.sleep(0.1)
    sys.exit("mita-server did not start")


def documents(count):
    """The first held-out document (2-8 KB) of each of the first `count` classes of the embedded model."""
    labels = [line.strip() for line in open("models/repository/linux-doc-mita/labels.txt") if line.strip()]
    found = []
    for folder in labels:
        paths = sorted(os.path.join(root, name) for root, _, files in os.walk(os.path.join(DOCUMENTATION, folder))
                       for name in files if name.endswith((".rst.gz", ".txt.gz")))
        for path in paths:
            relative = os.path.relpath(path, DOCUMENTATION)[: -len(".gz")]
            if hashlib.sha256(relative.encode()).digest()[0] < int(256 * 0.2):
                text = gzip.open(path).read()
                if 2048 <= len(text) <= 8000:
                    found.append(text.decode("utf-8", errors="replace").encode())
                    break
        if len(found) == count:
            break
    return found


def write_inputs(work, name, input_name, elements, model):
    """perf_analyzer's JSON (BYTES: base64 of the 4-byte little-endian length + bytes) and mita-bench's manifest."""
    folder = os.path.join(work, name)
    os.makedirs(folder, exist_ok=True)
    data = [{input_name: {"b64": base64.b64encode(struct.pack("<I", len(e)) + e).decode()}} for e in elements]
    with open(os.path.join(folder, "inputs.json"), "w") as f:
        json.dump({"data": data}, f)
    kind = "image" if input_name == "image" else "document"
    with open(os.path.join(folder, "manifest.csv"), "w") as f:
        for i, element in enumerate(elements):
            path = os.path.join(folder, f"{i}.{'png' if kind == 'image' else 'txt'}")
            open(path, "wb").write(element)
            f.write(f"{kind},{os.path.basename(path)},{model}\n")
    return folder


def client_cpu_seconds():
    """User + system CPU time of this script's finished children (the load generators), seconds."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_perf_analyzer(port, model, folder, concurrency, window_ms, budget, work):
    """perf_analyzer's own measurement: time windows of `window_ms`, reported over the last 3 stable ones (average latency and throughput within 100%:
    on a shared machine its default 10% is seldom reached; the windows still follow each other)."""
    report = os.path.join(work, "perf_analyzer.csv")
    command = [PERF_ANALYZER, "-m", model, "-i", "grpc", "-u", f"127.0.0.1:{port}",
               "--input-data", os.path.join(folder, "inputs.json"), "--concurrency-range", f"{concurrency}",
               "--measurement-mode", "time_windows", "--measurement-interval", str(window_ms),
               "--stability-percentage", "100", "--max-trials", "10", "--warmup-request-count", "50",
               "--request-parameter", f"mita_expert_count:{budget[0]}:int",
               "--request-parameter", f"mita_expert_width:{budget[1]}:int", "-f", report]
    cpu = client_cpu_seconds()
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cpu = client_cpu_seconds() - cpu
    if result.returncode != 0:
        sys.exit(f"perf_analyzer failed:\n{result.stdout}")
    row = next(csv.DictReader(open(report)))
    return float(row["Inferences/Second"]), float(row["p50 latency"]) / 1000, float(row["p99 latency"]) / 1000, cpu


def run_mita_bench(build, port, folder, concurrency, window_ms, budget):
    """mita-bench for as long as perf_analyzer's 3 windows (after 50 warm-up calls, like it)."""
    command = [os.path.join(build, "client", "mita-bench"), f"--server=127.0.0.1:{port}",
               f"--manifest={os.path.join(folder, 'manifest.csv')}", "--mode=closed",
               f"--concurrency={concurrency}", "--requests=0", f"--duration_s={3 * window_ms / 1000}",
               "--warmup_requests=50", f"--budgets={budget[0]}x{budget[1]}"]
    cpu = client_cpu_seconds()
    output = subprocess.run(command, stdout=subprocess.PIPE, check=True, text=True).stdout
    cpu = client_cpu_seconds() - cpu
    fields = dict(item.split("=", 1) for item in output.strip().splitlines()[-1].split()[1:])
    assert int(fields["ok"]) == int(fields["answered"]), output
    return float(fields["ok_throughput"]), float(fields["p50_ms"]), float(fields["p99_ms"]), cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default="build")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--window_ms", type=int, default=2000, help="perf_analyzer's measurement interval")
    args = parser.parse_args()
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([os.path.join(args.build, "tools", "mita-export-images"), "--count=32",
                        f"--out={work}/png"], check=True, stdout=subprocess.DEVNULL)
        pngs = [open(os.path.join(work, "png", name), "rb").read()
                for name in sorted(os.listdir(os.path.join(work, "png"))) if name.endswith(".png")]
        cases = [("images", "fashion-mnist-vit", write_inputs(work, "images", "image", pngs, "fashion-mnist-vit"),
                  (16, 32)),
                 ("documents", "linux-doc-mita", write_inputs(work, "documents", "text", documents(8), "linux-doc-mita"),
                  (16, 64))]
        levels = [int(c) for c in args.concurrency.split(",")]
        server, port = start_server(args.build, work)
        ratios = {}
        try:
            print(f"{'case':<10} {'conc':>4} {'round':>5} | {'perf_analyzer /s':>16} {'p50 ms':>7} {'p99 ms':>7} "
                  f"{'cpu s':>6} | {'mita-bench /s':>13} {'p50 ms':>7} {'p99 ms':>7} {'cpu s':>6} | {'ratio':>5}")
            for round_index in range(1, args.rounds + 1):
                for name, model, folder, budget in cases:
                    for concurrency in levels if name == "images" else [c for c in levels if c in (1, 16)]:
                        runs = {}
                        order = ["pa", "mb"] if round_index % 2 else ["mb", "pa"]
                        for tool in order:
                            if tool == "pa":
                                runs[tool] = run_perf_analyzer(port, model, folder, concurrency, args.window_ms, budget, work)
                            else:
                                runs[tool] = run_mita_bench(args.build, port, folder, concurrency, args.window_ms, budget)
                        ratio = runs["pa"][0] / runs["mb"][0]
                        ratios.setdefault((name, concurrency), []).append(ratio)
                        pa, mb = runs["pa"], runs["mb"]
                        print(f"{name:<10} {concurrency:>4} {round_index:>5} | {pa[0]:>16.1f} {pa[1]:>7.2f} {pa[2]:>7.2f} "
                              f"{pa[3]:>6.2f} | {mb[0]:>13.1f} {mb[1]:>7.2f} {mb[2]:>7.2f} {mb[3]:>6.2f} | {ratio:>5.2f}",
                              flush=True)
        finally:
            server.terminate()
            server.wait()
        print("median throughput ratio perf_analyzer / mita-bench: " +
              ", ".join(f"{name} c={c}: {statistics.median(r):.2f}" for (name, c), r in ratios.items()))


if __name__ == "__main__":
    main()
