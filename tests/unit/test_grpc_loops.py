"""grpcio's poller reading its closed notification socket once more at stop is one debug line, not asyncio's
error with a traceback; every other exception of a callback still reaches asyncio's report."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable

import pytest

from nodeagent.grpcadapter.loops import quiet_closed_poller

# a callback whose frame carries the name and file of grpcio's poller callback, as its Cython frames do
_POLLER = compile("def _handle_events(loop):\n    os.read(fd, 1)\n", "completion_queue.pyx.pxi", "exec")


def _callback(name: str, fd: int) -> Callable[[asyncio.AbstractEventLoop], None]:
    scope: dict[str, object] = {"os": os, "fd": fd}
    exec(_POLLER if name == "_handle_events" else compile(
        f"def {name}(loop):\n    os.read(fd, 1)\n", "elsewhere.py", "exec"), scope)
    fn = scope[name]
    assert callable(fn)
    return fn


def _run_callback(fn: Callable[[asyncio.AbstractEventLoop], None]) -> None:
    loop = asyncio.new_event_loop()
    quiet_closed_poller(loop)
    try:
        loop.call_soon(fn, loop)
        loop.run_until_complete(asyncio.sleep(0.01))
    finally:
        loop.close()


def _closed_fd() -> int:
    """A descriptor no file is open under (far above any this process opens): reading it fails with EBADF."""
    return 1 << 20


def _qualified(fn: Callable[[asyncio.AbstractEventLoop], None]) -> Callable[[asyncio.AbstractEventLoop], None]:
    """The same callback with its frame named as grpcio's Cython frame is (module and class before the name)."""
    fn.__code__ = fn.__code__.replace(co_name="grpc._cython.cygrpc.PollerCompletionQueue._handle_events")
    return fn


@pytest.mark.parametrize("named", [lambda fn: fn, _qualified], ids=["plain", "qualified-as-cython-names-it"])
def test_the_closed_poller_read_is_one_debug_line(
        caplog: pytest.LogCaptureFixture,
        named: Callable[[Callable[[asyncio.AbstractEventLoop], None]], Callable[[asyncio.AbstractEventLoop], None]],
) -> None:
    caplog.set_level(logging.DEBUG)
    _run_callback(named(_callback("_handle_events", _closed_fd())))
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]
    debug = [r.getMessage() for r in caplog.records if r.name == "nodeagent.grpcadapter.loops"]
    assert len(debug) == 1 and f"[Errno {errno.EBADF}]" in debug[0], debug


def test_other_callbacks_failing_are_reported_as_asyncio_does(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    _run_callback(_callback("something_else", _closed_fd()))  # the same EBADF elsewhere: asyncio's report
    reported = [r for r in caplog.records if r.name == "asyncio" and r.levelno == logging.ERROR]
    assert len(reported) == 1 and reported[0].exc_info is not None, [r.getMessage() for r in caplog.records]

    caplog.clear()
    _run_callback(lambda loop: (_ for _ in ()).throw(ValueError("not grpc")))
    reported = [r for r in caplog.records if r.name == "asyncio" and r.levelno == logging.ERROR]
    assert len(reported) == 1, [r.getMessage() for r in caplog.records]
