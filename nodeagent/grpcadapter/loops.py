"""What grpcio's asyncio side needs of the event loops it runs on; imports no grpc (the daemon's loop takes it
whether or not a gRPC server or client ever starts)."""

from __future__ import annotations

import asyncio
import errno
import logging
import traceback
from typing import Any

log = logging.getLogger(__name__)


def _from_closed_poller(exc: BaseException | None) -> bool:
    """Whether ``exc`` is grpcio's completion-queue poller reading its notification socket after grpcio closed
    it: a callback of an event loop that still ran once after the last aio server or channel went away (a race
    inside grpcio at stop, harmless: nothing waits on that queue any more)."""
    if not isinstance(exc, OSError) or exc.errno != errno.EBADF:
        return False
    # Cython names the frame by its qualified name (grpc._cython.cygrpc.PollerCompletionQueue._handle_events)
    return any(frame.name.rsplit(".", 1)[-1] == "_handle_events" and "completion_queue" in frame.filename
               for frame in traceback.extract_tb(exc.__traceback__))


def quiet_closed_poller(loop: asyncio.AbstractEventLoop) -> None:
    """Make ``loop`` report grpcio's closed-poller read (``_from_closed_poller``) as one debug line instead of
    asyncio's error with a traceback; anything else as asyncio reports it."""

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if _from_closed_poller(exc):
            log.debug("grpc: the completion queue's poller ran after its close: %s", exc)
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
