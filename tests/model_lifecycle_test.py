"""ctest model_lifecycle_test: models loaded, replaced and unloaded while mita-server serves, driven by Triton's own
Python client (tritonclient.grpc: get_model_repository_index, load_model, unload_model, infer), against a real
mita-server on a temporary repository made of the embedded image model.

Usage (run by ctest with the peers' venv): /opt/mita/peers/bin/python tests/model_lifecycle_test.py SOURCE_DIR BUILD_DIR

--model_control_mode=explicit, with 16 client threads calling ModelInfer on the image model the whole time:
  * version 2 is added and loaded: the answers switch from version 1 to version 2 (each answer names exactly one
    version; every call sent after load_model returned is answered by 2, none goes back to 1), no call fails;
  * a corrupt version 3 fails to load: load_model raises FAILED_PRECONDITION naming it, the index says why, version
    2 keeps serving, the clients see nothing;
  * a 100 MB model is loaded, called by 16 concurrent calls and unloaded meanwhile: each call is answered OK or
    NOT_FOUND (sent after the unload), nothing else; the server's resident memory goes back to its level before the
    load, within 15% of the model's weights;
  * 6 loads and 6 unloads of the image model posted together while 16 threads call it: every call is answered OK or
    NOT_FOUND, every operation within 10 s;
  * the load metrics count it all (mita_model_loads_total, mita_model_ready, mita_model_unloads_total).
--model_control_mode=poll (1 s): a version folder added is served, a version policy keeps two, a bad policy file is
reported and changes nothing, a removed folder is unloaded; the API's load is refused.
"""
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mita_server_process import start_server

MODEL = "fashion-mnist-vit"
BIG = "big-vit"
CONCURRENCY = 16


def rss_bytes(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def metrics_port(work, log_name):
    match = re.search(r"metrics on http://\S+ \(port (\d+)\)", open(os.path.join(work, log_name)).read())
    assert match, "no metrics port in the log"
    return int(match.group(1))


def metric(port, name, **labels):
    """The value of metric `name` with exactly these labels, or None."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        match = re.match(r"(\w+)\{(.*)\} (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if found == {key: str(value) for key, value in labels.items()}:
            return float(match.group(3))
    return None


def index(client):
    """{(name, version): (state, reason)} of the repository index."""
    return {(entry.name, entry.version): (entry.state, entry.reason)
            for entry in client.get_model_repository_index().models}


def image_input(png):
    tensor = grpcclient.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([png], dtype=np.object_))
    return tensor


def infer(client, model, png, version=""):
    """The version that answered (the response names the model, not its version folder)."""
    result = client.infer(model, [image_input(png)], model_version=version,
                          outputs=[grpcclient.InferRequestedOutput("labels")], client_timeout=120)
    assert result.get_response().model_name == model, result.get_response().model_name
    return result.get_response().model_version


def error_of(call):
    """(status, message) of the InferenceServerException `call` raises; fails when it raises none."""
    try:
        call()
    except InferenceServerException as error:
        return error.status(), error.message()
    raise AssertionError("no error")


class Load:
    """CONCURRENCY threads calling `model` (no version) until stop(); every call's outcome with its times."""

    def __init__(self, port, model, png):
        self.port, self.model, self.png = port, model, png
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.calls = []  # (thread, sent, answered, version or None, error or None)
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(CONCURRENCY)]
        for thread in self.threads:
            thread.start()

    def run(self, index):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.port}")
        while not self.stopping.is_set():
            sent = time.monotonic()
            try:
                version, error = infer(client, self.model, self.png), None
            except InferenceServerException as failure:
                version, error = None, (failure.status(), failure.message())
            with self.lock:
                self.calls.append((index, sent, time.monotonic(), version, error))
        client.close()

    def stop(self):
        self.stopping.set()
        for thread in self.threads:
            thread.join()
        return self.calls


def make_big_package(directory, source_dir):
    """A ViT package of random weights, about 100 MB (embed 512, depth 8), from the PyTorch twin."""
    sys.path.insert(0, os.path.join(source_dir, "tools"))
    import torch
    from mita_reference import MitaVit, fashion_mnist_config, save_safetensors
    config = fashion_mnist_config()
    config.update({"embed_dim": 512, "depth": 8, "num_heads": 8, "mlp_hidden_dim": 2048})
    config["attention"].pop("accuracy_order", None)
    torch.manual_seed(0)
    os.makedirs(directory)
    save_safetensors(MitaVit(config).state_dict(), os.path.join(directory, "model.safetensors"))
    json.dump(config, open(os.path.join(directory, "config.json"), "w"))
    shutil.copy(os.path.join(source_dir, "models", "repository", MODEL, "labels.txt"), directory)


def check_explicit(source_dir, build_dir, work, png):
    repository = os.path.join(work, "explicit")
    shutil.copytree(os.path.join(source_dir, "models", "repository", MODEL), os.path.join(repository, MODEL, "1"))
    process, port = start_server(build_dir, repository, work,
                                 ["--model_control_mode=explicit", "--cost_calibration_ms=300",
                                  "--metrics_listen=127.0.0.1:0"], "explicit.log")
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        metrics = metrics_port(work, "explicit.log")
        assert "model_repository" in client.get_server_metadata().extensions
        assert index(client) == {(MODEL, "1"): ("READY", "")}, index(client)
        assert infer(client, MODEL, png) == "1"

        load = Load(port, MODEL, png)
        time.sleep(2)
        # Replace: version 2 appears and is loaded while the 16 threads call.
        shutil.copytree(os.path.join(repository, MODEL, "1"), os.path.join(repository, MODEL, "2"))
        swap_started = time.monotonic()
        client.load_model(MODEL)
        swapped = time.monotonic()
        print(f"version 2 loaded in {swapped - swap_started:.2f} s under load")
        state = index(client)
        assert state[(MODEL, "2")] == ("READY", ""), state
        assert state[(MODEL, "1")][0] == "UNAVAILABLE", state
        time.sleep(2)
        # A corrupt version 3 fails to load: the error says why, version 2 keeps serving.
        shutil.copytree(os.path.join(repository, MODEL, "2"), os.path.join(repository, MODEL, "3"))
        weights = os.path.join(repository, MODEL, "3", "model.safetensors")
        os.truncate(weights, os.path.getsize(weights) // 2)
        status, message = error_of(lambda: client.load_model(MODEL))
        print(f"corrupt version 3: {status}: {message}")
        assert status == "StatusCode.FAILED_PRECONDITION" and "version 3 failed to load" in message, message
        state = index(client)
        assert state[(MODEL, "3")][0] == "UNAVAILABLE" and "model.safetensors" in state[(MODEL, "3")][1], state
        assert state[(MODEL, "2")] == ("READY", ""), state
        time.sleep(2)
        calls = load.stop()
        shutil.rmtree(os.path.join(repository, MODEL, "3"))

        failed = [call for call in calls if call[4] is not None]
        assert not failed, failed[:5]
        assert {call[3] for call in calls} == {"1", "2"}, {call[3] for call in calls}
        late_ones = [call for call in calls if call[1] > swapped and call[3] != "2"]
        assert not late_ones, late_ones[:5]
        for thread in range(CONCURRENCY):
            versions = [call[3] for call in sorted(calls) if call[0] == thread]
            assert versions == sorted(versions), f"thread {thread} went back to version 1"
        print(f"replace under load: {len(calls)} calls at concurrency {CONCURRENCY}, 0 failed, "
              f"{sum(call[3] == '1' for call in calls)} answered by version 1, "
              f"{sum(call[3] == '2' for call in calls)} by version 2")
        assert error_of(lambda: infer(client, MODEL, png, "1"))[0] == "StatusCode.NOT_FOUND"
        assert error_of(lambda: client.load_model(MODEL, config="{}"))[0] == "StatusCode.INVALID_ARGUMENT"
        assert error_of(lambda: client.load_model("no-such-model"))[0] == "StatusCode.NOT_FOUND"

        # Loads and unloads posted together under traffic (a load and an unload that each held a gRPC thread once
        # hung every call until its deadline): every call is answered OK or NOT_FOUND, every operation promptly.
        overlapping = Load(port, MODEL, png)
        slowest = [0.0]

        def operate(kind):
            own = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
            for _ in range(6):
                started = time.monotonic()
                getattr(own, kind)(MODEL, client_timeout=60)
                slowest[0] = max(slowest[0], time.monotonic() - started)
            own.close()

        operators = [threading.Thread(target=operate, args=(kind,)) for kind in ("load_model", "unload_model")]
        for operator in operators:
            operator.start()
        for operator in operators:
            operator.join()
        client.load_model(MODEL)
        calls = overlapping.stop()
        outcomes = {"OK" if call[4] is None else call[4][0] for call in calls}
        print(f"6 loads and 6 unloads posted together under {CONCURRENCY} threads: {len(calls)} calls, outcomes "
              f"{sorted(outcomes)}, slowest operation {slowest[0]:.2f} s")
        assert outcomes <= {"OK", "StatusCode.NOT_FOUND"}, outcomes
        assert slowest[0] < 10, slowest

        # Unload under load, and the memory it frees.
        for _ in range(20):
            infer(client, MODEL, png)
        before = rss_bytes(process.pid)
        make_big_package(os.path.join(repository, BIG, "1"), source_dir)
        client.load_model(BIG)
        for _ in range(5):
            assert infer(client, BIG, png) == "1"
        loaded = rss_bytes(process.pid)
        outcomes = []
        lock = threading.Lock()

        def call_big():
            own = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
            for _ in range(4):
                try:
                    outcome = infer(own, BIG, png)
                except InferenceServerException as failure:
                    outcome = failure.status()
                with lock:
                    outcomes.append(outcome)
            own.close()

        callers = [threading.Thread(target=call_big) for _ in range(CONCURRENCY)]
        for caller in callers:
            caller.start()
        time.sleep(0.3)
        client.unload_model(BIG)
        for caller in callers:
            caller.join()
        assert set(outcomes) <= {"1", "StatusCode.NOT_FOUND"}, outcomes
        assert "1" in outcomes, outcomes
        assert index(client)[(BIG, "1")] == ("UNAVAILABLE", "unloaded"), index(client)
        time.sleep(1)
        after = rss_bytes(process.pid)
        weights = os.path.getsize(os.path.join(repository, BIG, "1", "model.safetensors"))
        print(f"memory: {before >> 20} MiB before the load, {loaded >> 20} MiB loaded, {after >> 20} MiB after the "
              f"unload (weights {weights >> 20} MiB); {outcomes.count('1')} calls answered, "
              f"{outcomes.count('StatusCode.NOT_FOUND')} sent after it")
        assert loaded - before > weights, (before, loaded)
        assert after - before < 0.15 * weights, (before, loaded, after)

        assert metric(metrics, "mita_model_loads_total", model=MODEL, result="ok") >= 2  # more after the overlap
        assert metric(metrics, "mita_model_loads_total", model=MODEL, result="failed") == 1
        assert metric(metrics, "mita_model_ready", model=MODEL, version="1") == 0
        assert metric(metrics, "mita_model_ready", model=MODEL, version="2") == 1
        assert metric(metrics, "mita_model_ready", model=BIG, version="1") == 0
        assert metric(metrics, "mita_model_unloads_total", model=BIG) == 1
        assert metric(metrics, "mita_model_load_seconds", model=BIG, version="1") > 0
        client.close()
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    assert code == 0, f"mita-server exited with {code}"


def wait_for(client, condition, what, bound=20):
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        state = index(client)
        if condition(state):
            return state
        time.sleep(0.2)
    raise AssertionError(f"{what}: {index(client)}")


def check_poll(source_dir, build_dir, work, png):
    repository = os.path.join(work, "poll")
    shutil.copytree(os.path.join(source_dir, "models", "repository", MODEL), os.path.join(repository, MODEL, "1"))
    shutil.copytree(os.path.join(source_dir, "models", "repository", MODEL), os.path.join(repository, "other", "1"))
    process, port = start_server(build_dir, repository, work,
                                 ["--model_control_mode=poll", "--repository_poll_s=1", "--cost_calibration_ms=300"],
                                 "poll.log")
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        status, message = error_of(lambda: client.load_model(MODEL))
        assert status == "StatusCode.FAILED_PRECONDITION" and "--model_control_mode=poll" in message, message
        shutil.copytree(os.path.join(repository, MODEL, "1"), os.path.join(repository, MODEL, "2"))
        wait_for(client, lambda s: s.get((MODEL, "2")) == ("READY", "") and s[(MODEL, "1")][0] == "UNAVAILABLE",
                 "version 2 served by the poll")
        assert infer(client, MODEL, png) == "2"
        json.dump({"all": True}, open(os.path.join(repository, MODEL, "version_policy.json"), "w"))
        wait_for(client, lambda s: s[(MODEL, "1")] == ("READY", ""), "version 1 served again by the policy")
        assert infer(client, MODEL, png, "1") == "1" and infer(client, MODEL, png) == "2"
        open(os.path.join(repository, MODEL, "version_policy.json"), "w").write('{"latest": 0}')
        state = wait_for(client, lambda s: "version_policy.json" in s.get((MODEL, ""), ("", ""))[1],
                         "the bad policy reported")
        assert state[(MODEL, "1")] == ("READY", "") and state[(MODEL, "2")] == ("READY", ""), state
        print(f"bad policy: {state[(MODEL, '')][1]}")
        assert infer(client, MODEL, png, "1") == "1"
        shutil.rmtree(os.path.join(repository, MODEL))
        wait_for(client, lambda s: (MODEL, "1") not in s and (MODEL, "2") not in s, "the removed model unloaded")
        assert error_of(lambda: infer(client, MODEL, png))[0] == "StatusCode.NOT_FOUND"
        assert infer(client, "other", png) == "1"
        client.close()
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    assert code == 0, f"mita-server exited with {code}"
    print("poll: OK")


def main():
    source_dir, build_dir = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([os.path.join(build_dir, "tools", "mita-export-images"), "--count=1", f"--out={work}/images"],
                       check=True, stdout=subprocess.DEVNULL)
        rows = [row for row in csv.reader(open(f"{work}/images/manifest.csv"))
                if row and not row[0].startswith("#") and row[0] != "path"]
        png = open(os.path.join(work, "images", rows[0][0]), "rb").read()
        check_explicit(source_dir, build_dir, work, png)
        check_poll(source_dir, build_dir, work, png)
    print("model lifecycle: OK")


if __name__ == "__main__":
    main()
