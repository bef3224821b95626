"""A gRPC server on one Unix socket, speaking HTTP/2 itself: the transport of every socket nodeagent serves
to the kubelet (the device-plugin servers, the DRA driver and its registration).

The kubelet opens one connection per plugin socket and calls small unary methods (Allocate above all) and
server-streaming ones (ListAndWatch, the DRA health watch). This server answers a unary call on the connection's reader
thread, in the same pass that read the request: one ``recv`` and one ``sendall`` per call, no hand-off
between threads. (grpcio's server passes every call through its completion-queue thread and a worker
thread and back, which costs more than the Allocate itself; benchmark: tests/bench/bench_deviceplugin.py.)
A server-streaming call gets a thread of its own.

What it speaks (RFC 9113 over a socket with prior knowledge, the gRPC HTTP/2 mapping):
  * the client preface, SETTINGS (acknowledged; the peer's window and frame size are followed), PING,
    WINDOW_UPDATE with flow control both ways, RST_STREAM (cancels a stream), GOAWAY (both ways),
    HEADERS + CONTINUATION decoded with HPACK (``nodeagent.wire.hpack``), DATA carrying gRPC's
    length-prefixed messages (uncompressed only);
  * answers: HEADERS (``:status 200``, ``content-type: application/grpc``), DATA, trailers with
    ``grpc-status``/``grpc-message``; an error before any answer is sent as trailers only.

Everything a client sends is bounded: frame size, header list size, message size, concurrent streams,
streaming calls, connections, and time (a frame begun must be complete within ``FRAME_TIMEOUT_S``). A
connection that breaks the protocol gets one GOAWAY naming the fault, one log line, and is closed; the
server and its other connections go on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from nodeagent.wire.hpack import HpackDecoder, HpackError, encode_literal

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
# Flags
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Error codes (RFC 9113 §7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
# SETTINGS identifiers
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE = 1, 2, 3, 4
S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 5, 6

# gRPC status codes
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED = 0, 1, 2, 3, 4, 8
UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 12, 13, 14

DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
FRAME_SIZE = 16_384  # what this server accepts (the protocol's default; it never asks for more)
MAX_HEADER_LIST = 16_384
MAX_STREAMS = 100  # concurrent streams per connection
MAX_MESSAGE = 4 * 1024 * 1024  # one request message (gRPC's default limit)
MAX_BUFFERED = 8 * 1024 * 1024  # request bytes held at once by one connection, all its streams together
FRAME_TIMEOUT_S = 10.0  # the preface, and the rest of any frame begun, must arrive within this
SEND_TIMEOUT_S = 30.0  # a peer that reads nothing for this long loses its connection
RECV_CHUNK = 65_536
MAX_STATUS_MESSAGE = 1024

_FRAME_HEAD = struct.Struct(">HBBBI")  # length as 16 + 8 bits, type, flags, stream ID
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")

# Response header blocks: static-table references and literals without indexing, so the peer's decoder
# state never depends on what this side sent.
_RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + bytes([16]) + b"application/grpc"  # :status 200, content-type


class RpcError(Exception):
    """Raised by a method to end its call with a gRPC status other than OK."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ProtocolFault(Exception):
    """The peer broke HTTP/2: the connection is closed with GOAWAY ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


UnaryMethod = Callable[[bytes], bytes]


class ServerStream:
    """What a server-streaming method sees of its call: whether it still runs, and a way to be told when it
    ends (cancelled by the client, connection gone, server stopping)."""

    __slots__ = ("_active", "_callbacks", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = True
        self._callbacks: list[Callable[[], None]] = []

    def is_active(self) -> bool:
        return self._active

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the call ends (at once if it has ended)."""
        with self._lock:
            if self._active:
                self._callbacks.append(callback)
                return
        callback()

    def end(self) -> None:
        with self._lock:
            if not self._active:
                return
            self._active = False
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:
                log.exception("stream end callback failed")


StreamMethod = Callable[[bytes, ServerStream], Iterator[bytes]]


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME_HEAD.pack(n >> 8, n & 0xFF, kind, flags, stream_id) + payload


def _percent_encode(message: str) -> bytes:
    """gRPC's grpc-message encoding: bytes outside printable ASCII, and '%', as %XX."""
    raw = message.encode("utf-8", "replace")[:MAX_STATUS_MESSAGE]
    return b"".join(bytes([c]) if 0x20 <= c <= 0x7E and c != 0x25 else b"%%%02X" % c for c in raw)


def _trailers(code: int, message: str, *, with_headers: bool) -> bytes:
    block = _RESPONSE_HEADERS if with_headers else b""
    block += encode_literal(b"grpc-status", str(code).encode())
    if message:
        block += encode_literal(b"grpc-message", _percent_encode(message))
    return block


_OK_TRAILERS = _trailers(OK, "", with_headers=False)


# What this server announces on every new connection.
_SERVER_SETTINGS = _frame(SETTINGS, 0, 0, b"".join((
    _SETTING.pack(S_MAX_CONCURRENT_STREAMS, MAX_STREAMS),
    _SETTING.pack(S_ENABLE_PUSH, 0),
    _SETTING.pack(S_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST),
)))


def _grpc_message(body: bytes | bytearray) -> bytes:
    """The one message of a unary request body; ``RpcError`` for anything else."""
    if len(body) < 5:
        raise RpcError(UNIMPLEMENTED, "the request carries no message (exactly one is required)")
    if body[0] != 0:
        raise RpcError(UNIMPLEMENTED, "compressed messages are not accepted")
    (length,) = _U32.unpack_from(body, 1)
    if length != len(body) - 5:
        raise RpcError(UNIMPLEMENTED, "the request must carry exactly one message")
    return bytes(body[5:])


_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))
_CONNECTION_SPECIFIC = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"))
_BAD_NAME = re.compile(rb"[^a-z0-9!#$%&'*+\-.^_`|~]")  # a field name is a lowercase token (RFC 9113 8.2.1)
_BAD_VALUE = re.compile(rb"[\x00\r\n]|^[ \t]|[ \t]$")


def malformed(fields: list[tuple[bytes, bytes]]) -> str | None:
    """Why a request's header list is malformed (RFC 9113 8.2 and 8.3), or None: names lowercase tokens,
    values without NUL/CR/LF or edge whitespace, the request pseudo-headers once each and first,
    :method/:scheme/:path present, no connection-specific field, TE only "trailers", a content-length that
    is a number."""
    seen: set[bytes] = set()
    regular = False
    for name, value in fields:
        if name[:1] == b":":
            if regular:
                return f"pseudo-header {name.decode('latin-1')} after a regular field"
            if name not in _PSEUDO or name in seen:
                return f"pseudo-header {name.decode('latin-1')} unknown or repeated"
            seen.add(name)
        else:
            regular = True
            if not name or _BAD_NAME.search(name):
                return f"field name {name.decode('latin-1')!r} is not a lowercase token"
            if name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
                return f"connection-specific field {name.decode('latin-1')}"
        if _BAD_VALUE.search(value):
            return f"field {name.decode('latin-1')} has a value with NUL, CR, LF or edge whitespace"
        if name == b"content-length" and not (value.isdigit() and len(value) <= 12):
            return f"content-length {value.decode('latin-1')!r} is not a length"
    missing = sorted(n.decode() for n in (b":method", b":scheme", b":path") if n not in seen)
    if missing:
        return f"request without {', '.join(missing)}"
    return None


def parse_request(message: Any, request: bytes) -> Any:
    """``request`` parsed as ``message`` (a generated protobuf class); INVALID_ARGUMENT naming the message
    when the bytes are not one."""
    try:
        return message.FromString(request)
    except DecodeError as e:
        raise RpcError(
            INVALID_ARGUMENT, f"malformed {message.DESCRIPTOR.name} ({len(request)} bytes): {e}"
        ) from e


def _message_frame_payload(message: bytes) -> bytes:
    return b"\x00" + _U32.pack(len(message)) + message


class _Stream:
    __slots__ = ("body", "content_length", "handle", "path", "send_window", "sending")

    def __init__(self, path: str, send_window: int, content_length: int) -> None:
        self.path = path
        self.body = bytearray()
        self.send_window = send_window
        self.handle: ServerStream | None = None  # set for a running server-streaming call
        self.content_length = content_length  # the request's content-length, -1 without one
        self.sending = False


class _Connection:
    """One client connection: its reader thread parses frames and answers unary calls; streaming calls send
    from their own threads. Writes go through one lock; flow-control windows through one condition."""

    def __init__(self, server: UnixGrpcServer, sock: socket.socket, number: int) -> None:
        self.server = server
        self.sock = sock
        self.name = f"{server.name} connection {number}"
        self._wlock = threading.Lock()
        self._flow = threading.Condition()  # guards windows, peer settings, streams' send windows
        self._send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_frame_size = FRAME_SIZE
        self._streams: dict[int, _Stream] = {}
        self._last_stream = 0
        self._open = True
        self._going_away = False
        self._decoder = HpackDecoder(max_header_list_size=MAX_HEADER_LIST)
        self._valid_headers: set[tuple[tuple[bytes, bytes], ...]] = set()
        self._continuing: tuple[int, int, bytearray] | None = None  # stream, flags, header block so far
        self._out: list[bytes] = []  # written at the end of the reader's pass
        self._stream_threads: dict[int, threading.Thread] = {}
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    # -- writing ---------------------------------------------------------------------------------------------

    def _write(self, data: bytes, wait_s: float = -1) -> bool:
        """Send ``data`` whole (False when the connection is closed, or its writer stays busy past ``wait_s``
        when that is given)."""
        if not self._wlock.acquire(timeout=wait_s):
            return False
        try:
            if not self._open:
                return False
            self.sock.sendall(data)
        except OSError:
            self._open = False
            return False
        finally:
            self._wlock.release()
        return True

    def _flush(self) -> None:
        if self._out:
            data = b"".join(self._out)
            self._out.clear()
            self._write(data)

    # -- the reader ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        reason = ""
        try:
            self.sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0)
            )
            self._write(_SERVER_SETTINGS)
            self._read_loop()
        except ProtocolFault as e:
            reason = str(e)
            log.warning("%s: closed: %s", self.name, e)
            self._write(
                _frame(GOAWAY, 0, 0, _U32.pack(self._last_stream) + _U32.pack(e.code) + str(e).encode()[:256])
            )
        except (OSError, EOFError) as e:
            reason = str(e) or type(e).__name__
        except Exception:
            reason = "internal error"
            log.exception("%s: reader failed", self.name)
        finally:
            self.close(reason)
            with self._wlock:  # a write still under way has failed on the shut-down socket by now
                self.sock.close()
            self.server.forget(self)

    def _read_loop(self) -> None:
        buf = bytearray()
        while len(buf) < len(PREFACE):
            self._receive(buf, "the client preface")
        if bytes(buf[: len(PREFACE)]) != PREFACE:
            raise ProtocolFault(
                PROTOCOL_ERROR, "the connection does not begin with the HTTP/2 client preface"
            )
        del buf[: len(PREFACE)]
        while True:
            pos = 0
            end = len(buf)
            while end - pos >= 9:
                hi, lo, kind, flags, sid = _FRAME_HEAD.unpack_from(buf, pos)
                length = (hi << 8) | lo
                if length > FRAME_SIZE:
                    raise ProtocolFault(FRAME_SIZE_ERROR, f"a frame of {length} bytes (at most {FRAME_SIZE})")
                if end - pos - 9 < length:
                    break
                payload = bytes(buf[pos + 9 : pos + 9 + length])
                pos += 9 + length
                self._on_frame(kind, flags, sid & 0x7FFFFFFF, payload)
            if pos:
                del buf[:pos]
            self._flush()
            # between frames the client may stay silent; a frame begun must be finished in time
            self._receive(buf, "the rest of a frame" if buf else None)

    def _receive(self, buf: bytearray, awaited: str | None) -> None:
        """Append what the socket has next to ``buf``. With ``awaited`` (what is expected) it must come
        within FRAME_TIMEOUT_S (poll: any descriptor number), else the connection ends naming it."""
        if awaited is not None:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            if not poller.poll(FRAME_TIMEOUT_S * 1000):
                raise ProtocolFault(PROTOCOL_ERROR, f"{awaited} did not arrive within {FRAME_TIMEOUT_S:g} s")
        chunk = self.sock.recv(RECV_CHUNK)
        if not chunk:
            raise EOFError("closed by the client")
        buf += chunk

    # -- frames ----------------------------------------------------------------------------------------------

    def _on_frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self._continuing is not None and kind != CONTINUATION:
            raise ProtocolFault(PROTOCOL_ERROR, "a header block interrupted by another frame")
        if kind == DATA:
            self._on_data(flags, sid, payload)
        elif kind == HEADERS:
            self._on_headers(flags, sid, payload)
        elif kind == CONTINUATION:
            if self._continuing is None or self._continuing[0] != sid:
                raise ProtocolFault(PROTOCOL_ERROR, "a CONTINUATION frame outside a header block")
            block = self._continuing[2]
            block += payload
            if len(block) > 4 * MAX_HEADER_LIST:
                raise ProtocolFault(PROTOCOL_ERROR, f"a header block over {4 * MAX_HEADER_LIST} bytes")
            if flags & END_HEADERS:
                head_flags = self._continuing[1]
                self._continuing = None
                self._on_header_block(head_flags, sid, bytes(block))
        elif kind == SETTINGS:
            self._on_settings(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif kind == PING:
            if len(payload) != 8 or sid != 0:
                raise ProtocolFault(
                    FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR, "a malformed PING"
                )
            if not flags & ACK:
                self._out.append(_frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if sid == 0 or len(payload) != 4:
                raise ProtocolFault(PROTOCOL_ERROR, "a malformed RST_STREAM")
            self._end_stream(sid)
        elif kind == GOAWAY:
            if sid != 0:
                raise ProtocolFault(PROTOCOL_ERROR, "GOAWAY on a stream")
            self._going_away = True
        elif kind == PRIORITY:
            if sid == 0 or len(payload) != 5:
                raise ProtocolFault(PROTOCOL_ERROR, "a malformed PRIORITY frame")
        elif kind == PUSH_PROMISE:
            raise ProtocolFault(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # frames of unknown types are ignored (RFC 9113 §5.5)

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise ProtocolFault(PROTOCOL_ERROR, "padding longer than its frame")
            return payload[1 : len(payload) - payload[0]]
        return payload

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise ProtocolFault(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolFault(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            return
        if len(payload) % 6:
            raise ProtocolFault(FRAME_SIZE_ERROR, f"SETTINGS of {len(payload)} bytes (a multiple of 6)")
        with self._flow:
            for off in range(0, len(payload), 6):
                ident, value = _SETTING.unpack_from(payload, off)
                if ident == S_INITIAL_WINDOW_SIZE:
                    if value > MAX_WINDOW:
                        raise ProtocolFault(FLOW_CONTROL_ERROR, f"an initial window of {value}")
                    delta = value - self._peer_initial_window
                    self._peer_initial_window = value
                    for st in self._streams.values():
                        st.send_window += delta
                elif ident == S_MAX_FRAME_SIZE:
                    if not FRAME_SIZE <= value <= 16_777_215:
                        raise ProtocolFault(PROTOCOL_ERROR, f"a maximum frame size of {value}")
                    self._peer_frame_size = value
                elif ident == S_ENABLE_PUSH and value > 1:
                    raise ProtocolFault(PROTOCOL_ERROR, f"ENABLE_PUSH {value}")
            self._flow.notify_all()
        self._out.append(_frame(SETTINGS, ACK, 0))

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolFault(FRAME_SIZE_ERROR, "a WINDOW_UPDATE not of 4 bytes")
        (inc,) = _U32.unpack(payload)
        inc &= 0x7FFFFFFF
        with self._flow:
            if sid == 0:
                if inc == 0:
                    raise ProtocolFault(PROTOCOL_ERROR, "a connection WINDOW_UPDATE of 0")
                self._send_window += inc
                if self._send_window > MAX_WINDOW:
                    raise ProtocolFault(FLOW_CONTROL_ERROR, "the connection window over 2^31-1")
            else:
                st = self._streams.get(sid)
                if st is not None:
                    if inc == 0 or st.send_window + inc > MAX_WINDOW:
                        self._reset(sid, PROTOCOL_ERROR if inc == 0 else FLOW_CONTROL_ERROR)
                        return
                    st.send_window += inc
            self._flow.notify_all()

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise ProtocolFault(PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise ProtocolFault(PROTOCOL_ERROR, "HEADERS too short for its priority fields")
            block = block[5:]
        if flags & END_HEADERS:
            self._on_header_block(flags, sid, block)
        else:
            self._continuing = (sid, flags, bytearray(block))

    def _on_header_block(self, flags: int, sid: int, block: bytes) -> None:
        try:
            fields = self._decoder.decode(block)  # always, to keep the decoder's table in step
        except HpackError as e:
            raise ProtocolFault(COMPRESSION_ERROR, f"undecodable headers: {e}") from e
        st = self._streams.get(sid)
        if st is not None:  # trailers from the client end its request
            if st.sending:
                return
            if not flags & END_STREAM:
                self._reset(sid, PROTOCOL_ERROR)
                return
            self._request_complete(sid, st)
            return
        if sid % 2 == 0 or sid <= self._last_stream:
            raise ProtocolFault(PROTOCOL_ERROR, f"a new stream {sid} (client streams are odd and increase)")
        self._last_stream = sid
        if self._going_away or self.server.closing:
            self._reset(sid, REFUSED_STREAM)
            return
        if len(self._streams) >= MAX_STREAMS:
            self._reset(sid, REFUSED_STREAM)
            return
        key = tuple(fields)
        if key not in self._valid_headers:  # the same few header lists come again and again
            reason = malformed(fields)
            if reason is not None:
                log.warning("%s: stream %d refused: malformed request: %s", self.name, sid, reason)
                self._reset(sid, PROTOCOL_ERROR)
                return
            if len(self._valid_headers) >= 64:
                self._valid_headers.clear()
            self._valid_headers.add(key)
        method = path = content_type = encoding = ""
        length = -1
        for name, value in fields:
            if name == b":path":
                path = value.decode("latin-1")
            elif name == b":method":
                method = value.decode("latin-1")
            elif name == b"content-type":
                content_type = value.decode("latin-1")
            elif name == b"grpc-encoding":
                encoding = value.decode("latin-1")
            elif name == b"content-length":
                length = int(value)  # checked by malformed()
        with self._flow:
            st = _Stream(path, self._peer_initial_window, length)
            self._streams[sid] = st
        if method != "POST" or not content_type.startswith("application/grpc"):
            self._finish(
                sid,
                UNIMPLEMENTED,
                f"not a gRPC request (method {method!r}, content-type {content_type!r})",
                headers_sent=False,
            )
            return
        if encoding not in ("", "identity"):
            self._finish(
                sid, UNIMPLEMENTED, f"message encoding {encoding!r} is not supported", headers_sent=False
            )
            return
        if path not in self.server.unary and path not in self.server.streaming:
            self._finish(sid, UNIMPLEMENTED, f"unknown method {path}", headers_sent=False)
            return
        if flags & END_STREAM:
            self._request_complete(sid, st)

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise ProtocolFault(PROTOCOL_ERROR, "DATA on stream 0")
        if payload:  # the connection's receive window is given back at once, whatever the stream's fate
            self._out.append(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(len(payload))))
        st = self._streams.get(sid)
        if st is None or st.sending:
            if sid > self._last_stream:
                raise ProtocolFault(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            if st is None:
                self._reset(sid, STREAM_CLOSED)
            return
        st.body += self._unpad(flags, payload)
        if len(st.body) > MAX_MESSAGE + 5:
            self._finish(
                sid, RESOURCE_EXHAUSTED, f"a request message over {MAX_MESSAGE} bytes", headers_sent=False
            )
            return
        if len(self._streams) > 1 and sum(len(s.body) for s in self._streams.values()) > MAX_BUFFERED:
            self._finish(
                sid,
                RESOURCE_EXHAUSTED,
                f"requests over {MAX_BUFFERED} bytes held on one connection",
                headers_sent=False,
            )
            return
        if flags & END_STREAM:
            self._request_complete(sid, st)
        elif payload:
            self._out.append(_frame(WINDOW_UPDATE, 0, sid, _U32.pack(len(payload))))

    # -- calls -----------------------------------------------------------------------------------------------

    def _request_complete(self, sid: int, st: _Stream) -> None:
        st.sending = True
        if st.content_length >= 0 and st.content_length != len(st.body):  # malformed (RFC 9113 8.1.1)
            log.warning("%s: stream %d refused: content-length %d, %d bytes sent", self.name, sid,
                        st.content_length, len(st.body))
            self._reset(sid, PROTOCOL_ERROR)
            return
        server = self.server
        unary = server.unary.get(st.path)
        try:
            request = _grpc_message(st.body)
        except RpcError as e:
            self._finish(sid, e.code, e.message, headers_sent=False)
            return
        st.body = bytearray()
        if unary is not None:
            try:
                answer = unary(request)
            except RpcError as e:
                self._finish(sid, e.code, e.message, headers_sent=False)
                return
            except Exception:
                log.exception("%s: %s failed", self.name, st.path)
                self._finish(sid, INTERNAL, "internal error", headers_sent=False)
                return
            self._answer(sid, st, answer)
            return
        method = server.streaming[st.path]
        handle = server.open_stream()
        if handle is None:
            self._finish(
                sid,
                RESOURCE_EXHAUSTED,
                f"more than {server.max_streaming_calls} streaming calls",
                headers_sent=False,
            )
            return
        st.handle = handle
        thread = threading.Thread(
            target=self._run_stream,
            args=(sid, st, method, request, handle),
            name=f"{self.name} stream {sid}",
            daemon=True,
        )
        self._stream_threads[sid] = thread
        self._flush()  # what this pass owes the peer (a SETTINGS acknowledgement above all) goes first
        thread.start()

    def _answer(self, sid: int, st: _Stream, message: bytes) -> None:
        """A unary answer from the reader thread: at once when the windows allow (the usual case), else
        from a thread that waits for them."""
        payload = _message_frame_payload(message)
        n = len(payload)
        with self._flow:
            fits = n <= self._send_window and n <= st.send_window and n <= self._peer_frame_size
            if fits:
                self._send_window -= n
                st.send_window -= n
                del self._streams[sid]
        if fits:
            self._out.append(
                _frame(HEADERS, END_HEADERS, sid, _RESPONSE_HEADERS)
                + _frame(DATA, 0, sid, payload)
                + _frame(HEADERS, END_HEADERS | END_STREAM, sid, _OK_TRAILERS)
            )
            return
        self._flush()

        def send() -> None:
            if self._write(_frame(HEADERS, END_HEADERS, sid, _RESPONSE_HEADERS)) and self._send_message(
                sid, payload
            ):
                self._close_stream(sid, _OK_TRAILERS)

        threading.Thread(target=send, name=f"{self.name} answer {sid}", daemon=True).start()

    def _run_stream(
        self, sid: int, st: _Stream, method: StreamMethod, request: bytes, handle: ServerStream
    ) -> None:
        code, message = OK, ""
        try:
            if self._write(_frame(HEADERS, END_HEADERS, sid, _RESPONSE_HEADERS)):
                for item in method(request, handle):
                    if not handle.is_active() or not self._send_message(sid, _message_frame_payload(item)):
                        break
        except RpcError as e:
            code, message = e.code, e.message
        except Exception:
            log.exception("%s: %s failed", self.name, st.path)
            code, message = INTERNAL, "internal error"
        finally:
            if handle.is_active():
                trailers = _OK_TRAILERS if code == OK else _trailers(code, message, with_headers=False)
                self._close_stream(sid, trailers)
            handle.end()
            self._stream_threads.pop(sid, None)

    def _send_message(self, sid: int, payload: bytes) -> bool:
        """Send one message's DATA frames as the windows allow; False when the stream or connection ended."""
        view = memoryview(payload)
        while view:
            with self._flow:
                while True:
                    st = self._streams.get(sid)
                    if st is None or not self._open:
                        return False
                    room = min(self._send_window, st.send_window, self._peer_frame_size, len(view))
                    if room > 0:
                        break
                    self._flow.wait(1.0)
                self._send_window -= room
                st.send_window -= room
            if not self._write(_frame(DATA, 0, sid, bytes(view[:room]))):
                return False
            view = view[room:]
        return True

    def _finish(self, sid: int, code: int, message: str, *, headers_sent: bool) -> None:
        """End a call with an error status (trailers only when no answer headers were sent)."""
        with self._flow:
            self._streams.pop(sid, None)
        self._out.append(
            _frame(
                HEADERS,
                END_HEADERS | END_STREAM,
                sid,
                _trailers(code, message, with_headers=not headers_sent),
            )
        )

    def _close_stream(self, sid: int, trailers: bytes) -> None:
        with self._flow:
            if self._streams.pop(sid, None) is None:
                return
        self._write(_frame(HEADERS, END_HEADERS | END_STREAM, sid, trailers))

    def _reset(self, sid: int, code: int) -> None:
        self._out.append(_frame(RST_STREAM, 0, sid, _U32.pack(code)))
        self._end_stream(sid)

    def _end_stream(self, sid: int) -> None:
        """The client cancelled ``sid`` (or it was reset): a streaming call stops."""
        with self._flow:
            st = self._streams.pop(sid, None)
            self._flow.notify_all()
        if st is not None and st.handle is not None:
            st.handle.end()

    # -- the end ---------------------------------------------------------------------------------------------

    def goaway(self) -> None:
        """Tell the client no new calls will be taken (server stopping); skipped when a write is stuck on a
        client that reads nothing (the close that follows ends it)."""
        self._write(_frame(GOAWAY, 0, 0, _U32.pack(self._last_stream) + _U32.pack(NO_ERROR)), wait_s=0.2)

    def close(self, reason: str = "") -> None:
        # Not under the write lock: a writer blocked on a client that reads nothing holds it, and the
        # shutdown below is what frees that writer.
        was_open, self._open = self._open, False
        if was_open:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        with self._flow:
            streams = list(self._streams.values())
            self._streams.clear()
            self._flow.notify_all()
        for st in streams:
            if st.handle is not None:
                st.handle.end()
        if was_open:
            log.debug("%s closed%s", self.name, f" ({reason})" if reason else "")

    def join(self, timeout: float) -> None:
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        for t in list(self._stream_threads.values()):
            t.join(timeout)


class UnixGrpcServer:
    """Serves ``unary`` and ``streaming`` methods (by path, ``/package.Service/Method``) on ``path``, a Unix
    socket of mode 0600 (it never exists with another mode: bound under a temporary name, restricted, then
    renamed into place)."""

    def __init__(
        self,
        path: Path,
        unary: Mapping[str, UnaryMethod],
        streaming: Mapping[str, StreamMethod],
        *,
        name: str,
        max_connections: int = 16,
        max_streaming_calls: int = 8,
    ) -> None:
        self.path = path
        self.unary = dict(unary)
        self.streaming = dict(streaming)
        self.name = name
        self.max_connections = max_connections
        self.max_streaming_calls = max_streaming_calls
        self.closing = False
        self._lock = threading.Lock()
        self._calls_ended = threading.Condition(self._lock)
        self._connections: set[_Connection] = set()
        self._streaming_calls = 0
        self._accepted = 0
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    def start(self) -> None:
        """Bind and listen (raises ``OSError``); calls are taken from then on."""
        tmp = self.path.with_name(f".{secrets.token_hex(6)}.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(os.fsencode(tmp))
            try:
                os.chmod(tmp, 0o600)
                sock.listen(16)
                os.rename(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
        except BaseException:
            sock.close()
            raise
        self.closing = False
        self._listener = sock
        self._acceptor = threading.Thread(
            target=self._accept_loop, args=(sock,), name=f"{self.name} accept", daemon=True
        )
        self._acceptor.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # the listener was shut down (stop)
            with self._lock:
                if self.closing:
                    conn.close()
                    return
                if len(self._connections) >= self.max_connections:
                    log.warning(
                        "%s: refused a connection: %d are open already", self.name, len(self._connections)
                    )
                    conn.close()
                    continue
                self._accepted += 1
                c = _Connection(self, conn, self._accepted)
                self._connections.add(c)
            c.thread.start()

    def open_stream(self) -> ServerStream | None:
        with self._lock:
            if self._streaming_calls >= self.max_streaming_calls or self.closing:
                return None
            self._streaming_calls += 1
        handle = ServerStream()
        handle.add_callback(self.close_stream)  # counted while the call runs, not while its thread winds down
        return handle

    def close_stream(self) -> None:
        with self._lock:
            self._streaming_calls -= 1
            self._calls_ended.notify_all()

    def forget(self, conn: _Connection) -> None:
        with self._lock:
            self._connections.discard(conn)

    @property
    def streaming_calls(self) -> int:
        with self._lock:
            return self._streaming_calls

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop taking connections and calls (GOAWAY), give the streaming calls running up to ``grace_s`` to
        end on their own (the owner tells them first), then end the rest and close every connection."""
        with self._lock:
            self.closing = True
            conns = list(self._connections)
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        if self._acceptor is not None:
            self._acceptor.join(grace_s)
            self._acceptor = None
        for c in conns:
            c.goaway()
        deadline = time.monotonic() + grace_s
        with self._lock:
            while self._streaming_calls and self._calls_ended.wait(max(0.0, deadline - time.monotonic())):
                pass
        for c in conns:
            c.close("server stopping")
        for c in conns:
            c.join(grace_s)
