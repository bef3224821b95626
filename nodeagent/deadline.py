"""Await something within a deadline, without ever losing a cancellation.

``asyncio.wait_for`` of Python 3.11 returns the inner result when the waiting task is cancelled in the
same turn of the loop as the inner awaitable completes: the cancellation is dropped and the task goes on
(a component told to stop keeps running; a stopped reconciler waits forever for the next Node version).
``asyncio.timeout`` (3.11+) and aio-libs' ``async-timeout`` (its backport, 3.10) cancel through the task
and re-raise the cancellation. Every deadline in the agent's own tasks goes through ``within``; a stop ends
its tasks through ``cancel_all``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - the interpreter of the package's oldest supported distribution
    from async_timeout import timeout as _timeout

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float) -> T:
    """The result of ``awaitable``, or TimeoutError (the builtin one) after ``seconds``."""
    try:
        async with _timeout(seconds):
            return await awaitable
    except TimeoutError as e:  # the builtin TimeoutError from 3.11; its own class before
        if isinstance(e, TimeoutError):
            raise
        raise TimeoutError(*e.args) from e


async def cancel_all(tasks: Iterable[asyncio.Task[Any]], log: logging.Logger) -> None:
    """Cancel ``tasks`` and wait until each has ended. One that had already failed is logged to ``log``, not
    raised: a loop that died earlier must not keep the rest of its owner's stop from running."""
    ending = list(tasks)
    for t in ending:
        t.cancel()
    for t in ending:
        try:
            await t
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("task %s had failed", t.get_name())
