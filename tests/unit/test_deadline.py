"""``within``: a deadline that never drops a cancellation (the reason it replaced ``asyncio.wait_for``);
``cancel_all``: a stop's tasks end, a dead one logged, not raised."""

from __future__ import annotations

import asyncio
import logging

import pytest

from nodeagent.deadline import cancel_all, within


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


async def test_cancel_all_ends_every_task_and_logs_one_that_had_failed(caplog: pytest.LogCaptureFixture) -> None:
    async def dies() -> None:
        raise RuntimeError("the loop died earlier")

    dead = asyncio.ensure_future(dies())
    sleeping = asyncio.ensure_future(asyncio.sleep(60))
    await asyncio.sleep(0)  # the first has failed by now
    assert dead.done() and not sleeping.done()
    with caplog.at_level(logging.ERROR, logger="tests.cancel_all"):
        await cancel_all([dead, sleeping], logging.getLogger("tests.cancel_all"))
    assert sleeping.cancelled()
    failed = [r for r in caplog.records if r.name == "tests.cancel_all"]
    assert len(failed) == 1 and failed[0].exc_info is not None and "the loop died earlier" in str(failed[0].exc_info[1])
