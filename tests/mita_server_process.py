"""A mita-server process for the Python tests (Triton's client, timm's models)."""
import os
import re
import subprocess
import sys
import time


def start_server(build_dir, repository, work, extra_args=(), log_name="server.log"):
    """Starts build_dir's mita-server on 127.0.0.1 with a free port, serving `repository` (with `extra_args`, which
    override the defaults here), its log in work/`log_name`; returns (process, port). Exits the test with the log
    when it does not start within 120 s."""
    log = open(os.path.join(work, log_name), "w+")
    process = subprocess.Popen(
        [os.path.join(build_dir, "server", "mita-server"), "--listen=127.0.0.1:0", "--metrics_listen=",
         f"--model_repository={repository}", "--torch_threads=2", *extra_args],
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
