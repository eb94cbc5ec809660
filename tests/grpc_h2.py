"""gRPC calls written as raw HTTP/2 frames (python3-h2), for the transport tests: any grpc-timeout or
grpc-encoding header, a message prefix that declares more bytes than follow, a stream reset mid-message, a
client that never opens its flow-control window. Nothing here checks what a well-behaved client would."""
import gzip
import socket
import struct
import time
import zlib

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings


def grpc_frame(payload, compressed=False, declared_length=None):
    """The gRPC length-prefixed message: flag byte (1: compressed), 4-byte big-endian length, payload.
    `declared_length` overrides the length (a prefix that promises more bytes than follow)."""
    length = len(payload) if declared_length is None else declared_length
    return struct.pack(">BI", 1 if compressed else 0, length) + payload


def varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def length_delimited(field, payload_length):
    """The tag and length of a length-delimited protobuf field whose payload follows."""
    return varint(field << 3 | 2) + varint(payload_length)


def gzip_bomb(prefix, zero_mib):
    """A single-member gzip stream (RFC 1952) of `prefix` followed by `zero_mib` MiB of zero bytes, about 1 KiB
    per MiB. Each MiB of zeros is compressed once, after a full flush (which resets the compressor's history),
    and repeated: the inflated message is never held in memory, and building a 1 GiB bomb takes about a second."""
    zeros = bytes(1 << 20)
    raw = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = raw.compress(prefix) + raw.flush(zlib.Z_FULL_FLUSH)
    chunk = raw.compress(zeros) + raw.flush(zlib.Z_FULL_FLUSH)
    tail = raw.flush(zlib.Z_FINISH)
    crc = zlib.crc32(prefix)
    for _ in range(zero_mib):
        crc = zlib.crc32(zeros, crc)
    size = len(prefix) + (zero_mib << 20)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    return header + head + chunk * zero_mib + tail + struct.pack("<II", crc, size & 0xFFFFFFFF)


class Answer:
    """What came back on one stream."""

    def __init__(self):
        self.headers = {}
        self.trailers = {}
        self.data = b""
        self.reset_code = None  # RST_STREAM error code from the server
        self.ended = False
        self.connection_closed = False

    @property
    def status(self):
        """grpc-status as an int (from the trailers, or a trailers-only answer), or None."""
        value = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        return int(value) if value is not None else None

    @property
    def message(self):
        from urllib.parse import unquote
        return unquote(self.trailers.get("grpc-message", self.headers.get("grpc-message", "")))

    def messages(self):
        """The gRPC messages of the response body, as (compressed flag, payload) pairs."""
        out, data = [], self.data
        while len(data) >= 5:
            flag, length = struct.unpack(">BI", data[:5])
            out.append((flag, data[5:5 + length]))
            data = data[5 + length:]
        return out

    def __repr__(self):
        return (f"Answer(status={self.status}, message={self.message!r}, reset={self.reset_code}, "
                f"ended={self.ended}, closed={self.connection_closed}, {len(self.data)} data bytes)")


class Connection:
    """One plaintext HTTP/2 connection to a gRPC server. `initial_window` sets this client's stream receive
    window (0: the server can send no DATA until the client opens it, which it never does when
    `open_window` is False). `source` binds the client socket to that local address first."""

    def __init__(self, port, host="127.0.0.1", initial_window=None, open_window=True, source=None, timeout=30):
        self.sock = socket.create_connection((host, port), timeout=timeout,
                                            source_address=(source, 0) if source else None)
        self.sock.settimeout(timeout)
        self.open_window = open_window
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        if initial_window is not None:
            self.conn.local_settings = h2.settings.Settings(
                client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window})
        self.conn.initiate_connection()
        self._flush()
        self.answers = {}

    def close(self):
        try:
            self.conn.close_connection()
            self._flush()
        except Exception:
            pass
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()

    def _flush(self):
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def _pump(self, deadline):
        """Reads once from the socket (until `deadline`) and handles the events; False when the connection
        closed or the deadline passed."""
        self.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = self.sock.recv(1 << 16)
        except socket.timeout:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            for answer in self.answers.values():
                answer.connection_closed = True
            return False
        try:
            events = self.conn.receive_data(chunk)
        except h2.exceptions.StreamClosedError as error:
            # A frame on a stream h2 considers closed (e.g. the server's trailers after its RST_STREAM): that
            # stream has ended.
            if error.stream_id in self.answers:
                self.answers[error.stream_id].ended = True
            events = []
        for event in events:
            answer = self.answers.get(getattr(event, "stream_id", None))
            if isinstance(event, h2.events.ResponseReceived):
                answer.headers.update(dict(event.headers))
            elif isinstance(event, h2.events.TrailersReceived):
                answer.trailers.update(dict(event.headers))
            elif isinstance(event, h2.events.DataReceived):
                answer.data += event.data
                if self.open_window:
                    self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                answer.ended = True
            elif isinstance(event, h2.events.StreamReset):
                if answer is not None:
                    answer.reset_code = event.error_code
                    answer.ended = True
            elif isinstance(event, h2.events.ConnectionTerminated):
                for a in self.answers.values():
                    a.connection_closed = True
        self._flush()
        return True

    def start(self, path, metadata=(), timeout_header=None, encoding=None, authority="localhost"):
        """Opens a stream with the request headers; returns its id."""
        stream_id = self.conn.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
                   ("content-type", "application/grpc"), ("te", "trailers")]
        if timeout_header is not None:
            headers.append(("grpc-timeout", timeout_header))
        if encoding is not None:
            headers.append(("grpc-encoding", encoding))
        headers.extend(metadata)
        self.conn.send_headers(stream_id, headers)
        self._flush()
        self.answers[stream_id] = Answer()
        return stream_id

    def send(self, stream_id, data, end_stream=False, deadline_s=60):
        """Sends `data` on the stream within flow control (waiting for the server's window updates)."""
        deadline = time.monotonic() + deadline_s
        view = memoryview(data)
        while view:
            window = min(self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size)
            if window <= 0:
                if not self._pump(deadline) and time.monotonic() >= deadline:
                    raise TimeoutError("the server opened no flow-control window")
                if self.answers[stream_id].ended:
                    return False  # answered (or reset) before the whole body went out
                continue
            self.conn.send_data(stream_id, bytes(view[:window]))
            view = view[window:]
            self._flush()
        if end_stream:
            self.conn.end_stream(stream_id)
            self._flush()
        return True

    def reset(self, stream_id, error_code=8):
        """RST_STREAM (8: CANCEL)."""
        self.conn.reset_stream(stream_id, error_code)
        self._flush()

    def wait(self, stream_id, timeout=30):
        """Reads until the stream ended or was reset, the connection closed, or `timeout` seconds passed."""
        deadline = time.monotonic() + timeout
        answer = self.answers[stream_id]
        while not answer.ended and not answer.connection_closed and time.monotonic() < deadline:
            self._pump(deadline)
        return answer

    def wait_for_headers(self, stream_id, timeout=30):
        """Reads until the stream's response headers (or its end) arrived."""
        deadline = time.monotonic() + timeout
        answer = self.answers[stream_id]
        while not answer.headers and not answer.ended and not answer.connection_closed and \
                time.monotonic() < deadline:
            self._pump(deadline)
        return answer


def unary(port, path, body, **kwargs):
    """One call on a fresh connection: headers, `body` (already framed), end of stream; returns the Answer."""
    metadata = kwargs.pop("metadata", ())
    timeout_header = kwargs.pop("timeout_header", None)
    encoding = kwargs.pop("encoding", None)
    wait_s = kwargs.pop("wait_s", 60)
    with Connection(port, **kwargs) as connection:
        stream = connection.start(path, metadata=metadata, timeout_header=timeout_header, encoding=encoding)
        connection.send(stream, body, end_stream=True)  # False when answered before the whole body went out
        return connection.wait(stream, timeout=wait_s)


def gzip_bytes(data):
    return gzip.compress(data)
