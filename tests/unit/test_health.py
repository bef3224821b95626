"""XID classification (NVIDIA's env variables), lost GPUs and recovery after a quiet window."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from nodeagent.errors import ConfigError
from nodeagent.gpu.health import (
    DEFAULT_SKIPPED_XIDS,
    EventPumps,
    HealthMonitor,
    HealthMonitorSettings,
    XidEvent,
    to_xid_event,
)
from tests.unit.test_health_reload import wait_for


class Source:
    """Our own HealthSource interface, scripted."""

    fault_domain: str | None = None

    def __init__(self) -> None:
        self.healthy: dict[int, bool] = {}
        self.recovery: dict[int, int] = {}

    def wait_events(self, timeout_ms: int) -> Sequence[Any]:
        return []

    def gpu_healthy(self, index: int) -> bool:
        return self.healthy.get(index, True)

    def recovery_action(self, index: int) -> int:
        return self.recovery.get(index, 0)

    def gpu_uuid(self, index: int) -> str:
        return f"GPU-{index}"


def test_default_skip_list() -> None:
    s = HealthMonitorSettings.from_env({})
    assert {13, 31, 43, 45, 68, 109} == DEFAULT_SKIPPED_XIDS
    assert not any(s.is_critical(x) for x in DEFAULT_SKIPPED_XIDS)
    assert s.is_critical(79) and s.is_critical(48)


@pytest.mark.parametrize(
    ("env", "critical", "not_critical", "enabled"),
    [
        ({"DP_DISABLE_HEALTHCHECKS": "all"}, [], [79, 48], False),
        ({"DP_DISABLE_HEALTHCHECKS": "xids"}, [], [79, 48], True),
        ({"DP_DISABLE_HEALTHCHECKS": "79, 94"}, [48], [79, 94, 13], True),
        ({"DP_ENABLE_HEALTHCHECKS": "13"}, [13, 79], [31], True),
        ({"DP_ENABLE_HEALTHCHECKS": "all"}, [13, 31, 109, 79], [], True),
        ({"DP_DISABLE_HEALTHCHECKS": "xids", "DP_ENABLE_HEALTHCHECKS": "79"}, [79], [48], True),
    ],
)
def test_env_variables(env: dict[str, str], critical: list[int], not_critical: list[int], enabled: bool) -> None:
    s = HealthMonitorSettings.from_env(env)
    assert s.enabled is enabled
    assert all(s.is_critical(x) for x in critical)
    assert not any(s.is_critical(x) for x in not_critical)


def test_bad_env_value_named() -> None:
    with pytest.raises(ConfigError, match="DP_DISABLE_HEALTHCHECKS: 'sometimes'"):
        HealthMonitorSettings.from_env({"DP_DISABLE_HEALTHCHECKS": "sometimes"})


def test_event_normalisation() -> None:
    assert to_xid_event({"kind": "xid", "gpu_index": 2, "xid": 79}) == XidEvent(2, 79)
    assert to_xid_event({"gpu": 1, "xid": 48, "gi_id": 3}) == XidEvent(1, 48, 3)
    assert to_xid_event({"gpu": 1, "xid": 48, "gi_id": 0xFFFFFFFF}) == XidEvent(1, 48)
    assert to_xid_event({"kind": "clock", "gpu_index": 1}) is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _noop() -> None:
    return None


def monitor(window: float | None = 10.0) -> tuple[HealthMonitor, Source, Clock]:
    src, clock = Source(), Clock()
    m = HealthMonitor(
        source=src, settings=HealthMonitorSettings(recovery_window_s=window), on_change=_noop, clock=clock,
        gpu_indices=frozenset({0, 1}),
    )
    return m, src, clock


async def test_xid_marks_unhealthy_and_recovers_after_window() -> None:
    m, _, clock = monitor()
    assert await m.handle_events([{"gpu_index": 0, "xid": 79}])
    assert not m.is_healthy(0) and not m.is_healthy(0, 3) and m.is_healthy(1)
    assert not await m.handle_events([{"gpu_index": 0, "xid": 13}])  # skipped XID changes nothing
    assert not await m.poll_once()  # first healthy poll starts the window
    clock.now += 5
    assert await m.handle_events([]) is False
    assert not await m.poll_once()
    clock.now += 6
    assert await m.poll_once()
    assert m.is_healthy(0)


async def test_new_xid_restarts_window() -> None:
    m, _, clock = monitor()
    await m.handle_events([{"gpu_index": 1, "xid": 48}])
    await m.poll_once()
    clock.now += 8
    await m.handle_events([{"gpu_index": 1, "xid": 48}])
    clock.now += 8
    assert not await m.poll_once()
    assert not m.is_healthy(1)
    clock.now += 3
    assert await m.poll_once() and m.is_healthy(1)


async def test_lost_gpu_and_no_recovery_while_lost() -> None:
    m, src, clock = monitor()
    src.healthy[0] = False
    assert await m.poll_once()
    assert m.unhealthy() == {(0, None): "GPU lost"}
    clock.now += 100
    assert not await m.poll_once()
    src.healthy[0] = True
    assert not await m.poll_once()
    clock.now += 10
    assert await m.poll_once() and m.is_healthy(0)


async def test_mig_instance_fault_is_local() -> None:
    m, _, _ = monitor()
    await m.handle_events([{"gpu_index": 0, "xid": 79, "gi_id": 2}])
    assert m.is_healthy(0) and m.is_healthy(0, 1) and not m.is_healthy(0, 2)


async def test_nvidia_mode_never_recovers() -> None:
    m, _, clock = monitor(window=None)
    await m.handle_events([{"gpu_index": 0, "xid": 79}])
    clock.now += 10_000
    await m.poll_once()
    assert not m.is_healthy(0)


async def test_unknown_gpu_ignored() -> None:
    m, _, _ = monitor()
    assert not await m.handle_events([{"gpu_index": 7, "xid": 79}])


async def test_recovery_action_keeps_gpu_unhealthy_until_none() -> None:
    """After an XID the driver asks for a GPU reset (recovery action 1): the GPU stays unhealthy however
    long it is quiet; once the action is back to none, the usual quiet window applies."""
    m, src, clock = monitor()
    await m.handle_events([{"gpu_index": 0, "xid": 79}])
    src.recovery[0] = 1
    for _ in range(3):
        clock.now += 100
        assert not await m.poll_once()
        assert not m.is_healthy(0)
    assert m.unhealthy() == {(0, None): "XID 79 (recovery: GPU reset)"}
    src.recovery[0] = 0
    assert not await m.poll_once()  # the window starts now, not at the XID
    clock.now += 9
    assert not await m.poll_once() and not m.is_healthy(0)
    clock.now += 2
    assert await m.poll_once() and m.is_healthy(0)


async def test_recovery_action_of_a_healthy_gpu_marks_nothing() -> None:
    m, src, _ = monitor()
    src.recovery[1] = 2
    assert not await m.poll_once()
    assert m.is_healthy(1)


async def test_event_pumps_are_owned_by_their_creator() -> None:
    """A monitor given a registry keeps its pump there (not in the shared one); a successor given the same
    registry takes over the unhealthy set."""
    from nodeagent.gpu.health import shared_pumps

    pumps = EventPumps()
    src = Source()
    before = len(shared_pumps())
    m1 = HealthMonitor(source=src, settings=HealthMonitorSettings(event_wait_ms=20), on_change=_noop, pumps=pumps)
    await m1.start([0, 1])
    await m1.handle_events([{"gpu_index": 1, "xid": 48}])
    await m1.stop()
    assert len(pumps) == 1 and len(shared_pumps()) == before
    m2 = HealthMonitor(source=src, settings=HealthMonitorSettings(event_wait_ms=20), on_change=_noop, pumps=pumps)
    await m2.start([0, 1])
    try:
        assert not m2.is_healthy(1) and m2.is_healthy(0)
    finally:
        await m2.stop()
    m3 = HealthMonitor(source=src, settings=HealthMonitorSettings(event_wait_ms=20), on_change=_noop,
                       pumps=EventPumps())
    await m3.start([0, 1])
    try:
        assert m3.is_healthy(1)  # another owner's registry knows nothing of it
    finally:
        await m3.stop()


async def test_what_keeps_a_gpu_unhealthy_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The XID says when the GPU can come back; the first poll that finds it healthy again (after a loss, or
    after the simulator's ``recover``) says that it stays out for the [health] window, and for how long; with
    no window, that it stays out until the agent restarts."""
    m, src, clock = monitor()
    with caplog.at_level(logging.INFO, logger="nodeagent.gpu.health"):
        await m.handle_events([{"gpu_index": 0, "xid": 79}])
        src.healthy[0] = False
        await m.poll_once()
        src.healthy[0] = True  # recovered
        clock.now += 4
        await m.poll_once()
        clock.now += 3
        await m.poll_once()  # (said once per episode)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("GPU 0: critical XID 79, marking unhealthy (Healthy again once NVML has shown it healthy "
                        "for 10s without another critical XID; checked every 1s)"), lines
    assert lines[1:] == ["GPU 0: NVML reports it healthy; it stays Unhealthy until 10s pass without a critical "
                         "XID ([health] window): Healthy again in 10s unless one comes"], lines

    m, src, clock = monitor(window=None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nodeagent.gpu.health"):
        await m.handle_events([{"gpu_index": 1, "xid": 48}])
        await m.poll_once()
        await m.poll_once()
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 1: critical XID 48, marking unhealthy (until the agent restarts: no [health] window)",
        "GPU 1: NVML reports it healthy, but it stays Unhealthy until the agent restarts (no [health] window: "
        "NVIDIA's behaviour)"]


async def test_a_release_while_nvml_answers_the_poll_is_not_an_error() -> None:
    """The poll asks NVML for the recovery action in a thread; a remediation that releases the GPU meanwhile
    (its faults forgotten) leaves the poll nothing to update, not a missing key."""
    m, src, _ = monitor()
    asking, answer = threading.Event(), threading.Event()

    def recovery_action(index: int) -> int:
        asking.set()
        answer.wait(5)
        return 0

    src.recovery_action = recovery_action  # type: ignore[method-assign]
    await m.handle_events([{"gpu_index": 0, "xid": 48}])
    polling = asyncio.ensure_future(m.poll_once())
    assert await asyncio.to_thread(asking.wait, 5)
    await m.release(0)
    answer.set()
    await polling
    assert m.is_healthy(0) and m.unhealthy() == {}


async def test_the_poll_loop_outlives_a_failed_round(caplog: pytest.LogCaptureFixture) -> None:
    """An unexpected error in one poll round is logged, and the next rounds still find a lost GPU."""
    src = Source()
    changes: list[int] = []

    async def on_change() -> None:
        changes.append(1)
        if len(changes) == 1:
            raise RuntimeError("publisher went away")

    m = HealthMonitor(source=src, settings=HealthMonitorSettings(poll_interval_s=0.01, event_wait_ms=20),
                      on_change=on_change, pumps=EventPumps())
    await m.start([0, 1])
    try:
        with caplog.at_level(logging.ERROR, logger="nodeagent.gpu.health"):
            src.healthy[0] = False
            assert await wait_for(lambda: changes)
            src.healthy[1] = False
            assert await wait_for(lambda: len(changes) > 1)
        assert len(changes) == 2 and not m.is_healthy(0) and not m.is_healthy(1)
        assert any("GPU health poll failed" in r.getMessage() for r in caplog.records)
    finally:
        await m.stop()
