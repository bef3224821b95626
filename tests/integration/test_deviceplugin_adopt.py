"""No fight with another device plugin at nodeagent's socket name (NVIDIA's plugin uses nvidia-gpu.sock
too), judged by the kubelet's own device manager: nodeagent leaves a live foreign socket alone and does
not register until it is gone, then serves; with take_over it replaces it at once. The other plugin is
another process (a socket of the agent's own process is never another plugin's)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from nodeagent.deviceplugin.service import DevicePluginService
from nodeagent.gpu.health import HealthMonitorSettings
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.nvmlsource import open_nvml
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

HEALTH = HealthMonitorSettings(recovery_window_s=None, poll_interval_s=0.2, event_wait_ms=100)


def _service(harness: KubeletHarness, nvml: NvmlAdapter, *, take_over: bool = False) -> DevicePluginService:
    return DevicePluginService(
        plugin_dir=harness.plugin_dir, nvml=nvml, health=HEALTH, take_over=take_over, backoff_max_s=0.5
    )


# The other plugin: nodeagent's device-plugin service in a process of its own, on a simulated T4.
OTHER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from nodeagent.deviceplugin.service import DevicePluginService
    from nodeagent.gpu.health import HealthMonitorSettings
    from nodeagent.nvmlsource import open_nvml

    async def main():
        nvml = open_nvml("t4x1", Path(sys.argv[2]))
        svc = DevicePluginService(plugin_dir=Path(sys.argv[1]), nvml=nvml, backoff_max_s=0.5,
                                  health=HealthMonitorSettings(recovery_window_s=None, poll_interval_s=0.2,
                                                               event_wait_ms=100))
        await svc.start(await asyncio.to_thread(nvml.discover))
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await svc.stop()
        nvml.close()

    asyncio.run(main())
    """
)


@contextmanager
def other_plugin(harness: KubeletHarness, state: Path) -> Iterator[subprocess.Popen[str]]:
    """The other plugin running (stopped, its socket removed if still its own, when its stdin closes)."""
    with subprocess.Popen([sys.executable, "-c", OTHER, str(harness.plugin_dir), str(state)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            yield proc
        finally:
            stop_other(proc)


def stop_other(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    proc.wait(30)


@pytest.fixture
async def ours(tmp_path: Path) -> AsyncIterator[NvmlAdapter]:
    # the other plugin sees one T4; nodeagent sees four A30s: the kubelet's device IDs tell them apart
    nvml = open_nvml("a30x4", tmp_path / "a30.json")
    yield nvml
    nvml.close()


async def _kubelet_ids(harness: KubeletHarness, total: int) -> list[str]:
    _, res = await asyncio.to_thread(harness.wait, "nvidia.com/gpu", total=total, registered=True, timeout=15)
    return sorted(d.id for d in res.devices)


async def test_leaves_a_live_foreign_plugin_alone_then_serves_once_it_is_gone(
    kubelet_harness: KubeletHarness, ours: NvmlAdapter, tmp_path: Path
) -> None:
    with other_plugin(kubelet_harness, tmp_path / "t4.json") as other:
        theirs = await _kubelet_ids(kubelet_harness, 1)
        socket = kubelet_harness.plugin_dir / "nvidia-gpu.sock"
        inode = socket.stat().st_ino

        service = _service(kubelet_harness, ours)
        try:
            await service.start(await asyncio.to_thread(ours.discover))  # starts: not a failure of the agent
            await asyncio.sleep(2.0)  # several register attempts
            assert socket.stat().st_ino == inode, "nodeagent replaced the other plugin's socket"
            assert await _kubelet_ids(kubelet_harness, 1) == theirs
            failure = service.failures["nvidia.com/gpu"]
            assert f"served by another process (process {other.pid};" in failure, service.failures
            assert not service.server("nvidia.com/gpu").running

            await asyncio.to_thread(stop_other, other)  # the other plugin goes away (its socket with it)
            mine = await _kubelet_ids(kubelet_harness, 4)
            assert not set(mine) & set(theirs)
            assert "nvidia.com/gpu" not in service.failures
        finally:
            await service.stop()


async def test_take_over_replaces_it(kubelet_harness: KubeletHarness, ours: NvmlAdapter, tmp_path: Path) -> None:
    with other_plugin(kubelet_harness, tmp_path / "t4.json"):
        await _kubelet_ids(kubelet_harness, 1)
        service = _service(kubelet_harness, ours, take_over=True)
        try:
            await service.start(await asyncio.to_thread(ours.discover))
            assert len(await _kubelet_ids(kubelet_harness, 4)) == 4
        finally:
            await service.stop()
