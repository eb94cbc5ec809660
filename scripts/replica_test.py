#!/usr/bin/env python3
"""Three mita-server replicas behind one client, on loopback: balance and a rolling restart under load.

The replicas listen on 127.0.0.1, 127.0.0.2 and 127.0.0.3, one port; mita-bench reaches all three through one
channel (--server as a list of the three addresses: gRPC target ipv4:..., as a Kubernetes client reaches the pods of
the headless Service through dns:///) with --load_balancing=round_robin and closed-loop load at --concurrency. For
each client policy (--policies) a fresh set of replicas is started and:

  1. balance: a --balance_s run; the OK answers of each replica (the peer of each answer) must be within
     --max_imbalance of an even share; liveness (health service "liveness") and readiness ("") are asked of each
     replica with mita-health-probe meanwhile: their answers and slowest answer under the load;
  2. rolling restart: a --restart_s run during which each replica in turn gets SIGTERM and drains, readiness is
     polled until it turns false, and once the process exited a new one starts on its address; the next waits
     until the new one is ready. Counted: failed calls (by code and message, from mita-bench), calls that reached
     a replica as a retry (mita_retried_calls_total, each replica's last log line), each drain's time (SIGTERM to
     exit), readiness false after SIGTERM, ready after start.

Policies: "documented" (round_robin, client-side health checking, 5 attempts: docs/deploy.md), "no_retries"
(round_robin and health checking), "retries_only" (round_robin and 5 attempts, no health checking, as a client
whose gRPC library does not watch health), "round_robin" (alone), "no_notice" (round_robin alone against servers with
--drain_notice_ms=0, the server's drain before it had a notice), "health_no_notice" (round_robin and health
checking, no retries, against such servers).

Checks (exit status 1 when one fails): every policy balanced within --max_imbalance, every restart done within the
restart run, readiness false within 1 s of every SIGTERM while liveness stays true, both true under load, no failed
call under the policies in --require_no_failures (default: documented), and some calls retried under those in
--require_retries (default: retries_only). Prints one "REPLICAS policy=..." line per policy.

Usage: scripts/replica_test.py [--build=build] [--balance_s=10] [--restart_s=45] [--policies=...]
The figures in docs/deploy.md ("Replicas and rolling restarts") come from the defaults.
"""
import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ADDRESSES = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
POLICIES = {
    "documented": (["--load_balancing=round_robin", "--client_health_check", "--max_attempts=5"], []),
    "no_retries": (["--load_balancing=round_robin", "--client_health_check"], []),
    "retries_only": (["--load_balancing=round_robin", "--max_attempts=5"], []),
    "round_robin": (["--load_balancing=round_robin"], []),
    "no_notice": (["--load_balancing=round_robin"], ["--drain_notice_ms=0"]),
    "health_no_notice": (["--load_balancing=round_robin", "--client_health_check"], ["--drain_notice_ms=0"]),
}


def free_port():
    """A port free on every replica address now (each is bound once and released)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind((ADDRESSES[0], 0))
            port = first.getsockname()[1]
            try:
                for address in ADDRESSES[1:]:
                    with socket.socket() as other:
                        other.bind((address, port))
                return port
            except OSError:
                continue
    raise RuntimeError("no port free on all of " + ", ".join(ADDRESSES))


class Replica:
    """One mita-server process on address:port, its log in work/NAME.log."""

    def __init__(self, args, address, port, name, extra):
        self.args, self.address, self.port, self.name = args, address, port, name
        self.log_path = os.path.join(args.work, name + ".log")
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [os.path.join(args.build, "server", "mita-server"), "--model_repository=" + args.repository,
                 f"--listen={address}:{port}", "--metrics_listen=", "--torch_threads=1", "--preparation_threads=1",
                 "--drain_timeout_s=20"] + extra,
                stderr=log, stdout=subprocess.DEVNULL)

    def log(self):
        with open(self.log_path, errors="replace") as log:
            return log.read()

    def probe(self, service="", timeout_ms=1000):
        """(serving, seconds) of one mita-health-probe call."""
        start = time.monotonic()
        code = subprocess.call([os.path.join(self.args.build, "server", "mita-health-probe"),
                                f"--address={self.address}:{self.port}", f"--service={service}",
                                f"--timeout_ms={timeout_ms}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return code == 0, time.monotonic() - start

    def wait_ready(self, bound_s=120):
        """Seconds from the start until readiness ("" SERVING), or None."""
        while time.monotonic() - self.started < bound_s:
            if self.process.poll() is not None:
                return None
            if self.probe(timeout_ms=500)[0]:
                return time.monotonic() - self.started
            time.sleep(0.05)
        return None

    def stop(self):
        """SIGTERM; returns (seconds until readiness was false, liveness then, seconds until exit, exit status)."""
        signalled = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        not_ready, live = None, None
        while self.process.poll() is None and not_ready is None:
            if not self.probe(timeout_ms=500)[0]:
                not_ready = time.monotonic() - signalled
                # Draining (--drain_notice_ms is 1 s): liveness still answers SERVING.
                live = self.probe("liveness", timeout_ms=500)[0]
            else:
                time.sleep(0.02)
        status = self.process.wait(timeout=60)
        return not_ready, live, time.monotonic() - signalled, status

    def retried(self):
        found = re.findall(r"calls received as retries (\d+)", self.log())
        return int(found[-1]) if found else None


def bench(args, port, policy_flags, seconds, label):
    """Starts mita-bench (closed loop at --concurrency for `seconds`) over the three replicas."""
    servers = ",".join(f"{address}:{port}" for address in ADDRESSES)
    out_path = os.path.join(args.work, label + ".txt")
    out = open(out_path, "wb")
    process = subprocess.Popen(
        [os.path.join(args.build, "client", "mita-bench"), "--server=" + servers, "--manifest=" + args.manifest,
         "--mode=closed", f"--concurrency={args.concurrency}", "--requests=0", f"--duration_s={seconds}",
         "--warmup_requests=0", "--deadlines_ms=30000", "--label=" + label] + policy_flags,
        stdout=out, stderr=subprocess.STDOUT)
    return process, out, out_path


def bench_result(process, out, out_path):
    process.wait()
    out.close()
    with open(out_path, errors="replace") as text:
        report = text.read()
    if process.returncode != 0 or "RESULT " not in report:
        raise RuntimeError(f"mita-bench failed (exit {process.returncode}):\n{report}")
    return report


def run_policy(args, policy):
    client_flags, server_flags = POLICIES[policy]
    port = free_port()
    replicas = [Replica(args, address, port, f"{policy}_r{i}_0", server_flags) for i, address in enumerate(ADDRESSES)]
    failures = []
    try:
        ready_s = [replica.wait_ready() for replica in replicas]
        if None in ready_s:
            raise RuntimeError("a replica did not become ready:\n" + "\n".join(r.log() for r in replicas))
        # 1. Balance, with liveness and readiness asked meanwhile.
        process, out, out_path = bench(args, port, client_flags, args.balance_s, f"{policy}_balance")
        time.sleep(min(2.0, args.balance_s / 4))
        probes = {"liveness": [], "": []}
        while process.poll() is None:
            for replica in replicas:
                for service in probes:
                    probes[service].append(replica.probe(service, timeout_ms=3000))
            time.sleep(0.2)
        report = bench_result(process, out, out_path)
        counts = [int(c) for c in re.findall(r"=(\d+)", re.search(r" servers=(\S+)", report).group(1))]
        answered = re.search(r"RESULT .* ok=(\d+) ", report)
        ok_total = int(answered.group(1))
        per_replica = {address: 0 for address in ADDRESSES}
        for peer, count in re.findall(r"ipv4:([\d.]+):\d+=(\d+)", report):
            per_replica[peer] = per_replica.get(peer, 0) + int(count)
        shares = [per_replica[a] / max(1, ok_total) * len(ADDRESSES) for a in ADDRESSES]
        imbalance = max(abs(share - 1) for share in shares)
        if len(counts) != len(ADDRESSES) or imbalance > args.max_imbalance:
            failures.append(f"{policy}: answers per replica {per_replica} are not within "
                            f"{args.max_imbalance:.0%} of even")
        live_ok = all(ok for ok, _ in probes["liveness"])
        ready_ok = all(ok for ok, _ in probes[""])
        slowest_probe = max(s for service in probes for _, s in probes[service])
        if not live_ok or not ready_ok:
            failures.append(f"{policy}: a health probe failed under load (liveness {live_ok}, readiness {ready_ok})")
        balance_line = (f"balance: {ok_total} OK answers in {args.balance_s} s at concurrency {args.concurrency}, "
                        f"per replica " + ", ".join(f"{a} {per_replica[a]}" for a in ADDRESSES) +
                        f" (largest deviation from even {imbalance:.1%}); {len(probes['liveness'])} liveness and "
                        f"readiness probes each under the load, all SERVING: {live_ok and ready_ok}, slowest "
                        f"{slowest_probe * 1000:.0f} ms")
        print(f"[{policy}] {balance_line}", flush=True)

        # 2. Rolling restart under the same load.
        process, out, out_path = bench(args, port, client_flags, args.restart_s, f"{policy}_restart")
        time.sleep(2.0)
        drains, not_ready, restart_ready, retried = [], [], [], 0
        for i, address in enumerate(ADDRESSES):
            old = replicas[i]
            not_ready_s, live, drain_s, status = old.stop()
            drains.append(drain_s)
            not_ready.append(not_ready_s)
            retried += old.retried() or 0
            if status != 0 or not_ready_s is None or not_ready_s > 1.0 or not live:
                failures.append(f"{policy}: replica {address} exited {status}, readiness false after {not_ready_s} "
                                f"s, liveness while draining {live}")
            replicas[i] = Replica(args, address, port, f"{policy}_r{i}_1", server_flags)
            ready = replicas[i].wait_ready()
            if ready is None:
                raise RuntimeError(f"the new replica on {address} did not become ready:\n{replicas[i].log()}")
            restart_ready.append(ready)
            # Let the client reconnect to it before the next replica goes.
            time.sleep(args.settle_s)
        restart_done = process.poll() is None
        report = bench_result(process, out, out_path)
        if not restart_done:
            failures.append(f"{policy}: the rolling restart outlasted the {args.restart_s} s run")
        answered = int(re.search(r"RESULT .* answered=(\d+) ", report).group(1))
        ok = int(re.search(r"RESULT .* ok=(\d+) ", report).group(1))
        errors = re.findall(r"^error (\d+)x (.*)$", report, re.MULTILINE)
        for replica in replicas:
            replica.stop()
            retried += replica.retried() or 0
        failed = answered - ok
        if policy in args.require_no_failures and failed:
            failures.append(f"{policy}: {failed} calls failed during the rolling restart")
        if policy in args.require_retries and retried == 0:
            failures.append(f"{policy}: no call reached a replica as a retry (mita_retried_calls_total)")
        print(f"[{policy}] rolling restart: {answered} calls in {args.restart_s} s, {failed} failed"
              + "".join(f"; {count}x {message}" for count, message in errors)
              + f"; {retried} calls reached a replica as a retry; drain (SIGTERM to exit) "
              + ", ".join(f"{d:.2f}" for d in drains) + " s; readiness false after "
              + ", ".join(f"{n * 1000:.0f}" for n in not_ready) + " ms; new replica ready after "
              + ", ".join(f"{r:.1f}" for r in restart_ready) + " s (first start "
              + ", ".join(f"{r:.1f}" for r in ready_s) + " s)", flush=True)
        print(f"REPLICAS policy={policy} ok_balance={ok_total} imbalance={imbalance:.4f} answered={answered} "
              f"failed={failed} retried={retried} drain_max_s={max(drains):.2f} "
              f"not_ready_max_ms={max(n * 1000 for n in not_ready):.0f} "
              f"ready_max_s={max(restart_ready):.1f} probe_max_ms={slowest_probe * 1000:.0f}", flush=True)
    finally:
        for replica in replicas:
            if replica.process.poll() is None:
                replica.process.kill()
                replica.process.wait()
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default="build")
    parser.add_argument("--repository", default="models/repository")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--balance_s", type=float, default=10)
    parser.add_argument("--restart_s", type=float, default=45)
    parser.add_argument("--settle_s", type=float, default=2)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--max_imbalance", type=float, default=0.2)
    parser.add_argument("--policies",
                        default="documented,no_retries,retries_only,round_robin,no_notice,health_no_notice")
    parser.add_argument("--require_no_failures", default="documented")
    parser.add_argument("--require_retries", default="retries_only",
                        help="policies under which some calls must reach a replica as a retry")
    parser.add_argument("--keep", action="store_true", help="keep the logs and reports (printed path)")
    args = parser.parse_args()
    policies = args.policies.split(",")
    for policy in policies:
        if policy not in POLICIES:
            parser.error(f"--policies: unknown policy '{policy}' (known: {', '.join(POLICIES)})")
    args.require_no_failures = set(filter(None, args.require_no_failures.split(",")))
    args.require_retries = set(filter(None, args.require_retries.split(",")))
    os.environ["OMP_WAIT_POLICY"] = "passive"
    args.work = tempfile.mkdtemp(prefix="mita_replicas_")
    failures = []
    try:
        subprocess.run([os.path.join(args.build, "tools", "mita-export-images"), "--split=t10k",
                        f"--count={args.images}", "--out=" + os.path.join(args.work, "images")],
                       check=True, stdout=subprocess.DEVNULL)
        args.manifest = os.path.join(args.work, "inputs.csv")
        with open(os.path.join(args.work, "images", "manifest.csv")) as source, open(args.manifest, "w") as target:
            for line in source:
                path = line.split(",")[0].strip()
                if path.endswith(".png"):
                    target.write(f"image,{os.path.join(args.work, 'images', path)}\n")
        for policy in policies:
            failures += run_policy(args, policy)
    finally:
        if args.keep:
            print("logs and reports kept in", args.work)
        else:
            shutil.rmtree(args.work, ignore_errors=True)
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
