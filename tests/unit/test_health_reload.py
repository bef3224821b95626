"""No XID is lost while a health monitor is replaced (the daemon rebuilds the device plugin on SIGHUP).

A stopped monitor's last ``wait_events`` call cannot be interrupted and may return an XID after ``stop()``;
that XID, and the unhealthy set the old monitor built, must reach the monitor that replaces it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from nodeagent.gpu.health import HealthMonitor, HealthMonitorSettings, HealthSource
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import open_nvml
from nodeagent.simulator import inject

XID = {"gpu_index": 0, "xid": 79}


class QueueSource:
    """Events arrive through a queue; ``wait_events`` blocks on it like NVML's uninterruptible wait."""

    def __init__(self) -> None:
        self.events: queue.Queue[dict[str, int]] = queue.Queue()
        self.waiting = threading.Event()  # a wait is in progress
        self.taken = threading.Event()  # some wait returned an event

    def wait_events(self, timeout_ms: int) -> Sequence[Any]:
        self.waiting.set()
        try:
            ev = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            return []
        finally:
            self.waiting.clear()
        self.taken.set()
        return [ev]

    def gpu_healthy(self, index: int) -> bool:
        return True

    fault_domain: str | None = None  # no UUIDs shared with other sources

    def recovery_action(self, index: int) -> int:
        return 0

    def gpu_uuid(self, index: int) -> str:
        return f"GPU-{index}"


class Changes:
    def __init__(self) -> None:
        self.count = 0

    async def __call__(self) -> None:
        self.count += 1


def new_monitor(source: HealthSource, changes: Changes | None = None) -> HealthMonitor:
    return HealthMonitor(source=source, settings=HealthMonitorSettings(poll_interval_s=0.05), on_change=changes or Changes())


async def wait_for(cond: Any, timeout: float = 3.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def event_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpu-health-events" and t.is_alive()]


async def test_xid_caught_by_the_stopped_monitors_last_wait_reaches_its_successor() -> None:
    src = QueueSource()
    old = new_monitor(src)
    await old.start([0, 1])
    assert await asyncio.to_thread(src.waiting.wait, 3.0)
    await old.stop()
    src.events.put(XID)  # during the replacement: only the old monitor's wait is there to take it
    assert await asyncio.to_thread(src.taken.wait, 3.0)
    await asyncio.sleep(0.05)  # the old wait has returned it
    changes = Changes()
    new = new_monitor(src, changes)
    await new.start([0, 1])
    try:
        assert await wait_for(lambda: not new.is_healthy(0)), "XID taken during the reload was lost"
        assert new.unhealthy() == {(0, None): "XID 79"} and changes.count == 1
        assert old.is_healthy(0)  # the stopped monitor applies nothing
    finally:
        await new.stop()


async def test_xid_while_both_monitors_exist_reaches_the_new_one_and_one_thread_waits() -> None:
    assert await wait_for(lambda: not event_threads())  # other tests' threads ended after their last wait
    src = QueueSource()
    old = new_monitor(src)
    await old.start([0])
    assert await asyncio.to_thread(src.waiting.wait, 3.0)
    await old.stop()
    new = new_monitor(src)
    await new.start([0])
    try:
        await asyncio.sleep(0.05)  # the new monitor's tasks have run
        assert len(event_threads()) == 1  # the waiting thread is handed over, not doubled
        src.events.put(XID)
        assert await wait_for(lambda: not new.is_healthy(0))
        assert old.is_healthy(0)
    finally:
        await new.stop()


async def test_unhealthy_set_survives_the_replacement() -> None:
    src = QueueSource()
    old = new_monitor(src)
    await old.start([0, 1])
    src.events.put({"gpu_index": 1, "xid": 48, "gi_id": 2})
    assert await wait_for(lambda: not old.is_healthy(1, 2))
    await old.stop()
    new = new_monitor(src)
    await new.start([0, 1])
    try:
        assert new.unhealthy() == {(1, 2): "XID 48"}
    finally:
        await new.stop()
    other = new_monitor(QueueSource())  # another source (another adapter) starts clean
    await other.start([0, 1])
    await other.stop()
    assert other.unhealthy() == {}


async def test_events_held_only_until_a_monitor_attaches_and_thread_ends_when_idle() -> None:
    src = QueueSource()
    old = new_monitor(src)
    await old.start([0])
    assert await asyncio.to_thread(src.waiting.wait, 3.0)
    await old.stop()
    src.events.put(XID)
    assert await asyncio.to_thread(src.taken.wait, 3.0)
    # with nobody attached the thread ends after that wait instead of polling on
    assert await wait_for(lambda: not event_threads())
    new = new_monitor(src)
    await new.start([0])
    try:
        assert await wait_for(lambda: not new.is_healthy(0))
    finally:
        await new.stop()


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[NvmlAdapter]:
    with open_nvml("l4x2", tmp_path / "state.json", HostPaths(tmp_path)) as nvml:
        yield nvml


async def test_simulated_xid_injected_during_replacement_marks_the_gpu(sim: NvmlAdapter) -> None:
    assert sim.wait_events(0) == []  # the event set exists before anything is injected, as in the daemon
    old = new_monitor(sim)
    await old.start([0, 1])
    await asyncio.sleep(0.1)  # its thread is inside a 1 s NVML wait
    await old.stop()
    inject.inject_xid(sim.nvml.store, 1, 79)  # the old wait sees it within milliseconds
    await asyncio.sleep(0.3)
    new = new_monitor(sim)
    await new.start([0, 1])
    try:
        assert await wait_for(lambda: not new.is_healthy(1)), "XID injected during the reload was lost"
        assert new.is_healthy(0)
    finally:
        await new.stop()


async def test_unhealthy_gpu_stays_unhealthy_when_the_adapter_is_reopened(tmp_path: Path) -> None:
    """A reload that changes global config closes the adapter and opens a new one on the same GPUs: the
    faults go over by GPU UUID, and another simulated machine of the same kind starts clean."""
    state, paths = tmp_path / "state.json", HostPaths(tmp_path)
    with open_nvml("l4x2", state, paths) as first:
        assert first.wait_events(0) == []
        old = new_monitor(first)
        await old.start([0, 1])
        inject.inject_xid(first.nvml.store, 1, 79)
        assert await wait_for(lambda: not old.is_healthy(1))
        await old.stop()
    with open_nvml(None, state, paths) as second:
        changes = Changes()
        new = new_monitor(second, changes)
        await new.start([0, 1])
        try:
            assert new.unhealthy() == {(1, None): "XID 79"}, "a reopened adapter forgot the unhealthy GPU"
            assert new.is_healthy(0)
        finally:
            await new.stop()
    (tmp_path / "other").mkdir()
    with open_nvml("l4x2", tmp_path / "other" / "state.json", HostPaths(tmp_path / "other")) as other_sim:
        other = new_monitor(other_sim)
        await other.start([0, 1])
        try:
            assert other.unhealthy() == {}
        finally:
            await other.stop()


async def test_xid_taken_by_the_closed_adapters_last_wait_reaches_the_new_adapters_monitor(tmp_path: Path) -> None:
    state, paths = tmp_path / "state.json", HostPaths(tmp_path)
    with open_nvml("l4x2", state, paths) as first:
        assert first.wait_events(0) == []
        old = new_monitor(first)
        await old.start([0, 1])
        await asyncio.sleep(0.1)  # its thread is inside a 1 s NVML wait
        await old.stop()
        inject.inject_xid(first.nvml.store, 1, 79)  # only the old adapter's wait is there to take it
        assert await wait_for(lambda: not event_threads())  # that wait returned it; nobody was attached
    with open_nvml(None, state, paths) as second:
        new = new_monitor(second)
        await new.start([0, 1])
        try:
            assert await wait_for(lambda: not new.is_healthy(1)), "XID taken by the old adapter was lost"
            assert new.unhealthy() == {(1, None): "XID 79"}
        finally:
            await new.stop()
