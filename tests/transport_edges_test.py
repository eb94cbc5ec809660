#!/usr/bin/env python3
"""ctest transport_edges_test: a real mita-server process (with a bearer token) spoken to in raw HTTP/2 frames
(tests/grpc_h2.py, python3-h2) and with grpcio, on what a well-behaved client never sends:

* compression bombs: a 1 MiB gzip body that inflates to a 1 GiB request, with and without the token, one at a
  time and four at once, costs the server less than 16 MB of resident memory and 50 ms of CPU each and gets
  UNAUTHENTICATED or RESOURCE_EXHAUSTED; gzip and deflate requests under the limit are served;
* deadlines beyond what the clock represents (grpc-timeout 2562047H, 2562048H, 99999999H; and 2000000H) on every
  method are no deadline; a short one still applies;
* framing: a message shorter than its prefix declares, no message, a stream reset mid-message, a body flagged
  gzip that is not gzip, over-long health service names: each answered with what is wrong (never INTERNAL, never
  "the model name is empty");
* an answer the client never received (its flow-control window stayed shut) is counted CANCELLED, not OK.

Usage: transport_edges_test.py SOURCE_DIR BUILD_DIR
"""
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

SOURCE_DIR, BUILD_DIR = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(SOURCE_DIR, "tests"))
sys.path.insert(0, os.path.join(BUILD_DIR, "client", "python"))
import grpc  # noqa: E402
import grpc_h2  # noqa: E402
from grpc_h2 import grpc_frame, length_delimited  # noqa: E402
from kserve import grpc_predict_v2_pb2 as kserve_pb2  # noqa: E402
from mita.v1 import mita_pb2  # noqa: E402

TOKEN = "transport-edges-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
DOCUMENT_MODEL = "linux-doc-mita"
LIMIT = 4 << 20  # the default --max_receive_message_bytes
MIB = 1 << 20

OK, CANCELLED, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND = 0, 1, 3, 4, 5
RESOURCE_EXHAUSTED, INTERNAL, UNAUTHENTICATED = 8, 13, 16


class Server:
    """A mita-server process on 127.0.0.1 with free ports, the embedded models, a bearer token and /metrics."""

    def __init__(self, work):
        token_file = os.path.join(work, "token")
        with open(token_file, "w") as f:
            f.write(TOKEN + "\n")
        self.log_path = os.path.join(work, "server.log")
        self.log = open(self.log_path, "w+")
        self.process = subprocess.Popen(
            [os.path.join(BUILD_DIR, "server", "mita-server"), "--listen=127.0.0.1:0",
             "--metrics_listen=127.0.0.1:0", f"--model_repository={SOURCE_DIR}/models/repository",
             f"--auth_token_file={token_file}", "--cost_calibration_ms=0", "--torch_threads=1",
             "--preparation_threads=1"],
            stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            text = self.read_log()
            match = re.search(r"serving gRPC.* \(port (\d+);.*metrics on \S+ \(port (\d+)\)", text)
            if match:
                self.port, self.metrics_port = int(match.group(1)), int(match.group(2))
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"mita-server did not start:\n{self.read_log()}")

    def read_log(self):
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=60)

    def rss_bytes(self):
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def cpu_seconds(self):
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def requests(self, method, code, model=None):
        """mita_requests_total{method, code[, model]} summed, from a scrape of /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30).read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith("mita_requests_total{"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[:line.index("}")]))
            if labels.get("method") == method and labels.get("code") == code and \
                    (model is None or labels.get("model") == model):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def await_requests(self, method, code, expected, model=None, bound_s=30):
        """The count once it reaches `expected` (calls are counted when gRPC is done with them), or after bound_s."""
        deadline = time.monotonic() + bound_s
        while True:
            value = self.requests(method, code, model)
            if value >= expected or time.monotonic() > deadline:
                return value
            time.sleep(0.05)


def text_request(text=b"The scheduler moves network interrupts between processors."):
    return mita_pb2.ClassifyRequest(model=DOCUMENT_MODEL, document=mita_pb2.Document(text=text)).SerializeToString()


def infer_request(text=b"The scheduler moves network interrupts between processors."):
    request = kserve_pb2.ModelInferRequest(model_name=DOCUMENT_MODEL)
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(text)
    return request.SerializeToString()


def health_request(service):
    return (length_delimited(1, len(service.encode())) + service.encode()) if service else b""


class TransportEdgesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="transport_edges_")
        cls.server = Server(cls.work)
        cls.channel = grpc.insecure_channel(f"127.0.0.1:{cls.server.port}")

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop()
        log = cls.server.read_log()
        assert "stopped after draining" in log, log

    def call(self, path, body, **kwargs):
        return grpc_h2.unary(self.server.port, path, body, **kwargs)

    def grpcio(self, path, request, compression=None, metadata=AUTH, timeout=60):
        """A unary call with grpcio on serialized bytes; returns (code, details, response bytes)."""
        method = self.channel.unary_unary(path)
        try:
            response = method(request, metadata=metadata, compression=compression, timeout=timeout)
            return grpc.StatusCode.OK, "", response
        except grpc.RpcError as error:
            return error.code(), error.details(), b""

    # ---- 1. compression bombs (first: the server is fresh) ----

    def test_1_compression_bombs_cost_nothing(self):
        classify_bomb = grpc_frame(grpc_h2.gzip_bomb(
            length_delimited(1, len(DOCUMENT_MODEL)) + DOCUMENT_MODEL.encode() + length_delimited(2, 1 << 30), 1024),
            compressed=True)
        infer_bomb = grpc_frame(grpc_h2.gzip_bomb(
            length_delimited(1, len(DOCUMENT_MODEL)) + DOCUMENT_MODEL.encode() + length_delimited(7, 1 << 30), 1024),
            compressed=True)
        self.assertLess(len(classify_bomb), 1100 * 1024)
        # Warm-up: a small compressed call, so that the bombs' figures are theirs alone.
        code, details, _ = self.grpcio("/mita.v1.MitaService/GetModel",
                                       mita_pb2.GetModelRequest(name=DOCUMENT_MODEL).SerializeToString(),
                                       compression=grpc.Compression.Gzip)
        self.assertEqual(code, grpc.StatusCode.OK, details)
        time.sleep(1)
        rss_before, cpu_before = self.server.rss_bytes(), self.server.cpu_seconds()
        answers = [
            self.call("/mita.v1.MitaService/Classify", classify_bomb, encoding="gzip"),
            self.call("/mita.v1.MitaService/Classify", classify_bomb, encoding="gzip", metadata=AUTH),
            self.call("/inference.GRPCInferenceService/ModelInfer", infer_bomb, encoding="gzip"),
            self.call("/inference.GRPCInferenceService/ModelInfer", infer_bomb, encoding="gzip", metadata=AUTH),
        ]
        concurrent = [None] * 4

        def send(i):
            concurrent[i] = self.call("/mita.v1.MitaService/Classify", classify_bomb, encoding="gzip", metadata=AUTH)
        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        time.sleep(1)
        rss_after, cpu_after = self.server.rss_bytes(), self.server.cpu_seconds()
        for i in (0, 2):
            self.assertEqual(answers[i].status, UNAUTHENTICATED, answers[i])
            self.assertIn("missing credentials", answers[i].message)
        for answer in [answers[1], answers[3]] + concurrent:
            self.assertEqual(answer.status, RESOURCE_EXHAUSTED, answer)
            self.assertIn(f"request message inflates to more than {LIMIT} bytes (gzip-compressed", answer.message)
            self.assertIn("flag --max_receive_message_bytes", answer.message)
        bombs = len(answers) + len(concurrent)
        grown, cpu = rss_after - rss_before, cpu_after - cpu_before
        print(f"{bombs} bombs of {len(classify_bomb)} bytes inflating to 1 GiB: server RSS {rss_before / MIB:.1f} -> "
              f"{rss_after / MIB:.1f} MiB (+{grown / MIB:.1f}), CPU {cpu * 1000:.0f} ms", flush=True)
        # Before: each inflated in full (RSS +951 MB, 3-4 s of CPU) before any token or size check.
        self.assertLess(grown, 16 * 10**6)
        self.assertLess(cpu, 0.050 * bombs)

    def test_2_gzip_and_deflate_under_the_limit_are_served(self):
        for compression in (grpc.Compression.Gzip, grpc.Compression.Deflate):
            code, details, response = self.grpcio("/mita.v1.MitaService/Classify", text_request(),
                                                   compression=compression)
            self.assertEqual(code, grpc.StatusCode.OK, details)
            self.assertEqual(mita_pb2.ClassifyResponse.FromString(response).model, DOCUMENT_MODEL)
            code, details, response = self.grpcio("/inference.GRPCInferenceService/ModelInfer", infer_request(),
                                                  compression=compression)
            self.assertEqual(code, grpc.StatusCode.OK, details)
            self.assertEqual(kserve_pb2.ModelInferResponse.FromString(response).model_name, DOCUMENT_MODEL)
            code, details, response = self.grpcio("/grpc.health.v1.Health/Check", health_request(""),
                                                  compression=compression, metadata=())
            self.assertEqual((code, response), (grpc.StatusCode.OK, b"\x08\x01"), details)
        # A message of 3 MiB that compresses to a few KiB inflates within the limit and is served.
        long_text = (b"network interrupts move between processors " * (3 * MIB // 43))[:3 * MIB]
        code, details, response = self.grpcio("/mita.v1.MitaService/Classify",
                                              mita_pb2.ClassifyRequest(model=DOCUMENT_MODEL, document=mita_pb2.Document(
                                                  text=long_text, truncate=True)).SerializeToString(),
                                              compression=grpc.Compression.Gzip)
        self.assertEqual(code, grpc.StatusCode.OK, details)
        # Without the token a compressed call is refused before it is read.
        code, details, _ = self.grpcio("/mita.v1.MitaService/Classify", text_request(),
                                       compression=grpc.Compression.Gzip, metadata=())
        self.assertEqual(code, grpc.StatusCode.UNAUTHENTICATED, details)

    # ---- 2. deadlines of any length ----

    def test_3_far_deadlines_are_no_deadline_on_every_method(self):
        unary = [
            ("/mita.v1.MitaService/Classify", text_request()),
            ("/mita.v1.MitaService/ListModels", b""),
            ("/mita.v1.MitaService/GetModel", mita_pb2.GetModelRequest(name=DOCUMENT_MODEL).SerializeToString()),
            ("/inference.GRPCInferenceService/ServerLive", b""),
            ("/inference.GRPCInferenceService/ServerReady", b""),
            ("/inference.GRPCInferenceService/ModelReady",
             kserve_pb2.ModelReadyRequest(name=DOCUMENT_MODEL).SerializeToString()),
            ("/inference.GRPCInferenceService/ServerMetadata", b""),
            ("/inference.GRPCInferenceService/ModelMetadata",
             kserve_pb2.ModelMetadataRequest(name=DOCUMENT_MODEL).SerializeToString()),
            ("/inference.GRPCInferenceService/ModelConfig",
             kserve_pb2.ModelConfigRequest(name=DOCUMENT_MODEL).SerializeToString()),
            ("/inference.GRPCInferenceService/ModelInfer", infer_request()),
            ("/grpc.health.v1.Health/Check", health_request("mita.v1.MitaService")),
            # A bidirectional stream: one ServerReflectionRequest {list_services = 7: ""}, then the end of the stream.
            ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", b"\x3a\x00"),
        ]
        for timeout in ("2000000H", "2562047H", "2562048H", "99999999H"):
            for path, body in unary:
                with self.subTest(timeout=timeout, method=path):
                    answer = self.call(path, grpc_frame(body), timeout_header=timeout, metadata=AUTH)
                    self.assertEqual(answer.status, OK, answer)
                    self.assertTrue(answer.messages(), answer)
            with self.subTest(timeout=timeout, method="Watch"), grpc_h2.Connection(self.server.port) as connection:
                stream = connection.start("/grpc.health.v1.Health/Watch", timeout_header=timeout)
                connection.send(stream, grpc_frame(health_request("")), end_stream=True)
                deadline = time.monotonic() + 30
                while not connection.answers[stream].messages() and not connection.answers[stream].ended and \
                        time.monotonic() < deadline:
                    connection._pump(deadline)
                answer = connection.answers[stream]
                self.assertEqual(answer.messages(), [(0, b"\x08\x01")], answer)  # SERVING, and the stream stays open
                self.assertFalse(answer.ended, answer)
                connection.reset(stream)
        # Deadlines still apply: one of a nanosecond has passed before the request is queued. gRPC's transport
        # answers DEADLINE_EXCEEDED, or on a loaded machine resets the stream before its trailers, which h2 then
        # refuses on the closed stream (grpc_h2 marks it ended, without a status): never an answer.
        answer = self.call("/mita.v1.MitaService/Classify", grpc_frame(text_request()), timeout_header="1n",
                           metadata=AUTH)
        if answer.status is None:
            self.assertTrue(answer.ended and not answer.data, answer)
        else:
            self.assertEqual(answer.status, DEADLINE_EXCEEDED, answer)

    # ---- 3. framing errors named as such ----

    def test_4_incomplete_messages_say_so(self):
        request = text_request()
        cases = [
            ("a prefix declaring more bytes than follow", grpc_frame(request[:10], declared_length=len(request))),
            ("a prefix alone", grpc_frame(b"", declared_length=100)),
            ("half a prefix", b"\x00\x00\x00"),
            ("no message", b""),
        ]
        invalid_before = self.server.requests("Classify", "INVALID_ARGUMENT", "unknown")
        for path in ("/mita.v1.MitaService/Classify", "/mita.v1.MitaService/GetModel",
                     "/inference.GRPCInferenceService/ModelInfer", "/grpc.health.v1.Health/Check"):
            for name, body in cases:
                with self.subTest(method=path, case=name):
                    answer = self.call(path, body, metadata=AUTH)
                    self.assertEqual(answer.status, INVALID_ARGUMENT, answer)
                    self.assertIn("no complete request message arrived", answer.message)
                    self.assertNotIn("model name is empty", answer.message)
        # Counted with model "unknown" (no request was read).
        self.assertEqual(self.server.await_requests("Classify", "INVALID_ARGUMENT", invalid_before + len(cases),
                                                    "unknown"), invalid_before + len(cases))

    def test_5_a_stream_reset_mid_message_is_counted_cancelled(self):
        # gRPC hands the service no message when the stream is reset, or the connection closed, before the message
        # was whole. That is neither an empty request ("field model: the model name is empty", as it was) nor an
        # invalid one: the client left, and the call counts as CANCELLED.
        invalid_before = self.server.requests("Classify", "INVALID_ARGUMENT")
        cancelled_before = self.server.requests("Classify", "CANCELLED")
        request = text_request()
        for close_connection in (False, True):
            connection = grpc_h2.Connection(self.server.port)
            stream = connection.start("/mita.v1.MitaService/Classify", metadata=AUTH)
            connection.send(stream, grpc_frame(request[:10], declared_length=len(request)))
            time.sleep(0.5)  # the partial message reaches the server first
            if close_connection:
                connection.sock.close()
            else:
                connection.reset(stream)
                time.sleep(0.2)
                connection.close()
        # The server goes on serving; by the time a later call is counted, the two have been handled.
        ok_before = self.server.requests("Classify", "OK", DOCUMENT_MODEL)
        answer = self.call("/mita.v1.MitaService/Classify", grpc_frame(request), metadata=AUTH)
        self.assertEqual(answer.status, OK, answer)
        self.assertEqual(self.server.await_requests("Classify", "OK", ok_before + 1, DOCUMENT_MODEL), ok_before + 1)
        self.assertEqual(self.server.requests("Classify", "INVALID_ARGUMENT"), invalid_before)
        self.assertEqual(self.server.requests("Classify", "CANCELLED") - cancelled_before, 2)

    def test_6_bodies_flagged_compressed_that_are_not_say_so(self):
        for path in ("/mita.v1.MitaService/Classify", "/inference.GRPCInferenceService/ModelInfer",
                     "/grpc.health.v1.Health/Check"):
            with self.subTest(method=path):
                answer = self.call(path, grpc_frame(b"hello world", compressed=True), encoding="gzip", metadata=AUTH)
                self.assertEqual(answer.status, INVALID_ARGUMENT, answer)
                self.assertIn("flagged gzip-compressed (grpc-encoding: gzip), but its 11 bytes are not gzip data",
                              answer.message)
        cut = grpc_h2.gzip_bytes(text_request())[:-12]
        answer = self.call("/mita.v1.MitaService/Classify", grpc_frame(cut, compressed=True), encoding="gzip",
                           metadata=AUTH)
        self.assertEqual(answer.status, INVALID_ARGUMENT, answer)
        self.assertIn("end before the end of the gzip data", answer.message)
        answer = self.call("/mita.v1.MitaService/Classify",
                           grpc_frame(grpc_h2.gzip_bytes(text_request()) + b"extra", compressed=True),
                           encoding="gzip", metadata=AUTH)
        self.assertEqual(answer.status, INVALID_ARGUMENT, answer)
        self.assertIn("go on after the end of the gzip data", answer.message)

    def test_7_long_health_service_names_are_unknown_services(self):
        for length in (200, 201, 300, 5000):
            name = "s" * length
            with self.subTest(length=length):
                answer = self.call("/grpc.health.v1.Health/Check", grpc_frame(health_request(name)))
                self.assertEqual(answer.status, NOT_FOUND, answer)
                self.assertIn("unknown service 'sss", answer.message)
                with grpc_h2.Connection(self.server.port) as connection:
                    stream = connection.start("/grpc.health.v1.Health/Watch")
                    connection.send(stream, grpc_frame(health_request(name)), end_stream=True)
                    deadline = time.monotonic() + 30
                    while not connection.answers[stream].messages() and not connection.answers[stream].ended and \
                            time.monotonic() < deadline:
                        connection._pump(deadline)
                    answer = connection.answers[stream]
                    self.assertEqual(answer.messages(), [(0, b"\x08\x03")], answer)  # SERVICE_UNKNOWN, still open
                    self.assertFalse(answer.ended, answer)
                    connection.reset(stream)

    # ---- 5. an answer the client never received ----

    def test_8_answers_held_back_by_flow_control_are_counted_cancelled(self):
        for method, path, body, model in (
                ("ListModels", "/mita.v1.MitaService/ListModels", b"", ""),
                ("Classify", "/mita.v1.MitaService/Classify", text_request(), DOCUMENT_MODEL)):
            with self.subTest(method=method):
                ok_before = self.server.requests(method, "OK", model)
                cancelled_before = self.server.requests(method, "CANCELLED", model)
                with grpc_h2.Connection(self.server.port, initial_window=0, open_window=False) as connection:
                    stream = connection.start(path, metadata=AUTH)
                    connection.send(stream, grpc_frame(body), end_stream=True)
                    answer = connection.wait_for_headers(stream)
                    # The server answered (its headers came) but could write no byte of the message.
                    self.assertEqual(answer.headers.get(":status"), "200", answer)
                    self.assertEqual(answer.data, b"", answer)
                    self.assertIsNone(answer.status, answer)
                    connection.reset(stream)
                self.assertEqual(self.server.await_requests(method, "CANCELLED", cancelled_before + 1, model),
                                 cancelled_before + 1)
                self.assertEqual(self.server.requests(method, "OK", model), ok_before)
        # The same client with its window open gets its answer, counted OK.
        ok_before = self.server.requests("ListModels", "OK", "")
        answer = self.call("/mita.v1.MitaService/ListModels", grpc_frame(b""), metadata=AUTH)
        self.assertEqual(answer.status, OK, answer)
        self.assertEqual(self.server.await_requests("ListModels", "OK", ok_before + 1, ""), ok_before + 1)
        # And one held back until its deadline passes: the server gives up on it, counted CANCELLED.
        cancelled_before = self.server.requests("GetModel", "CANCELLED", DOCUMENT_MODEL)
        with grpc_h2.Connection(self.server.port, initial_window=0, open_window=False) as connection:
            stream = connection.start("/mita.v1.MitaService/GetModel", metadata=AUTH, timeout_header="1S")
            connection.send(stream, grpc_frame(mita_pb2.GetModelRequest(name=DOCUMENT_MODEL).SerializeToString()),
                            end_stream=True)
            answer = connection.wait(stream, timeout=30)
            self.assertEqual(answer.data, b"", answer)
        self.assertEqual(self.server.await_requests("GetModel", "CANCELLED", cancelled_before + 1, DOCUMENT_MODEL),
                         cancelled_before + 1)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
