"""A mita-server process for the Python tests (Triton's client, timm's models)."""
import os
import re
import subprocess
import sys
import time


def start_server(build_dir, repository, work):
    """Starts build_dir's mita-server on 127.0.0.1 with a free port, serving `repository`, its log in
    work/server.log; returns (process, port). Exits the test with the log when it does not start within 120 s."""
    log = open(os.path.join(work, "server.log"), "w+")
    process = subprocess.Popen(
        [os.path.join(build_dir, "server", "mita-server"), "--listen=127.0.0.1:0", "--metrics_listen=",
         f"--model_repository={repository}", "--torch_threads=2"],
        stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        log.seek(0)
        match = re.search(r"serving gRPC on \S+ \(port (\d+);", log.read())
        if match:
            return process, int(match.group(1))
        if process.poll() is not None:
            break
        time.sleep(0.1)
    log.seek(0)
    sys.exit(f"mita-server did not start:\n{log.read()}")
