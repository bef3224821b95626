"""``within``: a deadline that never drops a cancellation (the reason it replaced ``asyncio.wait_for``)."""

from __future__ import annotations

import asyncio

import pytest

from nodeagent.deadline import within


async def test_a_cancellation_in_the_turn_the_awaited_completes_still_cancels() -> None:
    """The waiting task is cancelled in the same loop turn as the awaited future completes: the task ends
    cancelled. (``asyncio.wait_for`` of 3.11 returned the result instead, and the task went on to its next
    wait: a MIG reconciler stopped while recording its last event then waited forever for a Node version.)"""
    loop = asyncio.get_running_loop()
    inner: asyncio.Future[int] = loop.create_future()
    reached_after = asyncio.Event()

    async def waiter() -> None:
        await within(inner, 30)
        reached_after.set()
        await asyncio.Event().wait()  # where a lost cancellation would leave the task for good

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # the task now waits on the future
    inner.set_result(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and not reached_after.is_set()


async def test_the_deadline_raises_the_builtin_timeout_error_and_cancels_the_work() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def slow() -> int:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1

    with pytest.raises(TimeoutError):
        await within(slow(), 0.05)
    assert started.is_set() and cancelled.is_set()


async def test_a_result_in_time_is_returned() -> None:
    async def quick() -> str:
        await asyncio.sleep(0)
        return "done"

    assert await within(quick(), 5) == "done"
