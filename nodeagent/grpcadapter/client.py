"""gRPC clients on Unix sockets: channels (blocking and asyncio), calls that always carry a deadline, and the
one place where a failed call (``grpc.RpcError``) becomes an error of ``nodeagent.errors``.

Each caller says which error a failure is for it (``ToError``: the status code's name and the peer's details
in, a ``NodeAgentError`` out); the grpc exception stays attached as its cause.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from nodeagent.errors import NodeAgentError

T = TypeVar("T")

# The channel types, for callers' annotations (they never import grpc).
Channel = grpc.Channel
AioChannel = grpc.aio.Channel


@dataclass(frozen=True)
class Failure:
    """What a failed call tells: the status code's name (``UNAVAILABLE``; ``UNKNOWN`` when the error carries
    none) and the details the peer or the library gave (may be empty)."""

    code: str
    details: str


ToError = Callable[[Failure], NodeAgentError]


def target(socket: Path) -> str:
    """The gRPC target of a Unix socket, by its absolute path (gRPC resolves no relative ``unix://``)."""
    return f"unix://{socket.absolute()}"


def open_channel(socket: Path) -> grpc.Channel:
    """A blocking channel to ``socket``; it connects on the first call. Close it (or use ``with``)."""
    return grpc.insecure_channel(target(socket))


def open_aio_channel(socket: Path) -> grpc.aio.Channel:
    """An asyncio channel to ``socket`` (on the running loop); close it (or use ``async with``)."""
    return grpc.aio.insecure_channel(target(socket))


def raw_method(channel: grpc.Channel, method: str) -> Callable[..., bytes]:
    """A unary method by its full path (``/package.Service/Method``), bytes in and bytes out: for a service
    whose messages nodeagent never reads."""
    call: Callable[..., bytes] = channel.unary_unary(method)
    return call


def failure(error: grpc.RpcError) -> Failure:
    """The code and details of a failed call; an ``RpcError`` that is no call (a channel fault) has none."""
    code = error.code() if callable(getattr(error, "code", None)) else None
    details = error.details() if callable(getattr(error, "details", None)) else None
    return Failure(code.name if code is not None else "UNKNOWN", str(details or ""))


def call(
    method: Callable[..., T], request: Any, *, timeout: float, error: ToError, wait_for_ready: bool = False
) -> T:
    """``method(request)`` on a blocking channel within ``timeout`` seconds; a failure raises ``error(...)``.
    With ``wait_for_ready`` the call waits (within the deadline) for a socket that is not answering yet."""
    try:
        return method(request, timeout=timeout, wait_for_ready=wait_for_ready)
    except grpc.RpcError as e:
        raise error(failure(e)) from e


async def acall(
    method: Callable[..., Awaitable[T]],
    request: Any,
    *,
    timeout: float,
    error: ToError,
    wait_for_ready: bool = False,
) -> T:
    """``call`` for an asyncio channel."""
    try:
        return await method(request, timeout=timeout, wait_for_ready=wait_for_ready)
    except grpc.RpcError as e:  # grpc.aio.AioRpcError is one
        raise error(failure(e)) from e


def first_message(method: Callable[..., Any], request: Any, *, timeout: float, error: ToError) -> Any:
    """The first message of the server stream ``method(request)`` within ``timeout`` seconds; the stream is
    cancelled after it. A failure (or a stream that ends without a message) raises ``error(...)``."""
    stream = None
    try:
        stream = method(request, timeout=timeout)
        return next(iter(stream))
    except grpc.RpcError as e:
        raise error(failure(e)) from e
    except StopIteration as e:
        raise error(Failure("OK", "the stream ended without a message")) from e
    finally:
        cancel = getattr(stream, "cancel", None)
        if callable(cancel):
            cancel()
