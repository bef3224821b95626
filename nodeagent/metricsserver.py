"""The metrics endpoint's HTTP server: one asyncio event loop in one thread, h11 for HTTP/1.1.

A client costs a socket and a few kilobytes while it sends its request, never a thread, so the bounds can be
generous where a scraper needs them and still cheap:

- at most ``MAX_CONNECTIONS`` open connections, at most ``MAX_PER_CLIENT`` from one address. A new
  connection past either bound closes the oldest "waiting" connection (of its own address, for the
  per-address bound): one that was read at least once and has not sent its whole request. A connection
  is read once before it can wait (the loop polls its socket after accepting it), and a scraper has sent
  its request by then: it is answered, and a connection whose request is in is never closed for another.
  With no waiting connection to close, the new one is closed. So clients that connect and never finish
  their request cannot keep a scraper out, however many they open and at whatever rate, even from the
  scraper's own address and with the loop held up meanwhile (the connections that queued then are
  accepted together, the scraper's among them, and none of them can push it out before it is read);
- the request line and headers at most ``MAX_HEADER_BYTES`` (more: 431 and the connection closed), and all of
  them within ``REQUEST_TIMEOUT_S`` of the connection (a client sending a header line every second is cut off
  as surely as a silent one);
- one request per connection (``Connection: close``); the answer must be taken within ``WRITE_TIMEOUT_S``,
  else the connection is dropped;
- a listen backlog of ``BACKLOG``.

The answer comes from a WSGI application (prometheus_client's ``make_wsgi_app``: its content negotiation,
gzip, ``name[]`` filter and methods as they are), called on the loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import h11

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # open connections in all
MAX_PER_CLIENT = 64  # open connections from one client address
MAX_HEADER_BYTES = 8192  # the request line and headers
REQUEST_TIMEOUT_S = 5.0  # for the whole request (line and headers), from the connection on
WRITE_TIMEOUT_S = 5.0  # for the answer to be taken
BACKLOG = 64  # the listening socket's queue of connections not yet accepted

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass(frozen=True)
class Limits:
    max_connections: int = MAX_CONNECTIONS
    max_per_client: int = MAX_PER_CLIENT
    max_header_bytes: int = MAX_HEADER_BYTES
    request_timeout_s: float = REQUEST_TIMEOUT_S
    write_timeout_s: float = WRITE_TIMEOUT_S
    backlog: int = BACKLOG


@dataclass
class Counts:
    """What the server did with its connections since it started (exact on the loop's thread, a rough figure
    elsewhere)."""

    served: int = 0
    evicted: int = 0  # closed, request unfinished, to make room for a newer connection
    refused: int = 0  # closed at once: no room, and nothing that could give way
    timed_out: int = 0  # request not in within the deadline, or answer not taken within it
    malformed: int = 0  # not HTTP/1.1, or headers over the bound


class _Connection(asyncio.Protocol):
    """One client connection: reading its request (``waiting``), then answering it once and closing."""

    def __init__(self, server: _Server) -> None:
        self._server = server
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.waiting = True  # the request is not in yet
        self.fresh = True  # not read once yet: cannot give way
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=server.limits.max_header_bytes)
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self._server.admit(self):
            transport.abort()
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._server.limits.request_timeout_s, self._expire)
        # The transport registers its socket with the loop in this iteration (after this call); a callback
        # scheduled now runs in the next iteration before the reads that iteration's poll found, and one it
        # schedules runs after them: only then has the loop read whatever the client sent at once.
        loop.call_soon(loop.call_soon, self._settle)

    def _settle(self) -> None:
        if self.fresh and self.waiting and self.transport is not None and not self.transport.is_closing():
            self._server.settle(self)

    def data_received(self, data: bytes) -> None:
        if not self.waiting:
            return
        self._h11.receive_data(data)
        try:
            event = self._h11.next_event()
        except h11.RemoteProtocolError as e:
            self._server.counts.malformed += 1
            status = HTTPStatus(e.error_status_hint)
            self._answer(f"{status.value} {status.phrase}", [("Content-Type", "text/plain; charset=utf-8")],
                         f"{status.value} {e}\n".encode(), head=False)
            return
        if isinstance(event, h11.Request):
            if _head_size(event) > self._server.limits.max_header_bytes:  # came whole in one read
                self._server.counts.malformed += 1
                self._answer("431 Request Header Fields Too Large", [("Content-Type", "text/plain; charset=utf-8")],
                             b"431 request line and headers too large\n", head=False)
                return
            self._answer_request(event)
        elif event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
            self.close()
        # else NEED_DATA: more to come

    def eof_received(self) -> bool | None:
        if self.waiting:
            self.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._server.forget(self)

    def close(self) -> None:
        """Drop the connection at once (pending output discarded)."""
        self._server.forget(self)
        if self.transport is not None:
            self.transport.abort()

    def _expire(self) -> None:
        self._timer = None
        self._server.counts.timed_out += 1
        self.close()

    def _answer_request(self, request: h11.Request) -> None:
        self._server.counts.served += 1
        try:
            status, headers, body = self._server.call_app(request, self.client)
        except Exception:
            log.exception("metrics: the scrape of %s failed", request.target.decode("latin-1")[:80])
            status, headers, body = "500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")], \
                b"500 server error\n"
        self._answer(status, headers, body, head=request.method == b"HEAD")

    def _answer(self, status: str, headers: list[tuple[str, str]], body: bytes, *, head: bool) -> None:
        """Send one answer and close once it is written, or drop the connection after the write timeout."""
        assert self.transport is not None
        self._server.answered(self)
        self.transport.pause_reading()
        if self._timer is not None:
            self._timer.cancel()
        headers = [(k, v) for k, v in headers if k.lower() not in ("content-length", "connection")]
        headers += [("Content-Length", str(len(body))), ("Connection", "close")]
        try:
            code, _, reason = status.partition(" ")
            out = self._h11.send(h11.Response(status_code=int(code), reason=reason.encode("latin-1"), headers=headers))
            if not head and body:
                out += self._h11.send(h11.Data(data=body))
            out += self._h11.send(h11.EndOfMessage())
        except (h11.LocalProtocolError, ValueError):
            self.close()
            return
        self.transport.write(out or b"")
        self.transport.close()  # once everything is written
        self._timer = asyncio.get_running_loop().call_later(self._server.limits.write_timeout_s, self._expire)


def _head_size(request: h11.Request) -> int:
    """The bytes of ``request``'s line and headers (give or take the spaces around header values)."""
    return (len(request.method) + len(request.target) + 12
            + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items()))


class _Server:
    """The connections of one listener and their bounds; used on the loop's thread only."""

    def __init__(self, app: WsgiApp, limits: Limits, port: int) -> None:
        self.app = app
        self.limits = limits
        self.port = port
        self.counts = Counts()
        self._open: set[_Connection] = set()
        self._per_client: dict[str, int] = {}
        # connections still sending their request, oldest first (dicts keep insertion order)
        self._waiting: dict[_Connection, None] = {}
        self._waiting_of: dict[str, dict[_Connection, None]] = {}

    def admit(self, conn: _Connection) -> bool:
        """Room for the new ``conn``, made by closing the oldest waiting connection if need be."""
        if self._per_client.get(conn.client, 0) >= self.limits.max_per_client and not self._evict(
                self._waiting_of.get(conn.client, {})):
            self.counts.refused += 1
            return False
        if len(self._open) >= self.limits.max_connections and not self._evict(self._waiting):
            self.counts.refused += 1
            return False
        self._open.add(conn)
        self._per_client[conn.client] = self._per_client.get(conn.client, 0) + 1
        return True

    def settle(self, conn: _Connection) -> None:
        """``conn`` was read once and its request is not in: it waits, and may give way from now on."""
        conn.fresh = False
        self._waiting[conn] = None
        self._waiting_of.setdefault(conn.client, {})[conn] = None

    def _evict(self, waiting: dict[_Connection, None]) -> bool:
        if not waiting:
            return False
        oldest = next(iter(waiting))
        self.counts.evicted += 1
        oldest.close()
        return True

    def answered(self, conn: _Connection) -> None:
        """``conn`` has its request: from now on it never gives way to another."""
        conn.waiting = False
        self._unwait(conn)

    def _unwait(self, conn: _Connection) -> None:
        self._waiting.pop(conn, None)
        of = self._waiting_of.get(conn.client)
        if of is not None:
            of.pop(conn, None)
            if not of:
                del self._waiting_of[conn.client]

    def forget(self, conn: _Connection) -> None:
        if conn not in self._open:
            return
        self._open.discard(conn)
        self._unwait(conn)
        n = self._per_client.get(conn.client, 0) - 1
        if n > 0:
            self._per_client[conn.client] = n
        else:
            self._per_client.pop(conn.client, None)

    def close_all(self) -> None:
        for conn in list(self._open):
            conn.close()

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def waiting_connections(self) -> int:
        return len(self._waiting)

    def call_app(self, request: h11.Request, client: str) -> tuple[str, list[tuple[str, str]], bytes]:
        """The WSGI application's answer to ``request``: status ("200 OK"), headers, body."""
        target = request.target.decode("latin-1")
        path, _, query = target.partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": request.method.decode("ascii"),
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote(path, "latin-1"),
            "QUERY_STRING": query,
            "SERVER_NAME": "nodeagent",
            "SERVER_PORT": str(self.port),
            "SERVER_PROTOCOL": "HTTP/" + request.http_version.decode("ascii"),
            "REMOTE_ADDR": client,
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": False,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        for name, value in request.headers:
            key = name.decode("latin-1").upper().replace("-", "_")
            if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                key = "HTTP_" + key
            text = value.decode("latin-1")
            environ[key] = f"{environ[key]},{text}" if key in environ else text
        answer: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
            answer[:] = [status, headers]

        result = self.app(environ, start_response)
        try:
            body = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        status, headers = answer
        return str(status), list(headers), body


def _loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's report of an accept failing for want of file descriptors (retried by asyncio a second later):
    one line; anything else as asyncio reports it."""
    exc = context.get("exception")
    if isinstance(exc, OSError) and "accept" in str(context.get("message", "")):
        log.warning("metrics: %s: %s", context.get("message"), exc)
        return
    loop.default_exception_handler(context)


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class MetricsServer:
    """A running exposition listener on its own thread and event loop; ``stop`` closes it and every connection
    and joins the thread."""

    def __init__(self, host: str, port: int, app: WsgiApp, limits: Limits) -> None:
        self._sock = _listen(host, port, limits.backlog)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self.limits = limits
        self._server = _Server(app, limits, self.address[1])
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(_loop_exception)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def counts(self) -> Counts:
        return self._server.counts

    @property
    def open_connections(self) -> int:
        """Connections open now (read from another thread: a rough figure)."""
        return self._server.open_connections

    @property
    def waiting_connections(self) -> int:
        """Connections read once and still sending their request (a rough figure, as above)."""
        return self._server.waiting_connections

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            listener = loop.run_until_complete(loop.create_server(
                lambda: _Connection(self._server), sock=self._sock, backlog=self.limits.backlog))
        except BaseException as e:
            self._error = e
            self._sock.close()
            loop.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            listener.close()
            self._server.close_all()
            # the closed transports' callbacks (connection_lost) run, then the loop closes
            for _ in range(3):
                loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    def stop(self, timeout: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed already
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)


def start_bounded_server(host: str, port: int, app: WsgiApp, limits: Limits | None = None) -> MetricsServer:
    """Serve ``app`` on ``host:port`` (port 0: any free one) on a thread of its own, bounded as the module says."""
    return MetricsServer(host, port, app, limits or Limits())

