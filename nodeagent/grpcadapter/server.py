"""grpcio servers on Unix sockets for the kubelet: every bound set through grpcio's own options, the socket
never reachable with a mode wider than 0600, malformed requests refused by name, refusals logged within
bounds, a request that must arrive in time, and a cap on the long-lived streams.

Both kinds are grpc.aio servers, so a call that waits for its client (for its request, or for room in the
client's flow-control window) holds no thread:
  * ``AioServer``: on the running event loop (the methods are coroutines sharing the loop's state: the DRA
    driver's sockets);
  * ``LoopThreadServer``: on the event loop of the servers' own thread, one for all of them (the methods
    never wait for the caller's loop: the device-plugin servers).

The socket: grpcio binds a ``unix:`` path itself, so the server binds inside a fresh directory of mode 0700
next to the wanted path, the socket is set to 0600 there, and once the server runs it is renamed into place
(the listening socket keeps its inode: clients dialling the final name reach it). No other user can reach
the socket before its mode is 0600, and the final name appears only when calls are taken.

Requests: the generated ``add_*Servicer_to_server`` functions register the services; an interceptor takes
over reading each request: bytes that are no such message end the call with INVALID_ARGUMENT naming the
message (grpcio alone would answer INTERNAL "Exception deserializing request!") and the method never sees
them; a request that has not arrived ``REQUEST_TIMEOUT_S`` after the call began ends it with
DEADLINE_EXCEEDED. No bound counts the calls of the whole server: a client that opens calls and never sends
their requests would fill it and lock the kubelet out; a connection's calls are bounded by ``MAX_STREAMS``,
the connections by ``MAX_CONNECTIONS``, and a call without its request lasts ``REQUEST_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import gc
import inspect
import logging
import os
import re
import secrets
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from nodeagent.deadline import within
from nodeagent.grpcadapter.loops import quiet_closed_poller
from nodeagent.logs import MAX_REASON as MAX_LOGGED
from nodeagent.logs import LineBudget as LineBudget
from nodeagent.logs import RefusalLog as RefusalLog
from nodeagent.logs import cut_within

log = logging.getLogger(__name__)

MAX_MESSAGE = 4 * 1024 * 1024  # one message, either way (gRPC's default receive limit, set explicitly)
MAX_METADATA = 16 * 1024  # one call's header list
MAX_STREAMS = 32  # concurrent calls on one connection (a client waits for a free one; the kubelet uses a few)
MAX_CONNECTIONS = 64  # connections open at once on one server; beyond: dropped at accept
REQUEST_TIMEOUT_S = 10.0  # a call's request must have arrived this long after the call began
LARGE_REQUEST = 256 * 1024  # a request of this many bytes or more has the freed memory handed back after it
TRIM_DELAY_S = 0.5
STUCK_STREAM_S = 1.0  # a long-lived stream whose client left an answer untaken this long may be ended
HANDSHAKE_TIMEOUT_MS = 10_000  # a connection must send the HTTP/2 preface and settings within this
MIN_PING_INTERVAL_MS = 10_000  # pings closer than this are strikes
MAX_PING_STRIKES = 2  # strikes before the connection gets GOAWAY (too_many_pings)
MAX_CONNECTION_IDLE_MS = 60_000  # a connection without calls this long gets GOAWAY (a client dials again)
MAX_CONNECTION_AGE_MS = 60 * 60_000  # any connection this old gets GOAWAY (no new calls on it) ...
MAX_CONNECTION_AGE_GRACE_MS = 2**31 - 1  # ... but its calls run on: a kubelet's watch stream is never cut
MAX_DETAILS = 1024  # characters of a status message
PRIVATE_DIR_TRIES = 16
MAX_SOCKET_PATH = 107  # bytes of sun_path (108) less the terminating NUL


def options() -> list[tuple[str, int]]:
    """grpcio's options for a kubelet-facing server: the bounds above."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.max_metadata_size", MAX_METADATA),
        ("grpc.max_concurrent_streams", MAX_STREAMS),
        ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.keepalive_permit_without_calls", 0),  # a connection without calls may not ping at all
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
        ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
        ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
    ]


cut = cut_within  # a status message or log text of at most so many characters

# What servers use without importing grpc.
AioServicerContext = grpc.aio.ServicerContext
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED
# A generated ``add_<Service>Servicer_to_server`` and the servicer it registers.
AddServicer = Callable[[Any, Any], None]
Servicers = Sequence[tuple[AddServicer, object]]


async def arefuse(context: Any, code: Any, details: str) -> NoReturn:
    """End a call with ``code`` (an error status) and ``details`` (cut to a bound)."""
    await context.abort(code, cut(details, MAX_DETAILS))
    raise AssertionError("abort returned")


GRPC_LOGGER = "grpc._cython.cygrpc"  # where grpc.aio logs a call that failed in its own code


class GrpcLogBound(logging.Filter):
    """grpcio's own log lines about calls (grpc.aio logs, with a traceback, each call whose send failed
    because its client went away: a client could have one written for every stream it drops): at most
    ``burst`` in any ``window_s`` seconds, each one line without the traceback, cut to ``MAX_LOGGED``; the
    next line logged tells how many were left out."""

    def __init__(self, *, burst: int = 5, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self._budget = LineBudget(burst, window_s, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        left_out = self._budget.take()
        if left_out is None:
            return False
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text = f"{text}: {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        text = cut(text, MAX_LOGGED)
        if left_out:
            text = f"{text} ({left_out} lines before it not logged)"
        record.msg, record.args, record.exc_info, record.exc_text = text, None, None, None
        return True


_grpc_log_bound = GrpcLogBound()


def bound_grpc_log() -> None:
    """Put ``GrpcLogBound`` on grpcio's logger (once)."""
    logger = logging.getLogger(GRPC_LOGGER)
    if _grpc_log_bound not in logger.filters:
        logger.addFilter(_grpc_log_bound)


class StreamSlot:
    """One long-lived stream holding a slot. Its method calls ``sending()`` before it hands an answer to
    grpcio and ``sent()`` once grpcio took it (the client made room for it)."""

    __slots__ = ("_task", "stuck_since")

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self._task = task
        self.stuck_since: float | None = None

    def sending(self) -> None:
        self.stuck_since = time.monotonic()

    def sent(self) -> None:
        self.stuck_since = None

    def end(self) -> None:
        """Cancel the stream's call (on its server's loop)."""
        if self._task is not None:
            self._task.cancel()


class StreamSlots:
    """At most ``limit`` long-lived streams of one kind at once (each is sent every change). One more takes
    the slot of the stream whose client has left an answer untaken longest, ``STUCK_STREAM_S`` or more (a
    client that reads nothing, or opens no flow-control window, cannot keep the kubelet's stream out); with
    none such, it is refused with RESOURCE_EXHAUSTED. A slot is given back when its call ends, however it
    ends. Used from its server's loop only."""

    def __init__(self, limit: int, what: str, refusals: RefusalLog | None = None) -> None:
        self.limit = limit
        self.what = what
        self.refusals = refusals
        self._held: list[StreamSlot] = []
        self.ended = 0  # streams ended for a newer one

    @property
    def in_use(self) -> int:
        return len(self._held)

    def _give(self, slot: StreamSlot) -> None:
        with contextlib.suppress(ValueError):  # already taken from it
            self._held.remove(slot)

    async def ahold(self, context: Any) -> StreamSlot:
        """Take a slot for the call of ``context`` until it ends, or refuse the call."""
        if len(self._held) >= self.limit:
            now = time.monotonic()
            stuck = [s for s in self._held if s.stuck_since is not None and now - s.stuck_since >= STUCK_STREAM_S]
            if not stuck:
                await arefuse(
                    context, RESOURCE_EXHAUSTED, f"more than {self.limit} {self.what} streams at once on this socket"
                )
            victim = min(stuck, key=lambda s: s.stuck_since or now)
            self._held.remove(victim)
            victim.end()
            self.ended += 1
            if self.refusals is not None:
                self.refusals.ended(
                    self.what,
                    f"a stream whose client took no answer for {now - (victim.stuck_since or now):.1f} s, "
                    f"for a new one (all {self.limit} streams held)",
                )
        slot = StreamSlot(asyncio.current_task())
        self._held.append(slot)
        context.add_done_callback(lambda _: self._give(slot))
        return slot


class Malformed:
    """What a request parses to when its bytes are no such message."""

    __slots__ = ("reason", "size")

    def __init__(self, reason: str, size: int) -> None:
        self.reason = reason
        self.size = size


def parse_request(message: Any, data: bytes) -> Any:
    """``data`` parsed as ``message`` (a generated protobuf class), or ``Malformed`` naming the message."""
    try:
        return message.FromString(data)
    except DecodeError as e:
        return Malformed(f"malformed {message.DESCRIPTOR.name} ({len(data)} bytes): {e}", len(data))


def _parser(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A request deserializer that gives ``Malformed`` instead of raising (the message class is the one the
    generated code's ``FromString`` belongs to)."""
    message = getattr(deserializer, "__self__", None)
    if deserializer is None or getattr(message, "DESCRIPTOR", None) is None:
        return deserializer
    return lambda data: parse_request(message, data)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None where the C library has none, as musl)."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_TRIM = _malloc_trim()
_large_since_trim: dict[asyncio.AbstractEventLoop, int] = {}  # loops with a trim scheduled: large requests


def _trim_soon() -> None:
    """Hand the memory taken by large requests back to the system ``TRIM_DELAY_S`` after the last of them
    was answered or refused (again while more come). A finished call's objects form reference cycles (call, context, error) that
    keep its buffers until Python's cycle collector runs, which an idle process may not do for long; and
    grpcio takes a message in many small pieces, which, freed, leave the C library's heaps fragmented, which
    it does not give back by itself. Without both, each burst of large requests raised the resident memory
    for good."""
    loop = asyncio.get_running_loop()
    if _TRIM is None:
        return
    if loop in _large_since_trim:
        _large_since_trim[loop] += 1
        return
    _large_since_trim[loop] = 0

    def trim() -> None:
        assert _TRIM is not None
        gc.collect()  # a finished call's objects form cycles that hold its buffers
        _TRIM(0)
        if _large_since_trim.pop(loop, 0):
            _large_since_trim[loop] = 0
            loop.call_later(TRIM_DELAY_S, trim)

    loop.call_later(TRIM_DELAY_S, trim)


def _what(method: str) -> str:
    """``/v1beta1.DevicePlugin/ListAndWatch`` → ``list and watch`` (for log lines)."""
    name = method.rpartition("/")[2]
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r" \1", name).lower()


async def _request(what: str, context: Any, refusals: RefusalLog) -> Any:
    """The one request of a call, read through ``context`` within ``REQUEST_TIMEOUT_S``; a request that is no
    such message, comes too late or never ends the call.

    It is read with ``context.read()``, not from the call's request iterator: that iterator is an async
    generator that, left suspended after its first message, is finalized by the cycle collector through a
    task of its own, which made each call leave cyclic garbage behind and the collections that reclaim it
    (pauses landing on calls) three times as costly."""
    try:
        request = await within(context.read(), REQUEST_TIMEOUT_S)
    except TimeoutError:
        reason = f"no request within {REQUEST_TIMEOUT_S:g} s of the call"
        refusals.refused(what, reason)
        await arefuse(context, DEADLINE_EXCEEDED, reason)
    if request is grpc.aio.EOF:
        await arefuse(context, INVALID_ARGUMENT, "the call ended without its request message")
    if isinstance(request, Malformed):
        if request.size >= LARGE_REQUEST:
            _trim_soon()
        refusals.refused(what, request.reason)
        await arefuse(context, INVALID_ARGUMENT, request.reason)
    return request


def _large(request: Any) -> bool:
    """Whether ``request`` (a parsed message) took ``LARGE_REQUEST`` bytes or more."""
    size = getattr(request, "ByteSize", None)
    return size is not None and int(size()) >= LARGE_REQUEST


def _forget_locals(error: BaseException) -> None:
    """Drop the variables of the finished frames ``error`` passed through (the request, what was made of it):
    grpc.aio keeps the error of an aborted call for a while, and with it whatever its frames held."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__context__


class _Interceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Wraps each method handler once (kept by method): the wrapped one takes the request as a stream, so the
    call runs from its start and ``_request`` reads the request with its bounds before the method sees it."""

    def __init__(self, refusals: RefusalLog) -> None:
        self.refusals = refusals
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        return self.wrapped(details.method, await continuation(details))

    def wrapped(self, method: str, handler: Any) -> Any:
        if handler is None or handler.request_streaming:  # no client-streaming methods are served
            return handler
        kept = self._wrapped.get(method)
        if kept is not None and kept[0] is handler:
            return kept[1]
        wrapped = self.wrap(_what(method), handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def wrap(self, what: str, handler: Any) -> Any:
        refusals = self.refusals
        parser = _parser(handler.request_deserializer)
        if handler.response_streaming:
            items = handler.unary_stream
            if not inspect.isasyncgenfunction(items):
                raise TypeError(f"{what}: a streaming method must be an async generator")

            async def stream(_requests: Any, context: Any) -> AsyncIterator[Any]:
                try:
                    request = await _request(what, context, refusals)
                    if _large(request):
                        _trim_soon()
                    async with contextlib.aclosing(items(request, context)) as answers:
                        async for answer in answers:
                            yield answer
                except BaseException as e:
                    _forget_locals(e)
                    raise

            return grpc.stream_stream_rpc_method_handler(
                stream, request_deserializer=parser, response_serializer=handler.response_serializer
            )
        method = handler.unary_unary
        if not inspect.iscoroutinefunction(method):
            raise TypeError(f"{what}: a method must be a coroutine function")

        async def unary(_requests: Any, context: Any) -> Any:
            large = False
            try:
                request = await _request(what, context, refusals)
                large = _large(request)
                return await method(request, context)
            except BaseException as e:
                _forget_locals(e)
                raise
            finally:
                if large:  # once the call's work is done (the trim waits on the loop for the answer's send)
                    _trim_soon()

        return grpc.stream_unary_rpc_method_handler(
            unary, request_deserializer=parser, response_serializer=handler.response_serializer
        )


class _PrivateSocket:
    """The socket bound in a fresh 0700 directory beside ``path``, restricted to 0600 there, and renamed onto
    ``path`` by ``publish``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._dir: Path | None = None
        for _ in range(PRIVATE_DIR_TRIES):
            candidate = path.parent / f".{secrets.token_hex(2)}"
            try:
                candidate.mkdir(mode=0o700)
            except FileExistsError:
                continue
            self._dir = candidate
            break
        if self._dir is None:
            raise OSError(errno.EEXIST, f"no free private directory name beside {path}")
        self.bound = self._dir / "s"
        self.file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file, once bound
        if len(os.fsencode(self.bound)) > MAX_SOCKET_PATH:
            self.discard()
            raise OSError(errno.ENAMETOOLONG, f"socket path {self.bound} is too long for a Unix socket")

    def bind(self, server: Any) -> None:
        try:
            server.add_insecure_port(f"unix:{self.bound}")
        except RuntimeError as e:  # grpcio's way of saying the bind failed
            raise OSError(errno.EADDRNOTAVAIL, f"cannot listen on {self.path}: {e}") from e
        os.chmod(self.bound, 0o600)
        st = os.lstat(self.bound)
        self.file_id = (st.st_dev, st.st_ino)

    def publish(self) -> None:
        os.rename(self.bound, self.path)
        self.discard()

    def discard(self) -> None:
        """Remove the private directory (and the socket, when it was not published)."""
        if self._dir is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.bound.unlink()
        with contextlib.suppress(FileNotFoundError):
            self._dir.rmdir()
        self._dir = None


def _add(server: Any, servicers: Servicers) -> None:
    for add, servicer in servicers:
        add(servicer, server)


class AioServer:
    """grpc.aio's server on ``path``, on the running event loop."""

    def __init__(self, path: Path, servicers: Servicers, *, refusals: RefusalLog) -> None:
        self.path = path
        # (st_dev, st_ino) of the socket file this server bound (kept by the rename into place): how its owner
        # tells its own socket at ``path`` from one another process put there
        self.socket_id: tuple[int, int] | None = None
        bound_grpc_log()
        self._server = grpc.aio.server(interceptors=(_Interceptor(refusals),), options=options())
        _add(self._server, servicers)

    async def start(self) -> None:
        """Bind, start and put the socket in place (raises ``OSError``, nothing left behind)."""
        sock = _PrivateSocket(self.path)
        try:
            sock.bind(self._server)
            await self._server.start()
            self.socket_id = sock.file_id
            sock.publish()
        except BaseException:
            await self._server.stop(None)
            sock.discard()
            raise

    async def stop(self, grace_s: float) -> None:
        """No new calls; calls still running after ``grace_s`` are cancelled."""
        await self._server.stop(grace_s)


SERVER_LOOP_THREAD = "grpc servers"
_server_loop_lock = threading.Lock()
_server_loop: asyncio.AbstractEventLoop | None = None


def server_loop() -> asyncio.AbstractEventLoop:
    """The event loop every ``LoopThreadServer`` runs on, in one thread started with the first server and
    kept for the life of the process: grpcio hands a stopped server's last events (of calls whose client
    went away later) to the loop of their call, which must then still run."""
    global _server_loop
    with _server_loop_lock:
        if _server_loop is None:
            loop = asyncio.new_event_loop()
            quiet_closed_poller(loop)
            threading.Thread(target=loop.run_forever, name=SERVER_LOOP_THREAD, daemon=True).start()
            _server_loop = loop
        return _server_loop


class LoopThreadServer:
    """An ``AioServer`` on ``server_loop()``, the loop of the servers' own thread: its methods are coroutines
    on that loop, never waiting for the caller's loop."""

    def __init__(self, path: Path, servicers: Servicers, *, refusals: RefusalLog) -> None:
        self.path = path
        self._servicers = servicers
        self._refusals = refusals
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: AioServer | None = None

    @property
    def socket_id(self) -> tuple[int, int] | None:
        """(st_dev, st_ino) of the socket file this server bound (None before it started)."""
        return self._server.socket_id if self._server is not None else None

    def start(self) -> None:
        """Bind, start and put the socket in place, on the servers' loop (blocking: run it in a thread;
        raises ``OSError``, nothing left behind)."""
        loop = server_loop()

        async def serve() -> AioServer:
            server = AioServer(self.path, self._servicers, refusals=self._refusals)
            await server.start()
            return server

        self._server = asyncio.run_coroutine_threadsafe(serve(), loop).result()
        self._loop = loop

    def call_soon(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` on the server's loop, from any thread (nothing once stopped)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(callback)

    def stop(self, grace_s: float) -> None:
        """No new calls; calls still running after ``grace_s`` are cancelled (blocking: run it in a thread)."""
        loop, server = self._loop, self._server
        self._loop = self._server = None
        if loop is not None and server is not None:
            asyncio.run_coroutine_threadsafe(server.stop(grace_s), loop).result()
