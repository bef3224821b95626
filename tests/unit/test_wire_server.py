"""nodeagent's own gRPC-over-HTTP/2 server on a Unix socket: served to grpcio's client, and to a raw HTTP/2
client that misbehaves on purpose (every fault closes only its own connection, with one GOAWAY naming it)."""

from __future__ import annotations

import os
import random
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from nodeagent.wire import server as wire
from nodeagent.wire.hpack import HpackDecoder, encode_literal
from nodeagent.wire.server import RpcError, ServerStream, UnixGrpcServer

PATH_ECHO = "/test.Svc/Echo"
PATH_FAIL = "/test.Svc/Fail"
PATH_CRASH = "/test.Svc/Crash"
PATH_WATCH = "/test.Svc/Watch"


def headers_block(
    path: str, *, content_type: str = "application/grpc", extra: tuple[tuple[str, str], ...] = ()
) -> bytes:
    """A request header block as literals without indexing (no Huffman)."""
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", content_type),
        ("te", "trailers"),
        *extra,
    ]
    return b"".join(encode_literal(name.encode(), value.encode()) for name, value in fields)


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">HBBBI", n >> 8, n & 0xFF, kind, flags, sid) + payload


def message(body: bytes, compressed: bool = False) -> bytes:
    return bytes([1 if compressed else 0]) + struct.pack(">I", len(body)) + body


class Raw:
    """A hand-driven HTTP/2 client."""

    def __init__(self, path: Path, settings: bytes = b"", preface: bytes = wire.PREFACE) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        try:
            self.sock.connect(str(path))
        except OSError:
            self.sock.close()
            raise
        self.buf = b""
        self.decoder = HpackDecoder()
        if preface:
            self.sock.sendall(preface + frame(wire.SETTINGS, 0, 0, settings))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, timeout: float = 5.0) -> tuple[int, int, int, bytes] | None:
        """The next frame, or None when the server closed the connection."""
        self.sock.settimeout(timeout)
        while True:
            if len(self.buf) >= 9:
                hi, lo, kind, flags, sid = struct.unpack_from(">HBBBI", self.buf)
                n = (hi << 8) | lo
                if len(self.buf) >= 9 + n:
                    payload = self.buf[9 : 9 + n]
                    self.buf = self.buf[9 + n :]
                    return kind, flags, sid & 0x7FFFFFFF, payload
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None
            self.buf += chunk

    def until(self, kind: int, timeout: float = 5.0) -> tuple[int, int, int, bytes]:
        """Skip SETTINGS, acknowledgements and window updates up to the first frame of ``kind``."""
        while True:
            f = self.frame(timeout)
            assert f is not None, f"connection closed while waiting for frame type {kind}"
            if f[0] == kind:
                return f

    def request(self, sid: int, path: str, data: bytes, *, end: bool = True) -> None:
        """HEADERS for ``path`` on ``sid`` and one DATA frame of ``data`` (raw: the message framing is the
        caller's)."""
        self.send(
            frame(wire.HEADERS, wire.END_HEADERS, sid, headers_block(path))
            + frame(wire.DATA, wire.END_STREAM if end else 0, sid, data)
        )

    def call(self, sid: int, path: str, body: bytes) -> tuple[dict[bytes, bytes], bytes]:
        """One unary call: the trailers (headers merged) and the answer's body."""
        self.request(sid, path, message(body))
        return self.answer(sid)

    def answer(self, sid: int) -> tuple[dict[bytes, bytes], bytes]:
        fields: dict[bytes, bytes] = {}
        data = b""
        while True:
            f = self.frame()
            assert f is not None, "connection closed before the answer ended"
            kind, flags, fsid, payload = f
            if kind == wire.HEADERS and fsid == sid:
                fields.update(self.decoder.decode(payload))
                if flags & wire.END_STREAM:
                    return fields, data[5:]
            elif kind == wire.DATA and fsid == sid:
                data += payload

    def goaway(self) -> int:
        """The error code of the GOAWAY that ends the connection (the connection must then close)."""
        code = -1
        while True:
            f = self.frame()
            if f is None:
                return code
            if f[0] == wire.GOAWAY:
                code = struct.unpack(">I", f[3][4:8])[0]

    def close(self) -> None:
        self.sock.close()


class Watch:
    """A streaming method: yields the request back every time ``bump`` is called, until the call ends."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version = 0
        self.ended: list[bool] = []
        self.payload = b""

    def bump(self, payload: bytes) -> None:
        with self.cond:
            self.payload = payload
            self.version += 1
            self.cond.notify_all()

    def __call__(self, request: bytes, stream: ServerStream) -> Iterator[bytes]:
        def wake() -> None:
            with self.cond:
                self.cond.notify_all()

        stream.add_callback(wake)
        seen = -1
        try:
            while True:
                with self.cond:
                    while self.version == seen and stream.is_active():
                        self.cond.wait()
                    if not stream.is_active():
                        return
                    seen, payload = self.version, self.payload
                yield payload or request
        finally:
            self.ended.append(True)


def fail(request: bytes) -> bytes:
    raise RpcError(wire.INVALID_ARGUMENT, "bad 100% naïve input")


def crash(request: bytes) -> bytes:
    raise ValueError("boom")


@pytest.fixture()
def watch() -> Watch:
    return Watch()


@pytest.fixture()
def served(tmp_path: Path, watch: Watch) -> Iterator[UnixGrpcServer]:
    server = UnixGrpcServer(
        tmp_path / "t.sock",
        {PATH_ECHO: lambda r: r[::-1], PATH_FAIL: fail, PATH_CRASH: crash},
        {PATH_WATCH: watch},
        name="test",
        max_connections=4,
        max_streaming_calls=3,
    )
    server.start()
    yield server
    server.stop(2)
    assert not threads_named("test "), "threads left after stop"


def threads_named(prefix: str) -> list[threading.Thread]:
    """Threads whose name begins with ``prefix``, once those already on their way out have ended."""
    deadline = time.monotonic() + 2
    while True:
        left = [t for t in threading.enumerate() if t.name.startswith(prefix)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


def test_socket_is_0600_from_the_start_and_alone(served: UnixGrpcServer) -> None:
    mode = os.stat(served.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert [p.name for p in served.path.parent.iterdir()] == ["t.sock"]  # the temporary name is gone


def test_grpcio_client_unary_errors_and_stream(served: UnixGrpcServer, watch: Watch) -> None:
    with grpc.insecure_channel(f"unix://{served.path}") as ch:
        echo = ch.unary_unary(PATH_ECHO)
        assert echo(b"abc", timeout=5) == b"cba"
        assert echo(b"x" * 200_000, timeout=5) == b"x" * 200_000  # over every default window and frame size
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(PATH_FAIL)(b"", timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "bad 100% naïve input"
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(PATH_CRASH)(b"", timeout=5)
        assert e.value.code() == grpc.StatusCode.INTERNAL
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/test.Svc/Nope")(b"", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "unknown method /test.Svc/Nope" in (e.value.details() or "")
        stream = ch.unary_stream(PATH_WATCH)(b"first", timeout=10)
        assert next(stream) == b"first"
        watch.bump(b"y" * 100_000)
        assert next(stream) == b"y" * 100_000
        stream.cancel()
        deadline = time.monotonic() + 5
        while not watch.ended and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.ended, "a cancelled stream must end its method"
        assert echo(b"after", timeout=5) == b"retfa"


def test_raw_unary_and_malformed_messages(served: UnixGrpcServer) -> None:
    c = Raw(served.path)
    fields, body = c.call(1, PATH_ECHO, b"hello")
    assert fields[b":status"] == b"200" and fields[b"content-type"] == b"application/grpc"
    assert fields[b"grpc-status"] == b"0" and body == b"olleh"
    c.request(3, PATH_ECHO, message(b"z", compressed=True))
    fields, _ = c.answer(3)
    assert fields[b"grpc-status"] == b"12" and b"compressed" in fields[b"grpc-message"]
    c.request(5, PATH_ECHO, message(b"a") + message(b"b"))
    assert c.answer(5)[0][b"grpc-status"] == b"12"
    c.send(frame(wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, 7, headers_block(PATH_ECHO)))
    assert c.answer(7)[0][b"grpc-status"] == b"12"
    c.send(
        frame(wire.HEADERS, wire.END_HEADERS, 9, headers_block(PATH_ECHO, content_type="text/plain"))
        + frame(wire.DATA, wire.END_STREAM, 9, message(b"a"))
    )
    assert c.answer(9)[0][b"grpc-status"] == b"12"
    c.send(
        frame(
            wire.HEADERS, wire.END_HEADERS, 11, headers_block(PATH_ECHO, extra=(("grpc-encoding", "gzip"),))
        )
        + frame(wire.DATA, wire.END_STREAM, 11, message(b"a"))
    )
    assert b"gzip" in c.answer(11)[0][b"grpc-message"]
    # headers split over HEADERS + CONTINUATION, a PING answered, the connection still good
    block = headers_block(PATH_ECHO)
    c.send(
        frame(wire.HEADERS, 0, 13, block[:10])
        + frame(wire.CONTINUATION, wire.END_HEADERS, 13, block[10:])
        + frame(wire.DATA, wire.END_STREAM, 13, message(b"ab"))
    )
    assert c.answer(13)[1] == b"ba"
    c.send(frame(wire.PING, 0, 0, b"12345678"))
    _, flags, _, payload = c.until(wire.PING)
    assert flags & wire.ACK and payload == b"12345678"
    c.close()


def test_request_sizes_are_bounded_and_the_connection_goes_on(
    served: UnixGrpcServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One message over MAX_MESSAGE, or unfinished requests on several streams holding more than
    MAX_BUFFERED together, end that stream with RESOURCE_EXHAUSTED; the connection and its other streams
    go on."""
    monkeypatch.setattr(wire, "MAX_MESSAGE", 1000)
    monkeypatch.setattr(wire, "MAX_BUFFERED", 1500)
    exhausted = str(wire.RESOURCE_EXHAUSTED).encode()
    c = Raw(served.path)
    c.request(1, PATH_ECHO, message(b"x" * 2000))
    assert c.answer(1)[0][b"grpc-status"] == exhausted
    assert c.call(3, PATH_ECHO, b"ok")[1] == b"ko"
    for sid in (5, 7):
        c.request(sid, PATH_ECHO, b"\0\0\0\x01\xf4" + b"x" * 400, end=False)  # 500 announced, 400 sent
    c.request(9, PATH_ECHO, b"y" * 800, end=False)
    assert c.answer(9)[0][b"grpc-status"] == exhausted
    c.send(frame(wire.DATA, wire.END_STREAM, 5, b"x" * 100))  # the others go on
    assert c.answer(5)[1] == b"x" * 500
    c.close()


@pytest.mark.parametrize(
    ("what", "data", "code"),
    [
        ("not HTTP/2", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 10, wire.PROTOCOL_ERROR),
        ("frame over 16 KiB", struct.pack(">HBBBI", 0x41, 0, wire.DATA, 0, 1), wire.FRAME_SIZE_ERROR),
        (
            "even stream",
            frame(wire.HEADERS, wire.END_HEADERS, 2, headers_block(PATH_ECHO)),
            wire.PROTOCOL_ERROR,
        ),
        ("undecodable headers", frame(wire.HEADERS, wire.END_HEADERS, 1, b"\x80"), wire.COMPRESSION_ERROR),
        (
            "interrupted header block",
            frame(wire.HEADERS, 0, 1, b"\x82") + frame(wire.PING, 0, 0, b"8bytes!!"),
            wire.PROTOCOL_ERROR,
        ),
        ("DATA on an idle stream", frame(wire.DATA, 0, 9, b"abc"), wire.PROTOCOL_ERROR),
        ("short PING", frame(wire.PING, 0, 0, b"1234"), wire.FRAME_SIZE_ERROR),
        ("PUSH_PROMISE", frame(wire.PUSH_PROMISE, wire.END_HEADERS, 1, b"\0\0\0\2"), wire.PROTOCOL_ERROR),
        (
            "window over 2^31-1",
            frame(wire.WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)),
            wire.FLOW_CONTROL_ERROR,
        ),
        ("bad SETTINGS", frame(wire.SETTINGS, 0, 0, b"\0\5\0\0\0\1"), wire.PROTOCOL_ERROR),
    ],
)
def test_protocol_faults_close_only_their_connection(
    served: UnixGrpcServer, what: str, data: bytes, code: int
) -> None:
    good = Raw(served.path)
    if what == "not HTTP/2":
        bad = Raw(served.path, preface=b"")
        bad.send(data)
    else:
        bad = Raw(served.path)
        bad.send(data)
    assert bad.goaway() == code, what
    bad.close()
    assert good.call(1, PATH_ECHO, b"still")[1] == b"llits"
    good.close()


def test_stalled_preface_and_frame_are_dropped(
    served: UnixGrpcServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "FRAME_TIMEOUT_S", 0.3)
    silent = Raw(served.path, preface=b"")
    half = Raw(served.path)
    half.send(frame(wire.DATA, 0, 1, b"abcdef")[:12])  # a frame begun, never finished
    t = time.monotonic()
    assert silent.goaway() == wire.PROTOCOL_ERROR
    assert half.goaway() == wire.PROTOCOL_ERROR
    assert time.monotonic() - t < 4
    silent.close()
    half.close()


def test_flow_control_is_followed(served: UnixGrpcServer, watch: Watch) -> None:
    """A peer with a 1000-byte stream window gets 1000 bytes, then more only as it opens the window; the
    connection's own window (65535) holds a large answer back the same way."""
    c = Raw(served.path, settings=struct.pack(">HI", wire.S_INITIAL_WINDOW_SIZE, 1000))
    c.request(1, PATH_WATCH, message(b"r" * 3000))
    got = 0
    while got < 1000:
        got += len(c.until(wire.DATA)[3])
    assert got == 1000
    c.sock.settimeout(0.3)
    with pytest.raises(TimeoutError):
        while True:  # nothing more comes while the window is closed
            f = c.frame(0.3)
            assert f is None or f[0] != wire.DATA
    c.send(frame(wire.WINDOW_UPDATE, 0, 1, struct.pack(">I", 10_000)))
    while got < 3005:
        got += len(c.until(wire.DATA)[3])
    assert got == 3005
    # the connection window: 65535 at the start, 3005 used; a 100000-byte message stops at the rest
    c.send(frame(wire.WINDOW_UPDATE, 0, 1, struct.pack(">I", 1_000_000)))
    watch.bump(b"m" * 100_000)
    second = 0
    while second < 65_535 - 3005:
        second += len(c.until(wire.DATA)[3])
    assert second == 65_535 - 3005
    c.send(frame(wire.WINDOW_UPDATE, 0, 0, struct.pack(">I", 1_000_000)))
    while second < 100_005:
        second += len(c.until(wire.DATA)[3])
    assert second == 100_005
    c.send(frame(wire.RST_STREAM, 0, 1, struct.pack(">I", wire.CANCEL)))
    deadline = time.monotonic() + 5
    while not watch.ended and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.ended
    c.close()


def test_a_large_unary_answer_waits_for_the_window(served: UnixGrpcServer) -> None:
    c = Raw(served.path, settings=struct.pack(">HI", wire.S_INITIAL_WINDOW_SIZE, 100))
    c.request(1, PATH_ECHO, message(b"q" * 500))
    assert len(c.until(wire.DATA)[3]) == 100
    c.send(frame(wire.WINDOW_UPDATE, 0, 1, struct.pack(">I", 1000)))
    fields, rest = c.answer(1)
    # 505 bytes of DATA in all (a 5-byte prefix and 500): the first 100 came above, and answer() drops five
    # more as if they were the prefix
    assert fields[b"grpc-status"] == b"0" and len(rest) == 505 - 100 - 5
    c.close()


def test_limits_on_streams_calls_and_connections(served: UnixGrpcServer, watch: Watch) -> None:
    c = Raw(served.path)
    for sid in range(1, 2 * wire.MAX_STREAMS, 2):  # requests begun, not finished: each holds a stream
        c.send(frame(wire.HEADERS, wire.END_HEADERS, sid, headers_block(PATH_ECHO)))
    c.send(frame(wire.HEADERS, wire.END_HEADERS, 2 * wire.MAX_STREAMS + 1, headers_block(PATH_ECHO)))
    _, _, sid, payload = c.until(wire.RST_STREAM)
    assert sid == 2 * wire.MAX_STREAMS + 1 and struct.unpack(">I", payload)[0] == wire.REFUSED_STREAM
    c.close()
    with grpc.insecure_channel(f"unix://{served.path}") as ch:
        streams = [ch.unary_stream(PATH_WATCH)(b"w", timeout=10) for _ in range(served.max_streaming_calls)]
        assert [next(s) for s in streams] == [b"w"] * served.max_streaming_calls
        with pytest.raises(grpc.RpcError) as e:
            next(ch.unary_stream(PATH_WATCH)(b"w", timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for s in streams:
            s.cancel()
    held = [Raw(served.path) for _ in range(served.max_connections)]
    for h in held:  # each connection answered: all of them are open
        assert h.until(wire.SETTINGS)
    deadline = time.monotonic() + 5
    while served.connections < served.max_connections and time.monotonic() < deadline:
        time.sleep(0.01)
    extra = Raw(served.path, preface=b"")  # sends nothing: the server may close before any write
    assert extra.frame() is None  # closed at once, without a SETTINGS frame
    for h in held:
        h.close()
    extra.close()


def test_stop_ends_streams_and_connections(tmp_path: Path, watch: Watch) -> None:
    server = UnixGrpcServer(
        tmp_path / "s.sock", {PATH_ECHO: lambda r: r}, {PATH_WATCH: watch}, name="stopping"
    )
    server.start()
    c = Raw(server.path)
    c.request(1, PATH_WATCH, message(b"s"))
    c.until(wire.DATA)
    server.stop(2)
    assert c.goaway() == wire.NO_ERROR
    assert watch.ended
    assert not [t for t in threading.enumerate() if t.name.startswith("stopping ")]  # stop joined them
    with pytest.raises(OSError):
        Raw(server.path)
    c.close()


def test_random_frames_never_take_the_server_down(served: UnixGrpcServer) -> None:
    rng = random.Random(20261124)
    kinds = list(range(11))
    for _ in range(60):
        c = Raw(served.path)
        data = b""
        for _ in range(rng.randint(1, 6)):
            payload = rng.randbytes(rng.randint(0, 40))
            data += frame(rng.choice(kinds), rng.randint(0, 255), rng.choice([0, 1, 2, 3, 5]), payload)
        try:
            c.send(data)
            while c.frame(0.5) is not None:
                pass
        except (TimeoutError, OSError):
            pass
        c.close()
    good = Raw(served.path)
    assert good.call(1, PATH_ECHO, b"alive")[1] == b"evila"
    good.close()


def test_stop_lets_a_stream_end_with_its_status_first(tmp_path: Path) -> None:
    """The owner tells its streams to end, then stops the server: the client gets the stream's OK trailers
    before the connection goes (a graceful end, as the kubelet sees when a plugin stops)."""
    closing = threading.Event()

    def until_closing(request: bytes, stream: ServerStream) -> Iterator[bytes]:
        yield request
        closing.wait(5)

    server = UnixGrpcServer(tmp_path / "g.sock", {}, {PATH_WATCH: until_closing}, name="graceful")
    server.start()
    c = Raw(server.path)
    c.request(1, PATH_WATCH, message(b"g"))
    assert c.until(wire.DATA)[3] == message(b"g")
    closing.set()
    t = time.monotonic()
    server.stop(5)
    assert time.monotonic() - t < 4
    frames = []
    while (f := c.frame()) is not None:
        frames.append(f)
    goaways = [struct.unpack(">II", p[:8]) for kind, _, _, p in frames if kind == wire.GOAWAY]
    assert goaways == [(1, wire.NO_ERROR)]  # stream 1 may finish: it is at or below the last stream
    trailers = [
        c.decoder.decode(p)
        for kind, flags, sid, p in frames
        if kind == wire.HEADERS and sid == 1 and flags & wire.END_STREAM
    ]
    assert trailers == [[(b"grpc-status", b"0")]]
    c.close()


def test_a_client_that_reads_nothing_does_not_hold_up_stop(tmp_path: Path) -> None:
    """A stream writing to a client that never reads blocks in the socket; stop still ends it at once (the
    shutdown frees the blocked writer), and the other connections were served meanwhile."""

    def flood(request: bytes, stream: ServerStream) -> Iterator[bytes]:
        while stream.is_active():
            yield b"f" * 1_000_000

    server = UnixGrpcServer(
        tmp_path / "f.sock", {PATH_ECHO: lambda r: r}, {PATH_WATCH: flood}, name="flooded"
    )
    server.start()
    big = struct.pack(">HI", wire.S_INITIAL_WINDOW_SIZE, 2**31 - 1) + struct.pack(
        ">HI", wire.S_MAX_FRAME_SIZE, 2**24 - 1
    )
    c = Raw(server.path, settings=big)
    c.send(
        frame(wire.WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1 - 65_535))
        + frame(wire.HEADERS, wire.END_HEADERS, 1, headers_block(PATH_WATCH))
        + frame(wire.DATA, wire.END_STREAM, 1, message(b""))
    )
    time.sleep(0.5)  # the stream fills the socket's buffers and blocks in sendall
    other = Raw(server.path)
    assert other.call(1, PATH_ECHO, b"meanwhile")[1] == b"meanwhile"
    other.close()
    t = time.monotonic()
    server.stop(1)
    assert time.monotonic() - t < 5
    assert not threads_named("flooded ")
    c.close()


GOOD = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH_ECHO.encode()),
        (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ([*GOOD, (b"Content-Type", b"x")], "not a lowercase token"),
        ([*GOOD, (b"bad name", b"x")], "not a lowercase token"),
        ([*GOOD, (b"", b"x")], "not a lowercase token"),
        ([*GOOD, (b":status", b"200")], "after a regular field"),
        ([(b":status", b"200"), *GOOD], "unknown or repeated"),
        ([(b":path", b"/a"), *GOOD], "unknown or repeated"),
        ([*GOOD, (b"connection", b"close")], "connection-specific field connection"),
        ([*GOOD, (b"transfer-encoding", b"chunked")], "connection-specific"),
        ([*GOOD[:5], (b"te", b"gzip")], "connection-specific field te"),
        ([*GOOD, (b"x-a", b"a\r\nb")], "NUL, CR, LF"),
        ([*GOOD, (b"x-a", b" padded")], "edge whitespace"),
        ([*GOOD, (b"content-length", b"12a")], "is not a length"),
        ([GOOD[0], GOOD[2], *GOOD[4:]], "without :scheme"),
        (GOOD[3:], "without :method, :path, :scheme"),
    ],
)
def test_malformed_header_lists_are_named(fields: list[tuple[bytes, bytes]], reason: str) -> None:
    assert wire.malformed(GOOD) is None
    got = wire.malformed(fields)
    assert got is not None and reason in got, got


def test_a_malformed_request_is_reset_and_the_connection_goes_on(served: UnixGrpcServer) -> None:
    """RFC 9113 8.1.1: a malformed request is a stream error (RST_STREAM PROTOCOL_ERROR); the method never
    runs and the connection serves the next request."""
    c = Raw(served.path)
    c.send(frame(wire.HEADERS, wire.END_HEADERS, 1, headers_block(PATH_ECHO, extra=(("Upper", "x"),)))
           + frame(wire.DATA, wire.END_STREAM, 1, message(b"no")))
    _, _, sid, payload = c.until(wire.RST_STREAM)
    assert sid == 1 and struct.unpack(">I", payload)[0] == wire.PROTOCOL_ERROR
    # content-length that does not match the body
    c.send(frame(wire.HEADERS, wire.END_HEADERS, 3, headers_block(PATH_ECHO, extra=(("content-length", "99"),)))
           + frame(wire.DATA, wire.END_STREAM, 3, message(b"short")))
    resets = [c.until(wire.RST_STREAM)[2:] for _ in range(2)]  # stream 1's DATA came after its reset
    assert (1, struct.pack(">I", wire.STREAM_CLOSED)) in resets
    assert (3, struct.pack(">I", wire.PROTOCOL_ERROR)) in resets
    # a matching content-length is fine
    body = message(b"fine")
    c.send(frame(wire.HEADERS, wire.END_HEADERS, 5,
                 headers_block(PATH_ECHO, extra=(("content-length", str(len(body))),)))
           + frame(wire.DATA, wire.END_STREAM, 5, body))
    assert c.answer(5)[1] == b"enif"
    assert c.call(7, PATH_ECHO, b"next")[1] == b"txen"
    c.close()
