#!/usr/bin/env python3
"""Measures what a gzip bomb costs a mita-server: a Classify whose 1 MiB gzip body inflates to a 1 GiB
ClassifyRequest, sent in raw HTTP/2 frames (tests/grpc_h2.py, python3-h2) once without and once with the bearer
token, to a server started here with --auth_token_file (and --cost_calibration_ms=0); prints each answer and the
server's VmRSS and CPU time (/proc/PID) around each call.

    /usr/bin/python3 scripts/measure_compression_bomb.py BUILD_DIR [extra mita-server flags]
"""
import os
import re
import subprocess
import sys
import tempfile
import time

source = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(source, "tests"))
import grpc_h2  # noqa: E402

build = sys.argv[1]
work = tempfile.mkdtemp(prefix="bomb_")
with open(os.path.join(work, "token"), "w") as f:
    f.write("bomb-measure-token\n")
log = open(os.path.join(work, "server.log"), "w+")
server = subprocess.Popen(
    [os.path.join(build, "server", "mita-server"), "--listen=127.0.0.1:0", "--metrics_listen=",
     f"--model_repository={source}/models/repository", f"--auth_token_file={work}/token",
     "--cost_calibration_ms=0"] + sys.argv[2:], stderr=log, stdout=subprocess.DEVNULL)
port = None
for _ in range(1800):
    log.seek(0)
    match = re.search(r"serving gRPC.* \(port (\d+);", log.read())
    if match:
        port = int(match.group(1))
        break
    time.sleep(0.1)
if port is None:
    sys.exit("mita-server did not start")


def rss_mib():
    with open(f"/proc/{server.pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def cpu_s():
    with open(f"/proc/{server.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


time.sleep(2)
model = b"fashion-mnist-vit"
prefix = grpc_h2.length_delimited(1, len(model)) + model + grpc_h2.length_delimited(2, 1 << 30)
body = grpc_h2.grpc_frame(grpc_h2.gzip_bomb(prefix, 1024), compressed=True)
print(f"idle VmRSS {rss_mib():.1f} MiB; bomb body {len(body) - 5} bytes, inflating to {len(prefix) + (1 << 30)}")
for label, metadata in (("without token", ()), ("with token", (("authorization", "Bearer bomb-measure-token"),))):
    rss, cpu, start = rss_mib(), cpu_s(), time.monotonic()
    answer = grpc_h2.unary(port, "/mita.v1.MitaService/Classify", body, encoding="gzip", metadata=metadata,
                           wait_s=300)
    wall = time.monotonic() - start
    time.sleep(1)
    print(f"{label}: status {answer.status} '{answer.message}' after {wall:.2f} s; VmRSS {rss:.1f} -> "
          f"{rss_mib():.1f} MiB, CPU {cpu_s() - cpu:.2f} s")
server.terminate()
server.wait()
